"""What a work item of the fused path reads about its row block and the stores that end it,
shared by the two-kernel path (:mod:`.gate_up_down`) and the one-kernel step
(:mod:`.expert_mlp`), so both address the same routes and write exactly the same values to
exactly the same places."""
import triton
import triton.language as tl

from .rounding import round_to, swiglu7


@triton.jit
def block_rows(block, bank, block_start_ptr, offsets_ptr, BLOCK_M: tl.constexpr):
    """The route rows (CSR indices, int64) of live block ``block`` of ``bank``, and which of
    them exist (a bank's last block is padded past its routes)."""
    start = tl.load(block_start_ptr + block)
    end = tl.load(offsets_ptr + bank.to(tl.int64) + 1)
    rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
    return rows, rows < end


@triton.jit
def store_activation(acc_g, acc_u, block, n, act_ptr, stride_act, BLOCK_M: tl.constexpr,
                     SOFT_BF16: tl.constexpr):
    """SwiGLU7 of the fp32 gate/up accumulators, rounded once to the activation dtype, into the
    work item's block's padded rows (padding rows had x = 0, so they store exact zeros)."""
    act = round_to(swiglu7(acc_g, acc_u), act_ptr.dtype.element_ty, SOFT_BF16)
    padded = tl.cast(block, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    tl.store(act_ptr + padded[:, None] * stride_act + n[None, :], act)


@triton.jit
def store_weighted_rows(acc, rows, row_mask, n, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                        stride_rows):
    """``p * acc`` in fp32 into the routes' rows ``[R, Dh]`` (CSR order), and each route's CSR
    index into its slot. Every column tile stores the same slot entries (identical values, so
    the order of the duplicate writes cannot matter): cheaper than a branch on the tile index."""
    probs = tl.load(probs_ptr + rows, mask=row_mask, other=0.0)
    acc = acc * probs[:, None]  # routing weight in fp32
    tl.store(rows_ptr + rows[:, None] * stride_rows + n[None, :], acc, mask=row_mask[:, None])
    slots = tl.load(slots_ptr + rows, mask=row_mask, other=0)
    tl.store(slot_route_ptr + slots, rows.to(tl.int32), mask=row_mask)


@triton.jit
def block_x_rows(x_ptr, gather_ptr, rows, row_mask, head, stride_x, HEAD_DIM: tl.constexpr):
    """The block's routed tokens' ``x`` rows of head ``head``, whole width ``[BLOCK_M, Dh]``
    (``Dh`` a power of two), zeros in padding rows."""
    tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    return tl.load(x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + d[None, :],
                   mask=row_mask[:, None], other=0.0)
