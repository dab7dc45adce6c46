"""The discipline auditor (CUDA): a .item() in the path and a per-call allocation are caught, a
disciplined control passes, and the fused path keeps its promises; torch.compile of the layer
gives the reference's answer. Without a GPU only the argument check runs."""
from __future__ import annotations

import pytest

from magi_moe.audit.discipline import audit_compile, audit_discipline, audit_layer_discipline
from magi_moe.audit.probes import probe_problem
from magi_moe.config import preset
from magi_moe.layer import MagiMoE
from magi_moe.registry import get_implementation
from magi_moe.tests.audit_broken import (ALLOCATES_PER_CALL, DISCIPLINED_TOY, ITEM_IN_PATH,
                                with_item_in_path)


@pytest.mark.parametrize("call, pattern", [
    pytest.param(lambda: audit_discipline(DISCIPLINED_TOY, probe_problem("random", preset("tiny"), 8,
                                                                         seed=0)),
                 "needs a CUDA problem", id="cpu-problem"),
    pytest.param(lambda: audit_layer_discipline(lambda: MagiMoE(preset("tiny"), impl="reference")),
                 "needs a CUDA layer", id="cpu-layer"),
])
def test_cpu_problem_is_rejected(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.fixture
def gpu_problem(cuda_device):
    return probe_problem("random", preset("magi2-ep4-local"), 4096, seed=0, device=cuda_device)


@pytest.mark.cuda
def test_disciplined_control_passes(gpu_problem):
    report = audit_discipline(DISCIPLINED_TOY, gpu_problem)
    assert report.ok and not report.host_sync and report.allocations_per_call == 0, report.summary()


@pytest.mark.cuda
def test_item_in_path_is_caught(gpu_problem):
    report = audit_discipline(ITEM_IN_PATH, gpu_problem)
    assert report.host_sync and not report.ok, report.summary()


@pytest.mark.cuda
def test_per_call_allocation_is_caught(gpu_problem):
    report = audit_discipline(ALLOCATES_PER_CALL, gpu_problem)
    assert report.allocations_per_call >= 1 and not report.ok, report.summary()


def _fused():
    try:
        return get_implementation("fused")
    except ValueError:
        pytest.skip("no 'fused' implementation registered")


@pytest.mark.cuda
def test_fused_path_is_disciplined(gpu_problem, cuda_device):
    fused = _fused()
    report = audit_discipline(fused, gpu_problem)
    assert report.ok, report.summary()
    broken = audit_discipline(with_item_in_path(fused), gpu_problem)
    assert broken.host_sync and not broken.ok, broken.summary()
    layer = audit_layer_discipline(lambda: MagiMoE(gpu_problem.config, impl=fused,
                                                   device=cuda_device))
    assert layer.ok, layer.summary()


@pytest.mark.cuda
def test_compiled_layer_matches_reference(cuda_device):
    report = audit_compile(lambda: MagiMoE(preset("small"), device=cuda_device))
    assert report.ok, report.summary()
