"""The few private Hypothesis attributes the fuzz runner needs, in one place.

Hypothesis has no public way to change a ``@given`` test's settings after decoration, to key one
``@pytest.mark.parametrize`` row's examples apart from another's when the rows are built by hand,
or to seed the stream each run's seed is drawn from without switching the example database off.
The campaign needs all three, so it reaches into Hypothesis here and nowhere else.
``tests/test_hypothesis_internals.py`` checks each on the installed Hypothesis, and names the
versions this was checked on (:data:`CHECKED_ON`): a release that moves one fails there first.
"""
from __future__ import annotations

import random
from typing import Any, Callable

__all__ = ["CHECKED_ON", "given_settings", "missing", "seed_run_stream", "set_database_key",
           "set_given_settings"]

# Hypothesis releases on which every accessor here was checked (tests/test_hypothesis_internals.py).
CHECKED_ON = ("6.170.17",)

_SETTINGS = "_hypothesis_internal_use_settings"  # on the test function, set by @given / @settings
_DIGEST = "_hypothesis_internal_add_digest"      # on the inner test: bytes mixed into the db key
_GLOBAL_RANDOM = "_hypothesis_global_random"     # hypothesis.core.threadlocal: each run's seed


def _function(test: Callable) -> Callable:
    return getattr(test, "__func__", test)


def given_settings(test: Callable) -> Any:
    """The settings a ``@given`` test runs with, or None for a test without them."""
    return getattr(_function(test), _SETTINGS, None)


def set_given_settings(test: Callable, settings: Any) -> None:
    """Make a ``@given`` test run with ``settings`` from its next call on."""
    setattr(_function(test), _SETTINGS, settings)


def set_database_key(test: Callable, key: bytes) -> None:
    """Key a ``@given`` test's saved examples by ``key`` as well as by its source, as Hypothesis
    keys the rows of ``@pytest.mark.parametrize``: rows of one function keep apart examples."""
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    setattr(_function(test).hypothesis.inner_test, _DIGEST, key)


def seed_run_stream(seed: int) -> bool:
    """Seed the stream Hypothesis draws each run's seed from (``hypothesis.seed()`` or
    ``--hypothesis-seed`` would also switch the example database off). False where this
    Hypothesis has no such stream: runs are then seeded from the OS."""
    from hypothesis import core

    local = getattr(core, "threadlocal", None)
    if local is None:
        return False
    try:
        getattr(local, _GLOBAL_RANDOM)
    except AttributeError:
        return False
    setattr(local, _GLOBAL_RANDOM, random.Random(seed))
    return True


class _ShrinkUntil(float):
    """Hypothesis ends a shrink at ``perf_counter() + MAX_SHRINKING_SECONDS``, taken when the
    shrink starts. As that number, this float makes the sum a fixed moment instead (the right
    operand's reflected addition runs first for a float subclass), at least ``least`` seconds
    after the shrink starts."""

    def __new__(cls, until: float, least: float):
        self = super().__new__(cls, least)
        self.until, self.least = until, least
        return self

    def __radd__(self, started: float) -> float:
        return max(started + self.least, self.until)


def set_shrink_deadline(deadline: float, *, least: float = 1.0) -> bool:
    """Stop any shrink that starts from now on at ``deadline`` (epoch seconds, as
    ``time.time()``), or ``least`` seconds after it starts if that is later (Hypothesis's own
    limit is five minutes); the failure is then reported with the example shrunk so far.
    False where this Hypothesis has no such limit."""
    import time

    from hypothesis.internal.conjecture import engine

    if not hasattr(engine, "MAX_SHRINKING_SECONDS"):
        return False
    until = time.perf_counter() + (float(deadline) - time.time())
    engine.MAX_SHRINKING_SECONDS = _ShrinkUntil(until, max(0.0, float(least)))
    return True


def missing() -> list[str]:
    """What of the above the installed Hypothesis lacks (empty where all is there)."""
    from hypothesis import core, given, strategies as st

    @given(st.none())
    def probe(_):
        pass

    lacks = []
    if given_settings(probe) is None:
        lacks.append(f"{_SETTINGS} on a @given test")
    if not hasattr(getattr(probe, "hypothesis", None), "inner_test"):
        lacks.append("hypothesis.inner_test on a @given test")
    local = getattr(core, "threadlocal", None)
    try:
        getattr(local, _GLOBAL_RANDOM)
    except AttributeError:
        lacks.append(f"hypothesis.core.threadlocal.{_GLOBAL_RANDOM}")
    from hypothesis.internal.conjecture import engine

    if not hasattr(engine, "MAX_SHRINKING_SECONDS"):
        lacks.append("hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS")
    return lacks
