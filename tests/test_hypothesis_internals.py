"""fuzz.hypothesis_internals on the installed Hypothesis: each private attribute the campaign
runner uses still does what the runner relies on. Checked on the Hypothesis releases in
``CHECKED_ON``; on another release a failure here says which part moved."""
from __future__ import annotations

import random

import hypothesis
import pytest
from hypothesis import Phase, given, settings, strategies as st
from hypothesis.database import InMemoryExampleDatabase

from magi_moe.fuzz import hypothesis_internals as hi

RELEASE = (f"installed Hypothesis {hypothesis.__version__}; fuzz/hypothesis_internals.py was "
           f"checked on {', '.join(hi.CHECKED_ON)}")


def test_the_installed_hypothesis_has_every_attribute():
    assert hi.missing() == [], f"{RELEASE}: lacks {hi.missing()}"


def test_given_settings_are_read_and_replaced():
    calls = []

    @settings(max_examples=7, database=None, phases=[Phase.generate])
    @given(st.integers())
    def prop(n):
        calls.append(n)

    assert hi.given_settings(prop).max_examples == 7, RELEASE
    hi.set_given_settings(prop, settings(hi.given_settings(prop), max_examples=3))
    prop()
    assert len(calls) == 3, f"{RELEASE}: ran {len(calls)} examples after the swap, not 3"
    assert hi.given_settings(lambda: None) is None


def test_database_keys_keep_rows_apart():
    """Two rows of one function, each failing: each row's example is saved under its own key."""
    db = InMemoryExampleDatabase()

    @settings(database=db, max_examples=5, phases=[Phase.generate])
    @given(st.integers())
    def prop(n):
        raise AssertionError("always")

    keys = []
    for row in (b"row-a", b"row-b"):
        hi.set_database_key(prop, row)
        before = set(db.data)
        with pytest.raises(AssertionError):
            prop()
        keys.append(set(db.data) - before)
    assert all(keys) and not keys[0] & keys[1], f"{RELEASE}: rows saved under {keys}"
    with pytest.raises(TypeError, match="key must be bytes"):
        hi.set_database_key(prop, "row-a")


@pytest.fixture
def reseeded_from_the_os():
    yield
    hi.seed_run_stream(random.SystemRandom().getrandbits(64))  # later tests: unseeded again


def test_the_run_stream_seeds_each_run(reseeded_from_the_os):
    """Seeded alike, two runs draw the same examples; the example database stays on."""
    def run() -> list[int]:
        seen = []

        @settings(max_examples=5, database=InMemoryExampleDatabase(), phases=[Phase.generate],
                  derandomize=False)
        @given(st.integers(0, 2**60))
        def prop(n):
            seen.append(n)

        prop()
        return seen

    assert hi.seed_run_stream(1234), RELEASE
    first = run()
    assert hi.seed_run_stream(1234)
    assert run() == first, RELEASE
    assert hi.seed_run_stream(99)
    assert run() != first, RELEASE
