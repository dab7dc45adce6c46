"""Probe: the router's top-K launch as two, a logits GEMM and a picks kernel, against the
committed ``router_topk_kernel``: each launch alone and the pair (L2 flushed, median of 60), ids,
probabilities and per-block counts compared bit for bit.

1. ``router_logits_kernel``: ``logits = x @ gate^T`` in fp32 as a plain wgmma GEMM over
   ``K' = 3 * Dh``: the gate's three exact bf16 parts interleaved per 64-wide slice of Dh
   (part 3, 2, 1 of slice 0, then of slice 1, ...), the order in which the committed kernel sums
   them, so every logit has the committed bits; ``x`` is read once per part.
2. ``router_picks_kernel``: the committed kernel's scores, keys, picks, normalisation and block
   counts on the stored logits, a row of 256 experts within one warp (no barrier a pick)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from magi_moe.bench.cases import BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.timing import time_paths, summarize  # noqa: E402
from magi_moe.kernels import fused_routing as FR  # noqa: E402
from magi_moe.kernels.schedule import cdiv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_router_wgmma import committed, gate_parts, selection_key  # noqa: E402


@triton.jit
def router_logits_kernel(x_desc, g_desc, logits_desc, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NSTAGES: tl.constexpr,
                         BLOCK_N: tl.constexpr = 256):
    # grid (token blocks, heads, expert blocks): a column of experts changes no logit's sum
    tb = tl.program_id(0)
    head = tl.program_id(1)
    n0 = head * NUM_EXPERTS + tl.program_id(2) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, 3 * (HEAD_DIM // BLOCK_D), num_stages=NSTAGES):
        xk = x_desc.load([tb * BLOCK_M, head * HEAD_DIM + (k // 3) * BLOCK_D])
        gk = g_desc.load([n0, k * BLOCK_D])
        acc = tl.dot(xk, gk.T, acc)
    logits_desc.store([tb * BLOCK_M, n0], acc)


@triton.jit
def router_picks_kernel(logits_ptr, bias_ptr, ids_ptr, probs_ptr, block_counts_ptr,
                        num_tokens, route_scale, NUM_HEADS: tl.constexpr,
                        NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                        BLOCK_S: tl.constexpr, SUB_S: tl.constexpr, ROUTE_NORM: tl.constexpr,
                        HAS_BIAS: tl.constexpr):
    # BLOCK_S tokens (the block counts' granularity) in steps of SUB_S rows, one row a warp
    # when SUB_S == num_warps: 8 experts a lane, every pick within a warp.
    tb = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.arange(0, NUM_EXPERTS)
    kk = tl.arange(0, K_PAD)
    bias = tl.load(bias_ptr + head * NUM_EXPERTS + e)
    taken_rows = tl.zeros((SUB_S, NUM_EXPERTS), dtype=tl.int32)
    for sub in tl.static_range(BLOCK_S // SUB_S):
        s = (tb.to(tl.int64) * BLOCK_S + sub * SUB_S) + tl.arange(0, SUB_S).to(tl.int64)
        s_mask = s < num_tokens
        logits = tl.load(logits_ptr + s[:, None] * (NUM_HEADS * NUM_EXPERTS)
                         + head * NUM_EXPERTS + e[None, :], mask=s_mask[:, None], other=0.0)
        scores = tl.sigmoid(logits)
        selection = scores
        if HAS_BIAS:
            selection = scores + bias[None, :]
        key = selection_key(selection)
        experts = tl.broadcast_to(e[None, :], (SUB_S, NUM_EXPERTS))
        chosen_ids = tl.zeros((SUB_S, K_PAD), dtype=tl.int32)
        chosen_p = tl.zeros((SUB_S, K_PAD), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            _, idx, p_k = tl.reduce((key, experts, scores), 1, FR._higher_selection)
            key = tl.where(e[None, :] == idx[:, None], -2147483648, key)
            chosen_ids = tl.where(kk[None, :] == k, idx[:, None], chosen_ids)
            chosen_p = tl.where(kk[None, :] == k, p_k[:, None], chosen_p)
        if ROUTE_NORM:
            denom = tl.maximum(tl.sum(chosen_p, axis=1), FR.NORM_EPS_VALUE)
            chosen_p = chosen_p / denom[:, None]
        chosen_p = chosen_p * route_scale
        out_offsets = (s[:, None] * NUM_HEADS + head) * TOP_K + kk[None, :]
        out_mask = s_mask[:, None] & (kk[None, :] < TOP_K)
        tl.store(ids_ptr + out_offsets, chosen_ids, mask=out_mask)
        tl.store(probs_ptr + out_offsets, chosen_p, mask=out_mask)
        taken_rows += (s_mask[:, None] & (key == -2147483648)).to(tl.int32)
    counts = tl.sum(taken_rows, axis=0)
    tl.store(block_counts_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + e, counts)



@triton.jit
def router_picks_rows_kernel(logits_ptr, bias_ptr, ids_ptr, probs_ptr, block_counts_ptr,
                             num_tokens, route_scale, NUM_HEADS: tl.constexpr,
                             NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                             K_PAD: tl.constexpr, BLOCK_S: tl.constexpr, SUB_S: tl.constexpr,
                             NORM_ORDER: tl.constexpr):
    # A token's 256 experts as [J, 1, 32] (expert j*32 + lane): lanes along the experts, warps
    # along the tokens, J in each thread, so a pick is 8 in-thread steps and 5 shuffles. Sigmoid
    # scores and a selection bias only (the anchors problem).
    tb = tl.program_id(0)
    head = tl.program_id(1)
    C: tl.constexpr = 32
    J: tl.constexpr = NUM_EXPERTS // C
    j = tl.arange(0, J)
    c = tl.arange(0, C)
    kk = tl.arange(0, K_PAD)
    e3 = j[:, None, None] * C + c[None, None, :]
    experts = tl.broadcast_to(e3, (J, SUB_S, C))
    bias = tl.load(bias_ptr + head * NUM_EXPERTS + experts)  # full shape: keeps one layout
    taken_rows = tl.zeros((J, SUB_S, C), dtype=tl.int32)
    for sub in tl.static_range(BLOCK_S // SUB_S):
        s = (tb.to(tl.int64) * BLOCK_S + sub * SUB_S) + tl.arange(0, SUB_S).to(tl.int64)
        s_mask = s < num_tokens
        logits = tl.load(logits_ptr + s[None, :, None] * (NUM_HEADS * NUM_EXPERTS)
                         + head * NUM_EXPERTS + experts, mask=s_mask[None, :, None], other=0.0)
        scores = tl.sigmoid(logits)
        selection = scores + bias
        key = selection_key(selection)
        chosen_ids = tl.zeros((SUB_S, K_PAD), dtype=tl.int32)
        chosen_p = tl.zeros((SUB_S, K_PAD), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            k2, i2, p2 = tl.reduce((key, experts, scores), 0, FR._higher_selection)
            _, idx, p_k = tl.reduce((k2, i2, p2), 1, FR._higher_selection)
            key = tl.where(experts == idx[None, :, None], -2147483648, key)
            chosen_ids = tl.where(kk[None, :] == k, idx[:, None], chosen_ids)
            chosen_p = tl.where(kk[None, :] == k, p_k[:, None], chosen_p)
        if NORM_ORDER == 0:
            denom = tl.sum(chosen_p, axis=1)
        else:
            p0 = tl.sum(tl.where(kk[None, :] == 0, chosen_p, 0.0), axis=1)
            p1 = tl.sum(tl.where(kk[None, :] == 1, chosen_p, 0.0), axis=1)
            p2_ = tl.sum(tl.where(kk[None, :] == 2, chosen_p, 0.0), axis=1)
            p3 = tl.sum(tl.where(kk[None, :] == 3, chosen_p, 0.0), axis=1)
            p4 = tl.sum(tl.where(kk[None, :] == 4, chosen_p, 0.0), axis=1)
            p5 = tl.sum(tl.where(kk[None, :] == 5, chosen_p, 0.0), axis=1)
            if NORM_ORDER == 1:
                denom = ((p0 + p1) + (p2_ + p3)) + (p4 + p5)
            elif NORM_ORDER == 2:
                denom = ((p0 + p1) + (p4 + p5)) + (p2_ + p3)
            else:
                denom = ((((p0 + p1) + p2_) + p3) + p4) + p5
        denom = tl.maximum(denom, FR.NORM_EPS_VALUE)
        chosen_p = chosen_p / denom[:, None] * route_scale
        out_offsets = (s[:, None] * NUM_HEADS + head) * TOP_K + kk[None, :]
        out_mask = s_mask[:, None] & (kk[None, :] < TOP_K)
        tl.store(ids_ptr + out_offsets, chosen_ids, mask=out_mask)
        tl.store(probs_ptr + out_offsets, chosen_p, mask=out_mask)
        taken_rows += (s_mask[None, :, None] & (key == -2147483648)).to(tl.int32)
    counts = tl.sum(taken_rows, axis=1)  # [J, C]: expert j*32 + c
    tl.store(block_counts_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + j[:, None] * C + c[None, :], counts)



@triton.jit
def router_picks_block_kernel(logits_ptr, bias_ptr, ids_ptr, probs_ptr, block_counts_ptr,
                              num_tokens, route_scale, NUM_HEADS: tl.constexpr,
                              NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                              BLOCK_S: tl.constexpr):
    # All BLOCK_S tokens at once as [J, BLOCK_S, 32] (expert j*32 + lane): warps along the
    # tokens, lanes along the experts, J in each thread. No [tokens, K] tensors (whose layout
    # costs a conversion a pick): each pick's ids go straight out, the six scores stay six
    # vectors and are normalised in the committed order of sums. Top-6, sigmoid, a bias only.
    tb = tl.program_id(0)
    head = tl.program_id(1)
    C: tl.constexpr = 32
    J: tl.constexpr = NUM_EXPERTS // C
    j = tl.arange(0, J)
    c = tl.arange(0, C)
    s = tb.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    s_mask = s < num_tokens
    experts = tl.broadcast_to(j[:, None, None] * C + c[None, None, :], (J, BLOCK_S, C))
    logits = tl.load(logits_ptr + s[None, :, None] * (NUM_HEADS * NUM_EXPERTS)
                     + head * NUM_EXPERTS + experts, mask=s_mask[None, :, None], other=0.0)
    scores = tl.sigmoid(logits)
    selection = scores + tl.load(bias_ptr + head * NUM_EXPERTS + experts)
    key = selection_key(selection)
    slot = (s * NUM_HEADS + head) * TOP_K
    tl.static_assert(TOP_K == 6, "the probe writes out the committed six-term sum only")
    for k in tl.static_range(TOP_K):
        k2, i2, p2 = tl.reduce((key, experts, scores), 0, FR._higher_selection)
        _, idx, p_k = tl.reduce((k2, i2, p2), 1, FR._higher_selection)
        key = tl.where(experts == idx[None, :, None], -2147483648, key)
        tl.store(ids_ptr + slot + k, idx, mask=s_mask)
        if k == 0:
            p0 = p_k
        elif k == 1:
            p1 = p_k
        elif k == 2:
            p2_ = p_k
        elif k == 3:
            p3 = p_k
        elif k == 4:
            p4 = p_k
        else:
            p5 = p_k
    # the committed kernel's tl.sum over its [tokens, 8] picks, on the H200: (01 + 45) + 23
    denom = tl.maximum(((p0 + p1) + (p4 + p5)) + (p2_ + p3), FR.NORM_EPS_VALUE)
    tl.store(probs_ptr + slot, p0 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + slot + 1, p1 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + slot + 2, p2_ / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + slot + 3, p3 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + slot + 4, p4 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + slot + 5, p5 / denom * route_scale, mask=s_mask)
    taken = (s_mask[None, :, None] & (key == -2147483648)).to(tl.int32)
    counts = tl.sum(taken, axis=1)  # [J, C]: expert j*32 + c
    tl.store(block_counts_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + j[:, None] * C + c[None, :], counts)


def interleaved_parts(gate: torch.Tensor, block_d: int = 64) -> torch.Tensor:
    """[H*E, 3*Dh] bf16: per 64-wide slice of Dh, part 3, part 2, part 1 of the exact split."""
    parts = gate_parts(gate).view(3, gate.shape[0], -1, block_d)   # [part 1..3, HE, slices, 64]
    return parts.flip(0).permute(1, 2, 0, 3).reshape(gate.shape[0], -1).contiguous()


def split_form(problem, g_inter, bm, gemm_warps, stages, bs, picks_warps, bn=256):
    cfg = problem.config
    H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
    x = problem.x
    S = x.shape[0]
    TB = cdiv(S, bs)
    logits = torch.full((S, H * E), float("nan"), dtype=torch.float32, device=x.device)
    ids = torch.full((S, H, K), -7, dtype=torch.int32, device=x.device)
    probs = torch.full((S, H, K), float("nan"), dtype=torch.float32, device=x.device)
    counts = torch.full((TB, H * E), -7, dtype=torch.int32, device=x.device)
    x_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [bm, 64])
    g_desc = TensorDescriptor(g_inter, list(g_inter.shape), [g_inter.stride(0), 1], [bn, 64])
    l_desc = TensorDescriptor(logits, list(logits.shape), [logits.stride(0), 1], [bm, bn])

    def gemm():
        return router_logits_kernel[(cdiv(S, bm), H, E // bn)](
            x_desc, g_desc, l_desc, NUM_HEADS=H, HEAD_DIM=Dh, NUM_EXPERTS=E, BLOCK_M=bm,
            BLOCK_D=64, NSTAGES=stages, BLOCK_N=bn, num_warps=gemm_warps)

    gemm.logits = logits  # the rows compare each GEMM form's logits with the first's

    def picks():
        return router_picks_kernel[(TB, H)](
            logits, problem.bias, ids, probs, counts, S, 1.0, NUM_HEADS=H, NUM_EXPERTS=E,
            TOP_K=K, K_PAD=max(2, triton.next_power_of_2(K)), BLOCK_S=bs, SUB_S=picks_warps,
            ROUTE_NORM=True,
            HAS_BIAS=True, num_warps=picks_warps)

    def both():
        gemm()
        return picks()

    def rows(order):
        def go():
            return router_picks_rows_kernel[(TB, H)](
                logits, problem.bias, ids, probs, counts, S, 1.0, NUM_HEADS=H, NUM_EXPERTS=E,
                TOP_K=K, K_PAD=max(2, triton.next_power_of_2(K)), BLOCK_S=bs,
                SUB_S=picks_warps, NORM_ORDER=order, num_warps=picks_warps)
        return go
    return gemm, picks, both, (ids, probs, counts), rows


FORMS = [  # GEMM block_m, warps, stages; picks block_s, warps
    (128, 8, 3, 32, 4), (64, 4, 3, 32, 8), (128, 8, 2, 32, 16), (64, 4, 4, 32, 2),
]


def rows_main():
    """The picks kernel with a token's row in one warp, four sums' orders for the normalisation,
    on logits from the GEMM; each order's ids, probabilities and counts against the committed."""
    device = torch.device("cuda")
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        g_inter = interleaved_parts(problem.gate)
        fn0, (ids0, probs0, counts0) = committed(problem)
        fn0()
        paths = {"committed": fn0}
        for warps in (4, 8):
            gemm, _, _, (ids, probs, counts), rows = split_form(problem, g_inter, 64, 4, 3, 32,
                                                                warps)
            gemm()
            for order in (0, 1, 2, 3):
                go = rows(order)
                ids.fill_(-7), probs.fill_(float("nan")), counts.fill_(-7)
                k = go()
                torch.cuda.synchronize()
                same_ids = torch.equal(ids, ids0) and torch.equal(counts, counts0)
                differ = (probs.view(torch.int32) != probs0.view(torch.int32)).sum().item()
                print(f"H={H} S={S} rows w{warps} order {order}: regs {k.n_regs} spills "
                      f"{k.n_spills}; ids and counts {'same' if same_ids else 'DIFFER'}, "
                      f"probabilities differing {differ}", flush=True)
            paths[f"rows w{warps} [picks]"] = rows(1)

            def pair(gemm=gemm, go=rows(1)):
                gemm()
                return go()
            paths[f"gemm bm64 w4 st3 + rows w{warps}"] = pair
        first = None
        for bm, warps, stages, bn in GEMM_FORMS:
            gemm, *_ = split_form(problem, g_inter, bm, warps, stages, 32, 8, bn)
            k = gemm()
            torch.cuda.synchronize()
            first = gemm.logits.clone() if first is None else first
            same = torch.equal(gemm.logits.view(torch.int32), first.view(torch.int32))
            name = f"gemm bm{bm} bn{bn} w{warps} st{stages}"
            print(f"  {name}: regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}; "
                  f"logits {'the same bits as the first form' if same else 'DIFFER'}")
            paths[name] = gemm
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            print(f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us",
                  flush=True)


GEMM_FORMS = [  # block_m, warps, stages, block_n: logits alone (same sums in every form)
    (64, 4, 3, 256), (64, 4, 3, 128), (128, 8, 3, 128), (64, 4, 4, 64), (128, 4, 3, 128),
]


def block_main():
    """The picks kernel taking all 32 tokens of a block at once, 4 / 8 / 16 warps, on logits
    from the GEMM; ids, probabilities and counts against the committed kernel; times."""
    device = torch.device("cuda")
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        g_inter = interleaved_parts(problem.gate)
        fn0, (ids0, probs0, counts0) = committed(problem)
        fn0()
        paths = {"committed": fn0}
        gemm, _, _, (ids, probs, counts), _ = split_form(problem, g_inter, 64, 4, 3, 32, 8)
        gemm()
        TB = cdiv(S, 32)
        for warps in (4, 8, 16):
            def go(warps=warps):
                return router_picks_block_kernel[(TB, H)](
                    gemm.logits, problem.bias, ids, probs, counts, S, 1.0, NUM_HEADS=H,
                    NUM_EXPERTS=256, TOP_K=6, BLOCK_S=32, num_warps=warps)
            ids.fill_(-7), probs.fill_(float("nan")), counts.fill_(-7)
            k = go()
            torch.cuda.synchronize()
            same = (torch.equal(ids, ids0) and torch.equal(counts, counts0)
                    and torch.equal(probs.view(torch.int32), probs0.view(torch.int32)))
            print(f"H={H} S={S} block w{warps}: regs {k.n_regs} spills {k.n_spills} smem "
                  f"{k.metadata.shared}; ids, probabilities and counts "
                  f"{'same' if same else 'DIFFER'}", flush=True)
            paths[f"block w{warps} [picks]"] = go

            def pair(go=go):
                gemm()
                return go()
            paths[f"gemm bm64 w4 st3 + block w{warps}"] = pair
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            print(f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us",
                  flush=True)


def main():
    if "--block" in sys.argv:
        return block_main()
    if "--rows" in sys.argv:
        return rows_main()
    device = torch.device("cuda")
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        g_inter = interleaved_parts(problem.gate)
        fn, out0 = committed(problem)
        fn()
        paths, outs = {"committed": fn}, {}
        for form in FORMS:
            name = "gemm bm{} w{} st{} + picks bs{} w{}".format(*form)
            try:
                gemm, picks, both, out, _ = split_form(problem, g_inter, *form)
                kg, kp = gemm(), picks()
                torch.cuda.synchronize()
            except Exception as exc:  # a form that does not compile is reported, not fatal
                print(f"H={H} S={S} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            print(f"  {name}: gemm regs {kg.n_regs} spills {kg.n_spills} smem "
                  f"{kg.metadata.shared}; picks regs {kp.n_regs} spills {kp.n_spills} smem "
                  f"{kp.metadata.shared}", flush=True)
            paths[name] = both
            paths[name + " [gemm]"] = gemm
            paths[name + " [picks]"] = picks
            outs[name] = out
        torch.cuda.synchronize()
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        ids0, probs0, counts0 = out0
        for name in paths:
            line = f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us"
            if name in outs:
                ids, probs, counts = outs[name]
                same = (torch.equal(ids, ids0) and torch.equal(probs.view(torch.int32),
                                                               probs0.view(torch.int32))
                        and torch.equal(counts, counts0))
                line += f" bits {'same' if same else 'DIFFER'}"
                if not same:
                    line += (f" (ids differ {(ids != ids0).sum().item()}, probs differ "
                             f"{(probs.view(torch.int32) != probs0.view(torch.int32)).sum().item()})")
            print(line, flush=True)


if __name__ == "__main__":
    main()
