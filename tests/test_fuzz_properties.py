"""Every fuzz property (the records of ``fuzz.fuzzers.PROPERTIES``) on everything it runs on: one
parametrized test, a row per property and implementation/backend pair (or router), with ids
``<property>-<impl>@<backend>`` (``-k differential``, ``-k "linearity and native"``). A property is
added by its record, not here.

Per commit: ``pytest tests/test_fuzz_*.py --hypothesis-profile ci`` (derandomised, small).
Nightly: ``python -m fuzz`` runs this same test in a loop with the nightly profile, and
HypoFuzz discovers it as an ordinary ``@given`` test (README of fuzz: ``hypothesis fuzz``).
Each failure message ends with a one-line ``python -m fuzz replay '...'`` command.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from magi_moe.config import preset
from magi_moe.fuzz import fuzzers, profiles
from magi_moe.fuzz import properties as P
from magi_moe.fuzz.cases import ExpertCase, RoutingSpec, ValueSpec

# Per commit, a row's examples must be able to fail (fuzz.properties.TALLY): a row whose strategy
# draws mostly vacuous cases (one token to permute, one head) or exercises its property fewer than
# MIN_EXERCISED times fails its teardown. Up to half vacuous draws are tolerated: a narrow
# implementation's fitted shapes can leave a drawn case with, say, no bank to empty.
MIN_EXERCISED = 2


def pytest_generate_tests(metafunc):
    if metafunc.definition.name == "test_property":
        metafunc.parametrize(("prop", "subject"), fuzzers.pytest_rows(metafunc.config))


@pytest.fixture(autouse=True)
def _row_settings(request):
    """Each row searches with its record's share of the examples, under its own database key;
    under the ci profile, each row that passed must have exercised its property in at least
    half its examples, and in at least ``MIN_EXERCISED`` (or all, when the row has fewer)."""
    prop = getattr(getattr(request.node, "callspec", None), "params", {}).get("prop")
    if not isinstance(prop, fuzzers.Property):
        yield
        return
    fuzzers.apply_row_settings(request.function, prop, request.node.nodeid)
    P.TALLY.clear()
    failed_before = request.session.testsfailed
    yield
    exercised, vacuous = P.TALLY[(prop.name, P.EXERCISED)], P.TALLY[(prop.name, P.VACUOUS)]
    ran = exercised + vacuous
    if settings.get_current_profile_name() != "ci" or not ran or request.session.testsfailed > failed_before:
        return  # other profiles draw more; a skipped or failed row says so itself
    wanted = min(MIN_EXERCISED, prop.search_settings().max_examples)
    if 2 * vacuous > ran or exercised < wanted:
        pytest.fail(f"{prop.name}: {vacuous} of {ran} examples could not fail (vacuous), "
                    f"{exercised} exercised it (at least {wanted} wanted): see the events in "
                    "fuzz.properties (--hypothesis-show-statistics)")


def _one_token_case(heads: int = 1) -> ExpertCase:
    return ExpertCase(preset("tiny").replace(num_heads=heads), 1, RoutingSpec("uniform", seed=1),
                      ValueSpec(seed=2))


def test_a_vacuous_example_is_counted():
    """The control of the tally: one token cannot be permuted, one head has no neighbour."""
    target = P.make_target("torch-bf16", "cpu")
    P.TALLY.clear()
    P.check_token_permutation(target, _one_token_case(), perm_seed=0)
    P.check_head_locality(target, _one_token_case(heads=1), head=0, seed=0)
    P.check_head_locality(target, _one_token_case(heads=2), head=0, seed=0)
    assert P.TALLY[("token_permutation", P.VACUOUS)] == 1
    assert P.TALLY[("head_locality", P.VACUOUS)] == 1
    assert P.TALLY[("head_locality", P.EXERCISED)] == 1


def test_an_identity_permutation_is_never_used():
    """Two tokens: about half of all seeds draw the identity (an output compared with itself),
    which the check turns into a swap, so a kernel that zeroes its last row fails every seed."""
    identity = [seed for seed in range(8)
                if torch.randperm(2, generator=torch.Generator().manual_seed(seed)).tolist() == [0, 1]]
    assert identity, "no seed below 8 draws the identity: pick others"
    target = P.make_target("magi_moe.tests.fuzz_broken:drops_last_token", "cpu")
    case = ExpertCase(preset("tiny"), 2, RoutingSpec("uniform", seed=1), ValueSpec(seed=2))
    for seed in identity:
        with pytest.raises(P.PropertyViolation, match="permuting tokens did not permute"):
            P.check_token_permutation(target, case, perm_seed=seed)


@fuzzers.campaign_target(by_param="prop")
@given(data=st.data())
def test_property(prop, subject, data):
    target = fuzzers.pytest_target(subject, prop)
    case, params = data.draw(prop.strategy(target, budget=profiles.size_budget()), label="case, params")
    prop.run(target, case, params)


def test_a_racing_deterministic_kernel_fails_only_the_determinism_clause():
    """One root cause, one verdict row: a kernel declared deterministic whose top-k sum order
    changes from call to call (tests/outside_broken_kernels.py). On top-k sums that cancel its
    two calls of the linearity check differ bitwise (an exact comparison, as linearity once made
    for deterministic paths, would report the race under locality); within rounding they
    agree. The determinism property fails it."""
    from magi_moe.problems import cancelling_problem, run_poisoned

    target = P.make_target("magi_moe.tests.outside_broken_kernels:WANDERING_SUM", "cpu")
    problem = cancelling_problem(preset("tiny"), 64, seed=5)
    out = run_poisoned(target.impl, problem)
    out2 = run_poisoned(target.impl, problem.with_routes(problem.routes))  # a second call ...
    assert not torch.equal(out, out2), "the race did not show: pick another seed"
    P.linearity_on(target, problem)  # ... and linearity passes it
    with pytest.raises(P.PropertyViolation, match="differs bitwise"):
        P.check_deterministic(target, ExpertCase(preset("tiny"), 16, RoutingSpec("uniform", seed=1),
                                                 ValueSpec(seed=2)), runs=3)


@pytest.mark.slow  # three searches: about 9 s on two cores
def test_a_racing_deterministic_kernel_passes_every_locality_search():
    from hypothesis import HealthCheck, Phase

    target = P.make_target("magi_moe.tests.outside_broken_kernels:WANDERING_SUM", "cpu")
    quick = settings(max_examples=4, derandomize=True, database=None, deadline=None,
                     phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    locality = [p for p in fuzzers.PROPERTIES.values() if p.clause == "locality"]
    assert {p.name for p in locality} == {"token_permutation", "head_locality", "linearity"}
    for prop in locality:
        fuzzers.search(prop, target, settings=quick)


def test_order_mismatch_allows_the_bounds_and_nothing_more():
    from magi_moe.fuzz.tolerance import order_mismatch

    a = torch.ones(4, dtype=torch.bfloat16)
    b = a + torch.tensor([0.0, 0.5, 0.25, float("nan")]).to(torch.bfloat16)
    asked = []

    def slack():
        asked.append(1)
        return torch.full((4,), 0.3, dtype=torch.float64)
    assert order_mismatch(a, b, slack, out_dtype=torch.bfloat16).tolist() == [False, True, False, True]
    assert order_mismatch(a, a, slack, out_dtype=torch.bfloat16).tolist() == [False] * 4
    assert len(asked) == 1  # the bounds are computed only when rounding does not explain a gap
