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

import torch
import triton
import triton.language as tl

from ..backends import interpreter_enabled
from ..config import MoEConfig
from ..inputs import check_expert_inputs
from ..routing import RouteTable
from ..validation import check_kernel_device, check_tensor
from ..weights import ExpertWeights
from . import fused_tma as T
from .blocks import block_rows, store_activation, store_weighted_rows
from .descriptors import banked_descriptor, matrix_descriptor
from .device import persistent_grid, shared_memory_limit, tma_supported
from .rounding import round_to
from .schedule import BlockSchedule, launch_block_schedule
from .tiles import DOWN_VARIANTS, GATE_UP_VARIANTS, FusedTiles, choose_fused_tiles, two_kernel_tiles
from .workspace import FusedWorkspace, shared_workspace

FUSED_DTYPES = (torch.bfloat16, torch.float16)


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
def check_fused_inputs(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                       config: MoEConfig, *, check_bounds: bool | None = None) -> None:
    """Shapes, dtypes, devices, strides and (with ``check_bounds``, one host sync; by default
    for untrusted tables) the table's values: see :func:`~magi_moe.inputs.check_expert_inputs`."""
    check_expert_inputs(x, table, weights, config, dtypes=FUSED_DTYPES, check_bounds=check_bounds)
    check_kernel_device("x", x)
    if x.numel() and x.stride(-1) != 1:
        raise ValueError(f"x must have unit stride in its last dim, got strides {x.stride()}")
    for name, w in weights._asdict().items():
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got strides {w.stride()}")
    R = table.num_routes
    check_tensor("table.sorted_probs", table.sorted_probs, dtype=torch.float32)
    slots = table.num_tokens * config.num_heads * config.top_k
    if max(R, slots) >= 2**31:
        raise ValueError(f"table has {R} routes and {slots} slots; the slot map is int32, so "
                         f"both must stay below 2^31")


def _register_cap(maxnreg: int) -> dict:
    return {"maxnreg": maxnreg} if maxnreg and not interpreter_enabled() else {}


def _dot_modes() -> tuple[bool, str]:
    upcast = interpreter_enabled()
    return upcast, "ieee" if upcast else "tf32"  # tf32 is never used: operands are 16-bit


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _whole_head_tiles(config: MoEConfig) -> bool:
    """The one-kernel path loads ``[Dh, BLOCK_N]`` weight tiles in one descriptor box (a power
    of two, at most 256 per side)."""
    dh = config.head_dim
    return dh & (dh - 1) == 0 and 16 <= dh <= 256


def launch_gate_up(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
                   schedule: BlockSchedule, act: torch.Tensor, tiles: FusedTiles,
                   workspace: FusedWorkspace | None = None) -> None:
    """Kernel 2: SwiGLU7 activations of every live block into ``act`` ``[max_blocks*BLOCK_M, I]``
    (``tma_gathered`` first gathers the blocks' ``x`` rows into a ``workspace`` buffer)."""
    if tiles.gu_variant not in GATE_UP_VARIANTS:
        raise ValueError(f"FusedTiles.gu_variant must be one of {GATE_UP_VARIANTS}, "
                         f"got {tiles.gu_variant!r}")
    tiles = two_kernel_tiles(tiles, config)  # "mlp_tma" tiles: its fallback's gate/up
    if tiles.gu_act_store not in ("ptr", "tma"):
        raise ValueError(f"FusedTiles.gu_act_store must be 'ptr' or 'tma', got {tiles.gu_act_store!r}")
    if tiles.gu_variant in ("tma", "tma_gathered") and _launch_gate_up_tma(
            x, table, weights, config, schedule, act, tiles, workspace):
        return
    upcast, precision = _dot_modes()
    wg, wu = weights.w_gate, weights.w_up
    I = config.intermediate_size
    work = schedule.max_blocks * (I // tiles.gu_block_n)
    gate_up_kernel[(persistent_grid(work, tiles.gu_programs_per_sm, x.device),)](
        x, wg, wu, table.gather_ids, table.offsets,
        schedule.block_bank, schedule.block_start, schedule.block_count, act,
        x.stride(0), wg.stride(0), wg.stride(1), wu.stride(0), wu.stride(1), act.stride(0),
        config.num_experts, HEAD_DIM=config.head_dim, INTER=I,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.gu_block_n, BLOCK_K=tiles.gu_block_k,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.gu_warps, num_stages=tiles.gu_stages, **_register_cap(tiles.gu_maxnreg),
    )


def _launch_gate_up_tma(x, table, weights, config, schedule, act, tiles, workspace) -> bool:
    """The descriptor variants of kernel 2; False (nothing launched) where TMA cannot run."""
    if not tma_supported(x.device):
        return False
    bk, bn = tiles.gu_block_k, tiles.gu_block_n
    wg_desc = banked_descriptor(weights.w_gate, [bk, bn])
    wu_desc = banked_descriptor(weights.w_up, [bk, bn])
    if wg_desc is None or wu_desc is None:
        return False
    gathered = tiles.gu_variant == "tma_gathered"
    xg_desc = None
    if gathered:
        workspace = workspace or shared_workspace(x.device)
        xg = workspace.get("x_gathered", (schedule.max_blocks * tiles.block_m, config.head_dim),
                           x.dtype)
        xg_desc = matrix_descriptor(xg, [tiles.block_m, bk])
        if xg_desc is None:
            return False
        T.launch_gather_rows(x, table, schedule, xg, config)
    act_desc = matrix_descriptor(act, [tiles.block_m, bn]) if tiles.gu_act_store == "tma" else None
    upcast, precision = _dot_modes()
    work = schedule.max_blocks * (config.intermediate_size // bn)
    T.gate_up_tma_kernel[(persistent_grid(work, tiles.gu_programs_per_sm, x.device),)](
        x, xg_desc, wg_desc, wu_desc, table.gather_ids, table.offsets,
        schedule.block_bank, schedule.block_start, schedule.block_count, act, act_desc,
        x.stride(0), act.stride(0), config.num_experts,
        HEAD_DIM=config.head_dim, INTER=config.intermediate_size,
        BLOCK_M=tiles.block_m, BLOCK_N=bn, BLOCK_K=bk, X_GATHERED=gathered,
        ACT_DESC=act_desc is not None,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.gu_warps, num_stages=tiles.gu_stages, **_register_cap(tiles.gu_maxnreg),
    )
    return True


def launch_expert_mlp(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                      config: MoEConfig, schedule: BlockSchedule, rows: torch.Tensor,
                      slot_route: torch.Tensor, tiles: FusedTiles) -> bool:
    """Kernels 2 and 3 as one (``gu_variant="mlp_tma"``): weighted fp32 rows per route with no
    activation buffer. False (nothing launched) where it cannot run; the caller then launches
    the two-kernel path."""
    if not (tma_supported(x.device) and _whole_head_tiles(config)):
        return False
    bn, dh = tiles.gu_block_n, config.head_dim
    wg_desc = banked_descriptor(weights.w_gate, [dh, bn])
    wu_desc = banked_descriptor(weights.w_up, [dh, bn])
    wd_desc = banked_descriptor(weights.w_down, [bn, dh])
    if wg_desc is None or wu_desc is None or wd_desc is None:
        return False
    upcast, precision = _dot_modes()
    grid = (persistent_grid(schedule.max_blocks, tiles.gu_programs_per_sm, x.device),)
    args = (x, wg_desc, wu_desc, wd_desc, table.gather_ids, table.sorted_probs, table.route_slots,
            table.offsets, schedule.block_bank, schedule.block_start, schedule.block_count,
            rows, slot_route, x.stride(0), rows.stride(0), config.num_experts)
    meta = dict(HEAD_DIM=dh, INTER=config.intermediate_size, BLOCK_M=tiles.block_m, BLOCK_N=bn,
                ACT_DTYPE=_TL_DTYPES[weights.w_down.dtype], UPCAST=upcast,
                DOT_PRECISION=precision, num_warps=tiles.gu_warps, num_stages=tiles.gu_stages,
                **_register_cap(tiles.gu_maxnreg))
    key = (x.device, x.dtype, dh, config.intermediate_size, tiles)
    if x.device.type == "cuda" and not _fits_shared_memory(T.expert_mlp_tma_kernel, key, grid,
                                                           args, meta):
        return False
    T.expert_mlp_tma_kernel[grid](*args, **meta)
    return True


_FITS: dict[tuple, bool] = {}


def _fits_shared_memory(kernel, key: tuple, grid, args, meta: dict) -> bool:
    """Whether ``kernel`` compiled for this launch fits the GPU's shared memory. Its footprint
    depends on the shapes as well as the tiles (with a single activation slice, I = BLOCK_N,
    Triton 3.6 asked 353 KiB for tiles that take 208 KiB at I = 1280), so it is read from the
    compiled kernel, once per ``key`` = (device, dtype, shapes, tiles), instead of estimated."""
    fits = _FITS.get(key)
    if fits is None:
        compiled = kernel.warmup(*args, grid=grid, **meta)
        fits = _FITS[key] = compiled.metadata.shared <= shared_memory_limit(key[0])
    return fits


def launch_down(table: RouteTable, weights: ExpertWeights, config: MoEConfig,
                schedule: BlockSchedule, act: torch.Tensor, rows: torch.Tensor,
                slot_route: torch.Tensor, tiles: FusedTiles) -> None:
    """Kernel 3: weighted fp32 rows per route into ``rows`` ``[R, Dh]`` and ``slot_route``."""
    if tiles.down_variant not in DOWN_VARIANTS:
        raise ValueError(f"FusedTiles.down_variant must be one of {DOWN_VARIANTS}, "
                         f"got {tiles.down_variant!r}")
    tiles = two_kernel_tiles(tiles, config)
    upcast, precision = _dot_modes()
    wd = weights.w_down
    Dh = config.head_dim
    work = schedule.max_blocks * (Dh // tiles.down_block_n)
    if tiles.down_variant == "tma" and tma_supported(act.device):
        act_desc = matrix_descriptor(act, [tiles.block_m, tiles.down_block_k])
        wd_desc = banked_descriptor(wd, [tiles.down_block_k, tiles.down_block_n])
        if act_desc is not None and wd_desc is not None:
            T.down_tma_kernel[(persistent_grid(work, tiles.down_programs_per_sm, act.device),)](
                act_desc, wd_desc, table.sorted_probs, table.route_slots, table.offsets,
                schedule.block_bank, schedule.block_start, schedule.block_count, rows,
                slot_route, rows.stride(0),
                HEAD_DIM=Dh, INTER=config.intermediate_size,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k,
                UPCAST=upcast, DOT_PRECISION=precision,
                num_warps=tiles.down_warps, num_stages=tiles.down_stages,
            )
            return
    down_kernel[(persistent_grid(work, tiles.down_programs_per_sm, act.device),)](
        act, wd, table.sorted_probs, table.route_slots, table.offsets,
        schedule.block_bank, schedule.block_start, schedule.block_count, rows, slot_route,
        act.stride(0), wd.stride(0), wd.stride(1), rows.stride(0),
        HEAD_DIM=Dh, INTER=config.intermediate_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.down_warps, num_stages=tiles.down_stages,
    )


def launch_route_rows(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                      config: MoEConfig, rows: torch.Tensor, slot_route: torch.Tensor, *,
                      tiles: FusedTiles, workspace: FusedWorkspace,
                      schedule: BlockSchedule | None = None) -> None:
    """Expert rows only: fp32 ``p * expert(x)`` into caller-owned ``rows`` ``[R, Dh]`` (CSR
    order, as the native kernel's deterministic rows) and each route's CSR index into
    ``slot_route`` ``[S*H*K]`` int32. Huge-input tests call this with lazily allocated buffers."""
    R = table.num_routes
    if R == 0:
        return
    if schedule is None:
        schedule = launch_block_schedule(table.offsets, R, config.num_banks, tiles.block_m,
                                         workspace)
    if tiles.gu_variant == "mlp_tma":
        if launch_expert_mlp(x, table, weights, config, schedule, rows, slot_route, tiles):
            return
        tiles = two_kernel_tiles(tiles, config)
    act = workspace.get("act", (schedule.max_blocks * tiles.block_m, config.intermediate_size),
                        weights.w_down.dtype)
    launch_gate_up(x, table, weights, config, schedule, act, tiles, workspace)
    launch_down(table, weights, config, schedule, act, rows, slot_route, tiles)


def launch_topk_sum(rows: torch.Tensor, slot_route: torch.Tensor, out: torch.Tensor,
                    config: MoEConfig, tiles: FusedTiles) -> None:
    """``out[s, h] = sum_k rows[slot_route[(s*H + h)*K + k]]`` in fixed order, one rounding."""
    S = out.shape[0]
    if S == 0:
        return
    pairs = S * config.num_heads
    topk_sum_kernel[(triton.cdiv(pairs, tiles.sum_block_t),)](
        rows, slot_route, out, pairs, config.num_heads, rows.stride(0), out.stride(0),
        HEAD_DIM=config.head_dim, DH_PAD=max(16, triton.next_power_of_2(config.head_dim)),
        TOP_K=config.top_k, BLOCK_T=tiles.sum_block_t, SOFT_BF16=interpreter_enabled(),
        num_warps=tiles.sum_warps,
    )


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
    (the fused router builds it with the route table); built here otherwise."""
    check_fused_inputs(x, table, weights, config, check_bounds=check_bounds)
    S, D = x.shape
    if out is None:
        out = torch.empty(S, D, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, shape=(S, D), dtype=x.dtype, device=x.device)
        if out.numel() and out.stride(-1) != 1:
            raise ValueError(f"out must have unit stride in its last dim, got strides {out.stride()}")
    if S == 0:
        return out
    workspace = workspace or shared_workspace(x.device)
    R = table.num_routes
    tiles = tiles or choose_fused_tiles(config, R, x.device)
    if schedule is not None and schedule.block_m != tiles.block_m:
        raise ValueError(f"schedule was built for block_m={schedule.block_m}, "
                         f"tiles use {tiles.block_m}")
    num_slots = S * config.num_heads * config.top_k
    rows = workspace.get("rows", (R, config.head_dim), torch.float32)
    slot_route = workspace.get("slot_route", (num_slots,), torch.int32)
    if R < num_slots:  # a partial (hand-built) table leaves slots without a route
        slot_route.fill_(-1)
    launch_route_rows(x, table, weights, config, rows, slot_route, tiles=tiles,
                      workspace=workspace, schedule=schedule)
    launch_topk_sum(rows, slot_route, out, config, tiles)
    return out
