"""Property fuzzers over every (implementation, backend) pair of tests/conftest.py's matrix.

Per commit: ``pytest tests/test_fuzz_*.py --hypothesis-profile ci`` (derandomised, small).
Nightly: ``python -m fuzz`` runs these same tests in a loop with the nightly profile, and
HypoFuzz discovers them as ordinary ``@given`` tests (README of fuzz: ``hypothesis fuzz``).
Each failure message ends with a one-line ``python -m fuzz replay '...'`` command.
"""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from magi_moe.fuzz import fuzzers, profiles
from magi_moe.fuzz.properties import campaign_target

BUDGET = profiles.size_budget()


def fuzz(prop: str, impl_backend, data) -> None:
    target = fuzzers.pytest_target(impl_backend, prop)
    case, params = data.draw(fuzzers.case_strategy(prop, target, budget=BUDGET), label="case, params")
    fuzzers.run(prop, target, case, params)


@campaign_target
@profiles.examples(1.0)
@given(data=st.data())
def test_differential(impl_backend, data):
    """Agreement with the float64 oracle on the same routes; no unwritten elements."""
    fuzz("differential", impl_backend, data)


@campaign_target
@profiles.examples(0.5)
@given(data=st.data())
def test_token_permutation(impl_backend, data):
    fuzz("token_permutation", impl_backend, data)


@campaign_target
@profiles.examples(0.5)
@given(data=st.data())
def test_head_locality(impl_backend, data):
    fuzz("head_locality", impl_backend, data)


@campaign_target
@profiles.examples(0.5)
@given(data=st.data())
def test_linearity(impl_backend, data):
    fuzz("linearity", impl_backend, data)


@campaign_target
@profiles.examples(0.75)
@given(data=st.data())
def test_empty_experts(impl_backend, data):
    """(token, head) pairs whose experts were all emptied give exactly zero."""
    fuzz("empty_experts", impl_backend, data)


@campaign_target
@profiles.examples(0.25)
@given(data=st.data())
def test_zero_tokens(impl_backend, data):
    fuzz("zero_tokens", impl_backend, data)


@campaign_target
@pytest.mark.needs("deterministic")
@profiles.examples(0.34)
@given(data=st.data())
def test_deterministic(impl_backend, data):
    fuzz("deterministic", impl_backend, data)


ROUTERS = [
    pytest.param("magi_moe.routing:route", "cpu", id="torch@cpu"),
    pytest.param("magi_moe.routing:route", "cuda", id="torch@cuda", marks=pytest.mark.cuda),
    pytest.param("magi_moe.kernels.fused_routes:fused_routes", "interpret", id="fused@interpret",
                 marks=pytest.mark.interpret),
    pytest.param("magi_moe.kernels.fused_routes:fused_routes", "cuda", id="fused@cuda",
                 marks=pytest.mark.cuda),
]


@campaign_target
@pytest.mark.parametrize("router, backend", ROUTERS)
@profiles.examples(2.0)
@given(data=st.data())
def test_tie_rule(router, backend, data):
    """Every router (torch and fused): exact ties to the lower index, first; NaN last; scores
    that underflow to zero and infinite ones."""
    from magi_moe.backends import BACKENDS

    why = BACKENDS[backend].unavailable_reason()
    if why:
        pytest.skip(f"backend {backend} unavailable: {why}")
    case, params = data.draw(fuzzers.case_strategy("tie_rule", budget=BUDGET), label="case, params")
    fuzzers.run("tie_rule", (router, BACKENDS[backend].device), case, params)
