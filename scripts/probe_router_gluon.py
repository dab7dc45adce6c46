"""Probe: the router's top-K launch written in Gluon (explicit layouts), against the committed
``router_topk_kernel`` at the H200 table's tiles: the kernel alone (L2 flushed, median of 60),
ids, probabilities and per-block counts compared bit for bit.

The form: one program of BLOCK_S tokens of one head on 4 warps per 64 tokens (one warpgroup), the
logits as one wgmma chain over the gate's three exact bf16 parts in the committed order of sums
(per BLOCK_D slice of Dh: part 3, part 2, part 1), the parts made once per gate (not per program)
and streamed by TMA through a ring of NSLOT tiles, x by TMA once. In the wgmma accumulator's
layout a token's 256 experts lie in four lanes of one warp, so each pick is a reduction within a
quad (two shuffles) and never crosses warps; the scores go to a per-program scratch and each
winner's score is read back, so only the int32 keys stay in registers. The normalising sum is
written out in the committed kernel's order on the H200, ((p0 + p1) + (p4 + p5)) + (p2 + p3).

    python scripts/probe_router_gluon.py            # forms x four cases, bits and times
    python scripts/probe_router_gluon.py --screen   # compile for sm_90 only (no GPU): regs, smem
    python scripts/probe_router_gluon.py --floor    # what any router launch costs at least

Needs Triton 3.6's Gluon (the H200's). Top-6, sigmoid with a selection bias, E = 256 only.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from magi_moe.routing import NORM_EPS  # noqa: E402

INT32_MIN = -2147483648


@gluon.jit
def _key(selection):
    # the committed kernel's int32 key: signed order is float order, -0.0 is +0.0, NaN last
    bits = gl.where(selection == 0.0, 0.0, selection).to(gl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return gl.where(selection == selection, key, -2147483647)


@gluon.jit
def _pick(key, e, sc_row, s_mask, NUM_EXPERTS: gl.constexpr):
    # the highest key, on equal keys the lower expert; its id stored, its score read back
    best = gl.max(key, axis=1)
    idx = gl.min(gl.where(key == best[:, None], e[None, :], NUM_EXPERTS), axis=1)
    key = gl.where(e[None, :] == idx[:, None], -2147483648, key)
    p = gl.load(sc_row + idx, mask=s_mask, other=0.0)
    return key, idx, p


@gluon.jit
def _issue_tile(g_desc, g_smem, ready, t, head, NT: gl.constexpr, NSLOT: gl.constexpr,
                NUM_EXPERTS: gl.constexpr, BLOCK_D: gl.constexpr):
    slot = t % NSLOT
    mbarrier.expect(ready.index(slot), NUM_EXPERTS * BLOCK_D * 2)
    tma.async_copy_global_to_shared(g_desc, [(head * NT + t) * NUM_EXPERTS, 0],
                                    ready.index(slot), g_smem.index(slot))


@gluon.jit
def router_topk_gluon(
    x_desc, g_desc, bias_ptr, ids_ptr, probs_ptr, block_counts_ptr, scratch_ptr,
    num_tokens, route_scale, norm_eps,
    NUM_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_EXPERTS: gl.constexpr,
    TOP_K: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_D: gl.constexpr, NSLOT: gl.constexpr,
    num_warps: gl.constexpr, PICKS: gl.constexpr = True,
):
    NSLICE: gl.constexpr = HEAD_DIM // BLOCK_D
    NT: gl.constexpr = 3 * NSLICE
    tb = gl.program_id(0)
    head = gl.program_id(1)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, NUM_EXPERTS, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc_layout)

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NSLICE, BLOCK_S, BLOCK_D], x_desc.layout)
    g_smem = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, NUM_EXPERTS, BLOCK_D], g_desc.layout)
    x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    mbarrier.init(x_bar, count=1)
    for i in gl.static_range(NSLOT):
        mbarrier.init(ready.index(i), count=1)

    # x's slices once (rows past the last token are zero-filled), the first NSLOT gate tiles
    mbarrier.expect(x_bar, NSLICE * BLOCK_S * BLOCK_D * 2)
    for c in gl.static_range(NSLICE):
        tma.async_copy_global_to_shared(x_desc, [tb * BLOCK_S, head * HEAD_DIM + c * BLOCK_D],
                                        x_bar, x_smem.index(c))
    for t in gl.static_range(NSLOT):
        _issue_tile(g_desc, g_smem, ready, t, head, NT, NSLOT, NUM_EXPERTS, BLOCK_D)
    mbarrier.wait(x_bar, 0)

    # logits: tile t is slice t // 3, part 3 - t % 3 (the committed order of sums)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_S, NUM_EXPERTS], gl.float32, acc_layout))
    for t in range(NT):
        slot = t % NSLOT
        mbarrier.wait(ready.index(slot), (t // NSLOT) & 1)
        acc = warpgroup_mma(x_smem.index(t // 3), g_smem.index(slot).permute((1, 0)), acc,
                            is_async=True)
        # tile t-1's MMA done (t's runs on): the loop carries the accumulator, re-wrapped
        acc = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=1, deps=(acc,)))
        nxt = t - 1 + NSLOT
        if t >= 1 and nxt < NT:
            gl.thread_barrier()  # tile t-1's MMA is done in every warp: its slot is free
            _issue_tile(g_desc, g_smem, ready, nxt, head, NT, NSLOT, NUM_EXPERTS, BLOCK_D)
    logits = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.invalidate(x_bar)
    for i in gl.static_range(NSLOT):
        mbarrier.invalidate(ready.index(i))

    r = gl.arange(0, BLOCK_S, layout=rows_l)
    s = tb.to(gl.int64) * BLOCK_S + r.to(gl.int64)
    s_mask = s < num_tokens
    e = gl.arange(0, NUM_EXPERTS, layout=cols_l)
    scores = 1 / (1 + gl.exp(-logits))  # tl.sigmoid spelled out: the same operations
    sc_base = scratch_ptr + (head * gl.num_programs(0) + tb).to(gl.int64) * (BLOCK_S * NUM_EXPERTS)
    gl.store(sc_base + r[:, None] * NUM_EXPERTS + e[None, :], scores)
    selection = scores + gl.load(bias_ptr + head * NUM_EXPERTS + e)[None, :]
    key = _key(selection)
    gl.thread_barrier()  # the scores stored above are read back by other lanes
    sc_row = sc_base + r * NUM_EXPERTS
    out_base = ids_ptr + (s * NUM_HEADS + head) * TOP_K
    if PICKS:
        key, i0, p0 = _pick(key, e, sc_row, s_mask, NUM_EXPERTS)
        key, i1, p1 = _pick(key, e, sc_row, s_mask, NUM_EXPERTS)
        key, i2, p2 = _pick(key, e, sc_row, s_mask, NUM_EXPERTS)
        key, i3, p3 = _pick(key, e, sc_row, s_mask, NUM_EXPERTS)
        key, i4, p4 = _pick(key, e, sc_row, s_mask, NUM_EXPERTS)
        key, i5, p5 = _pick(key, e, sc_row, s_mask, NUM_EXPERTS)
    else:  # ablation: no picks, the first six experts
        i0 = gl.zeros_like(r)
        i1, i2, i3, i4, i5 = i0 + 1, i0 + 2, i0 + 3, i0 + 4, i0 + 5
        p0 = gl.load(sc_row, mask=s_mask, other=0.0)
        p1, p2, p3, p4, p5 = p0, p0, p0, p0, p0
        key = gl.where(e[None, :] < 6, -2147483648, key)
    denom = gl.maximum(((p0 + p1) + (p4 + p5)) + (p2 + p3), norm_eps)
    pbase = probs_ptr + (s * NUM_HEADS + head) * TOP_K
    gl.store(out_base + 0, i0, mask=s_mask)
    gl.store(out_base + 1, i1, mask=s_mask)
    gl.store(out_base + 2, i2, mask=s_mask)
    gl.store(out_base + 3, i3, mask=s_mask)
    gl.store(out_base + 4, i4, mask=s_mask)
    gl.store(out_base + 5, i5, mask=s_mask)
    gl.store(pbase + 0, p0 / denom * route_scale, mask=s_mask)
    gl.store(pbase + 1, p1 / denom * route_scale, mask=s_mask)
    gl.store(pbase + 2, p2 / denom * route_scale, mask=s_mask)
    gl.store(pbase + 3, p3 / denom * route_scale, mask=s_mask)
    gl.store(pbase + 4, p4 / denom * route_scale, mask=s_mask)
    gl.store(pbase + 5, p5 / denom * route_scale, mask=s_mask)

    taken = s_mask[:, None] & (key == -2147483648)
    counts = gl.sum(taken.to(gl.int32), axis=0)
    gl.store(block_counts_ptr + tb.to(gl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + e, counts)


@triton.jit
def _empty_kernel(out_ptr):
    if tl.program_id(0) + tl.program_id(1) == 0:
        tl.store(out_ptr, 1)


@triton.jit
def _router_io_kernel(x_ptr, ids_ptr, counts_ptr, num_tokens, stride_x,
                      NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                      BLOCK_S: tl.constexpr):
    # a router's memory traffic and nothing else: x's block of one head in, an id a token and
    # the block's counts out (argmax of x over Dh stands in for the selection)
    tb = tl.program_id(0)
    head = tl.program_id(1)
    s = tb.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + s[:, None] * stride_x + head * HEAD_DIM + d[None, :],
                mask=(s < num_tokens)[:, None], other=0.0)
    top = tl.argmax(x, axis=1)
    tl.store(ids_ptr + s * NUM_HEADS + head, top.to(tl.int32), mask=s < num_tokens)
    e = tl.arange(0, NUM_EXPERTS)
    tl.store(counts_ptr + (tb * NUM_HEADS + head) * NUM_EXPERTS + e, e)


def floor(cases):
    """Launch floors under the benchmark's timing (L2 flushed before each call): an empty launch
    on the router's grid, three such launches back to back (the router's table steps), a kernel
    with the router's memory traffic only, and cuBLAS on the logits' GEMM with the three parts
    (K = 3 Dh) and with one (K = Dh): what any router of this shape costs at least."""
    from magi_moe.bench.cases import BenchCase, draw_problem
    from magi_moe.bench.timing import summarize, time_paths
    device = torch.device("cuda")
    for H, S in cases:
        problem = draw_problem(BenchCase(H, S), device)
        x, E, Dh = problem.x, problem.config.num_experts, problem.config.head_dim
        TB = triton.cdiv(S, 32)
        out = torch.zeros(1, dtype=torch.int32, device=device)
        ids = torch.empty(S * H, dtype=torch.int32, device=device)
        counts = torch.empty(TB * H * E, dtype=torch.int32, device=device)
        xh = x.view(S, H, Dh).transpose(0, 1)
        a3 = torch.cat([xh, xh, xh], dim=2).contiguous()              # [H, S, 3 Dh]
        b3 = torch.randn(H, 3 * Dh, E, device=device).to(torch.bfloat16)
        a1, b1 = xh.contiguous(), b3[:, :Dh].contiguous()

        def empty():
            _empty_kernel[(TB, H)](out)

        def three_empty():
            for _ in range(3):
                _empty_kernel[(TB, H)](out)

        def io():
            _router_io_kernel[(TB, H)](x, ids, counts, S, x.stride(0), NUM_HEADS=H,
                                       HEAD_DIM=Dh, NUM_EXPERTS=E, BLOCK_S=32, num_warps=8)
        paths = {"empty launch": empty, "three empty launches": three_empty,
                 "router memory traffic": io,
                 "cuBLAS logits GEMM, K = 3 Dh": lambda: torch.bmm(a3, b3),
                 "cuBLAS logits GEMM, K = Dh": lambda: torch.bmm(a1, b1)}
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            print(f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us",
                  flush=True)


def gate_tiles(gate: torch.Tensor, heads: int, block_d: int) -> torch.Tensor:
    """[H * 3 * Dh/block_d * E, block_d] bf16: the exact split g = g1 + g2 + g3, laid out as the
    kernel streams it: per head, per slice of Dh, part 3, part 2, part 1, each [E, block_d]."""
    g1 = gate.to(torch.bfloat16)
    rest = gate - g1.float()
    g2 = rest.to(torch.bfloat16)
    g3 = (rest - g2.float()).to(torch.bfloat16)
    he, dh = gate.shape
    e = he // heads
    parts = torch.stack([g3, g2, g1])                    # [3, H*E, Dh]
    parts = parts.view(3, heads, e, dh // block_d, block_d)
    parts = parts.permute(1, 3, 0, 2, 4).contiguous()    # [H, slice, part, E, block_d]
    return parts.view(-1, block_d)


def shared_layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def gluon_form(problem, tiles_2d, bs, warps, nslot, block_d, picks=True):
    cfg = problem.config
    H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
    x = problem.x
    S = x.shape[0]
    TB = triton.cdiv(S, bs)
    ids = torch.full((S, H, K), -7, dtype=torch.int32, device=x.device)
    probs = torch.full((S, H, K), float("nan"), dtype=torch.float32, device=x.device)
    counts = torch.full((TB, H * E), -7, dtype=torch.int32, device=x.device)
    scratch = torch.empty(H * TB * bs * E, dtype=torch.float32, device=x.device)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bs, block_d],
                              shared_layout([bs, block_d]))
    g_desc = TensorDescriptor(tiles_2d, list(tiles_2d.shape), list(tiles_2d.stride()),
                              [E, block_d], shared_layout([E, block_d]))

    def go():
        return router_topk_gluon[(TB, H)](
            x_desc, g_desc, problem.bias, ids, probs, counts, scratch, S, 1.0, NORM_EPS,
            NUM_HEADS=H, HEAD_DIM=Dh, NUM_EXPERTS=E, TOP_K=K, BLOCK_S=bs, BLOCK_D=block_d,
            NSLOT=nslot, num_warps=warps, PICKS=picks)
    return go, (ids, probs, counts)


def committed_form(problem, block_d):
    """The committed launch at the H200 table's tiles (32 tokens, 8 warps) and ``block_d``."""
    from magi_moe.kernels import fused_routing as FR
    cfg = problem.config
    H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
    x = problem.x
    S = x.shape[0]
    TB = triton.cdiv(S, 32)
    ids = torch.full((S, H, K), -7, dtype=torch.int32, device=x.device)
    probs = torch.full((S, H, K), float("nan"), dtype=torch.float32, device=x.device)
    counts = torch.full((TB, H * E), -7, dtype=torch.int32, device=x.device)

    def go():
        return FR.router_topk_kernel[(TB, H)](
            x, problem.gate, problem.bias, ids, probs, counts, S, x.stride(0), 1.0,
            NUM_HEADS=H, HEAD_DIM=Dh, NUM_EXPERTS=E, E_PAD=E, TOP_K=K, K_PAD=8, BLOCK_S=32,
            BLOCK_D=block_d, SOFTMAX=False, ROUTE_NORM=True, HAS_BIAS=True,
            DOT_PRECISION="ieee", SPLIT_GATE=True, UPCAST=False, TUPLE_PICKS=True, num_warps=8)
    return go, (ids, probs, counts)


def counts_per(counts32: torch.Tensor, bs: int) -> torch.Tensor:
    """Per-32-token block counts summed to ``bs``-token blocks."""
    r = bs // 32
    pad = (-counts32.shape[0]) % r
    c = torch.cat([counts32, counts32.new_zeros(pad, counts32.shape[1])])
    return c.view(-1, r, c.shape[1]).sum(1).to(torch.int32)


FORMS = [  # block_s, warps, nslot, block_d
    (64, 4, 3, 32), (64, 4, 4, 32), (64, 4, 6, 32), (128, 8, 4, 32), (64, 4, 3, 64),
]


def screen():
    """Compile each form for sm_90 without a GPU: registers, spills, shared memory."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from collections import Counter
    from inspect_kernel import ptxas_usage, sass_lines
    kernel = router_topk_gluon
    names = kernel.arg_names
    for bs, warps, nslot, bd in FORMS:
        x = torch.empty(4096, 768, dtype=torch.bfloat16)
        g = torch.empty(3 * 3 * 256 // bd * 256, bd, dtype=torch.bfloat16)
        args = [TensorDescriptor(x, list(x.shape), list(x.stride()), [bs, bd],
                                 shared_layout([bs, bd])),
                TensorDescriptor(g, list(g.shape), list(g.stride()), [256, bd],
                                 shared_layout([256, bd])),
                torch.empty(16), torch.empty(16, dtype=torch.int32), torch.empty(16),
                torch.empty(16, dtype=torch.int32), torch.empty(16), 4096, 1.0, 1e-20]
        signature, attrs = {}, {}
        for i, arg in enumerate(args):
            kind, key = native_specialize_impl(BaseBackend, arg, False, True, True)
            signature[names[i]] = kind
            if isinstance(key, str):
                attrs[(i,)] = BaseBackend.parse_attr(key)
        consts = dict(NUM_HEADS=3, HEAD_DIM=256, NUM_EXPERTS=256, TOP_K=6, BLOCK_S=bs,
                      BLOCK_D=bd, NSLOT=nslot, num_warps=warps, PICKS=True)
        for name in consts:
            signature[name] = "constexpr"
        source = GluonASTSource(fn=kernel, signature=signature, attrs=attrs,
                                constexprs={(names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
        usage = ptxas_usage(compiled, 90)
        ops = Counter(i.split()[0].split(".")[0] for _, i in sass_lines(compiled.asm["cubin"])[0])
        print(f"bs{bs} w{warps} slots{nslot} bd{bd}: smem {compiled.metadata.shared} {usage} "
              f"instructions {sum(ops.values())} HGMMA {ops['HGMMA']} BAR {ops['BAR']} "
              f"SHFL {ops['SHFL']} STL {ops['STL']}")


def main():
    if "--screen" in sys.argv:
        return screen()
    if "--floor" in sys.argv:
        return floor([(3, 512), (3, 4096), (3, 16384), (12, 4096)])
    from magi_moe.bench.cases import BenchCase, draw_problem
    from magi_moe.bench.timing import summarize, time_paths
    device = torch.device("cuda")
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        paths, outs, base = {}, {}, {}
        for bd in sorted({f[3] for f in FORMS}):
            fn, out = committed_form(problem, bd)
            fn()
            paths[f"committed bd{bd}"], base[bd] = fn, out
        tiles_by_bd = {bd: gate_tiles(problem.gate, H, bd) for bd in base}
        for bs, warps, nslot, bd in FORMS:
            for picks in (True, False):
                name = f"gluon bs{bs} w{warps} slots{nslot} bd{bd}" + ("" if picks else " no picks")
                fn, out = gluon_form(problem, tiles_by_bd[bd], bs, warps, nslot, bd, picks)
                try:
                    k = fn()
                    torch.cuda.synchronize()
                except Exception as exc:  # a form that fails is reported, not fatal
                    print(f"H={H} S={S} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                if picks:
                    print(f"  {name}: regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}")
                paths[name], outs[name] = fn, (out, bd, bs, picks)
        torch.cuda.synchronize()
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            line = f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us"
            if name in outs and outs[name][3]:
                (ids, probs, counts), bd, bs, _ = outs[name]
                ids0, probs0, counts0 = base[bd]
                same_ids = torch.equal(ids, ids0)
                same_p = torch.equal(probs.view(torch.int32), probs0.view(torch.int32))
                same_c = torch.equal(counts, counts_per(counts0, bs))
                line += (f" ids {'same' if same_ids else 'DIFFER'} probs "
                         f"{'same' if same_p else 'DIFFER %d' % (probs != probs0).sum().item()}"
                         f" counts {'same' if same_c else 'DIFFER'}")
            print(line, flush=True)
        for bd, tiles in tiles_by_bd.items():
            t = time_paths({"split": lambda: gate_tiles(problem.gate, H, bd)}, warmup=5,
                           iters=30, flush_mib=512, device=device)
            print(f"H={H} gate tiles bd{bd} (torch, once per gate): "
                  f"{summarize(t['split'])['median_ms'] * 1000:.1f} us", flush=True)


if __name__ == "__main__":
    main()
