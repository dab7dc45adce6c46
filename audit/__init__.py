"""magi-moe's auditors: proven error bounds, weight-cache rules, determinism, discipline, and
the backend self-check, run together by ``python -m audit`` (see :mod:`audit.report`).

For tests, the proven tolerance instead of a hand-picked ``atol``/``rtol``::

    from magi_moe.audit import check_error_bounds
    report = check_error_bounds(out, problem, impl)   # or a model name: "bf16-fp32acc"
    assert report.ok, report.summary()
"""
from .bounds import BoundReport, check_error_bounds, compute_error_bounds, evaluate_bounds

__all__ = ["BoundReport", "check_error_bounds", "compute_error_bounds", "evaluate_bounds"]
