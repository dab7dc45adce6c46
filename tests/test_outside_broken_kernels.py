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


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
def test_int32_wrap_is_caught_past_the_boundary():
    with pytest.raises(PropertyViolation, match="wrong rows past 2\\^31"):
        _search("huge_offsets", INT32_WRAP, "INT32_WRAP", examples=3)


def test_wandering_sum_is_caught_by_the_determinism_fuzzer():
    with pytest.raises(PropertyViolation, match="differs bitwise"):
        _search("deterministic", WANDERING_SUM, "WANDERING_SUM", examples=20)


def test_fixed_cases_outside_the_declared_shapes_run_at_the_nearest_accepted_widths():
    """A fixed-shape test (presets tiny, small, small-softmax; Dh = 16 boundary cases) against a
    wide-heads-only kernel: each case moves to the nearest widths the kernel declares
    (``Implementation.fit``) and runs there; none fails, none is called outside the rule, none is
    skipped as unsupported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rs",
           "tests/test_implementations.py", "-k", "random_problems or block_boundary",
           "--impl", f"{MODULE}:INT32_WRAP", "--backend", "cpu"]
    run = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "8 passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
    assert "unsupported" not in run.stdout, run.stdout[-2000:]


def test_the_audit_audits_inside_the_declared_shapes(tmp_path):
    """At a preset outside the rule (tiny, Dh=32) the audit moves to the nearest accepted widths
    instead of failing or skipping the implementation."""
    import json

    from magi_moe.audit.cli import main

    argv = ["--preset", "tiny", "--tokens", "24", "--probe", "random", "--no-mpcheck", "--no-controls",
            "--impl", f"{MODULE}:INT32_WRAP", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    bounds = [r for r in rows if r["section"] == "bounds" and r["status"] == "pass"]
    assert [r["subject"] for r in bounds] == ["outside-int32-wrap @ tiny(Dh=64,I=64)/random"]


def test_the_audit_fails_a_wandering_sum_on_cancelling_sums(tmp_path):
    """Random inputs hide a changing top-k order (0 of 4096 outputs differ); the audit's
    cancelling-sums rerun shows it and fails the run."""
    import json

    from magi_moe.audit.cli import main

    argv = ["--preset", "tiny", "--tokens", "24", "--probe", "random", "--no-mpcheck", "--no-controls",
            "--impl", f"{MODULE}:WANDERING_SUM", "--out", str(tmp_path)]
    assert main(argv) == 1
    rows = {r["subject"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]
            if r["section"] == "determinism"}
    assert rows["outside-wandering-sum (cancelling sums)"]["status"] == "FAIL"
