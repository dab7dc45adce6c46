"""The audit checking its own footing: the backend self-check (``selfcheck``), the bounds'
mpmath validation (``mpcheck``) and the negative controls (``controls``: broken emulations the
bounds must flag)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from magi_moe.backends import get_backend
from magi_moe.config import preset
from magi_moe.problems import Problem, run_poisoned

from .. import mpcheck
from magi_moe.judge.bounds import compute_error_bounds, evaluate_bounds
from magi_moe.judge.emulation import FP32ACC_EMULATION, negative_controls
from ..probes import PROBES, probe_problem
from ..rows import FAIL, PASS, SUITE, Row
from ..selfcheck import run_selfcheck

if TYPE_CHECKING:
    from ..report import Audit


def selfcheck(audit: Audit) -> Iterator[Row]:
    backend = audit.backend
    if backend.audits_kernels_on and get_backend(backend.audits_kernels_on).available:
        backend = get_backend(backend.audits_kernels_on)
    for c in run_selfcheck(backend, seed=audit.options.seed):
        yield Row("selfcheck", f"{backend.name}: {c.name}", c.status, c.detail, impl=SUITE)


def mp_validation(audit: Audit) -> Iterator[Row]:
    for c in mpcheck.iter_checks(seed=audit.options.seed, quick=True):
        yield Row("mpcheck", c.name, PASS if c.ok else FAIL, c.detail, {"name": c.name}, impl=SUITE)


def controls(audit: Audit) -> Iterator[Row]:
    """Broken emulations on the CPU at the small preset: each must be flagged on some probe."""
    config = preset("small")
    problems = {p: probe_problem(p, config, 128, seed=audit.options.seed) for p in PROBES}
    correct = FP32ACC_EMULATION
    for impl in (correct,) + negative_controls():
        flagged = []
        worst = 0.0
        for probe, problem in problems.items():
            report = evaluate_bounds(run_poisoned(impl, problem),
                                     _bounds_cache(problem, "bf16-fp32acc",
                                                   audit.options.failure_probability),
                                     label=impl.name)
            worst = max(worst, report.prob_max_ratio)
            if not report.ok:
                flagged.append(f"{probe} ({report.prob_max_ratio:.3g})")
        if impl is correct:
            status = PASS if not flagged else FAIL
            result = (f"passes every probe (max err/prob. bound {worst:.3g})" if not flagged
                      else f"flagged on {', '.join(flagged)}")
        else:
            status = PASS if flagged else FAIL
            result = (f"flagged on {', '.join(flagged)}" if flagged else
                      f"NOT flagged (max err/prob. bound {worst:.3g}): the bounds lost their power")
        yield Row("controls", f"{impl.name}: {impl.description}", status, result,
                  {"description": impl.description}, impl=SUITE)


_BOUNDS: dict = {}


def _bounds_cache(problem: Problem, model: str, failure_probability: float):
    """The controls' bounds, computed once per problem (each control is judged on the same ones)."""
    key = (id(problem), model)
    if key not in _BOUNDS or _BOUNDS[key][0] is not problem:
        _BOUNDS[key] = (problem, compute_error_bounds(
            problem.x, problem.table, problem.weights, problem.config, [model],
            failure_probability=failure_probability)[model])
    return _BOUNDS[key][1]
