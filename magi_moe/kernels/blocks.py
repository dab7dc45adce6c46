"""What a work item of the fused path reads about its row block and the stores that end it,
shared by the pointer-load kernels (:mod:`magi_moe.kernels.fused`) and the tensor-descriptor
ones (:mod:`.fused_tma`), so both address the same routes and write exactly the same values to
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
def activation(acc_g, acc_u, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """SwiGLU7 of the fp32 gate/up accumulators, rounded once to the activation dtype."""
    return round_to(swiglu7(acc_g, acc_u), dtype, SOFT_BF16)


@triton.jit
def store_activation(acc_g, acc_u, block, n, act_ptr, stride_act, BLOCK_M: tl.constexpr,
                     SOFT_BF16: tl.constexpr):
    """The activation of a work item into the block's padded rows (padding rows had x = 0, so
    they store exact zeros)."""
    act = activation(acc_g, acc_u, act_ptr.dtype.element_ty, SOFT_BF16)
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


@triton.jit
def sum_completed_pairs(rows, row_mask, slots_ptr, slot_route_ptr, rows_ptr, arrivals_ptr,
                        out_ptr, stride_rows, stride_out, num_heads, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, TOP_K: tl.constexpr, SOFT_BF16: tl.constexpr):
    """The top-k sum inside the expert kernel, after ``store_weighted_rows``: each route counts
    itself in its (token, head) pair's arrival counter, and the route that brings the count to
    ``TOP_K`` sums the pair's rows exactly as ``topk_sum_kernel`` does (``k = 0 .. K-1``, fp32,
    one rounding), then sets the counter back to zero for the next call. Which program arrives
    last depends on timing; the sum's order does not, so the bits are the sum kernel's.

    Only for tables with a route in every slot (the plan checks): a pair with fewer than
    ``TOP_K`` routes would never be summed. Ordering: the barrier puts every thread's row
    stores of this block before its counter increments, which are gpu-scope releases; the last
    arriver's increment is an acquire, and its loads bypass L1 (``.cg``), so it reads the rows
    and ``slot_route`` entries other programs wrote (the pattern of CUTLASS's split-K semaphore)."""
    tl.debug_barrier()
    slots = tl.load(slots_ptr + rows, mask=row_mask, other=0)
    pair = slots // TOP_K
    before = tl.atomic_add(arrivals_ptr + pair, 1, mask=row_mask, sem="acq_rel", scope="gpu")
    last = row_mask & (before == TOP_K - 1)
    out_row = out_ptr + (pair // num_heads)[:, None] * stride_out + (pair % num_heads)[:, None] * HEAD_DIM
    # column chunks: a whole [BLOCK_M, Dh] fp32 sum beside the kernel's live state spilled
    # (3.4 KB at BLOCK_M=64, Triton 3.6 for sm_90, scripts/inspect_kernel.py)
    CHUNK: tl.constexpr = 32 if HEAD_DIM > 32 else HEAD_DIM
    for c in tl.static_range(0, HEAD_DIM, CHUNK):
        d = c + tl.arange(0, CHUNK)
        acc = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)
        for k in tl.static_range(TOP_K):  # fixed order: k = 0, 1, ..., K-1
            route = tl.load(slot_route_ptr + pair * TOP_K + k, mask=last, other=0,
                            cache_modifier=".cg")
            acc += tl.load(rows_ptr + route.to(tl.int64)[:, None] * stride_rows + d[None, :],
                           mask=last[:, None], other=0.0, cache_modifier=".cg")
        tl.store(out_row + d[None, :], round_to(acc, out_ptr.dtype.element_ty, SOFT_BF16),
                 mask=last[:, None])
    tl.store(arrivals_ptr + pair, 0, mask=last)
