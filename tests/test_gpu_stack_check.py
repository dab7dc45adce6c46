"""``scripts/check_gpu_stack.py`` (run before ``tox -e cuda``) says what is missing and what to do."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_gpu_stack.py"


def _run(*python_args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_args, str(SCRIPT)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cpu_torch_is_told_to_use_tox_cpu():
    done = _run()
    assert done.returncode == 1
    assert "sees no CUDA GPU" in done.stderr and "tox -e cpu" in done.stderr, done.stderr


def test_missing_torch_is_named_with_the_install_command():
    # Without site-packages (-S -I) this Python is one that lacks torch and the rest.
    done = _run("-S", "-I")
    if done.returncode == 0 or "missing from" not in done.stderr:
        pytest.skip("torch is importable without site-packages here")
    assert "torch" in done.stderr.split("missing from")[1].splitlines()[0]
    assert "pip install torch triton" in done.stderr and "tox -e cpu" in done.stderr
