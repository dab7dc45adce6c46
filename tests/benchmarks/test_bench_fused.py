"""Timing tests for pytest-benchmark: the four cases of docs/ANCHORS.md on a GPU (fused, the fused
layer with routing, and the native kernel beside them), and small CPU cases so that CI runs the
harness on every commit. ``python -m magi_moe.bench`` is the fuller tool (floors, p90,
alternated paths); these tests exist to be saved and compared across commits.

GPU timings: the L2 is flushed in each round's setup; the timed call synchronises, so a round is
the path's GPU time plus its launch overhead. The GPU time from CUDA events and the
floors go into ``extra_info``.
"""
from __future__ import annotations

import pytest
import torch

from magi_moe.backends import BACKENDS
from magi_moe.bench.cases import ANCHOR_CASES, BenchCase, draw_problem, floors
from magi_moe.bench.paths import make_paths
from magi_moe.tests.benchmarks.cuda_events import device_median_ms

pytestmark = pytest.mark.benchmark

FLUSH_BYTES = 512 * 2**20
GPU_PATHS = ("fused", "fused-layer", "native")


def _require(backend: str) -> None:
    why = BACKENDS[backend].unavailable_reason()
    if why:
        pytest.skip(f"backend {backend} unavailable: {why}")


@pytest.fixture(scope="module")
def gpu_problems():
    cache = {}

    def get(heads, tokens):
        if (heads, tokens) not in cache:
            cache.clear()  # one production problem resident at a time (H=12: ~8 GB)
            cache[(heads, tokens)] = draw_problem(BenchCase(heads, tokens), torch.device("cuda"))
        return cache[(heads, tokens)]
    return get


@pytest.mark.cuda
@pytest.mark.parametrize("heads,tokens", ANCHOR_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("path", GPU_PATHS)
def test_anchor_case(benchmark, gpu_problems, heads, tokens, path):
    _require("cuda")
    problem = gpu_problems(heads, tokens)
    fn = make_paths(problem, (path,))[path]
    benchmark.group = f"H={heads},S={tokens}"
    median_ms = device_median_ms(benchmark, fn, "cuda", FLUSH_BYTES, rounds=30, warmup=5)
    fl = floors(problem)
    benchmark.extra_info.update(device_median_ms=median_ms,
                                memory_floor_ms=fl["memory_floor_ms"],
                                compute_floor_ms=fl["compute_floor_ms"])


@pytest.mark.interpret
def test_fused_tiny_under_the_interpreter(benchmark):
    _require("interpret")
    from magi_moe.config import preset
    from magi_moe.problems import random_problem

    problem = random_problem(preset("tiny"), 24, seed=1)
    fn = make_paths(problem, ("fused",))["fused"]
    benchmark.group = "cpu-tiny"
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=1)


def test_reference_tiny_on_the_cpu(benchmark):
    """Always runs: the harness itself stays exercised on machines without Triton kernels."""
    from magi_moe.config import preset
    from magi_moe.problems import random_problem
    from magi_moe.reference import expert_reference

    problem = random_problem(preset("tiny"), 64, seed=2)
    benchmark.group = "cpu-tiny"
    out = benchmark(lambda: expert_reference(problem.x, problem.table, problem.weights,
                                             problem.config, precision="bf16"))
    assert out.shape == problem.x.shape
