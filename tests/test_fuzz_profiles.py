"""The test suite loads a Hypothesis profile by itself: ``--hypothesis-profile``, else
``$HYPOTHESIS_PROFILE``, else ``ci`` (never Hypothesis' own 200 ms deadline)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402

from magi_moe.fuzz import profiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_profile():
    before = settings.get_current_profile_name()
    yield
    settings.load_profile(before)


def test_requested_beats_the_environment(monkeypatch, restore_profile):
    monkeypatch.setenv(profiles.PROFILE_ENV, "nightly")
    assert profiles.load_default_profile("dev") == "dev"
    assert settings.get_current_profile_name() == "dev" and settings.default.max_examples == 50


def test_environment_beats_the_ci_default(monkeypatch, restore_profile):
    settings.load_profile("default")
    monkeypatch.setenv(profiles.PROFILE_ENV, "nightly")
    assert profiles.load_default_profile(None) == "nightly"
    monkeypatch.delenv(profiles.PROFILE_ENV)
    settings.load_profile("default")
    assert profiles.load_default_profile(None) == "ci"
    assert settings.default.deadline is None and settings.default.derandomize


def test_a_profile_another_plugin_chose_is_kept(monkeypatch, restore_profile):
    settings.register_profile("someone-elses", max_examples=3)
    settings.load_profile("someone-elses")
    monkeypatch.setenv(profiles.PROFILE_ENV, "nightly")
    assert profiles.load_default_profile(None) == "someone-elses"
    assert settings.default.max_examples == 3


@pytest.mark.parametrize("requested", ["bogus", None])
def test_unknown_profile_names_where_it_came_from(monkeypatch, restore_profile, requested):
    settings.load_profile("default")
    monkeypatch.setenv(profiles.PROFILE_ENV, "bogus")
    source = "--hypothesis-profile" if requested else "$HYPOTHESIS_PROFILE"
    with pytest.raises(ValueError, match=f"{source.replace('$', '[$]')} must name .* got 'bogus'"):
        profiles.load_default_profile(requested)


def test_plain_pytest_has_no_deadline(tmp_path):
    """The first-hour trap end to end: a slow @given test run by plain pytest (no profile named,
    no $CI, no $HYPOTHESIS_PROFILE) must not fail on Hypothesis' 200 ms deadline."""
    test = tmp_path / "test_slow_given.py"
    test.write_text(textwrap.dedent("""
        import time
        from hypothesis import given, settings, strategies as st

        @given(st.integers(0, 3))
        def test_slow(n):
            assert settings.default.deadline is None
            time.sleep(0.25)
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", profiles.PROFILE_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider",
                           "-p", "tests.conftest", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
