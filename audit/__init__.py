"""magi-moe's auditors: proven error bounds, weight-cache rules, determinism, discipline, and
the backend self-check, run together by ``python -m audit`` (see :mod:`audit.report`).

For tests, the one accuracy judge (:mod:`audit.judge`) instead of a hand-picked ``atol``/``rtol``::

    from magi_moe.audit import judge
    v = judge(out, problem, impl)   # or a precision-model name: "bf16-fp32acc"
    assert v.ok, v.text
"""
if __name__ in ("audit", "fuzz", "tests"):  # the checkout's top-level name: an alias
    from magi_moe.suite_names import alias_top_level

    alias_top_level(__name__)
else:
    from .bounds import BoundReport, check_error_bounds, compute_error_bounds, evaluate_bounds
    from .judge import Verdict, judge

    __all__ = ["BoundReport", "Verdict", "check_error_bounds", "compute_error_bounds", "evaluate_bounds",
               "judge"]
