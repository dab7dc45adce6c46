"""The suite catches outside implementations' bugs through its own strategies (nothing in the
inputs names the bug): a wide-heads-only kernel with int32 row offsets, and a kernel that
declares determinism but changes its top-k summation order between calls
(tests/outside_broken_kernels.py)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from magi_moe.fuzz import fuzzers
from magi_moe.fuzz.properties import make_target
from magi_moe.fuzz.record import PropertyViolation

from magi_moe.tests.outside_broken_kernels import INT32_WRAP, WANDERING_SUM

MODULE = "magi_moe.tests.outside_broken_kernels"


def _search(prop: str, impl, attr: str, *, examples: int, budget: float = 1.0) -> None:
    target = make_target(impl, "cpu", spec=f"{MODULE}:{attr}")
    fuzzers.search(prop, target, budget=budget, settings=settings(
        max_examples=examples, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(HealthCheck)))


def test_int32_wrap_declares_its_shapes():
    from magi_moe.config import preset

    assert INT32_WRAP.supports(preset("tiny")) is not None  # Dh=32: outside its rule
    assert INT32_WRAP.supports(preset("magi2-full")) is None


def test_int32_wrap_is_right_below_the_boundary():
    """The differential fuzzer, drawing inside the declared shapes, finds nothing wrong: the bug
    needs tokens past 2^31 / row stride."""
    _search("differential", INT32_WRAP, "INT32_WRAP", examples=8)


def test_int32_wrap_is_caught_past_the_boundary():
    with pytest.raises(PropertyViolation, match="wrong rows past 2\\^31"):
        _search("huge_offsets", INT32_WRAP, "INT32_WRAP", examples=3)


def test_wandering_sum_is_caught_by_the_determinism_fuzzer():
    with pytest.raises(PropertyViolation, match="differs bitwise"):
        _search("deterministic", WANDERING_SUM, "WANDERING_SUM", examples=20)
