"""The ``isolation`` section (clause ``row-isolation``, CONTRACT 1): each implementation with some
rows of ``x`` poisoned (NaN, Inf and overflowing garbage in one row), its other rows judged
against the float64 reference of those rows alone (:mod:`audit.isolation`). One row per route
mode of the poisoned rows (unrouted, their own routes, a clean row's routes) and one for the
implementation's own layer, routing included."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch

from magi_moe.problems import random_problem
from magi_moe.verdict import LayerWrongOnItsOwn, cause_of

from ..cache import draw_state
from ..isolation import ROUTE_MODES, check_layer_row_isolation, check_row_isolation, poisoned_rows
from ..rows import FAIL, INFO, PASS, SKIP, Row
from .layer_shapes import layer_config

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "isolation"
TOKENS = 64  # a quarter of them poisoned: scattered for the kernel, padding rows for the layer


def run(audit: Audit) -> Iterator[Row]:
    seed = audit.options.seed + 17
    for impl in audit.selected_impls():
        config, why = layer_config(audit, impl)
        if why:
            yield Row(SECTION, impl.name, SKIP, why, impl=impl.name)
            continue
        problem = random_problem(config, TOKENS, seed=seed, device=audit.device)
        rows = poisoned_rows(TOKENS, seed=seed)
        for mode in ROUTE_MODES:
            yield _row(impl.name, f"{impl.name}: poisoned rows {mode}", lambda: check_row_isolation(
                impl, problem, rows, "mixed", mode, seed=seed))
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(TOKENS, config.hidden_size, generator=gen).to(device=audit.device, dtype=config.dtype)
        state = draw_state(config, seed, audit.device)
        yield _row(impl.name, f"{impl.name}.layer()", lambda: check_layer_row_isolation(
            impl, config, state, x, poisoned_rows(TOKENS, seed=seed, padding=True), "mixed", seed=seed))


def _row(impl: str, subject: str, check) -> Row:
    try:
        result = check()
    except LayerWrongOnItsOwn as exc:  # reported by the clauses that judge a fresh layer
        return Row(SECTION, subject, INFO, str(exc), impl=impl, skip=exc.reason())
    except Exception as exc:  # noqa: BLE001 -- reported, the audit goes on
        return Row(SECTION, subject, FAIL, f"raised {type(exc).__name__}: {exc}", impl=impl)
    # wrong without the poison too: its cause is accuracy's (counted there where accuracy fails)
    return Row(SECTION, subject, PASS if result.ok else FAIL, result.text.splitlines()[0],
               {"ratio": result.ratio}, impl=impl, cause=cause_of(result.inaccurate))
