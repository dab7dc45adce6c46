"""Running a checkout's developer scripts (``scripts/``) from the tests: the installed suite
(magi_moe.tests) has no scripts/, so their tests skip there."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script(name: str) -> Path:
    return ROOT / "scripts" / name


def in_checkout(name: str):
    """Skip marker for a test of ``scripts/<name>``, absent from the wheel."""
    return pytest.mark.skipif(not script(name).exists(),
                              reason=f"scripts/{name} is in a checkout, not the wheel")


def nvidia_tools() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def needs_nvidia_tools():
    """Skip marker for a test that compiles for sm_90 with Triton's bundled ptxas / nvdisasm."""
    return pytest.mark.skipif(not (nvidia_tools() / "nvdisasm").exists(),
                              reason="this Triton ships no NVIDIA tools (nvdisasm, ptxas)")


def run_script(name: str, *args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    """``python scripts/<name> args`` from the checkout's root, TRITON_INTERPRET set only when
    ``interpret`` (these scripts compile for a GPU and refuse the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(script(name)), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
