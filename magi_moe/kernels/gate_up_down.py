"""The two-kernel expert path: ``gate_up_kernel`` and ``down_kernel``, pointer loads, and their
launchers. It runs wherever the one-kernel step (:mod:`.expert_mlp`) cannot (the launch plan,
:mod:`.plan`, says why) and on every GPU without a table entry (``PORTABLE_TILES``).

* ``gate_up_kernel`` (persistent): for each (live block, ``BLOCK_N`` columns of ``I``), the
  block's tokens' ``x`` rows gathered on the fly, ``g = x W_gate`` and ``u = x W_up``
  accumulated in fp32, ``a = SwiGLU7(g, u)`` in fp32 rounded once to bf16, stored into the
  activation buffer ``[max_blocks * BLOCK_M, I]`` at the block's padded rows (padding rows read
  ``x = 0`` and store exact zeros).
* ``down_kernel`` (persistent): ``a W_down`` accumulated in fp32, times the routing weight in
  fp32, stored as one fp32 row per route in CSR order ``[R, Dh]`` (the layout of the native
  kernel's deterministic rows); it also records where each ``(s, h, k)`` slot's row went
  (``slot_route [S*H*K]``, int32).

The kernels read ``w_gate``/``w_up`` through their strides (unit stride in the last dim): the
packed bank of :mod:`magi_moe.packed_weights` (two dense ``[H*E, Dh, I]`` buffers), views with
a larger row stride and plain contiguous tensors all work without a copy.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .blocks import block_rows, store_activation, store_weighted_rows
from .launch_steps import FusedCall, Launcher, LaunchStep, dot_modes, register_cap


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


def _launch_gate_up(step: LaunchStep, call: FusedCall) -> None:
    """K loop over Dh per column tile: SwiGLU7 activations into ``call.act``."""
    c, tiles, act = call, step.tiles, call.act
    upcast, precision = dot_modes()
    wg, wu, sched = c.weights.w_gate, c.weights.w_up, c.schedule
    gate_up_kernel[(step.grid,)](
        c.x, wg, wu, c.table.gather_ids, c.table.offsets,
        sched.block_bank, sched.block_start, sched.block_count, act,
        c.x.stride(0), wg.stride(0), wg.stride(1), wu.stride(0), wu.stride(1), act.stride(0),
        c.config.num_experts, HEAD_DIM=c.config.head_dim, INTER=c.config.intermediate_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.gu_block_n, BLOCK_K=tiles.gu_block_k,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=tiles.gu_warps, num_stages=tiles.gu_stages, **register_cap(tiles.gu_maxnreg),
    )


def _launch_down(step: LaunchStep, call: FusedCall) -> None:
    """Weighted fp32 rows per route into ``call.rows`` ``[R, Dh]`` and ``call.slot_route``."""
    c, tiles, act = call, step.tiles, call.act
    upcast, precision = dot_modes()
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


GATE_UP = Launcher("gate_up_kernel", _launch_gate_up)
DOWN = Launcher("down_kernel", _launch_down)
