"""The fused BF16 path's expert GEMMs: a grouped GEMM over padded per-expert row blocks, no atomics.

Four launches, none of them sized by a count read back to the host:

1. ``block_schedule_kernel`` (:mod:`.schedule`, with a worked example): from the CSR offsets,
   the blocks of ``BLOCK_M`` routes of every bank ``f = h*E + e``, written into an upper-bound
   buffer, and the live block count into a one-element device buffer.
2. ``gate_up_kernel`` (persistent): for each (live block, ``BLOCK_N`` columns of ``I``), the
   block's tokens' ``x`` rows gathered on the fly, ``g = x W_gate`` and ``u = x W_up``
   accumulated in fp32, ``a = SwiGLU7(g, u)`` in fp32 rounded once to bf16, stored into the
   activation buffer ``[max_blocks * BLOCK_M, I]`` at the block's padded rows (padding rows read
   ``x = 0`` and store exact zeros).
3. ``down_kernel`` (persistent): ``a W_down`` accumulated in fp32, times the routing weight in
   fp32, stored as one fp32 row per route in CSR order ``[R, Dh]`` (the layout of the native
   kernel's deterministic rows); it also records where each ``(s, h, k)`` slot's row went
   (``slot_route [S*H*K]``, int32).
4. ``topk_sum_kernel``: ``y[s, h] = sum_k row(s, h, k)`` in fp32, ``k = 0 .. K-1`` in that order,
   rounded once to the output dtype. Slots without a route (hand-built tables) add nothing.

On Hopper the tile table replaces launches 2 and 3 by one, ``expert_mlp_tma_kernel``
(:mod:`.fused_tma`, ``gu_variant="mlp_tma"``): the same maths, the activation rounded to bf16
at the same point but kept in registers. Where it cannot run (no TMA, unaligned weights, a head
width not a power of two, more shared memory than the GPU has) the two kernels run instead.

The GEMM kernels are persistent: the host launches enough programs to fill the GPU, and
each loops over work items ``program_id, program_id + num_programs, ...`` below the live
count read from device memory. A grid of the upper bound would have launched up to
``min(H*E, R) * tiles`` programs with nothing to do, each holding a multiprocessor's shared
memory while it starts and exits.

Every output element is written by exactly one program and every sum has a fixed order, so
the result is bitwise identical run after run: deterministic mode costs nothing.

Offsets: every ``index * stride`` product is formed in int64 (token, route, padded row, bank),
so inputs past ``token * row_stride = 2^31`` are addressed correctly.

The kernels read ``w_gate``/``w_up`` through their strides (unit stride in the last dim): the
packed bank of :mod:`magi_moe.packed_weights` (two dense ``[H*E, Dh, I]`` buffers), views with
a larger row stride and plain contiguous tensors all work without a copy.

Interpreter (``TRITON_INTERPRET=1``): ``tl.dot`` on bf16 operands is wrong there (CONTRACT 8), so
``UPCAST`` converts operands to fp32 before each dot (bf16 x bf16 products are exact in fp32)
and uses "ieee" dots; its fp32 -> bf16 cast truncates, so the two roundings are done by bit
arithmetic there (``rounding.round_to``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from ..backends import interpreter_enabled
from ..config import MoEConfig
from ..routing import RouteTable
from ..validation import check_out, check_unit_last_stride
from ..weights import ExpertWeights
from . import fused_tma as T
from .blocks import block_rows, store_activation, store_weighted_rows
from .descriptors import step_descriptors
from .device import device_facts
from .fused_inputs import FUSED_DTYPES, check_fused_inputs  # noqa: F401 (FUSED_DTYPES: re-exported)
from .fused_prepare import expert_buffers
from .plan import (DOWN, DOWN_TMA, EXPERT_MLP, GATE_UP, GATE_UP_TMA, GATHER_ROWS, SCHEDULE,
                   TOPK_SUM, LaunchPlan, LaunchStep, plan_fused)
from .rounding import round_to
from .schedule import BlockSchedule, fill_block_schedule, max_blocks, schedule_buffers
from .tiles import INTERPRETER_TILES, FusedTiles, choose_fused_tiles
from .workspace import FusedWorkspace


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def gate_up_kernel(
    # pointers
    x_ptr,            # [S, H*Dh] input, unit stride in the last dim
    w_gate_ptr,       # bank f: [Dh, I] at w_gate_ptr + f*stride_wg_bank, rows stride_wg_k apart
    w_up_ptr,         # same layout as w_gate
    gather_ptr,       # [R] int32 token of each route (CSR order)
    offsets_ptr,      # [H*E + 1] int64 CSR offsets
    block_bank_ptr,   # [max_blocks] int32
    block_start_ptr,  # [max_blocks] int64
    block_count_ptr,  # [1] int32 live blocks
    act_ptr,          # [max_blocks*BLOCK_M, I] out: SwiGLU7 activation, weight dtype
    # strides and sizes
    stride_x,
    stride_wg_bank,
    stride_wg_k,
    stride_wu_bank,
    stride_wu_k,
    stride_act,
    num_experts,
    HEAD_DIM: tl.constexpr,
    INTER: tl.constexpr,
    # tiles and modes
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" when UPCAST: fp32 operands must not drop to tf32
):
    # Persistent: the grid is sized on the host, the work (live blocks x N tiles) on the device.
    num_n: tl.constexpr = INTER // BLOCK_N
    work = tl.load(block_count_ptr) * num_n
    # while, not range(): Triton 3.6's interpreter takes no tensor bounds (CONTRACT section 8).
    item = tl.program_id(0)
    while item < work:
        block = item // num_n
        n_block = item % num_n
        bank = tl.load(block_bank_ptr + block).to(tl.int64)
        head = bank // num_experts
        rows, row_mask = block_rows(block, bank, block_start_ptr, offsets_ptr, BLOCK_M)
        tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        k = tl.arange(0, BLOCK_K)
        n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        x_ptrs = x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + k[None, :]
        wg_ptrs = w_gate_ptr + bank * stride_wg_bank + k[:, None] * stride_wg_k + n[None, :]
        wu_ptrs = w_up_ptr + bank * stride_wu_bank + k[:, None] * stride_wu_k + n[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, HEAD_DIM // BLOCK_K):
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
            if UPCAST:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K * stride_wg_k
            wu_ptrs += BLOCK_K * stride_wu_k

        store_activation(acc_g, acc_u, block, n, act_ptr, stride_act, BLOCK_M, UPCAST)
        item += tl.num_programs(0)


@triton.jit
def down_kernel(
    # pointers
    act_ptr,          # [max_blocks*BLOCK_M, I] SwiGLU7 activation from gate_up_kernel
    w_down_ptr,       # bank f: [I, Dh] at w_down_ptr + f*stride_wd_bank, rows stride_wd_k apart
    probs_ptr,        # [R] fp32 routing weight of each route (CSR order)
    slots_ptr,        # [R] int64 slot (s*H + h)*K + k of each route
    offsets_ptr,      # [H*E + 1] int64
    block_bank_ptr,   # [max_blocks] int32
    block_start_ptr,  # [max_blocks] int64
    block_count_ptr,  # [1] int32 live blocks
    rows_ptr,         # [R, Dh] fp32 out: p * expert(x) per route, CSR order
    slot_route_ptr,   # [S*H*K] int32 out: CSR index of the route in each slot
    # strides and sizes
    stride_act,
    stride_wd_bank,
    stride_wd_k,
    stride_rows,
    HEAD_DIM: tl.constexpr,
    INTER: tl.constexpr,
    # tiles and modes
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_n: tl.constexpr = HEAD_DIM // BLOCK_N
    work = tl.load(block_count_ptr) * num_n
    # while, not range(): Triton 3.6's interpreter takes no tensor bounds (CONTRACT section 8).
    item = tl.program_id(0)
    while item < work:
        block = item // num_n
        n_block = item % num_n
        bank = tl.load(block_bank_ptr + block).to(tl.int64)
        # The rows are needed only after the K loop; loading them first hides the latency.
        rows, row_mask = block_rows(block, bank, block_start_ptr, offsets_ptr, BLOCK_M)
        padded = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        k = tl.arange(0, BLOCK_K)
        n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        a_ptrs = act_ptr + padded[:, None] * stride_act + k[None, :]
        w_ptrs = w_down_ptr + bank * stride_wd_bank + k[:, None] * stride_wd_k + n[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, INTER // BLOCK_K):
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wd_k

        store_weighted_rows(acc, rows, row_mask, n, probs_ptr, slots_ptr, rows_ptr,
                            slot_route_ptr, stride_rows)
        item += tl.num_programs(0)


@triton.jit
def topk_sum_kernel(
    rows_ptr,         # [R, Dh] fp32 per-route rows (CSR order)
    slot_route_ptr,   # [S*H*K] int32 CSR index per slot, -1: no route
    out_ptr,          # [S, H*Dh] out, unit stride in the last dim
    num_pairs,        # S*H
    num_heads,
    stride_rows,
    stride_out,
    HEAD_DIM: tl.constexpr,
    DH_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SOFT_BF16: tl.constexpr,   # interpreter: round to bf16 by bit arithmetic (see rounding.round_to)
):
    pid = tl.program_id(0)
    pairs = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    pair_mask = pairs < num_pairs
    token = pairs // num_heads
    head = pairs % num_heads
    d = tl.arange(0, DH_PAD)
    d_mask = d < HEAD_DIM
    acc = tl.zeros((BLOCK_T, DH_PAD), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # fixed order: k = 0, 1, ..., K-1
        route = tl.load(slot_route_ptr + pairs * TOP_K + k, mask=pair_mask, other=-1)
        has = route >= 0
        acc += tl.load(rows_ptr + route.to(tl.int64)[:, None] * stride_rows + d[None, :],
                       mask=has[:, None] & d_mask[None, :], other=0.0)
    tl.store(out_ptr + token[:, None] * stride_out + head[:, None] * HEAD_DIM + d[None, :],
             round_to(acc, out_ptr.dtype.element_ty, SOFT_BF16), mask=pair_mask[:, None] & d_mask[None, :])


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def _register_cap(maxnreg: int) -> dict:
    return {"maxnreg": maxnreg} if maxnreg and not interpreter_enabled() else {}


def _dot_modes() -> tuple[bool, str]:
    upcast = interpreter_enabled()
    return upcast, "ieee" if upcast else "tf32"  # tf32 is never used: operands are 16-bit


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass
class FusedCall:
    """The tensors one run of a :class:`~.plan.LaunchPlan` reads and writes. ``schedule``: the
    block schedule's buffers (filled by the plan's schedule step, or already built; None
    without routes); ``rows`` ``[R, Dh]`` fp32 and ``slot_route`` ``[S*H*K]`` int32: the
    per-route rows and where each slot's row is; ``out``: the top-k sum's output; ``act``: the
    two-kernel path's activation buffer and ``gathered``: the ``tma_gathered`` variant's x rows;
    ``descriptors``: the plan's tensor descriptors (:func:`~.fused_prepare.expert_buffers` makes
    these three where the plan needs them)."""

    x: torch.Tensor
    table: RouteTable
    weights: ExpertWeights
    config: MoEConfig
    workspace: FusedWorkspace | None
    schedule: BlockSchedule | None
    rows: torch.Tensor
    slot_route: torch.Tensor
    out: torch.Tensor | None = None
    act: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    descriptors: dict | None = None


def _launch_expert_mlp(step: LaunchStep, call: FusedCall, descs: dict, warmup: bool = False):
    """Kernels 2 and 3 as one (``expert_mlp_tma_kernel``): weighted fp32 rows per route, no
    activation buffer. ``warmup``: compile for this launch and return the compiled kernel."""
    c, tiles, w = call, step.tiles, call.weights
    bn, dh = tiles.gu_block_n, c.config.head_dim
    upcast, precision = _dot_modes()
    sched = c.schedule
    args = (c.x, descs["w_gate"], descs["w_up"], descs["w_down"], c.table.gather_ids,
            c.table.sorted_probs, c.table.route_slots,
            c.table.offsets, sched.block_bank, sched.block_start, sched.block_count,
            c.rows, c.slot_route, c.x.stride(0), c.rows.stride(0), c.config.num_experts)
    meta = dict(HEAD_DIM=dh, INTER=c.config.intermediate_size, BLOCK_M=tiles.block_m, BLOCK_N=bn,
                ACT_DTYPE=_TL_DTYPES[w.w_down.dtype], UPCAST=upcast,
                DOT_PRECISION=precision, num_warps=tiles.gu_warps, num_stages=tiles.gu_stages,
                **_register_cap(tiles.gu_maxnreg))
    if warmup:
        return T.expert_mlp_tma_kernel.warmup(*args, grid=(step.grid,), **meta)
    T.expert_mlp_tma_kernel[(step.grid,)](*args, **meta)


_SHARED: dict[tuple, int] = {}


def _signature_call(weights: ExpertWeights, config: MoEConfig) -> FusedCall:
    """Empty stand-ins of the one-kernel launch's tensors, of its dtypes on the weights' device:
    a compiled kernel depends on the arguments' dtypes and on which pointers are 16-byte aligned,
    and these are, as fresh inputs and workspace views are."""
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
        if step.kernel != EXPERT_MLP:
            raise ValueError(f"only {EXPERT_MLP} is measured, not {step.kernel}")
        w = weights.w_down
        key = (w.device, w.dtype, config.head_dim, config.intermediate_size, step.tiles)
        if key not in _SHARED:
            call = _signature_call(weights, config)
            descs = step_descriptors((step,), weights, config.head_dim, None, None)[EXPERT_MLP]
            _SHARED[key] = _launch_expert_mlp(step, call, descs, warmup=True).metadata.shared
        return _SHARED[key]
    return measure


def _launch_gate_up(step: LaunchStep, call: FusedCall) -> None:
    """Kernel 2, K loop over Dh per column tile: SwiGLU7 activations into ``act``."""
    c, tiles, act = call, step.tiles, call.act
    upcast, precision = _dot_modes()
    wg, wu, sched = c.weights.w_gate, c.weights.w_up, c.schedule
    gate_up_kernel[(step.grid,)](
        c.x, wg, wu, c.table.gather_ids, c.table.offsets,
        sched.block_bank, sched.block_start, sched.block_count, act,
        c.x.stride(0), wg.stride(0), wg.stride(1), wu.stride(0), wu.stride(1), act.stride(0),
        c.config.num_experts, HEAD_DIM=c.config.head_dim, INTER=c.config.intermediate_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.gu_block_n, BLOCK_K=tiles.gu_block_k,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.gu_warps, num_stages=tiles.gu_stages, **_register_cap(tiles.gu_maxnreg),
    )


def _launch_gate_up_tma(step: LaunchStep, call: FusedCall, descs: dict) -> None:
    """Kernel 2 with weight tiles by descriptor (``tma``), and ``x`` rows from the gathered
    buffer by descriptor too (``tma_gathered``); the activation stored by descriptor where the
    tiles ask it."""
    c, tiles, act = call, step.tiles, call.act
    bk, bn = tiles.gu_block_k, tiles.gu_block_n
    act_desc = descs.get("act")
    upcast, precision = _dot_modes()
    sched = c.schedule
    T.gate_up_tma_kernel[(step.grid,)](
        c.x, descs.get("x"), descs["w_gate"], descs["w_up"], c.table.gather_ids, c.table.offsets,
        sched.block_bank, sched.block_start, sched.block_count, act, act_desc,
        c.x.stride(0), act.stride(0), c.config.num_experts,
        HEAD_DIM=c.config.head_dim, INTER=c.config.intermediate_size,
        BLOCK_M=tiles.block_m, BLOCK_N=bn, BLOCK_K=bk,
        X_GATHERED=tiles.gu_variant == "tma_gathered",
        ACT_DESC=act_desc is not None,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.gu_warps, num_stages=tiles.gu_stages, **_register_cap(tiles.gu_maxnreg),
    )


def _launch_down(step: LaunchStep, call: FusedCall) -> None:
    """Kernel 3: weighted fp32 rows per route into ``rows`` ``[R, Dh]`` and ``slot_route``."""
    c, tiles, act = call, step.tiles, call.act
    upcast, precision = _dot_modes()
    wd, sched = c.weights.w_down, c.schedule
    down_kernel[(step.grid,)](
        act, wd, c.table.sorted_probs, c.table.route_slots, c.table.offsets,
        sched.block_bank, sched.block_start, sched.block_count, c.rows, c.slot_route,
        act.stride(0), wd.stride(0), wd.stride(1), c.rows.stride(0),
        HEAD_DIM=c.config.head_dim, INTER=c.config.intermediate_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.down_warps, num_stages=tiles.down_stages,
    )


def _launch_down_tma(step: LaunchStep, call: FusedCall, descs: dict) -> None:
    """Kernel 3 with the activation rows and the ``W_down`` tiles by descriptor."""
    c, tiles = call, step.tiles
    upcast, precision = _dot_modes()
    sched = c.schedule
    T.down_tma_kernel[(step.grid,)](
        descs["act"], descs["w_down"], c.table.sorted_probs, c.table.route_slots, c.table.offsets,
        sched.block_bank, sched.block_start, sched.block_count, c.rows, c.slot_route,
        c.rows.stride(0),
        HEAD_DIM=c.config.head_dim, INTER=c.config.intermediate_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.down_warps, num_stages=tiles.down_stages,
    )


def _launch_topk_sum(step: LaunchStep, call: FusedCall) -> None:
    """``out[s, h] = sum_k rows[slot_route[(s*H + h)*K + k]]`` in fixed order, one rounding."""
    c, tiles, cfg = call, step.tiles, call.config
    topk_sum_kernel[(step.grid,)](
        c.rows, c.slot_route, c.out, c.out.shape[0] * cfg.num_heads, cfg.num_heads,
        c.rows.stride(0), c.out.stride(0),
        HEAD_DIM=cfg.head_dim, DH_PAD=max(16, triton.next_power_of_2(cfg.head_dim)),
        TOP_K=cfg.top_k, BLOCK_T=tiles.sum_block_t, SOFT_BF16=interpreter_enabled(),
        num_warps=tiles.sum_warps,
    )


def launch_gather_rows(x: torch.Tensor, table: RouteTable, schedule: BlockSchedule,
                       xg: torch.Tensor, config: MoEConfig) -> None:
    """Each live block's ``x`` rows into ``xg`` ``[max_blocks*BLOCK_M, Dh]`` in padded-block
    order (the ``tma_gathered`` variant's first launch, ``gather_rows_kernel``)."""
    dh = config.head_dim
    T.gather_rows_kernel[(schedule.max_blocks,)](
        x, table.gather_ids, table.offsets, schedule.block_bank, schedule.block_start,
        schedule.block_count, xg, x.stride(0), xg.stride(0), config.num_experts,
        HEAD_DIM=dh, DH_PAD=max(16, triton.next_power_of_2(dh)), BLOCK_M=schedule.block_m,
        num_warps=1 if interpreter_enabled() else 4,
    )


def run_plan(plan: LaunchPlan, call: FusedCall) -> None:
    """Launch ``plan``'s steps in order on ``call``'s tensors and descriptors; nothing is
    decided or taken here."""
    descs = call.descriptors or {}
    if plan.clear_slots:  # a partial (hand-built) table leaves slots without a route
        call.slot_route.fill_(-1)
    for step in plan.steps:
        kernel = step.kernel
        if kernel in (EXPERT_MLP, GATE_UP_TMA, DOWN_TMA) and kernel not in descs:
            raise ValueError(f"call.descriptors has none for {kernel}: make them with "
                             f"descriptors.step_descriptors(plan.steps, ...)")
        if kernel == EXPERT_MLP:
            _launch_expert_mlp(step, call, descs[kernel])
        elif kernel == GATE_UP:
            _launch_gate_up(step, call)
        elif kernel == GATE_UP_TMA:
            _launch_gate_up_tma(step, call, descs[kernel])
        elif kernel == DOWN:
            _launch_down(step, call)
        elif kernel == DOWN_TMA:
            _launch_down_tma(step, call, descs[kernel])
        elif kernel == TOPK_SUM:
            _launch_topk_sum(step, call)
        elif kernel == GATHER_ROWS:
            launch_gather_rows(call.x, call.table, call.schedule, call.gathered, call.config)
        elif kernel == SCHEDULE:
            fill_block_schedule(call.schedule, call.table.offsets, call.config.num_banks)
        else:
            raise ValueError(f"run_plan cannot launch {kernel!r}")


def _plan_call(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
               tiles: FusedTiles, *, schedule_built: bool, rows_only: bool = False) -> LaunchPlan:
    """The plan :func:`fused_call` and :func:`launch_route_rows` run: this device's facts,
    and on a GPU the compiled one-kernel path's shared memory."""
    return plan_fused(config, table.num_tokens, table.num_routes, tiles, device_facts(x.device),
                      weights, schedule_built=schedule_built, rows_only=rows_only,
                      shared_memory_of=compiled_shared_memory(weights, config)
                      if x.device.type == "cuda" else None)


def _check_schedule(schedule: BlockSchedule, table: RouteTable, config: MoEConfig,
                    tiles: FusedTiles) -> None:
    """A schedule built already must fit the table and the tiles."""
    R = table.num_routes
    if schedule.block_m != tiles.block_m:
        raise ValueError(f"schedule was built for block_m={schedule.block_m}, "
                         f"tiles use {tiles.block_m}")
    want = max_blocks(R, config.num_banks, tiles.block_m)
    if schedule.max_blocks != want:
        raise ValueError(f"schedule has {schedule.max_blocks} blocks; a table of {R} routes over "
                         f"{config.num_banks} banks needs {want}")


def launch_route_rows(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                      config: MoEConfig, rows: torch.Tensor, slot_route: torch.Tensor, *,
                      tiles: FusedTiles, workspace: FusedWorkspace,
                      schedule: BlockSchedule | None = None) -> LaunchPlan:
    """Expert rows only: fp32 ``p * expert(x)`` into caller-owned ``rows`` ``[R, Dh]`` (CSR
    order, as the native kernel's deterministic rows) and each route's CSR index into
    ``slot_route`` ``[S*H*K]`` int32. Huge-input tests call this with lazily allocated buffers.
    Returns the plan it ran."""
    R = table.num_routes
    if schedule is not None and R:
        _check_schedule(schedule, table, config, tiles)
    plan = _plan_call(x, table, weights, config, tiles, schedule_built=schedule is not None,
                      rows_only=True)
    b = expert_buffers(workspace, x.device, plan, weights, config, table.num_tokens, R, x.dtype,
                       rows=rows, slot_route=slot_route)
    if R and schedule is None:
        schedule = schedule_buffers(workspace, R, config.num_banks, tiles.block_m)
    run_plan(plan, FusedCall(x, table, weights, config, workspace, schedule if R else None, rows,
                             slot_route, None, b.act, b.gathered, b.descriptors))
    return plan


def fused_call(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
               *, out: torch.Tensor | None = None, tiles: FusedTiles | None = None,
               workspace: FusedWorkspace | None = None,
               schedule: BlockSchedule | None = None,
               check_bounds: bool | None = None) -> tuple[LaunchPlan, FusedCall]:
    """What :func:`fused_forward` runs: its inputs checked, its plan made, its buffers taken
    from the workspace (:func:`~.fused_prepare.expert_buffers`); nothing launched. An empty
    input gets an empty plan."""
    check_fused_inputs(x, table, weights, config, check_bounds=check_bounds)
    S, D = x.shape
    if out is None:
        out = torch.empty(S, D, dtype=x.dtype, device=x.device)
    else:
        check_out(out, x)
        check_unit_last_stride("out", out)
    if S == 0:  # nothing to launch: the empty out stands in for the buffers no step reads
        return LaunchPlan((), tiles or INTERPRETER_TILES, device_facts(x.device), 0), FusedCall(
            x, table, weights, config, workspace, None, out, out, out)
    R = table.num_routes
    tiles = tiles or choose_fused_tiles(config, R, x.device)
    if schedule is not None and R:
        _check_schedule(schedule, table, config, tiles)
    plan = _plan_call(x, table, weights, config, tiles, schedule_built=schedule is not None)
    b = expert_buffers(workspace, x.device, plan, weights, config, S, R, x.dtype)
    if R and schedule is None:
        schedule = schedule_buffers(b.workspace, R, config.num_banks, tiles.block_m)
    return plan, FusedCall(x, table, weights, config, b.workspace, schedule if R else None,
                           b.rows, b.slot_route, out, b.act, b.gathered, b.descriptors)


def fused_forward(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
                  *, out: torch.Tensor | None = None, tiles: FusedTiles | None = None,
                  workspace: FusedWorkspace | None = None,
                  schedule: BlockSchedule | None = None,
                  check_bounds: bool | None = None) -> torch.Tensor:
    """The expert computation on ``table``'s routes; returns ``out`` ``[S, H*Dh]`` in ``x.dtype``.

    For a table magi-moe built itself and nobody changed since (``table.trusted``: the fused
    router, ``build_route_table``), no host synchronisation, and once the workspace has grown to
    the problem's size, no allocation. Any other table is validated first (one sync), so a bad
    hand-built or edited table gets a clear error instead of a wild memory access or a wrong
    sum; ``check_bounds`` overrides. ``schedule``: a block schedule already built on the device
    (the fused router builds it with the route table); built here otherwise. Which kernels
    run: :func:`fused_call`'s plan (:mod:`.plan`)."""
    plan, call = fused_call(x, table, weights, config, out=out, tiles=tiles, workspace=workspace,
                            schedule=schedule, check_bounds=check_bounds)
    run_plan(plan, call)
    return call.out
