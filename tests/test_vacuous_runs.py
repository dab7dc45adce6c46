"""No green run that tested nothing: a pytest run in which an implementation asked for with
--impl ran no test exits 5 and says why (magi_moe.pytest_plugin)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _pytest(*args: str, interpret: bool | None) -> subprocess.CompletedProcess:
    """``interpret``: TRITON_INTERPRET=1, =0, or (None) unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = "1" if interpret else "0"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
           "tests/test_implementations.py", "-k", "one_expert", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a child pytest run: 12 s on two cores
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="needs triton")
def test_an_impl_that_ran_no_test_fails_the_run_with_the_reason():
    run = _pytest("--impl", "fused", "--backend", "interpret", interpret=False)
    assert run.returncode == 5, run.stdout[-2000:]
    assert "--impl fused ran no test" in run.stdout and "TRITON_INTERPRET" in run.stdout
    allowed = _pytest("--impl", "fused", "--backend", "interpret", "--allow-vacuous", interpret=False)
    assert allowed.returncode == 0, allowed.stdout[-2000:]


def test_a_run_that_tested_something_passes():
    run = _pytest("--impl", "torch-bf16", "--backend", "cpu", interpret=False)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "nothing was tested" not in run.stdout


needs_triton_no_gpu = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("triton") or __import__("torch").cuda.is_available(),
    reason="needs triton and no GPU (the interpreter is the kernels' only backend)")


@needs_triton_no_gpu
def test_a_plain_run_without_a_gpu_tests_the_kernels():
    """TRITON_INTERPRET unset: the suite's conftest switches the interpreter on."""
    run = _pytest("--impl", "fused", interpret=None)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "fused@interpret: PASS" in run.stdout, run.stdout[-2000:]


@needs_triton_no_gpu
def test_a_whole_run_that_tested_no_kernel_fails():
    run = _pytest(interpret=False)
    assert run.returncode == 5, run.stdout[-2000:]
    assert "no Triton kernel was tested" in run.stdout
