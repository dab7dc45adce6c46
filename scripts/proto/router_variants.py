"""Router kernel variants for A/B on the H200 (NOTES-perf.md, version 11): a frozen copy of the
fused router's ``router_topk_kernel`` as it was before session 10 (int64 keys, the gate split
in the loop), with switches for the changes tried; all but RELAYOUT kept the bits (``router_ab.py``
checks).

* ``PRESPLIT``: the fp32 gate's three bf16 parts read from memory (``split_gate_kernel``, once a
  call) instead of split by every token block. 230 of a loop trip's 363 instructions; no gain.
* ``RELAYOUT``: the logits through a per-block global scratch, back in the load's layout. Gave
  other bits and was slower.
* ``KEY32``: int32 keys, the value's max then the lowest index holding it: 128 registers
  instead of 190, two programs per SM instead of one.
* ``TUPLE``: one reduction a pick over (key, index, score): what ``magi_moe`` now runs.
"""
import triton
import triton.language as tl

INT64_MIN = tl.constexpr(-9223372036854775808)
INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def split_gate_kernel(gate_ptr, g1_ptr, g2_ptr, g3_ptr, n, BLOCK: tl.constexpr):
    """gate = g1 + g2 + g3 exactly, each bf16 (the router kernel's in-loop split, once)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(gate_ptr + i, mask=m, other=0.0)
    g1 = g.to(tl.bfloat16)
    rest = g - g1.to(tl.float32)
    g2 = rest.to(tl.bfloat16)
    g3 = (rest - g2.to(tl.float32)).to(tl.bfloat16)
    tl.store(g1_ptr + i, g1, mask=m)
    tl.store(g2_ptr + i, g2, mask=m)
    tl.store(g3_ptr + i, g3, mask=m)


@triton.jit
def _pick_combine(key_a, idx_a, p_a, key_b, idx_b, p_b):
    a_wins = (key_a > key_b) | ((key_a == key_b) & (idx_a < idx_b))
    return (tl.where(a_wins, key_a, key_b), tl.where(a_wins, idx_a, idx_b),
            tl.where(a_wins, p_a, p_b))


@triton.jit
def router_topk_variant_kernel(
    x_ptr, gate_ptr, g1_ptr, g2_ptr, g3_ptr, bias_ptr, ids_ptr, probs_ptr, block_counts_ptr,
    scratch_ptr, num_tokens, stride_x, route_scale,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ROUTE_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRESPLIT: tl.constexpr, RELAYOUT: tl.constexpr,
    KEY32: tl.constexpr, TUPLE: tl.constexpr,
):
    tb = tl.program_id(0)
    head = tl.program_id(1)
    s = tb.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    s_mask = s < num_tokens
    e = tl.arange(0, E_PAD)
    e_mask = e < NUM_EXPERTS
    d = tl.arange(0, BLOCK_D)

    x_ptrs = x_ptr + s[:, None] * stride_x + head * HEAD_DIM + d[None, :]
    g_offs = (head * NUM_EXPERTS + e)[None, :].to(tl.int64) * HEAD_DIM + d[:, None]
    logits = tl.zeros((BLOCK_S, E_PAD), dtype=tl.float32)
    for _ in range(0, HEAD_DIM // BLOCK_D):
        xk = tl.load(x_ptrs, mask=s_mask[:, None], other=0.0)
        if PRESPLIT:
            g1 = tl.load(g1_ptr + g_offs, mask=e_mask[None, :], other=0.0)
            g2 = tl.load(g2_ptr + g_offs, mask=e_mask[None, :], other=0.0)
            g3 = tl.load(g3_ptr + g_offs, mask=e_mask[None, :], other=0.0)
        else:
            gk = tl.load(gate_ptr + g_offs, mask=e_mask[None, :], other=0.0)
            g1 = gk.to(tl.bfloat16)
            rest = gk - g1.to(tl.float32)
            g2 = rest.to(tl.bfloat16)
            g3 = (rest - g2.to(tl.float32)).to(tl.bfloat16)
        logits = tl.dot(xk, g3, logits)
        logits = tl.dot(xk, g2, logits)
        logits = tl.dot(xk, g1, logits)
        x_ptrs += BLOCK_D
        g_offs += BLOCK_D

    if RELAYOUT:
        r = tl.arange(0, BLOCK_S)
        here = scratch_ptr + ((head * tl.num_programs(0) + tb).to(tl.int64) * BLOCK_S
                              + r[:, None]) * E_PAD + e[None, :]
        tl.store(here, logits)
        tl.debug_barrier()
        logits = tl.load(here)

    scores = tl.sigmoid(logits)
    selection = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + head * NUM_EXPERTS + e, mask=e_mask, other=0.0)
        selection = scores + bias[None, :]
    bits = tl.where(selection == 0.0, 0.0, selection).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(selection == selection, ordered, -2147483647)
    kk = tl.arange(0, K_PAD)
    chosen_ids = tl.zeros((BLOCK_S, K_PAD), dtype=tl.int32)
    chosen_p = tl.zeros((BLOCK_S, K_PAD), dtype=tl.float32)
    if TUPLE:
        # one reduction a pick over (key, index, score): the larger key, on equal keys the
        # lower index, and the winner's score carried along (no separate where-sum)
        key32 = tl.where(e_mask[None, :] & (s[:, None] >= 0), ordered, INT32_MIN)
        ee = tl.broadcast_to(e[None, :], (BLOCK_S, E_PAD))
        for k in tl.static_range(TOP_K):
            best, idx, p_k = tl.reduce((key32, ee, scores), 1, _pick_combine)
            pick = e[None, :] == idx[:, None]
            key32 = tl.where(pick, INT32_MIN, key32)
            chosen_ids = tl.where(kk[None, :] == k, idx[:, None], chosen_ids)
            chosen_p = tl.where(kk[None, :] == k, p_k[:, None], chosen_p)
        taken_key = key32 == INT32_MIN
    elif KEY32:
        # int32 keys, two reductions a pick (value, then the lowest index holding it): half
        # the registers of the int64 key, which held the kernel to one program per SM
        key32 = tl.where(e_mask[None, :] & (s[:, None] >= 0), ordered, INT32_MIN)
        for k in tl.static_range(TOP_K):
            best = tl.max(key32, axis=1)
            idx = tl.min(tl.where(key32 == best[:, None], e[None, :], E_PAD), axis=1)
            pick = e[None, :] == idx[:, None]
            p_k = tl.sum(tl.where(pick, scores, 0.0), axis=1)
            key32 = tl.where(pick, INT32_MIN, key32)
            chosen_ids = tl.where(kk[None, :] == k, idx[:, None], chosen_ids)
            chosen_p = tl.where(kk[None, :] == k, p_k[:, None], chosen_p)
        taken_key = key32 == INT32_MIN
    else:
        low = (E_PAD - 1 - e).to(tl.int64)
        key = tl.where(e_mask[None, :] & (s[:, None] >= 0),
                       (ordered.to(tl.int64) << 32) | low[None, :], INT64_MIN)
        for k in tl.static_range(TOP_K):
            best = tl.max(key, axis=1)
            idx = E_PAD - 1 - best.to(tl.int32)
            pick = e[None, :] == idx[:, None]
            p_k = tl.sum(tl.where(pick, scores, 0.0), axis=1)
            key = tl.where(pick, INT64_MIN, key)
            chosen_ids = tl.where(kk[None, :] == k, idx[:, None], chosen_ids)
            chosen_p = tl.where(kk[None, :] == k, p_k[:, None], chosen_p)
        taken_key = key == INT64_MIN

    if ROUTE_NORM:
        denom = tl.maximum(tl.sum(chosen_p, axis=1), 1e-12)
        chosen_p = chosen_p / denom[:, None]
    chosen_p = chosen_p * route_scale

    out_offsets = (s[:, None] * NUM_HEADS + head) * TOP_K + kk[None, :]
    out_mask = s_mask[:, None] & (kk[None, :] < TOP_K)
    tl.store(ids_ptr + out_offsets, chosen_ids, mask=out_mask)
    tl.store(probs_ptr + out_offsets, chosen_p, mask=out_mask)
    taken = e_mask[None, :] & s_mask[:, None] & taken_key
    counts = tl.sum(taken.to(tl.int32), axis=0)
    tl.store(block_counts_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + e, counts, mask=e_mask)
