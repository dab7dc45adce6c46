"""The ``history`` section: each selected implementation's own layer and its kernel entry
serve a fixed stream of calls on one object (:func:`fuzz.serving.growing_steps`: token counts
growing and shrinking across the edges where plans switch, a weight change between, a call
with a NaN row and, on a GPU, a graph replayed with NaN padding); every call's real rows must
match the float64 reference on the current weights (contract clause ``history``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from magi_moe.verdict import LayerWrongOnItsOwn, cause_of

from ..rows import FAIL, INFO, PASS, SKIP, Row
from .layer_shapes import layer_config

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "history"


def _stream_row(impl, what: str, machine) -> Row:
    """Drive ``machine`` through the fixed stream; one row, with its replay line on a failure."""
    from magi_moe.fuzz.serving import drive, growing_steps, record_for

    steps = growing_steps(machine)
    counts = [s[1] for s in steps if s[0] in ("forward", "call")]
    subject = f"{impl.name}: {what}"
    try:
        drive(machine, 0, steps)
    except LayerWrongOnItsOwn as exc:  # reported by the clauses that judge a fresh layer
        return Row(SECTION, subject, INFO, str(exc).strip().splitlines()[0], impl=impl.name,
                   skip=exc.reason())
    except Exception as exc:  # noqa: BLE001 -- the finding, reported as a row
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        notes = [n.strip() for n in getattr(exc, "__notes__", ()) if "reproduce:" in n]
        return Row(SECTION, subject, FAIL, f"{type(exc).__name__}: {first}",
                   {"record": record_for(machine, 0, steps), "reproduce": notes[-1] if notes else ""},
                   impl=impl.name, cause=cause_of(exc))  # a first call already wrong: accuracy's
    return Row(SECTION, subject, PASS, f"{len(steps)} steps on one object, token counts {counts}",
               {"record": record_for(machine, 0, steps)}, impl=impl.name)


def run(audit: Audit) -> Iterator[Row]:
    from magi_moe.fuzz.serving import serving_kernel_machine, serving_layer_machine

    device = str(audit.device)
    for impl in audit.selected_impls():
        config, why = layer_config(audit, impl)
        if why:
            yield Row(SECTION, impl.name, SKIP, why, impl=impl.name)
            continue
        yield _stream_row(impl, "kernel entry, weights held fixed",
                          serving_kernel_machine(impl, config=config, device=device, budget=1.0))
        yield _stream_row(impl, "own layer (impl.layer)",
                          serving_layer_machine(impl, config=config, device=device, budget=1.0))
