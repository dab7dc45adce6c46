"""Probe: a router top-K form built for wgmma (64-128 tokens a program, warps along the tokens
only, so every pick reduces within a warp), against the committed ``router_topk_kernel``: the
kernel alone (L2 flushed, median of 60), each form's ids and probabilities compared bit for bit
and its per-block counts summed to the committed blocks'.

The form reads the fp32 gate as three bf16 parts made once (the exact split the committed kernel
makes in every program) by tensor descriptor, so no gate tile passes through registers; with
SCRATCH the scores go to a per-program scratch and each winner's score is read back, so only the
int32 keys stay in registers through the picks.

    python scripts/probe_router_wgmma.py             # nine forms, four cases
    python scripts/probe_router_wgmma.py --ablate    # the best form's parts switched off
    python scripts/probe_router_wgmma.py --deferred  # winners' scores read once, after the picks
"""
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
from probe_router_occupancy import launcher  # noqa: E402

NORM_EPS_VALUE = FR.NORM_EPS_VALUE


@triton.jit
def selection_key(selection):
    """The committed kernel's int32 key of a selection: signed order is float order, -0.0 is
    +0.0, NaN ranks below -inf (magi_moe/kernels/fused_routing.py, router_topk_kernel)."""
    bits = tl.where(selection == 0.0, 0.0, selection).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(selection == selection, key, -2147483647)


@triton.jit
def _higher2(key_a, expert_a, key_b, expert_b):
    a = (key_a > key_b) | ((key_a == key_b) & (expert_a < expert_b))
    return tl.where(a, key_a, key_b), tl.where(a, expert_a, expert_b)


@triton.jit
def router_topk_wgmma(
    x_desc, g_desc, bias_ptr, ids_ptr, probs_ptr, block_counts_ptr, scratch_ptr,
    num_tokens, route_scale,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ROUTE_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SCRATCH: tl.constexpr,
    PICK: tl.constexpr, NSTAGES: tl.constexpr, NO_GEMM: tl.constexpr = False,
    DEFER: tl.constexpr = False,
):
    tb = tl.program_id(0)
    head = tl.program_id(1)
    s = tb.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    s_mask = s < num_tokens
    e = tl.arange(0, NUM_EXPERTS)
    part = NUM_HEADS * NUM_EXPERTS
    logits = tl.zeros((BLOCK_S, NUM_EXPERTS), dtype=tl.float32)
    # the committed kernel's order of sums: per 64-wide slice of Dh, part 3, then 2, then 1
    for c in tl.range(0, 0 if NO_GEMM else HEAD_DIM // BLOCK_D, num_stages=NSTAGES):
        xk = x_desc.load([tb * BLOCK_S, head * HEAD_DIM + c * BLOCK_D])
        g3 = g_desc.load([2 * part + head * NUM_EXPERTS, c * BLOCK_D])
        logits = tl.dot(xk, g3.T, logits)
        g2 = g_desc.load([part + head * NUM_EXPERTS, c * BLOCK_D])
        logits = tl.dot(xk, g2.T, logits)
        g1 = g_desc.load([head * NUM_EXPERTS, c * BLOCK_D])
        logits = tl.dot(xk, g1.T, logits)
    if NO_GEMM:  # ablation: logits from the token and expert indices, no x or gate read
        logits += (s[:, None] * 7 + e[None, :] * 13).to(tl.float32) * 1e-3 % 5.0 - 2.5
    scores = tl.sigmoid(logits)
    row = tl.arange(0, BLOCK_S)
    sc_base = scratch_ptr + (head * tl.num_programs(0) + tb).to(tl.int64) * (BLOCK_S * NUM_EXPERTS)
    if SCRATCH:
        tl.store(sc_base + row[:, None] * NUM_EXPERTS + e[None, :], scores)
    selection = scores
    if HAS_BIAS:
        selection = scores + tl.load(bias_ptr + head * NUM_EXPERTS + e)[None, :]
    key = selection_key(selection)
    experts = tl.broadcast_to(e[None, :], (BLOCK_S, NUM_EXPERTS))
    kk = tl.arange(0, K_PAD)
    if SCRATCH:
        tl.debug_barrier()  # the scores stored above are read by other threads below
    chosen_ids = tl.zeros((BLOCK_S, K_PAD), dtype=tl.int32)
    chosen_p = tl.zeros((BLOCK_S, K_PAD), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if SCRATCH:
            if PICK == 2:
                _, idx = tl.reduce((key, experts), 1, _higher2)
            else:
                best = tl.max(key, axis=1)
                idx = tl.min(tl.where(key == best[:, None], experts, NUM_EXPERTS), axis=1)
            if DEFER:
                p_k = tl.zeros_like(idx).to(tl.float32)  # read after the picks, all at once
            else:
                p_k = tl.load(sc_base + row * NUM_EXPERTS + idx)
        else:
            _, idx, p_k = tl.reduce((key, experts, scores), 1, FR._higher_selection)
        key = tl.where(e[None, :] == idx[:, None], -2147483648, key)
        chosen_ids = tl.where(kk[None, :] == k, idx[:, None], chosen_ids)
        chosen_p = tl.where(kk[None, :] == k, p_k[:, None], chosen_p)
    if DEFER:
        chosen_p = tl.load(sc_base + row[:, None] * NUM_EXPERTS + chosen_ids,
                           mask=kk[None, :] < TOP_K, other=0.0)
    if ROUTE_NORM:
        denom = tl.maximum(tl.sum(chosen_p, axis=1), NORM_EPS_VALUE)
        chosen_p = chosen_p / denom[:, None]
    chosen_p = chosen_p * route_scale
    out_offsets = (s[:, None] * NUM_HEADS + head) * TOP_K + kk[None, :]
    out_mask = s_mask[:, None] & (kk[None, :] < TOP_K)
    tl.store(ids_ptr + out_offsets, chosen_ids, mask=out_mask)
    tl.store(probs_ptr + out_offsets, chosen_p, mask=out_mask)
    taken = s_mask[:, None] & (key == -2147483648)
    counts = tl.sum(taken.to(tl.int32), axis=0)
    tl.store(block_counts_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + e, counts)


def gate_parts(gate: torch.Tensor) -> torch.Tensor:
    """[3 * H*E, Dh] bf16: the exact split g = g1 + g2 + g3 (round to nearest even each)."""
    g1 = gate.to(torch.bfloat16)
    rest = gate - g1.float()
    g2 = rest.to(torch.bfloat16)
    g3 = (rest - g2.float()).to(torch.bfloat16)
    return torch.cat([g1, g2, g3]).contiguous()


def committed(problem):
    """The committed launch (32 tokens, 8 warps, block_d 64): the occupancy probe's form."""
    return launcher(problem, 32, 8, None, None)


def wgmma_form(problem, parts, bs, warps, stages, scratch, pick, top_k=None, no_gemm=False,
               defer=False):
    cfg = problem.config
    H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
    x = problem.x
    S = x.shape[0]
    TB = cdiv(S, bs)
    ids = torch.full((S, H, K), -7, dtype=torch.int32, device=x.device)
    probs = torch.full((S, H, K), float("nan"), dtype=torch.float32, device=x.device)
    counts = torch.full((TB, H * E), -7, dtype=torch.int32, device=x.device)
    scratch_buf = torch.empty(H * TB * bs * E if scratch else 1, dtype=torch.float32,
                              device=x.device)
    x_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [bs, 64])
    g_desc = TensorDescriptor(parts, list(parts.shape), [parts.stride(0), 1], [E, 64])

    def go():
        return router_topk_wgmma[(TB, H)](
            x_desc, g_desc, problem.bias, ids, probs, counts, scratch_buf, S, 1.0,
            NUM_HEADS=H, HEAD_DIM=Dh, NUM_EXPERTS=E, TOP_K=K if top_k is None else top_k,
            K_PAD=max(2, triton.next_power_of_2(K)), BLOCK_S=bs, BLOCK_D=64, ROUTE_NORM=True,
            HAS_BIAS=True, SCRATCH=scratch, PICK=pick, NSTAGES=stages, NO_GEMM=no_gemm,
            DEFER=defer,
            num_warps=warps)
    return go, (ids, probs, counts)


FORMS = [  # block_s, warps, stages, scratch, pick
    (64, 4, 1, True, 1), (64, 4, 1, True, 2), (64, 4, 2, True, 1), (64, 4, 1, False, 3),
    (64, 8, 1, False, 3), (64, 8, 1, True, 1), (128, 8, 1, False, 3), (128, 8, 1, True, 1),
    (128, 4, 1, True, 1),
]


ABLATIONS = [  # (block_s, warps, stages, scratch, pick), top_k, no_gemm
    ((64, 4, 1, True, 1), 6, False), ((64, 4, 1, True, 1), 1, False),
    ((64, 4, 1, True, 1), 0, False), ((64, 4, 1, False, 1), 0, False),
    ((64, 4, 1, True, 1), 6, True), ((64, 4, 1, False, 1), 0, True),
    ((64, 4, 2, False, 1), 0, False), ((64, 8, 1, False, 1), 0, False),
]


def ablate(cases):
    """Parts of the best form switched off: picks (top_k 1 or 0), the score scratch, the GEMM;
    only times (each changes what the kernel computes)."""
    device = torch.device("cuda")
    for H, S in cases:
        problem = draw_problem(BenchCase(H, S), device)
        parts = gate_parts(problem.gate)
        paths = {"committed": committed(problem)[0]}
        for form, top_k, no_gemm in ABLATIONS:
            name = "bs{} w{} st{} scratch{} pick{}".format(*form) + f" top_k {top_k}" + (
                " no GEMM" if no_gemm else "")
            fn = wgmma_form(problem, parts, *form, top_k=top_k, no_gemm=no_gemm)[0]
            k = fn()
            print(f"  {name}: regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}")
            paths[name] = fn
        torch.cuda.synchronize()
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            print(f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us",
                  flush=True)


def deferred(cases):
    """The winners' scores read from the scratch once after the picks, not once a pick."""
    device = torch.device("cuda")
    for H, S in cases:
        problem = draw_problem(BenchCase(H, S), device)
        parts = gate_parts(problem.gate)
        fn0, out0 = committed(problem)
        fn0()
        paths = {"committed": fn0}
        outs = {}
        for form in [(64, 4, 1, True, 1), (64, 4, 1, True, 2), (128, 8, 1, True, 1)]:
            for defer in (False, True):
                name = "bs{} w{} st{} scratch{} pick{}".format(*form) + (" deferred" if defer else "")
                fn, out = wgmma_form(problem, parts, *form, defer=defer)
                k = fn()
                paths[name], outs[name] = fn, out
                print(f"  {name}: regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}")
        torch.cuda.synchronize()
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            line = f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us"
            if name in outs:
                ids, probs, _ = outs[name]
                same = torch.equal(ids, out0[0]) and torch.equal(probs.view(torch.int32),
                                                                 out0[1].view(torch.int32))
                line += f" ids and probs {'same' if same else 'DIFFER'}"
            print(line, flush=True)


def main():
    if "--deferred" in sys.argv:
        return deferred([(3, 512), (3, 4096), (3, 16384), (12, 4096)])
    if "--ablate" in sys.argv:
        return ablate([(3, 512), (3, 16384)])
    device = torch.device("cuda")
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        parts = gate_parts(problem.gate)
        paths, outs, kernels = {}, {}, {}
        fn, out = committed(problem)
        kernels["committed"] = fn()
        paths["committed"], outs["committed"] = fn, out
        for form in FORMS:
            name = "bs{} w{} st{} scratch{} pick{}".format(*form)
            fn, out = wgmma_form(problem, parts, *form)
            try:
                kernels[name] = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a form that does not compile is reported, not fatal
                print(f"H={H} S={S} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            paths[name], outs[name] = fn, out
        torch.cuda.synchronize()
        ids0, probs0, counts0 = outs["committed"]
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            ids, probs, counts = outs[name]
            bs = 32 if name == "committed" else int(name.split()[0][2:])
            c32 = counts0
            if bs != 32:
                r = bs // 32
                pad = (-c32.shape[0]) % r
                c32 = torch.cat([c32, torch.zeros(pad, c32.shape[1], dtype=c32.dtype,
                                                  device=c32.device)])
                c32 = c32.view(-1, r, c32.shape[1]).sum(1).to(torch.int32)
            same = (torch.equal(ids, ids0)
                    and torch.equal(probs.view(torch.int32), probs0.view(torch.int32))
                    and torch.equal(counts, c32))
            k = kernels[name]
            ms = summarize(times[name])["median_ms"]
            print(f"H={H} S={S} {name}: {ms * 1000:.1f} us regs {k.n_regs} spills "
                  f"{k.n_spills} smem {k.metadata.shared} bits {'same' if same else 'DIFFER'}",
                  flush=True)
        t0 = time_paths({"split": lambda: gate_parts(problem.gate)}, warmup=5, iters=30,
                        flush_mib=512, device=device)
        print(f"H={H} gate split (torch, per call): "
              f"{summarize(t0['split'])['median_ms'] * 1000:.1f} us", flush=True)


if __name__ == "__main__":
    main()
