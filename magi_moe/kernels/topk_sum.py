"""The top-k sum, the fused path's last launch: ``y[s, h] = sum_k row(s, h, k)`` in fp32,
``k = 0 .. K-1`` in that order, rounded once to the output dtype (under the interpreter by bit
arithmetic, :func:`~.rounding.round_to`). Slots without a route (hand-built tables) add nothing.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..backends import interpreter_enabled
from .launch_steps import FusedCall, Launcher, LaunchStep
from .rounding import round_to


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


TOPK_SUM = Launcher("topk_sum_kernel", _launch_topk_sum)
