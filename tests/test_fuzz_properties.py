"""Property fuzzers over every (implementation, backend) pair of tests/conftest.py's matrix.

Per commit: ``pytest tests/test_fuzz_*.py --hypothesis-profile ci`` (derandomised, small).
Nightly: ``python -m fuzz`` runs these same tests in a loop with the nightly profile, and
HypoFuzz discovers them as ordinary ``@given`` tests (README of fuzz: ``hypothesis fuzz``).
Each failure message ends with a one-line ``python -m fuzz replay '...'`` command.
"""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from fuzz import fuzzers, profiles
from fuzz.properties import campaign_target

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


@campaign_target
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@profiles.examples(2.0)
@given(data=st.data())
def test_tie_rule(device, data):
    """magi-moe's router: exact ties to the lower index, first; NaN last."""
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU")
    case, params = data.draw(fuzzers.case_strategy("tie_rule", budget=BUDGET), label="case, params")
    fuzzers.run("tie_rule", ("magi_moe.routing:route", device), case, params)
