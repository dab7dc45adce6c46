"""magi_moe.bench.kernel_level: the kernel-level set-up the breakdown, the Nsight Compute
driver and A/B benches share (weights packed once, a fresh workspace per call)."""
from __future__ import annotations

import pytest
import torch

from magi_moe.bench.kernel_level import KernelLevel
from magi_moe.config import preset
from magi_moe.problems import random_problem


@pytest.fixture
def device(triton_device) -> torch.device:
    return triton_device


def test_a_call_is_the_fused_forward_on_the_tables_tiles_with_buffers_of_its_own(device):
    from magi_moe.kernels.fused import fused_forward, run_plan
    from magi_moe.kernels.tiles import choose_fused_tiles

    problem = random_problem(preset("tiny"), 37, seed=3, device=device)
    cfg = problem.config
    level = KernelLevel.of(problem)
    tiles = level.tiles()
    assert tiles == choose_fused_tiles(cfg, problem.table.num_routes, device).fitted(cfg)
    assert level.tiles(sum_block_t=tiles.sum_block_t * 2).sum_block_t == tiles.sum_block_t * 2

    plan, call = level.call(tiles)
    call.out.fill_(float("nan"))  # poisoned: every element must be written by the run
    run_plan(plan, call)
    want = fused_forward(problem.x, problem.table, level.packed, cfg, tiles=tiles)
    assert torch.equal(call.out.view(torch.int16), want.view(torch.int16))

    _, other = level.call(tiles)
    assert other.out.data_ptr() != call.out.data_ptr()
    assert other.workspace is not call.workspace


def test_the_breakdown_times_the_layers_router_and_the_whole_layer_beside_the_kernel(device):
    from magi_moe.bench.breakdown import breakdown_case

    problem = random_problem(preset("tiny"), 19, seed=5, device=device)
    ms = breakdown_case(problem, warmup=0, iters=1, flush_mib=256)["ms"]
    assert {"whole", "route", "layer", "sum"} <= set(ms)
    assert all(v > 0 for v in ms.values()), ms
