"""Fused routing: router logits, scores, biased top-k with the tie rule, L1 normalisation, route
scale and the CSR route table, on the device, in four launches and no host synchronisation.

1. ``router_topk_kernel``, grid ``(cdiv(S, BLOCK_S), H)``: fp32 logits for a block of tokens of
   one head, ``sigmoid`` or ``softmax`` scores, selection ``score + bias``, top-K highest first
   (ties: lower expert index; NaN selection strictly last, as :mod:`magi_moe.routing`), the unbiased
   probabilities normalised and scaled; ``expert_ids`` / ``probs`` ``[S, H, K]`` and this block's
   route count per bank (``block_counts [TB, H*E]``).
2. ``bank_prefix_kernel``, grid ``(cdiv(H*E, BLOCK_B),)``: for every bank, the exclusive prefix
   of ``block_counts`` over token blocks (where this block's routes start inside the bank) and
   the bank's total.
3. :func:`magi_moe.kernels.schedule.block_schedule_kernel` with ``FROM_COUNTS``: the CSR offsets
   from the totals, and the expert kernels' block schedule in the same launch.
4. ``place_routes_kernel``, grid ``(cdiv(S, BLOCK_S), H)``: every route's CSR position, offsets
   + block prefix + its rank among this block's routes to the same bank (tokens in order), so the
   table is the stable sort by bank of :func:`magi_moe.routing.build_route_table`, exactly.

No atomics: positions are prefix sums, so the table is the same bitwise on every run. All
buffers come from a :class:`~magi_moe.kernels.workspace.FusedWorkspace` sized by upper bounds known
on the host; the returned table's tensors are views into it, valid until the next call.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from torch.autograd.graph import increment_version
import triton.language as tl

from ..backends import interpreter_enabled
from ..config import MoEConfig
from ..routing import NORM_EPS, RouteTable
from .fused_inputs import check_router_inputs
from .schedule import BlockSchedule, cdiv, fill_block_schedule, schedule_buffers
from .tiles import RoutingTiles, choose_routing_tiles
from .workspace import FusedWorkspace, shared_workspace

NORM_EPS_VALUE = tl.constexpr(NORM_EPS)
# How router_topk_kernel picks top-K: None by backend, one tuple reduction a pick on GPUs and
# three built-in reductions (the same picks and bits) in the interpreter, which runs the tuple
# reduction's combine in Python (161 s against 2 s a call at S=512, E=64). Tests force each
# form on each backend at small sizes.
FORCE_TUPLE_PICKS: bool | None = None


@triton.jit
def _higher_selection(key_a, expert_a, score_a, key_b, expert_b, score_b):
    """The reduction of a pick: the larger key, on equal keys the lower expert index."""
    a = (key_a > key_b) | ((key_a == key_b) & (expert_a < expert_b))
    return tl.where(a, key_a, key_b), tl.where(a, expert_a, expert_b), tl.where(a, score_a, score_b)


@triton.jit
def router_topk_kernel(
    # pointers
    x_ptr,            # [S, H*Dh] bf16/fp16/fp32, unit stride in the last dim
    gate_ptr,         # [H*E, Dh] fp32 router weights, contiguous
    bias_ptr,         # [H*E] fp32 selection bias (read only if HAS_BIAS)
    ids_ptr,          # [S, H, K] int32 out: chosen experts, highest selection first
    probs_ptr,        # [S, H, K] fp32 out: routing weights
    block_counts_ptr,  # [TB, H*E] int32 out: this token block's routes per bank
    # sizes
    num_tokens,
    stride_x,
    route_scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    # tiles and modes
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    ROUTE_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee": the released router is fp32, not tf32
    SPLIT_GATE: tl.constexpr,     # bf16 x: the fp32 gate as three bf16 parts on tensor cores
    UPCAST: tl.constexpr,         # interpreter: its bf16 dot is wrong (CONTRACT 8)
    TUPLE_PICKS: tl.constexpr,    # one (key, expert, score) reduction a pick, else three
):
    tb = tl.program_id(0)
    head = tl.program_id(1)
    s = tb.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    s_mask = s < num_tokens
    e = tl.arange(0, E_PAD)
    e_mask = e < NUM_EXPERTS
    d = tl.arange(0, BLOCK_D)

    # logits[s, e] = x[s, head, :] . gate[head*E + e, :] in fp32
    x_ptrs = x_ptr + s[:, None] * stride_x + head * HEAD_DIM + d[None, :]
    g_ptrs = gate_ptr + (head * NUM_EXPERTS + e)[None, :].to(tl.int64) * HEAD_DIM + d[:, None]
    logits = tl.zeros((BLOCK_S, E_PAD), dtype=tl.float32)
    for _ in range(0, HEAD_DIM // BLOCK_D):
        xk = tl.load(x_ptrs, mask=s_mask[:, None], other=0.0)
        gk = tl.load(g_ptrs, mask=e_mask[None, :], other=0.0)
        if SPLIT_GATE:
            # gate = g1 + g2 + g3 exactly (three 8-bit significands cover fp32's 24), and each
            # bf16 x bf16 product is exact in fp32: the logits are exact products summed in
            # fp32, an fp32 dot like the FMA chain below, on tensor cores (the FMA form took
            # 0.18 ms of the layer's 0.82 at S=4096, docs/PERFORMANCE.md).
            g1 = gk.to(tl.bfloat16)
            rest = gk - g1.to(tl.float32)
            g2 = rest.to(tl.bfloat16)
            g3 = (rest - g2.to(tl.float32)).to(tl.bfloat16)
            if UPCAST:
                xf = xk.to(tl.float32)
                logits = tl.dot(xf, g3.to(tl.float32), logits, input_precision="ieee")
                logits = tl.dot(xf, g2.to(tl.float32), logits, input_precision="ieee")
                logits = tl.dot(xf, g1.to(tl.float32), logits, input_precision="ieee")
            else:
                logits = tl.dot(xk, g3, logits)
                logits = tl.dot(xk, g2, logits)
                logits = tl.dot(xk, g1, logits)
        else:
            logits = tl.dot(xk.to(tl.float32), gk, logits, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_D
        g_ptrs += BLOCK_D

    if SOFTMAX:
        # a NaN logit (NaN gate row) leaves the normalisation and keeps a NaN score: that
        # expert alone ranks last (magi_moe.routing.scores_from_logits)
        is_num = logits == logits
        masked = tl.where(e_mask[None, :] & is_num, logits, float("-inf"))
        shifted = masked - tl.max(masked, axis=1)[:, None]
        num = tl.exp(shifted)
        scores = tl.where(is_num, num / tl.sum(num, axis=1)[:, None], logits)
    else:
        scores = tl.sigmoid(logits)
    selection = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + head * NUM_EXPERTS + e, mask=e_mask, other=0.0)
        selection = scores + bias[None, :]
    # Top-K as K picks, each one reduction over (key, expert index, score): the selection's
    # bits in an order-preserving integer form (the larger key is the higher selection), on equal
    # keys the lower index (the tie rule of magi_moe.routing.select_experts), the winner's
    # unbiased score carried along. -0.0 is made +0.0 first (they are equal selections); NaN
    # ranks strictly last, below -inf, the lower index first. Taken or padded experts get
    # INT32_MIN, which no real expert's key may equal: NaN's key is therefore INT32_MIN + 1 (at
    # INT32_MIN a NaN expert read as taken and was counted as a route; tests/test_fused.py).
    # An int64 key (selection above the complemented index) took 190 registers a thread, one
    # program per SM; separate max, index and score reductions took twice the barriers
    # (docs/PERFORMANCE.md, "The fused router").
    bits = tl.where(selection == 0.0, 0.0, selection).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)         # signed order == float order
    ordered = tl.where(selection == selection, ordered, -2147483647)  # NaN: below -inf
    key = tl.where(e_mask[None, :] & (s[:, None] >= 0), ordered, -2147483648)
    experts = tl.broadcast_to(e[None, :], (BLOCK_S, E_PAD))
    kk = tl.arange(0, K_PAD)
    chosen_ids = tl.zeros((BLOCK_S, K_PAD), dtype=tl.int32)
    chosen_p = tl.zeros((BLOCK_S, K_PAD), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if TUPLE_PICKS:
            _, idx, p_k = tl.reduce((key, experts, scores), 1, _higher_selection)
        else:
            # the same pick in three built-in reductions: the interpreter runs a reduction
            # with a jit combine function element pair by element pair in Python, 80x slower
            best = tl.max(key, axis=1)
            idx = tl.min(tl.where(key == best[:, None], experts, E_PAD), axis=1)
            p_k = tl.sum(tl.where(experts == idx[:, None], scores, 0.0), axis=1)
        key = tl.where(e[None, :] == idx[:, None], -2147483648, key)
        chosen_ids = tl.where(kk[None, :] == k, idx[:, None], chosen_ids)
        chosen_p = tl.where(kk[None, :] == k, p_k[:, None], chosen_p)

    if ROUTE_NORM:
        # The sum's order follows chosen_p's layout: on the H200 (Triton 3.6, the tiled
        # 32 tokens x 8 warps) it is ((p0 + p1) + (p4 + p5)) + (p2 + p3) for top-6. A form with
        # another layout keeps these probabilities' bits only by writing that order out
        # (docs/PERFORMANCE.md, the router forms measured).
        denom = tl.maximum(tl.sum(chosen_p, axis=1), NORM_EPS_VALUE)
        chosen_p = chosen_p / denom[:, None]
    chosen_p = chosen_p * route_scale

    out_offsets = (s[:, None] * NUM_HEADS + head) * TOP_K + kk[None, :]
    out_mask = s_mask[:, None] & (kk[None, :] < TOP_K)
    tl.store(ids_ptr + out_offsets, chosen_ids, mask=out_mask)
    tl.store(probs_ptr + out_offsets, chosen_p, mask=out_mask)

    # Routes per bank of this token block: the chosen (no longer available) real experts.
    taken = e_mask[None, :] & s_mask[:, None] & (key == -2147483648)
    counts = tl.sum(taken.to(tl.int32), axis=0)
    tl.store(block_counts_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + e, counts, mask=e_mask)



@triton.jit
def bank_prefix_kernel(
    block_counts_ptr,  # [TB, H*E] int32 routes per (token block, bank)
    prefix_ptr,        # [TB, H*E] int32 out: routes of the bank in earlier token blocks
    totals_ptr,        # [H*E] int32 out: routes per bank
    num_blocks,
    num_banks,
    BLOCK_TB: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    f = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    f_mask = f < num_banks
    carry = tl.zeros((BLOCK_B,), dtype=tl.int32)
    # while, not range(): Triton 3.6's interpreter takes no tensor bounds (CONTRACT section 8).
    t0 = 0
    while t0 < num_blocks:
        t = t0 + tl.arange(0, BLOCK_TB)
        m = (t < num_blocks)[:, None] & f_mask[None, :]
        offs = t.to(tl.int64)[:, None] * num_banks + f[None, :]
        c = tl.load(block_counts_ptr + offs, mask=m, other=0)
        inclusive = tl.cumsum(c, axis=0)
        tl.store(prefix_ptr + offs, carry[None, :] + inclusive - c, mask=m)
        carry += tl.sum(c, axis=0)
        t0 += BLOCK_TB
    tl.store(totals_ptr + f, carry, mask=f_mask)


@triton.jit
def place_routes_kernel(
    ids_ptr,           # [S, H, K] int32 chosen experts
    probs_ptr,         # [S, H, K] fp32 routing weights
    prefix_ptr,        # [TB, H*E] int32 from bank_prefix_kernel
    offsets_ptr,       # [H*E + 1] int64 CSR offsets
    gather_ptr,        # [R] int32 out: token of each route (CSR order)
    sorted_probs_ptr,  # [R] fp32 out
    route_slots_ptr,   # [R] int64 out: slot (s*H + h)*K + k of each route
    num_tokens,
    NUM_HEADS: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    tb = tl.program_id(0)
    head = tl.program_id(1)
    s = tb.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    s_mask = s < num_tokens
    e = tl.arange(0, E_PAD)

    # chosen[s, e]: token s routes to expert e of this head (at most once per token).
    slot0 = (s * NUM_HEADS + head) * TOP_K
    chosen = tl.zeros((BLOCK_S, E_PAD), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        id_k = tl.load(ids_ptr + slot0 + k, mask=s_mask, other=-1)
        chosen += (e[None, :] == id_k[:, None]).to(tl.int32)
    # Rank among this block's routes to the same bank: earlier tokens first (stable order).
    rank = tl.cumsum(chosen, axis=0) - chosen
    bank0 = head * NUM_EXPERTS
    for k in tl.static_range(TOP_K):
        id_k = tl.load(ids_ptr + slot0 + k, mask=s_mask, other=0)
        rank_k = tl.sum(tl.where(e[None, :] == id_k[:, None], rank, 0), axis=1)
        bank = bank0 + id_k
        base = tl.load(offsets_ptr + bank, mask=s_mask, other=0) + tl.load(
            prefix_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS) + bank, mask=s_mask, other=0)
        pos = base + rank_k
        tl.store(gather_ptr + pos, s.to(tl.int32), mask=s_mask)
        tl.store(sorted_probs_ptr + pos, tl.load(probs_ptr + slot0 + k, mask=s_mask, other=0.0),
                 mask=s_mask)
        tl.store(route_slots_ptr + pos, slot0 + k, mask=s_mask)


@dataclass(frozen=True)
class FusedRoutes:
    """What the fused router produced: per-token choices and the CSR table built from them.

    ``expert_ids`` int32 ``[S, H, K]`` and ``probs`` fp32 ``[S, H, K]`` as
    :class:`magi_moe.routing.Routes`; ``table`` the CSR table; ``schedule`` the expert kernels'
    block schedule for ``block_m``. All are views into the workspace."""

    expert_ids: torch.Tensor
    probs: torch.Tensor
    table: RouteTable
    schedule: BlockSchedule | None


def fused_route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                config: MoEConfig, *, block_m: int | None = None,
                workspace: FusedWorkspace | None = None,
                tiles: RoutingTiles | None = None) -> FusedRoutes:
    """Route ``x`` ``[S, H*Dh]`` with ``gate`` ``[H*E, Dh]`` fp32 and ``bias`` ``[H*E]`` fp32:
    the inputs checked (:func:`~.fused_inputs.check_router_inputs`), then :func:`launch_router`.

    ``block_m``: also build the expert kernels' block schedule for this row block (one launch
    fewer than building it in :func:`~magi_moe.kernels.fused.fused_forward`)."""
    check_router_inputs(x, gate, bias, config)
    workspace = workspace or shared_workspace(x.device)
    workspace.note_capture()
    tiles = (tiles or choose_routing_tiles(config, x.device)).fitted(config)
    # The router writes the CSR offsets with the schedule's launch, so it builds one always.
    routes = launch_router(x, gate, bias, config, tiles, workspace, block_m or 16)
    return routes if block_m is not None else replace(routes, schedule=None)


def launch_router(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                  config: MoEConfig, tiles: RoutingTiles, workspace: FusedWorkspace,
                  block_m: int) -> FusedRoutes:
    """The router's four launches on checked inputs and fitted ``tiles``, and the expert
    kernels' block schedule for ``block_m`` built with them; every buffer is ``workspace``'s
    (told of a CUDA graph capture already: ``FusedWorkspace.note_capture``)."""
    H, E, K, Dh = config.num_heads, config.num_experts, config.top_k, config.head_dim
    S = x.shape[0]
    R = S * H * K
    HE = config.num_banks
    TB = cdiv(S, tiles.block_s)
    schedule = schedule_buffers(workspace, R, HE, block_m) if S else None
    ids = workspace.get("route_ids", (S, H, K), torch.int32)
    probs = workspace.get("route_probs", (S, H, K), torch.float32)
    block_counts = workspace.get("route_block_counts", (TB, HE), torch.int32)
    prefix = workspace.get("route_prefix", (TB, HE), torch.int32)
    totals = workspace.get("route_totals", (HE,), torch.int32)
    offsets = workspace.get("route_offsets", (HE + 1,), torch.int64)
    gather_ids = workspace.get("route_gather_ids", (R,), torch.int32)
    sorted_probs = workspace.get("route_sorted_probs", (R,), torch.float32)
    route_slots = workspace.get("route_slots", (R,), torch.int64)
    # The kernels below rewrite these buffers without moving their version counters: move them
    # here, so a table returned by an earlier call (views of the same buffers) loses its trust.
    if not torch.compiler.is_compiling():  # traced tables are never trusted (RouteTable.mark_trusted)
        for buffer in (offsets, gather_ids, sorted_probs, route_slots):
            increment_version(buffer)
    table = RouteTable(gather_ids, sorted_probs, offsets, route_slots, S, H, E, K).mark_trusted()
    if S == 0:
        offsets.zero_()
        return FusedRoutes(ids, probs, table, None)

    interpret = interpreter_enabled()
    router_topk_kernel[(TB, H)](
        x, gate, bias if bias is not None else gate, ids, probs, block_counts,
        S, x.stride(0), float(config.route_scale),
        NUM_HEADS=H, HEAD_DIM=Dh, NUM_EXPERTS=E, E_PAD=max(16, triton.next_power_of_2(E)),
        TOP_K=K, K_PAD=max(2, triton.next_power_of_2(K)),
        BLOCK_S=tiles.block_s, BLOCK_D=tiles.block_d,
        SOFTMAX=config.score_func == "softmax", ROUTE_NORM=config.route_norm,
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee",
        SPLIT_GATE=x.dtype == torch.bfloat16, UPCAST=interpret,
        TUPLE_PICKS=not interpret if FORCE_TUPLE_PICKS is None else FORCE_TUPLE_PICKS,
        num_warps=tiles.warps,
    )
    bank_prefix_kernel[(cdiv(HE, tiles.prefix_block_b),)](
        block_counts, prefix, totals, TB, HE,
        BLOCK_TB=tiles.prefix_block_tb, BLOCK_B=tiles.prefix_block_b,
        num_warps=4 if not interpret else 1,
    )
    fill_block_schedule(schedule, offsets, HE, counts=totals)
    place_routes_kernel[(TB, H)](
        ids, probs, prefix, offsets, gather_ids, sorted_probs, route_slots, S,
        NUM_HEADS=H, NUM_EXPERTS=E, E_PAD=max(16, triton.next_power_of_2(E)), TOP_K=K,
        BLOCK_S=tiles.block_s, num_warps=tiles.place_warps,
    )
    return FusedRoutes(ids, probs, table, schedule)
