"""Probe: a router whose gate stays in shared memory, against the committed ``router_topk_kernel``
at the H200 table's tiles (L2 flushed, median of 60; ids, probabilities and per-block counts
compared bit for bit).

Every program of the streaming forms (``probe_router_gluon.py``, ``probe_router_wgmma.py``, the
committed kernel) reads its head's whole gate from L2 for 32-128 tokens. Here two launches:

1. ``router_half_kernel`` (Gluon), persistent: a program owns one head and one half of its
   experts, loads that half's three exact bf16 parts once (192 KB of shared memory), then walks
   token blocks of 64: the logits of the block's tokens for its 128 experts in one wgmma chain
   in the committed order of sums (a logit's bits depend only on its own chain, not on the
   experts beside it), scores and keys in registers, and the six highest (key, expert, score)
   of its half per token, stored as candidates.
2. ``merge_halves_kernel`` (Triton): per token the six highest of its twelve candidates (the
   same total order: key, then the lower expert), the committed normalising sum written out,
   ids, probabilities and the per-32-token block counts.

The top six of a union are the top six of the six-highest lists of its parts, so the picks are
exact; the probabilities are the same scores normalised in the same order.

    python scripts/probe_router_resident.py            # bits and times, four cases
    python scripts/probe_router_resident.py --screen   # compile for sm_90 only (no GPU)
    ncu --kernel-name regex:router --launch-skip 2 --launch-count 2 ... \
        python scripts/probe_router_resident.py --once 3 4096   # a few calls, for a profiler

Needs Triton 3.6's Gluon (the H200's). Top-6, sigmoid with a selection bias, E = 256 only.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from magi_moe.routing import NORM_EPS  # noqa: E402
from probe_router_gluon import (  # noqa: E402
    _key, committed_form, counts_per, gate_tiles, shared_layout)

SPLIT = 2  # halves of the experts a head's programs divide


@gluon.jit
def _half_pick(key, scores, e, BIG: gl.constexpr):
    best = gl.max(key, axis=1)
    idx = gl.min(gl.where(key == best[:, None], e[None, :], BIG), axis=1)
    hit = e[None, :] == idx[:, None]
    p = gl.sum(gl.where(hit, scores, 0.0), axis=1)  # one score and zeros: exact
    return gl.where(hit, -2147483648, key), best, idx, p


@gluon.jit
def _store_candidate(base, k: gl.constexpr, key, idx, p, s_mask, keys_ptr, experts_ptr,
                     scores_ptr):
    gl.store(keys_ptr + base + k, key, mask=s_mask)
    gl.store(experts_ptr + base + k, idx, mask=s_mask)
    gl.store(scores_ptr + base + k, p, mask=s_mask)


@gluon.jit
def _issue_x(x_desc, x_smem, x_bar, block, head, NSLICE: gl.constexpr, BLOCK_S: gl.constexpr,
             BLOCK_D: gl.constexpr, HEAD_DIM: gl.constexpr):
    mbarrier.expect(x_bar, NSLICE * BLOCK_S * BLOCK_D * 2)
    for c in gl.static_range(NSLICE):
        tma.async_copy_global_to_shared(x_desc, [block * BLOCK_S, head * HEAD_DIM + c * BLOCK_D],
                                        x_bar, x_smem.index(c))


@gluon.jit
def router_half_kernel(
    x_desc, g_desc, gate_ptr, bias_ptr, keys_ptr, experts_ptr, scores_ptr,
    num_tokens, num_blocks,
    NUM_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_EXPERTS: gl.constexpr,
    BLOCK_S: gl.constexpr, BLOCK_D: gl.constexpr, num_warps: gl.constexpr,
    SPLIT_HERE: gl.constexpr = False,
):
    NSLICE: gl.constexpr = HEAD_DIM // BLOCK_D
    NT: gl.constexpr = 3 * NSLICE
    EN: gl.constexpr = NUM_EXPERTS // 2
    COMBOS: gl.constexpr = NUM_HEADS * 2
    pid = gl.program_id(0)
    combo = pid % COMBOS
    head = combo // 2
    half = combo % 2
    lane = pid // COMBOS
    lanes = gl.num_programs(0) // COMBOS

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, EN, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    g_smem = gl.allocate_shared_memory(gl.bfloat16, [NT, EN, BLOCK_D], g_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NSLICE, BLOCK_S, BLOCK_D], x_desc.layout)
    g_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(g_bar, count=1)
    mbarrier.init(x_bar, count=1)

    if lane < num_blocks:
        _issue_x(x_desc, x_smem, x_bar, lane, head, NSLICE, BLOCK_S, BLOCK_D, HEAD_DIM)
    # this half's gate tiles, once: tile t is slice t // 3, part 3 - t % 3
    if SPLIT_HERE:
        # from the fp32 gate itself, split here as the committed kernel splits it (so no copy
        # of the gate outlives the call)
        ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8],
                                            warps_per_cta=[num_warps, 1], order=[1, 0])
        rows = head * NUM_EXPERTS + half * EN + gl.arange(0, EN, layout=gl.SliceLayout(1, ld))
        cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
        ptrs = gate_ptr + rows.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
        for c in range(NSLICE):
            g = gl.load(ptrs + c * BLOCK_D)
            g1 = g.to(gl.bfloat16)
            rest = g - g1.to(gl.float32)
            g2 = rest.to(gl.bfloat16)
            g_smem.index(3 * c).store((rest - g2.to(gl.float32)).to(gl.bfloat16))
            g_smem.index(3 * c + 1).store(g2)
            g_smem.index(3 * c + 2).store(g1)
        fence_async_shared()
        gl.thread_barrier()
    else:
        mbarrier.expect(g_bar, NT * EN * BLOCK_D * 2)
        for t in gl.static_range(NT):
            tma.async_copy_global_to_shared(
                g_desc, [(head * NT + t) * NUM_EXPERTS + half * EN, 0], g_bar, g_smem.index(t))
        mbarrier.wait(g_bar, 0)

    e = half * EN + gl.arange(0, EN, layout=cols_l)
    bias = gl.load(bias_ptr + head * NUM_EXPERTS + e)
    r = gl.arange(0, BLOCK_S, layout=rows_l)
    phase = 0
    for block in range(lane, num_blocks, lanes):
        mbarrier.wait(x_bar, phase)
        phase ^= 1
        acc = warpgroup_mma_init(gl.zeros([BLOCK_S, EN], gl.float32, acc_layout))
        for t in gl.static_range(NT):
            acc = warpgroup_mma(x_smem.index(t // 3), g_smem.index(t).permute((1, 0)), acc,
                                is_async=True)
        logits = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warp's MMAs read x: the next block may overwrite it
        if block + lanes < num_blocks:
            _issue_x(x_desc, x_smem, x_bar, block + lanes, head, NSLICE, BLOCK_S, BLOCK_D,
                     HEAD_DIM)

        scores = 1 / (1 + gl.exp(-logits))  # tl.sigmoid spelled out: the same operations
        key = _key(scores + bias[None, :])
        s = block.to(gl.int64) * BLOCK_S + r.to(gl.int64)
        s_mask = s < num_tokens
        base = ((s * NUM_HEADS + head) * 2 + half) * 6
        key, k0, i0, p0 = _half_pick(key, scores, e, NUM_EXPERTS)
        _store_candidate(base, 0, k0, i0, p0, s_mask, keys_ptr, experts_ptr, scores_ptr)
        key, k1, i1, p1 = _half_pick(key, scores, e, NUM_EXPERTS)
        _store_candidate(base, 1, k1, i1, p1, s_mask, keys_ptr, experts_ptr, scores_ptr)
        key, k2, i2, p2 = _half_pick(key, scores, e, NUM_EXPERTS)
        _store_candidate(base, 2, k2, i2, p2, s_mask, keys_ptr, experts_ptr, scores_ptr)
        key, k3, i3, p3 = _half_pick(key, scores, e, NUM_EXPERTS)
        _store_candidate(base, 3, k3, i3, p3, s_mask, keys_ptr, experts_ptr, scores_ptr)
        key, k4, i4, p4 = _half_pick(key, scores, e, NUM_EXPERTS)
        _store_candidate(base, 4, k4, i4, p4, s_mask, keys_ptr, experts_ptr, scores_ptr)
        key, k5, i5, p5 = _half_pick(key, scores, e, NUM_EXPERTS)
        _store_candidate(base, 5, k5, i5, p5, s_mask, keys_ptr, experts_ptr, scores_ptr)
    mbarrier.invalidate(g_bar)
    mbarrier.invalidate(x_bar)


@triton.jit
def _merge_pick(key, expert, score):
    best = tl.max(key, axis=1)
    idx = tl.min(tl.where(key == best[:, None], expert, 1 << 30), axis=1)
    hit = expert == idx[:, None]
    p = tl.sum(tl.where(hit, score, 0.0), axis=1)
    return tl.where(hit, -2147483648, key), idx, p


@triton.jit
def merge_halves_kernel(keys_ptr, experts_ptr, scores_ptr, ids_ptr, probs_ptr,
                        block_counts_ptr, num_tokens, route_scale, norm_eps,
                        NUM_HEADS: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                        BLOCK_S: tl.constexpr):
    tb = tl.program_id(0)
    head = tl.program_id(1)
    s = tb.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    s_mask = s < num_tokens
    c = tl.arange(0, 16)
    cand = (s[:, None] * NUM_HEADS + head) * 12 + c[None, :]
    c_mask = s_mask[:, None] & (c[None, :] < 12)
    key = tl.load(keys_ptr + cand, mask=c_mask, other=-2147483648)
    expert = tl.load(experts_ptr + cand, mask=c_mask, other=1 << 20)
    expert = tl.where(c[None, :] < 12, expert, (1 << 20) + c[None, :])  # padding: distinct, last
    score = tl.load(scores_ptr + cand, mask=c_mask, other=0.0)
    key, i0, p0 = _merge_pick(key, expert, score)
    key, i1, p1 = _merge_pick(key, expert, score)
    key, i2, p2 = _merge_pick(key, expert, score)
    key, i3, p3 = _merge_pick(key, expert, score)
    key, i4, p4 = _merge_pick(key, expert, score)
    key, i5, p5 = _merge_pick(key, expert, score)
    denom = tl.maximum(((p0 + p1) + (p4 + p5)) + (p2 + p3), norm_eps)
    out = (s * NUM_HEADS + head) * 6
    tl.store(ids_ptr + out + 0, i0, mask=s_mask)
    tl.store(ids_ptr + out + 1, i1, mask=s_mask)
    tl.store(ids_ptr + out + 2, i2, mask=s_mask)
    tl.store(ids_ptr + out + 3, i3, mask=s_mask)
    tl.store(ids_ptr + out + 4, i4, mask=s_mask)
    tl.store(ids_ptr + out + 5, i5, mask=s_mask)
    tl.store(probs_ptr + out + 0, p0 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + out + 1, p1 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + out + 2, p2 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + out + 3, p3 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + out + 4, p4 / denom * route_scale, mask=s_mask)
    tl.store(probs_ptr + out + 5, p5 / denom * route_scale, mask=s_mask)
    e = tl.arange(0, NUM_EXPERTS)
    chosen = ((e[None, :] == i0[:, None]) | (e[None, :] == i1[:, None])
              | (e[None, :] == i2[:, None]) | (e[None, :] == i3[:, None])
              | (e[None, :] == i4[:, None]) | (e[None, :] == i5[:, None]))
    counts = tl.sum((chosen & s_mask[:, None]).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + tb.to(tl.int64) * (NUM_HEADS * NUM_EXPERTS)
             + head * NUM_EXPERTS + e, counts)


def programs(heads: int, blocks: int, sms: int) -> int:
    """Persistent grid: a multiple of the 2H (head, half) pairs, at most one program per SM and
    no more lanes per pair than token blocks."""
    combos = 2 * heads
    return combos * max(1, min(sms // combos, blocks))


def resident_form(problem, tiles_2d, sms, block_d=32, warps=4, merge_bs=32, split_here=False):
    cfg = problem.config
    H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
    x = problem.x
    S = x.shape[0]
    bs = 64
    blocks = triton.cdiv(S, bs)
    grid = programs(H, blocks, sms)
    dev = x.device
    cand_keys = torch.empty(S * H * 12, dtype=torch.int32, device=dev)
    cand_experts = torch.empty(S * H * 12, dtype=torch.int32, device=dev)
    cand_scores = torch.empty(S * H * 12, dtype=torch.float32, device=dev)
    ids = torch.full((S, H, K), -7, dtype=torch.int32, device=dev)
    probs = torch.full((S, H, K), float("nan"), dtype=torch.float32, device=dev)
    TB = triton.cdiv(S, merge_bs)
    counts = torch.full((TB, H * E), -7, dtype=torch.int32, device=dev)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bs, block_d],
                              shared_layout([bs, block_d]))
    g_desc = TensorDescriptor(tiles_2d, list(tiles_2d.shape), list(tiles_2d.stride()),
                              [E // 2, block_d], shared_layout([E // 2, block_d]))

    def half():
        return router_half_kernel[(grid,)](
            x_desc, g_desc, problem.gate, problem.bias, cand_keys, cand_experts, cand_scores, S,
            blocks, NUM_HEADS=H, HEAD_DIM=Dh, NUM_EXPERTS=E, BLOCK_S=bs, BLOCK_D=block_d,
            num_warps=warps, SPLIT_HERE=split_here)

    def merge():
        return merge_halves_kernel[(TB, H)](
            cand_keys, cand_experts, cand_scores, ids, probs, counts, S, 1.0, NORM_EPS,
            NUM_HEADS=H, NUM_EXPERTS=E, BLOCK_S=merge_bs, num_warps=4)

    def both():
        half()
        merge()
    return half, merge, both, (ids, probs, counts)


def screen():
    """Compile the Gluon kernel for sm_90 without a GPU: registers, spills, shared memory."""
    from collections import Counter
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from inspect_kernel import ptxas_usage, sass_lines
    kernel = router_half_kernel
    names = kernel.arg_names
    bd = 32
    x = torch.empty(4096, 768, dtype=torch.bfloat16)
    g = torch.empty(3 * 3 * 256 // bd * 256, bd, dtype=torch.bfloat16)
    args = [TensorDescriptor(x, list(x.shape), list(x.stride()), [64, bd], shared_layout([64, bd])),
            TensorDescriptor(g, list(g.shape), list(g.stride()), [128, bd],
                             shared_layout([128, bd])),
            torch.empty(16), torch.empty(16), torch.empty(16, dtype=torch.int32),
            torch.empty(16, dtype=torch.int32), torch.empty(16), 4096, 64]
    signature, attrs = {}, {}
    for i, arg in enumerate(args):
        kind, key = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[names[i]] = kind
        if isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    for split_here in (False, True):
        consts = dict(NUM_HEADS=3, HEAD_DIM=256, NUM_EXPERTS=256, BLOCK_S=64, BLOCK_D=bd,
                      num_warps=4, SPLIT_HERE=split_here)
        for name in consts:
            signature[name] = "constexpr"
        source = GluonASTSource(fn=kernel, signature=signature, attrs=attrs,
                                constexprs={(names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4))
        usage = ptxas_usage(compiled, 90)
        ops = Counter(i.split()[0].split(".")[0] for _, i in sass_lines(compiled.asm["cubin"])[0])
        print(f"router_half_kernel split_here={split_here}: smem {compiled.metadata.shared} "
              f"{usage} instructions {sum(ops.values())} HGMMA {ops['HGMMA']} BAR {ops['BAR']} "
              f"SHFL {ops['SHFL']}")


def main():
    if "--screen" in sys.argv:
        return screen()
    from magi_moe.bench.cases import BenchCase, draw_problem
    if "--once" in sys.argv:  # the committed and the resident kernel, three calls each
        at = sys.argv.index("--once")
        H, S = int(sys.argv[at + 1]), int(sys.argv[at + 2])
        problem = draw_problem(BenchCase(H, S), torch.device("cuda"))
        committed = committed_form(problem, 32)[0]
        half = resident_form(problem, gate_tiles(problem.gate, H, 32),
                             torch.cuda.get_device_properties(0).multi_processor_count)[0]
        for _ in range(3):
            committed()
            half()
        torch.cuda.synchronize()
        return None
    from magi_moe.bench.timing import summarize, time_paths
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        committed, (ids0, probs0, counts0) = committed_form(problem, 32)
        committed()
        paths = {"committed": committed}
        tiles = gate_tiles(problem.gate, H, 32)
        for split_here in (False, True):
            name = "gate split in the kernel" if split_here else "gate tiles made before"
            half, merge, both, (ids, probs, counts) = resident_form(problem, tiles, sms,
                                                                   split_here=split_here)
            k = half()
            merge()
            torch.cuda.synchronize()
            same_p = torch.equal(probs.view(torch.int32), probs0.view(torch.int32))
            same = (f"ids {'same' if torch.equal(ids, ids0) else 'DIFFER'}, probs "
                    f"{'same' if same_p else 'DIFFER %d' % (probs != probs0).sum().item()}"
                    f", counts {'same' if torch.equal(counts, counts0) else 'DIFFER'}")
            print(f"H={H} S={S} {name}: regs {k.n_regs} spills {k.n_spills} smem "
                  f"{k.metadata.shared} grid {programs(H, triton.cdiv(S, 64), sms)}; {same}",
                  flush=True)
            paths.update({f"{name}: resident + merge": both, f"{name}: resident alone": half})
        paths["merge alone"] = merge
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            print(f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
