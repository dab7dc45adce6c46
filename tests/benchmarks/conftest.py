"""pytest-benchmark settings for magi-moe's timing tests.

Save and compare across commits (the ``bench`` tox environment does this)::

    pytest tests/benchmarks --benchmark-autosave --benchmark-compare \
        --benchmark-compare-fail=median:10%

The machine info saved with every run carries the GPU's name, driver and CUDA version (and
torch/Triton versions and whether the Triton interpreter ran), so runs from different machines
are not compared blindly. An outside implementation's runs: ``pytest --impl mypkg:IMPL
tests/benchmarks -k impl --benchmark-autosave`` (test_bench_impl.py).
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _not_under_xdist(request):
    """pytest-benchmark disables itself in xdist workers, and its fixture then fails with an
    IndexError at the end of the run (seen under `-n 8` on the H200): skip, with the reason."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("pytest-benchmark does not run under pytest-xdist workers; run tests/benchmarks "
                    "without -n (tox -e bench, scripts/gpu_fused.sh bench)")


def pytest_benchmark_update_machine_info(config, machine_info):
    """The GPU (name, driver, CUDA, compute capability), torch and Triton versions and the
    interpreter flag, as ``python -m magi_moe.bench`` records them (:mod:`magi_moe.bench.machine`)."""
    from magi_moe.bench.machine import machine_info as magi_moe_machine

    machine_info.update(magi_moe_machine())
