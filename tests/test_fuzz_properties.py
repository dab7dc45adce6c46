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
from hypothesis import given, strategies as st

from magi_moe.fuzz import fuzzers, profiles


def pytest_generate_tests(metafunc):
    if metafunc.definition.name == "test_property":
        metafunc.parametrize(("prop", "subject"), fuzzers.pytest_rows(metafunc.config))


@pytest.fixture(autouse=True)
def _row_settings(request):
    """Each row searches with its record's share of the examples, under its own database key."""
    prop = getattr(getattr(request.node, "callspec", None), "params", {}).get("prop")
    if isinstance(prop, fuzzers.Property):
        fuzzers.apply_row_settings(request.function, prop, request.node.nodeid)


@fuzzers.campaign_target(by_param="prop")
@given(data=st.data())
def test_property(prop, subject, data):
    target = fuzzers.pytest_target(subject, prop)
    case, params = data.draw(prop.strategy(target, budget=profiles.size_budget()), label="case, params")
    prop.run(target, case, params)
