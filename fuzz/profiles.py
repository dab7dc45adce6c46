"""Hypothesis profiles for the fuzzers (``--hypothesis-profile ci|dev|nightly``; ``ci`` by default).

CONTRACT section 9: Hypothesis' built-in ``ci`` profile is only loaded when ``CI`` is set, and tox
drops that variable. So the test suite loads one itself (:func:`load_default_profile`, from
``tests/conftest.py``): ``--hypothesis-profile NAME`` first, else ``$HYPOTHESIS_PROFILE``, else
``ci``, so that no run meets Hypothesis' own 200 ms deadline on an interpreted kernel call.

* ``ci``: derandomised (the same examples on every commit), no example database, a small example
  budget and small shapes, no shrinking: the per-commit run. Shrinking a failure found under
  the Triton interpreter can take minutes; the first failing example is reported as found, with
  its exact one-line replay (``dev`` shrinks).
* ``dev``: random, with the default local database, a few times the ci budget.
* ``nightly``: random, large budgets, no deadline, a shared example database so failures found
  overnight replay first the next night: ``$FUZZ_DB`` when set (a directory or a
  ``redis://`` URL, :mod:`fuzz.database`; how HypoFuzz or a plain ``pytest`` run joins the
  campaigns' database), else the directory ``FUZZ_DATABASE`` (relative to the working
  directory). The campaign runner derives its own profile from this one with the database it
  is given.

Tests scale their per-test budget with :func:`examples` and their shape budget with
:func:`size_budget`, both read from the profile that is loaded, so one test file serves all three.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument
from hypothesis.database import DirectoryBasedExampleDatabase

__all__ = ["FUZZ_DATABASE", "PROFILE_ENV", "SIZE_BUDGETS", "examples", "load_default_profile",
           "size_budget", "register_campaign_profile"]

# One example database for nightly runs, campaigns and HypoFuzz.
FUZZ_DATABASE = os.environ.get("FUZZ_DB") or ".hypothesis/fuzz-db"

# Shape budget per profile: strategies scale token counts and widths with it (1 = per-commit sizes).
SIZE_BUDGETS = {"ci": 1.0, "dev": 2.0, "nightly": 8.0, "campaign": 8.0}

# Kernel calls are slow under the Triton interpreter: generating data is never the slow part.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci", derandomize=True, database=None, max_examples=8, deadline=None, print_blob=True,
    phases=(Phase.explicit, Phase.generate, Phase.target), suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "dev", max_examples=50, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK,
)
def _nightly_database():
    spec = os.environ.get("FUZZ_DB", "").strip()
    if not spec:
        return DirectoryBasedExampleDatabase(FUZZ_DATABASE)
    from .database import open_database
    return open_database(spec, check=False, what="FUZZ_DB")  # a Redis URL connects on first use


settings.register_profile(
    "nightly", max_examples=2000, deadline=None, print_blob=True,
    database=_nightly_database(), suppress_health_check=_SLOW_OK,
)


def register_campaign_profile(database, *, max_examples: int, parent: str = "nightly", **overrides) -> str:
    """Register (and return the name of) the campaign profile: ``parent``'s settings (nightly by
    default) with the campaign's database (a directory, or any Hypothesis ``ExampleDatabase``:
    see :mod:`fuzz.database`) and a per-round example budget (the runner loops rounds until its
    time is spent). ``overrides`` are further settings (the replay-only run's phases)."""
    if max_examples < 1:
        raise ValueError(f"max_examples must be >= 1, got {max_examples}")
    if isinstance(database, (str, bytes)) or hasattr(database, "__fspath__"):
        database = DirectoryBasedExampleDatabase(database)
    settings.register_profile(
        "campaign", parent=settings.get_profile(parent), max_examples=max_examples,
        database=database, **overrides,
    )
    return "campaign"


PROFILE_ENV = "HYPOTHESIS_PROFILE"  # the profile a test run loads when none is named on the command line
DEFAULT_PROFILE = "ci"
# Profiles nobody chose on purpose: Hypothesis' own default, and its ci when it saw $CI.
_AUTOMATIC = (None, "default", "ci")


def load_default_profile(requested: str | None = None) -> str:
    """Load the profile a test run asked for, and return its name: ``requested`` (the value of
    ``--hypothesis-profile``), else ``$HYPOTHESIS_PROFILE``, else ``ci``. A profile another
    plugin already loaded on purpose (the campaign runner's ``campaign``) is kept."""
    if not requested:
        if _current_profile() not in _AUTOMATIC:
            return _current_profile()
        requested = os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
        source = f"${PROFILE_ENV}"
    else:
        source = "--hypothesis-profile"
    try:
        settings.load_profile(requested)
    except InvalidArgument:
        raise ValueError(f"{source} must name a registered Hypothesis profile (ci, dev, nightly, "
                         f"Hypothesis' default, or one registered by your own code), got {requested!r}"
                         ) from None
    return requested


def _current_profile() -> str | None:
    try:
        return settings.get_current_profile_name()
    except AssertionError:  # nothing loaded yet
        return None


def size_budget() -> float:
    """Shape budget of the loaded profile (the ci size when none of ours is loaded)."""
    return SIZE_BUDGETS.get(_current_profile() or "", 1.0)


def examples(fraction: float = 1.0, *, at_least: int = 2) -> settings:
    """``@settings`` for a test that costs more (or less) than the typical one: a ``fraction`` of
    the loaded profile's ``max_examples`` (of ci's when none of ours is loaded, so a plain
    ``pytest`` run stays short). Read when the test module is imported, which pytest does after
    ``--hypothesis-profile`` has been applied."""
    if not fraction > 0:
        raise ValueError(f"fraction must be > 0, got {fraction}")
    ours = _current_profile() in SIZE_BUDGETS
    base = settings.default.max_examples if ours else settings.get_profile("ci").max_examples
    return settings(max_examples=max(at_least, round(base * fraction)))
