"""The ``checkpoint`` section: each selected implementation's own layer computes the checkpoint
it was given (:mod:`audit.checkpoint`), one row per implementation."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from ..checkpoint import WRONG_LAYER, check_layer_checkpoint
from magi_moe.verdict import not_run

from ..rows import FAIL, INFO, PASS, SKIP, Row
from .layer_shapes import layer_config

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "checkpoint"


def run(audit: Audit) -> Iterator[Row]:
    for impl in audit.selected_impls():
        config, why = layer_config(audit, impl)
        if why:
            yield Row(SECTION, impl.name, SKIP, why, impl=impl.name)
            continue
        try:
            found = check_layer_checkpoint(impl, config, audit.device, seed=audit.options.seed + 11)
        except Exception as exc:  # noqa: BLE001 -- reported, the audit goes on
            yield Row(SECTION, impl.name, FAIL, f"impl.layer(...) raised {type(exc).__name__}: {exc}",
                      impl=impl.name)
            continue
        if found.status == WRONG_LAYER:
            # the layer's accuracy (bounds, routing), judged in those sections: a note here
            why = f"not judged: the layer is {found.detail}"
            yield Row(SECTION, impl.name, INFO, why, impl=impl.name, skip=not_run(why))
            continue
        yield Row(SECTION, impl.name, PASS if found.ok else FAIL,
                  "; ".join([f"{found.status}: {found.detail}", *found.renamed]), impl=impl.name)
