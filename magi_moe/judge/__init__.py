"""The one accuracy judge, the product's criterion: is an output accurate enough for an
implementation on a problem? Tests, fuzzers, the audit and the benchmark all ask it::

    from magi_moe.judge import judge
    v = judge(out, problem, impl)   # or a precision-model name: "bf16-fp32acc"
    assert v.ok, v.text

* :mod:`magi_moe.judge.accuracy` -- :func:`judge` and its :class:`Verdict` (criteria in order:
  written, bounds, baseline, faithfulness).
* :mod:`magi_moe.judge.bounds` -- proven per-element error bounds (CONTRACT section 1).
* :mod:`magi_moe.judge.precision` -- floating-point formats and the precision models, as data.
* :mod:`magi_moe.judge.emulation` -- PyTorch emulations of precision models (the audit's
  negative controls and planted bugs).
"""
from .accuracy import Inaccurate, InvalidProblem, Verdict, judge
from .bounds import BoundReport, check_error_bounds, compute_error_bounds, evaluate_bounds, problem_bounds

__all__ = ["BoundReport", "Inaccurate", "InvalidProblem", "Verdict", "check_error_bounds",
           "compute_error_bounds", "evaluate_bounds", "judge", "problem_bounds"]
