"""The native kernel's tiles fit the GPU's shared memory for every head width the config allows
(the GPU fuzz campaign found Dh = 272 asking an H200 for 256 KiB: OutOfResources). Pure
arithmetic: no GPU needed."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")
import torch

from magi_moe.config import MoEConfig, preset
from magi_moe.kernels.native import NativeTiles, fit_shared_memory, shared_memory_estimate
from magi_moe.tests.aot_compile import SHARED_LIMIT

H200_OPTIN = SHARED_LIMIT[90]
SMALL_GPU = SHARED_LIMIT[80]   # consumer Ampere / Ada


def _config(head_dim: int) -> MoEConfig:
    return MoEConfig(num_heads=1, head_dim=head_dim, num_experts=2, top_k=1, intermediate_size=64)


def test_production_tiles_are_unchanged_on_hopper():
    cfg = preset("magi2-full")
    tiles = NativeTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
    assert fit_shared_memory(tiles, cfg, 2, H200_OPTIN) == tiles


@pytest.mark.parametrize("limit", [H200_OPTIN, SMALL_GPU])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 272, 368, 512])  # the fuzzers draw Dh <= 368 on a GPU
def test_tiles_fit_every_head_width(head_dim, dtype, limit):
    cfg = _config(head_dim)
    itemsize = torch.empty((), dtype=dtype).element_size()
    start = NativeTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if limit == SMALL_GPU and dtype == torch.float32 and head_dim > 256:
        # an fp32 x block 512 wide does not fit 99 KiB at any tile: a clear error, not a crash
        with pytest.raises(ValueError, match=f"head_dim={head_dim} needs more shared memory"):
            fit_shared_memory(start, cfg, itemsize, limit)
        return
    tiles = fit_shared_memory(start, cfg, itemsize, limit)
    assert shared_memory_estimate(tiles, cfg, itemsize) <= limit
    assert tiles.block_m >= 16 and tiles.block_n >= 16  # tl.dot's smallest tiles


def test_a_head_too_wide_for_the_gpu_is_a_clear_error():
    start = NativeTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
    with pytest.raises(ValueError, match="head_dim=1024 needs more shared memory"):
        fit_shared_memory(start, _config(1024), 4, SMALL_GPU)


def test_the_fuzz_finding_shrinks_the_tiles():
    cfg = _config(272)
    start = NativeTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
    assert shared_memory_estimate(start, cfg, 2) > H200_OPTIN  # what failed on the H200
    assert fit_shared_memory(start, cfg, 2, H200_OPTIN) != start
