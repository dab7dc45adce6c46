"""A/B on the H200 for the fused router (NOTES-perf.md, version 11): the router kernel as it was
(the gate split by every token block: ``router_variants.py`` with PRESPLIT off) against the
production ``split_gate_kernel`` + ``router_topk_kernel`` and variants, on the docs/ANCHORS.md
cases. Every variant's ids, probs and per-block route counts are compared bit for bit with the
old kernel's at the same block_d (block_d orders the logits' sums); then each is timed alone
(CUDA events, 512 MiB zeroed before every call, median of 30 after 5 warm-up), and the whole
``fused_route`` (five launches) with the tabled tiles.

    PYTHONPATH=. python scripts/proto/router_ab.py [--case 3,4096]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

from magi_moe.bench.cases import ANCHOR_CASES, BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.timing import time_one  # noqa: E402
from magi_moe.kernels import fused_routing as FR  # noqa: E402
from magi_moe.kernels.tiles import choose_routing_tiles  # noqa: E402
from magi_moe.kernels.workspace import FusedWorkspace  # noqa: E402
import router_variants as RV  # noqa: E402

# (block_s, block_d, warps, stages, presplit, relayout, key32, tuple); the first row is the
# int64-key kernel
VARIANTS = (
    (32, 32, 8, 3, False, False, False, False),
    (32, 32, 8, 3, False, False, True, False),
    (32, 32, 8, 3, False, False, False, True),
    (32, 32, 8, 4, False, False, False, True),
    (16, 32, 4, 3, False, False, False, True),
    (32, 64, 8, 2, False, False, False, True),
)


def run_variant(problem, variant, parts, scratch):
    bs, bd, warps, stages, presplit, relayout, key32, tup = variant
    cfg, x = problem.config, problem.x
    S, H, E, K = x.shape[0], cfg.num_heads, cfg.num_experts, cfg.top_k
    TB = triton.cdiv(S, bs)
    ids = torch.full((S, H, K), -1, dtype=torch.int32, device=x.device)
    probs = torch.full((S, H, K), float("nan"), device=x.device)
    counts = torch.full((TB, H * E), -1, dtype=torch.int32, device=x.device)

    def launch():
        if presplit:
            RV.split_gate_kernel[(triton.cdiv(problem.gate.numel(), 1024),)](
                problem.gate, parts[0], parts[1], parts[2], problem.gate.numel(), BLOCK=1024)
        RV.router_topk_variant_kernel[(TB, H)](
            x, problem.gate, parts[0], parts[1], parts[2], problem.bias, ids, probs, counts,
            scratch, S, x.stride(0), float(cfg.route_scale),
            NUM_HEADS=H, HEAD_DIM=cfg.head_dim, NUM_EXPERTS=E, E_PAD=max(16, triton.next_power_of_2(E)),
            TOP_K=K, K_PAD=max(2, triton.next_power_of_2(K)), BLOCK_S=bs, BLOCK_D=bd,
            ROUTE_NORM=cfg.route_norm, HAS_BIAS=problem.bias is not None, PRESPLIT=presplit,
            RELAYOUT=relayout, KEY32=key32, TUPLE=tup, num_warps=warps, num_stages=stages)
    launch()
    return launch, ids, probs, counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default=None, help="H,S (default: every ANCHORS case)")
    args = ap.parse_args()
    cases = [tuple(map(int, args.case.split(",")))] if args.case else ANCHOR_CASES
    device = torch.device("cuda")
    timing = dict(warmup=5, iters=30, flush_mib=512, device=device)
    for heads, tokens in cases:
        problem = draw_problem(BenchCase(heads, tokens), device)
        cfg = problem.config
        assert problem.x.dtype == torch.bfloat16 and cfg.score_func == "sigmoid"
        parts = torch.empty(3, cfg.num_banks, cfg.head_dim, dtype=torch.bfloat16, device=device)
        scratch = torch.empty(heads * (tokens + 64) * 256, device=device)
        print(f"H={heads} S={tokens}", flush=True)
        base = {}
        for variant in VARIANTS:
            launch, ids, probs, counts = run_variant(problem, variant, parts, scratch)
            torch.cuda.synchronize()
            key = variant[1]  # block_d
            if key not in base:  # the old kernel's rows at this block_d
                old = (variant[0], variant[1], variant[2], 3, False, False, False, False)
                _, o_ids, o_probs, o_counts = run_variant(problem, old, parts, scratch)
                base[key] = (o_ids, o_probs, o_counts, variant[0])
            o_ids, o_probs, o_counts, o_bs = base[key]
            differ = int((ids != o_ids).sum()) + int(
                (probs.view(torch.int32) != o_probs.view(torch.int32)).sum())
            same_counts = (counts == o_counts).all().item() if variant[0] == o_bs else "n/a"
            ms = time_one(launch, **timing)
            print(f"  {variant}: {ms:.4f} ms, ids/probs differ {differ}, counts equal {same_counts}",
                  flush=True)
        ws = FusedWorkspace(device)
        tiles = choose_routing_tiles(cfg, device)
        routes = FR.fused_route(problem.x, problem.gate, problem.bias, cfg, block_m=64,
                                workspace=ws, tiles=tiles)
        _, o_ids, o_probs, _ = run_variant(problem, (32, tiles.fitted(cfg).block_d, 8, 3, False, False, False, False),
                                           parts, scratch)
        differ = int((routes.expert_ids != o_ids).sum()) + int(
            (routes.probs.view(torch.int32) != o_probs.view(torch.int32)).sum())
        ms = time_one(lambda: FR.fused_route(problem.x, problem.gate, problem.bias, cfg, block_m=64,
                                             workspace=ws, tiles=tiles), **timing)
        print(f"  fused_route (production, tiles {tiles}): {ms:.4f} ms, differ from old {differ}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
