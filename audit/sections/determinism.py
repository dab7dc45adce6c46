"""The ``determinism`` section: each implementation run repeatedly on one input (and on a
cancelling one, where a changing sum order shows), and the layer of each that declares itself
deterministic (:mod:`audit.determinism`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from magi_moe.config import preset
from magi_moe.problems import cancelling_problem

from ..cache import draw_state
from ..determinism import audit_determinism, audit_layer_determinism
from ..probes import probe_problem
from magi_moe.verdict import not_declared

from ..rows import FAIL, INFO, PASS, SKIP, Row

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "determinism"


def run(audit: Audit) -> Iterator[Row]:
    o = audit.options
    runs = o.determinism_runs or audit.backend.audit_determinism_runs
    # the interpreter runs programs one after another: a small input shows as much
    problem = (probe_problem("random", preset("tiny"), 64, seed=o.seed) if audit.backend.small_audit_inputs
               else audit.main_problem())
    for impl in audit.selected_impls():
        config = impl.shapes.nearest(problem.config)  # inside the declared shapes
        why = audit.runnable_here(impl) or impl.supports(config)
        if why:
            yield Row(SECTION, impl.name, SKIP, why, impl=impl.name)
            continue
        mine = problem if config == problem.config else probe_problem(
            "random", config, problem.num_tokens, seed=o.seed, device=audit.device)
        report = audit_determinism(impl, mine, runs=runs)
        yield _row(impl, impl.name, report, runs)
        cancelling = cancelling_problem(config, max(64, problem.num_tokens // 4), seed=o.seed,
                                        device=audit.device)
        if impl.supports(cancelling.config) is None:  # where a changing sum order shows
            report = audit_determinism(impl, cancelling, runs=runs,
                                       label=f"{impl.name} (cancelling sums)")
            yield _row(impl, report.label, report, runs)
        if impl.deterministic:  # the implementation's own layer: routing, cache and kernels
            layer = impl.layer(config, draw_state(config, o.seed, audit.device), audit.device)
            report = audit_layer_determinism(layer, mine.x, runs=runs, declared=True,
                                             label=f"{impl.name}.layer()")
            yield _row(impl, report.label, report, runs)


def _row(impl, subject: str, report, runs: int) -> Row:
    declared = report.declared_deterministic
    status = (PASS if report.ok else FAIL) if declared else INFO
    return Row(SECTION, subject, status,
               f"{report.differing}/{report.elements} elements differ over {runs} runs "
               f"(max |diff| {report.max_abs_spread:.3g})"
               + ("" if declared else "; not declared deterministic"),
               report.to_dict(), impl=impl.name,
               skip=None if declared else not_declared("does not declare deterministic"))
