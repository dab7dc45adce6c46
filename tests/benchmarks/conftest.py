"""pytest-benchmark settings for magi-moe's timing tests.

Save and compare across commits (the ``bench`` tox environment does this)::

    pytest tests/benchmarks --benchmark-autosave --benchmark-compare \
        --benchmark-compare-fail=median:10%

The machine info saved with every run carries the GPU's name (and torch/Triton versions and
whether the Triton interpreter ran), so runs from different machines are not compared blindly.
"""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _not_under_xdist(request):
    """pytest-benchmark disables itself in xdist workers, and its fixture then fails with an
    IndexError at the end of the run (seen under `-n 8` on the H200): skip, with the reason."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("pytest-benchmark does not run under pytest-xdist workers; run tests/benchmarks "
                    "without -n (tox -e bench, scripts/gpu_fused.sh bench)")


def pytest_benchmark_update_machine_info(config, machine_info):
    import triton

    machine_info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    machine_info["torch"] = torch.__version__
    machine_info["triton"] = triton.__version__
    machine_info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0")
