"""Tensor-descriptor (TMA) kernels of the fused path, for Hopper and later.

A tensor descriptor load is one bulk copy issued by one thread (the copy engine does the
address arithmetic), where a pointer load costs every thread address registers and issue slots.

* ``expert_mlp_tma_kernel`` (the H200 tile table's choice for every class): gate/up, SwiGLU7
  and the down projection of a whole row block in one work item. The block's ``x`` rows are
  gathered once; ``[Dh, BLOCK_N]`` gate and up tiles and ``[BLOCK_N, Dh]`` down tiles stream
  through a pipelined loop over ``I``; each ``BLOCK_N``-wide activation slice is rounded to
  bf16 in registers and fed to the down MMA, so no activation buffer exists (docs/PERFORMANCE.md,
  "Shapes of the expert step").
* The two-kernel forms (same work items, fp32 accumulation order and outputs as
  ``gate_up_kernel`` and ``down_kernel`` in :mod:`magi_moe.kernels.fused`):
  ``gate_up_tma_kernel`` loads weight tiles by descriptor; with ``X_GATHERED`` the block's ``x``
  rows come from a buffer ``gather_rows_kernel`` filled in padded-block order, so both operands
  are descriptor loads; with ``ACT_DESC`` the activation tile leaves by a descriptor store.
  ``down_tma_kernel`` loads the activation rows and the ``W_down`` tiles by descriptor.

The descriptors themselves are made by :mod:`.descriptors`; which of these kernels run, and
why a fallback was taken, the launch plan says (:mod:`.plan`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .blocks import activation, block_rows, block_x_rows, store_activation, store_weighted_rows
from .rounding import round_operand, swiglu7


@triton.jit
def gather_rows_kernel(
    x_ptr,            # [S, H*Dh] input, unit stride in the last dim
    gather_ptr,       # [R] int32 token of each route (CSR order)
    offsets_ptr,      # [H*E + 1] int64 CSR offsets
    block_bank_ptr,   # [max_blocks] int32
    block_start_ptr,  # [max_blocks] int64
    block_count_ptr,  # [1] int32 live blocks
    xg_ptr,           # [max_blocks*BLOCK_M, Dh] out: each live block's x rows, zeros as padding
    stride_x,
    stride_xg,
    num_experts,
    HEAD_DIM: tl.constexpr,
    DH_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    block = tl.program_id(0)  # one program per possible block; those past the live count exit
    if block < tl.load(block_count_ptr):
        bank = tl.load(block_bank_ptr + block).to(tl.int64)
        head = bank // num_experts
        rows, row_mask = block_rows(block, bank, block_start_ptr, offsets_ptr, BLOCK_M)
        tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        d = tl.arange(0, DH_PAD)
        d_mask = d < HEAD_DIM
        vals = tl.load(x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + d[None, :],
                       mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        padded = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        tl.store(xg_ptr + padded[:, None] * stride_xg + d[None, :], vals, mask=d_mask[None, :])


@triton.jit
def gate_up_tma_kernel(
    x_ptr,            # [S, H*Dh] input (read when not X_GATHERED)
    xg_desc,          # [max_blocks*BLOCK_M, Dh] gathered rows (read when X_GATHERED)
    wg_desc,          # [H*E*Dh, I] gate weights
    wu_desc,          # [H*E*Dh, I] up weights
    gather_ptr, offsets_ptr, block_bank_ptr, block_start_ptr, block_count_ptr,
    act_ptr,          # [max_blocks*BLOCK_M, I] out
    act_desc,         # the same buffer by descriptor (written through it when ACT_DESC)
    stride_x,
    stride_act,
    num_experts,
    HEAD_DIM: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_GATHERED: tl.constexpr,
    ACT_DESC: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_n: tl.constexpr = INTER // BLOCK_N
    work = tl.load(block_count_ptr) * num_n
    # while, not range(): Triton 3.6's interpreter takes no tensor bounds (CONTRACT section 8).
    item = tl.program_id(0)
    while item < work:
        block = item // num_n
        n0 = (item % num_n) * BLOCK_N
        bank = tl.load(block_bank_ptr + block)
        w_row = bank * HEAD_DIM
        if not X_GATHERED:
            rows, row_mask = block_rows(block, bank, block_start_ptr, offsets_ptr, BLOCK_M)
            tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            head = bank.to(tl.int64) // num_experts
            x_ptrs = x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + tl.arange(0, BLOCK_K)[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, HEAD_DIM // BLOCK_K):
            k0 = kk * BLOCK_K
            if X_GATHERED:
                a = xg_desc.load([block * BLOCK_M, k0])
            else:
                a = tl.load(x_ptrs + k0, mask=row_mask[:, None], other=0.0)
            wg = wg_desc.load([w_row + k0, n0])
            wu = wu_desc.load([w_row + k0, n0])
            if UPCAST:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)

        if ACT_DESC:  # a bulk store from shared memory; padded rows belong to this block alone
            act_desc.store([block * BLOCK_M, n0],
                           activation(acc_g, acc_u, act_ptr.dtype.element_ty, UPCAST))
        else:
            store_activation(acc_g, acc_u, block, n0 + tl.arange(0, BLOCK_N), act_ptr,
                             stride_act, BLOCK_M, UPCAST)
        item += tl.num_programs(0)


@triton.jit
def down_tma_kernel(
    act_desc,         # [max_blocks*BLOCK_M, I] activations
    wd_desc,          # [H*E*I, Dh] down weights
    probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr, block_count_ptr,
    rows_ptr,         # [R, Dh] fp32 out
    slot_route_ptr,   # [S*H*K] int32 out
    stride_rows,
    HEAD_DIM: tl.constexpr,
    INTER: tl.constexpr,
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
        n0 = (item % num_n) * BLOCK_N
        bank = tl.load(block_bank_ptr + block)
        w_row = bank * INTER
        rows, row_mask = block_rows(block, bank, block_start_ptr, offsets_ptr, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, INTER // BLOCK_K):
            k0 = kk * BLOCK_K
            a = act_desc.load([block * BLOCK_M, k0])
            w = wd_desc.load([w_row + k0, n0])
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)

        store_weighted_rows(acc, rows, row_mask, n0 + tl.arange(0, BLOCK_N), probs_ptr,
                            slots_ptr, rows_ptr, slot_route_ptr, stride_rows)
        item += tl.num_programs(0)


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
