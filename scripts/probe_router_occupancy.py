"""Probe: router_topk_kernel's occupancy. Tiles x software-pipeline stages x register cap, the
kernel alone (L2 flushed), every form's ids, probabilities and block counts compared bit for
bit with the committed launch (block_s 32, 8 warps, default stages).

    python scripts/probe_router_occupancy.py                      # 54 forms at block_d 64
    python scripts/probe_router_occupancy.py --block-d 32 --quick  # the H200 table's block_d,
                                                                   # block_s 32, 4/8 warps, stages
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from magi_moe.bench.cases import BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.timing import time_paths, summarize  # noqa: E402
from magi_moe.kernels import fused_routing as FR  # noqa: E402
from magi_moe.kernels.schedule import cdiv  # noqa: E402


def launcher(problem, bs, warps, stages, maxnreg, block_d=64):
    cfg = problem.config
    H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
    x = problem.x
    S = x.shape[0]
    TB = cdiv(S, bs)
    ids = torch.full((S, H, K), -7, dtype=torch.int32, device=x.device)
    probs = torch.full((S, H, K), float("nan"), dtype=torch.float32, device=x.device)
    counts = torch.full((TB, H * E), -7, dtype=torch.int32, device=x.device)
    extra = {} if stages is None else {"num_stages": stages}
    if maxnreg:
        extra["maxnreg"] = maxnreg

    def go():
        return FR.router_topk_kernel[(TB, H)](
            x, problem.gate, problem.bias, ids, probs, counts, S, x.stride(0), 1.0,
            NUM_HEADS=H, HEAD_DIM=Dh, NUM_EXPERTS=E, E_PAD=max(16, triton.next_power_of_2(E)),
            TOP_K=K, K_PAD=max(2, triton.next_power_of_2(K)), BLOCK_S=bs,
            BLOCK_D=block_d, SOFTMAX=False, ROUTE_NORM=True, HAS_BIAS=True,
            DOT_PRECISION="ieee", SPLIT_GATE=True, UPCAST=False, TUPLE_PICKS=True,
            num_warps=warps, **extra)
    return go, (ids, probs, counts)


def main():
    device = torch.device("cuda")
    block_d = int(sys.argv[sys.argv.index("--block-d") + 1]) if "--block-d" in sys.argv else 64
    if "--quick" in sys.argv:
        forms = [(32, 8, None, None)] + list(itertools.product((32,), (4, 8), (1, 2, 3), (None,)))
    else:
        forms = [(32, 8, None, None)] + list(itertools.product(
            (16, 32), (4, 8, 16), (1, 2, 3), (None, 128, 96)))
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        base = None
        results = []
        for bs, w, st, mr in forms:
            name = f"bs{bs} w{w} stages{st} maxnreg{mr}"
            fn, outs = launcher(problem, bs, w, st, mr, block_d)
            try:
                kern = fn()
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"H={H} S={S} {name}: {type(exc).__name__}")
                continue
            ids, probs, counts = outs
            if base is None:
                base = (ids.clone(), probs.clone())
            same = torch.equal(ids, base[0]) and torch.equal(probs.view(torch.int32),
                                                             base[1].view(torch.int32))
            ms = summarize(time_paths({name: fn}, warmup=10, iters=60, flush_mib=512,
                                      device=device)[name])["median_ms"]
            results.append((ms, name, kern.n_regs, kern.n_spills, kern.metadata.shared, same))
        committed = [r for r in results if r[1] == "bs32 w8 stagesNone maxnregNone"]
        for ms, name, regs, spills, smem, same in sorted(results)[:12] + committed:
            print(f"H={H} S={S} block_d {block_d} {name}: {ms*1000:.1f} us regs {regs} "
                  f"spills {spills} "
                  f"smem {smem} bits {'same' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
