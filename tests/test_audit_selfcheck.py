"""The backend self-check: on the interpreter it passes what the kernels rely on and reports the
two known interpreter traps (raw bf16 tl.dot, truncating fp32 -> bf16) as info, not failures;
on a GPU everything must pass."""
from __future__ import annotations

import pytest

from magi_moe.audit.selfcheck import (ATOMIC_SUBNORMAL_CHECK, DOWNCAST_CHECK, ROUNDING_CHECK,
                             run_selfcheck, truncating_downcasts)
from magi_moe.backends import get_backend


def _statuses(backend: str) -> dict[str, str]:
    why = get_backend(backend).unavailable_reason()
    if why:
        pytest.skip(f"backend {backend} unavailable: {why}")
    return {c.name: c.status for c in run_selfcheck(backend, seed=3)}


def test_cpu_backend_runs_no_triton():
    checks = run_selfcheck("cpu")
    assert [c.status for c in checks] == ["skip"]
    assert not truncating_downcasts(checks)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        run_selfcheck("rocm")


@pytest.mark.interpret
def test_interpreter_selfcheck():
    status = _statuses("interpret")
    assert status["bf16 tl.dot, kernels' upcast policy (upcast)"] == "pass"
    assert status["raw bf16 tl.dot"] == "info"      # CONTRACT section 8: garbage, reported
    assert status["bf16 load/store"] == "pass"
    assert status[DOWNCAST_CHECK] == "info"          # truncates under Triton 3.9's interpreter
    assert status[ROUNDING_CHECK] == "pass"          # the kernels' own rounding, subnormals too
    assert status["fp32 atomic_add"] == "pass"
    assert status[ATOMIC_SUBNORMAL_CHECK] == "pass"  # numpy keeps subnormals
    assert status["fp32 SwiGLU7 (the kernel's)"] == "pass"
    assert truncating_downcasts(run_selfcheck("interpret"))


@pytest.mark.cuda
def test_gpu_selfcheck_all_pass():
    status = _statuses("cuda")
    # NVIDIA's fp32 atomics flush subnormals: reported, and allowed for by the atomic model
    assert status.pop(ATOMIC_SUBNORMAL_CHECK) in ("pass", "info")
    assert status and all(s == "pass" for s in status.values()), status
