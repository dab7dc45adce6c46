"""The one-kernel expert step, ``expert_mlp_tma_kernel`` (tiles ``gu_variant="mlp_tma"``, the
H200 tile table's choice for every class), with its launcher, the tensor descriptors it reads
and the measure of its compiled shared memory the planner asks for.

Gate/up, SwiGLU7 and the down projection of a whole row block in one work item: the block's
``x`` rows are gathered once; ``[Dh, BLOCK_N]`` gate and up tiles and ``[BLOCK_N, Dh]`` down
tiles stream by tensor descriptor (TMA: one bulk copy issued by one thread, where a pointer
load costs every thread address registers and issue slots) through a pipelined loop over
``I``; each ``BLOCK_N``-wide activation slice is rounded to bf16 in registers (the same
rounding point as the two-kernel path, :mod:`.gate_up_down`) and fed to the down MMA, so no
activation buffer exists (docs/PERFORMANCE.md, "Shapes of the expert step"). Where it cannot
run (no TMA, unaligned weights, a head width not a power of two, more shared memory than the
GPU has) the launch plan (:mod:`.plan`) takes the two-kernel path and says why.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ..config import MoEConfig
from ..routing import RouteTable
from ..weights import ExpertWeights
from .blocks import block_rows, block_x_rows, store_weighted_rows
from .descriptors import banked_descriptor
from .launch_steps import FusedCall, Launcher, LaunchStep, dot_modes, register_cap
from .rounding import round_operand, swiglu7
from .schedule import BlockSchedule


@triton.jit
def expert_mlp_tma_kernel(
    x_ptr,            # [S, H*Dh] input
    wg_desc,          # [H*E*Dh, I] gate weights, blocks [Dh, BLOCK_N]
    wu_desc,          # [H*E*Dh, I] up weights
    wd_desc,          # [H*E*I, Dh] down weights, blocks [BLOCK_N, Dh]
    gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
    block_count_ptr,
    rows_ptr,         # [R, Dh] fp32 out: p * expert(x) per route, CSR order
    slot_route_ptr,   # [S*H*K] int32 out
    stride_x,
    stride_rows,
    num_experts,
    HEAD_DIM: tl.constexpr,   # a power of two
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT_DTYPE: tl.constexpr,  # the activation's rounding point (the weights' dtype)
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Gate/up, SwiGLU7 and the down projection of a whole row block in one work item: each
    ``BLOCK_N``-wide slice of the activation is rounded to ``ACT_DTYPE`` (the same precision
    point as the two-kernel path) and multiplied into the fp32 ``[BLOCK_M, Dh]`` output
    accumulator straight from registers, so the activation never goes to memory."""
    # while, not range(): Triton 3.6's interpreter takes no tensor bounds (CONTRACT section 8).
    num_blocks = tl.load(block_count_ptr)
    block = tl.program_id(0)
    while block < num_blocks:
        bank = tl.load(block_bank_ptr + block)
        rows, row_mask = block_rows(block, bank, block_start_ptr, offsets_ptr, BLOCK_M)
        x_tile = block_x_rows(x_ptr, gather_ptr, rows, row_mask, bank.to(tl.int64) // num_experts,
                              stride_x, HEAD_DIM)
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        for j in range(0, INTER // BLOCK_N):
            n0 = j * BLOCK_N
            wg = wg_desc.load([bank * HEAD_DIM, n0])
            wu = wu_desc.load([bank * HEAD_DIM, n0])
            wd = wd_desc.load([bank * INTER + n0, 0])
            if UPCAST:
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
                wd = wd.to(tl.float32)
            g = tl.dot(x_tile, wg, input_precision=DOT_PRECISION)
            u = tl.dot(x_tile, wu, input_precision=DOT_PRECISION)
            a = round_operand(swiglu7(g, u), ACT_DTYPE, UPCAST)
            acc = tl.dot(a, wd, acc, input_precision=DOT_PRECISION)
        store_weighted_rows(acc, rows, row_mask, tl.arange(0, HEAD_DIM), probs_ptr, slots_ptr,
                            rows_ptr, slot_route_ptr, stride_rows)
        block += tl.num_programs(0)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _descriptors(step: LaunchStep, weights: ExpertWeights, head_dim: int) -> dict:
    """``[Dh, BLOCK_N]`` gate and up tiles, ``[BLOCK_N, Dh]`` down tiles, over the banks."""
    bn = step.tiles.gu_block_n
    return {"w_gate": banked_descriptor(weights.w_gate, [head_dim, bn]),
            "w_up": banked_descriptor(weights.w_up, [head_dim, bn]),
            "w_down": banked_descriptor(weights.w_down, [bn, head_dim])}


def _launch(step: LaunchStep, call: FusedCall, descs: dict | None = None, warmup: bool = False):
    """Weighted fp32 rows per route, no activation buffer. ``warmup``: compile for this launch
    and return the compiled kernel."""
    c, tiles, w = call, step.tiles, call.weights
    descs = descs or call.descriptors_of(step)
    upcast, precision = dot_modes()
    sched = c.schedule
    args = (c.x, descs["w_gate"], descs["w_up"], descs["w_down"], c.table.gather_ids,
            c.table.sorted_probs, c.table.route_slots,
            c.table.offsets, sched.block_bank, sched.block_start, sched.block_count,
            c.rows, c.slot_route, c.x.stride(0), c.rows.stride(0), c.config.num_experts)
    meta = dict(HEAD_DIM=c.config.head_dim, INTER=c.config.intermediate_size,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.gu_block_n,
                ACT_DTYPE=_TL_DTYPES[w.w_down.dtype], UPCAST=upcast,
                DOT_PRECISION=precision, num_warps=tiles.gu_warps, num_stages=tiles.gu_stages,
                **register_cap(tiles.gu_maxnreg))
    if warmup:
        return expert_mlp_tma_kernel.warmup(*args, grid=(step.grid,), **meta)
    expert_mlp_tma_kernel[(step.grid,)](*args, **meta)


EXPERT_MLP = Launcher("expert_mlp_tma_kernel", _launch, _descriptors)

_SHARED: dict[tuple, int] = {}


def _signature_call(weights: ExpertWeights, config: MoEConfig) -> FusedCall:
    """Empty stand-ins of the launch's tensors, of its dtypes on the weights' device: a compiled
    kernel depends on the arguments' dtypes and on which pointers are 16-byte aligned, and
    these are, as fresh inputs and workspace views are."""
    device, dtype = weights.w_down.device, weights.w_down.dtype

    def empty(*shape: int, of: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=of, device=device)
    H, E, K = config.num_heads, config.num_experts, config.top_k
    table = RouteTable(empty(0, of=torch.int32), empty(0), empty(config.num_banks + 1, of=torch.int64),
                       empty(0, of=torch.int64), 0, H, E, K)
    schedule = BlockSchedule(empty(0, of=torch.int32), empty(0, of=torch.int64),
                             empty(1, of=torch.int32), 16)
    return FusedCall(empty(0, config.hidden_size, of=dtype), table, weights, config, None,
                     schedule, empty(0, config.head_dim), empty(0, of=torch.int32))


def compiled_shared_memory(weights: ExpertWeights, config: MoEConfig) -> Callable[[LaunchStep], int]:
    """For the planner: bytes of shared memory a step's kernel, compiled for these weights'
    device, dtype and shapes, needs. Its footprint depends on the shapes as well as the tiles
    (with a single activation slice, I = BLOCK_N, Triton 3.6 asked 353 KiB for tiles that take
    208 KiB at I = 1280), so it is read from the compiled kernel, once per (device, dtype,
    shapes, tiles), not estimated; no input is needed to compile it."""
    def measure(step: LaunchStep) -> int:
        if step.launcher is not EXPERT_MLP:
            raise ValueError(f"only {EXPERT_MLP} is measured, not {step.kernel}")
        w = weights.w_down
        key = (w.device, w.dtype, config.head_dim, config.intermediate_size, step.tiles)
        if key not in _SHARED:
            descs = _descriptors(step, weights, config.head_dim)
            call = _signature_call(weights, config)
            _SHARED[key] = _launch(step, call, descs, warmup=True).metadata.shared
        return _SHARED[key]
    return measure
