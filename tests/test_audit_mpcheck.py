"""The bounds checked with mpmath: constants, the formula element by element, and exact
simulations of each model's rounding chain (true error under the worst-case bound)."""
from __future__ import annotations

import mpmath
import pytest
import torch

from magi_moe.audit import mpcheck
from magi_moe.judge.precision import BF16, FP32


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest


@pytest.fixture(scope="module")
def tiny():
    return mpcheck.tiny_problems(seed=5)


def test_constants():
    failures = [c for c in mpcheck.check_constants(seed=5) if not c.ok]
    assert not failures, failures


@pytest.mark.parametrize("model", ["bf16-fp32acc", "bf16-plain"])
def test_vectorised_bound_equals_mpmath_formula(tiny, model):
    check = mpcheck.check_formula(tiny["clamp"], model, "clamp")
    assert check.ok, check


@pytest.mark.parametrize("probe", ["random", "cancel-up", "swamp"])
@pytest.mark.parametrize("model, accumulate, downcast", [
    ("bf16-fp32acc", "nearest", "nearest"),
    ("bf16-fp32acc", "truncate", "nearest"),
    ("bf16-plain", "nearest", "nearest"),
    ("bf16-fp32acc", "truncate", "truncate"),
])
def test_exact_simulation_under_worst_case_bound(tiny, probe, model, accumulate, downcast):
    check = mpcheck.check_simulation(tiny[probe], model, accumulate=accumulate,
                                     downcast=downcast, seed=9, label=probe)
    assert check.ok, check


def test_float64_reference_error(tiny):
    check = mpcheck.check_reference(tiny["swamp"], "swamp")
    assert check.ok, check


def test_simulated_chain_really_rounds(tiny):
    """The simulation is not the exact value (else the check above would be vacuous)."""
    with mpmath.workprec(mpcheck.PREC):
        numbers = mpcheck._Numbers(tiny["random"])
        exact = mpcheck.exact_output(numbers)
        sim = mpcheck.simulated_output(numbers, mpcheck.precision_model("bf16-fp32acc"),
                                       accumulate="nearest", seed=0)
        differing = sum(a != b for key in exact for a, b in zip(exact[key], sim[key]))
    assert differing > 0.9 * sum(len(v) for v in exact.values())


@pytest.mark.parametrize("value, fmt, mode, expected", [
    (1 + 2.0 ** -8, BF16, "nearest", 1.0),                 # tie to even
    (1 + 3 * 2.0 ** -8, BF16, "nearest", 1 + 2.0 ** -6),   # tie to even, upward
    (1 + 2.0 ** -8 + 2.0 ** -20, BF16, "nearest", 1 + 2.0 ** -7),
    (-(1 + 2.0 ** -7 - 2.0 ** -20), BF16, "truncate", -1.0),
    (3 * 2.0 ** -150, FP32, "nearest", 2.0 ** -148),       # subnormal: 1.5 quanta -> 2, even
    (2.0 ** -151, FP32, "nearest", 0.0),                   # half the smallest subnormal -> 0
])
def test_mp_round(value, fmt, mode, expected):
    with mpmath.workprec(mpcheck.PREC):
        assert mpcheck.mp_round(mpmath.mpf(value), fmt, mode) == mpmath.mpf(expected)


def test_mp_round_agrees_with_torch():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(300, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -30, 30, (300,), generator=gen).double()
    with mpmath.workprec(mpcheck.PREC):
        for v, b, f in zip(values.tolist(), values.to(torch.bfloat16).double().tolist(),
                           values.float().double().tolist()):
            assert mpcheck.mp_round(mpmath.mpf(v), BF16) == mpmath.mpf(b)
            assert mpcheck.mp_round(mpmath.mpf(v), FP32) == mpmath.mpf(f)


def test_mp_round_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        mpcheck.mp_round(1.5, BF16, "up")
