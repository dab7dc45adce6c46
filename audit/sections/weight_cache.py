"""The ``cache`` section: the weight-cache audit (:mod:`audit.cache`) on each selected
implementation's own layer (``impl.layer``) that shows a cache or whose implementation declares
``weight_cache``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from ..cache import SKIPPED, audit_weight_cache, cache_protocol, draw_state
from ..rows import FAIL, INFO, PASS, SKIP, Row
from .layer_shapes import layer_config
from .streaming import rows_as_found

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "cache"


def run(audit: Audit) -> Iterator[Row]:
    o = audit.options
    audited = 0
    for impl in audit.selected_impls():
        declared = "weight_cache" in impl.capabilities
        config, why = layer_config(audit, impl)
        if why:
            if declared:
                yield Row(SECTION, impl.name, SKIP, why)
            continue
        try:
            layer = impl.layer(config, draw_state(config, o.seed, audit.device), audit.device)
            shows = cache_protocol(layer).offered
            del layer
        except Exception as exc:  # noqa: BLE001 -- reported, the audit goes on
            yield Row(SECTION, impl.name, FAIL, f"impl.layer(...) raised {type(exc).__name__}: {exc}")
            continue
        if not (declared or shows):
            continue
        audited += 1

        def row(r, impl=impl):
            status = SKIP if r.status == SKIPPED else (PASS if r.ok else FAIL)
            return Row(SECTION, f"{impl.name}: {r.route}/{r.parameter}", status,
                       f"{r.status}: {r.detail}", r.to_dict(), impl=impl.name,
                       clause=f"weight-change/{r.route}")

        report = yield from rows_as_found(
            lambda on_result, impl=impl: audit_weight_cache(
                impl, config=config, device=audit.device, label=impl.name, seed=o.seed,
                on_result=on_result),
            row)
        if not report.measures_packs:
            yield Row(SECTION, impl.name, INFO, "its layer offers no pack count (layer.pack_count "
                      "or layer.weight_cache.pack_count): repacks not measured")
    if not audited:
        yield Row(SECTION, "weight cache", SKIP,
                  "no selected implementation's layer shows a cache or declares weight_cache")
