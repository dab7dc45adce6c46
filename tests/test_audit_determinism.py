"""The determinism auditor: it counts bitwise differences, fails a "deterministic" path that is
not, and on the GPU (with other work on the device) catches an atomic "deterministic" mode."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from magi_moe.audit.determinism import audit_determinism
from magi_moe.audit.probes import probe_problem
from magi_moe.backends import get_backend
from magi_moe.config import preset
from magi_moe.problems import bit_pattern
from magi_moe.registry import get_implementation
from magi_moe.tests.audit_broken import ATOMIC_DETERMINISTIC, CORRECT_EMULATION, FLAKY_DETERMINISTIC


@pytest.fixture(scope="module")
def problem():
    return probe_problem("random", preset("small"), 64, seed=21)


def test_flaky_deterministic_is_caught(problem):
    report = audit_determinism(FLAKY_DETERMINISTIC, problem, runs=4)
    assert not report.ok
    assert report.runs_differing == 3
    assert 0 < report.differing < report.elements
    assert report.max_abs_spread > 0
    assert "NON-DETERMINISTIC" in report.summary()


def test_deterministic_emulation_passes(problem):
    declared = dataclasses.replace(CORRECT_EMULATION, name="emulation-det",
                                   capabilities=frozenset({"deterministic"}))
    report = audit_determinism(declared, problem, runs=3)
    assert report.ok and report.differing == 0 and report.declared_deterministic


def test_undeclared_path_is_reported_not_failed(problem):
    undeclared = dataclasses.replace(FLAKY_DETERMINISTIC, name="flaky-undeclared",
                                     capabilities=frozenset())
    report = audit_determinism(undeclared, problem, runs=3)
    assert report.ok and report.differing > 0 and not report.declared_deterministic


def test_bit_pattern_compares_bits():
    a = torch.tensor([0.0, float("nan"), 1.5], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, float("nan"), 1.5], dtype=torch.bfloat16)
    assert (bit_pattern(a) != bit_pattern(b)).tolist() == [True, False, False]
    assert bit_pattern(a.double()).dtype == torch.int64


@pytest.mark.parametrize("kwargs, pattern", [
    pytest.param(dict(runs=1), "runs must be >= 2", id="one-run"),
    pytest.param(dict(runs=2, background=True), "CUDA", id="background-on-cpu"),
])
def test_bad_arguments(problem, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        audit_determinism(CORRECT_EMULATION, problem, **kwargs)


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["native-det", "fused"])
def test_interpreted_deterministic_kernels(name):
    if get_backend("interpret").unavailable_reason():
        pytest.skip(get_backend("interpret").unavailable_reason())
    impl = get_implementation(name)
    report = audit_determinism(impl, probe_problem("random", preset("tiny"), 48, seed=2), runs=3)
    assert report.ok, report.summary()


@pytest.mark.cuda
def test_gpu_atomic_deterministic_mode_fails(cuda_device):
    """docs/ANCHORS.md: the atomic paths differ in ~4% of elements over 20 runs at H=3, S=4096."""
    problem = probe_problem("random", preset("magi2-ep4-local"), 4096, seed=0, device=cuda_device)
    report = audit_determinism(ATOMIC_DETERMINISTIC, problem, runs=20)
    assert not report.ok, report.summary()
    for name in ("native-det", "fused"):
        try:
            impl = get_implementation(name)
        except ValueError:
            continue
        report = audit_determinism(impl, problem, runs=20)
        assert report.ok, report.summary()
