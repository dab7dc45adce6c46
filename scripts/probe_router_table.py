"""Probe: the route table's two launches after the top-K (``bank_prefix_kernel`` and
``place_routes_kernel``) in other launch shapes, each alone (L2 flushed, median of 60), every
form's outputs compared bit for bit with the committed launch's (the H200 table's tiles).

The inputs (ids, probabilities, per-block counts, prefix, offsets) come from one committed
``fused_route`` call on the docs/ANCHORS.md draw; each form writes its own poisoned outputs.

    python scripts/probe_router_table.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from magi_moe.bench.cases import BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.timing import summarize, time_paths  # noqa: E402
from magi_moe.kernels import fused_routing as FR  # noqa: E402
from magi_moe.kernels.schedule import cdiv  # noqa: E402
from magi_moe.kernels.tiles import choose_routing_tiles  # noqa: E402
from magi_moe.kernels.workspace import FusedWorkspace  # noqa: E402
from magi_moe.problems import same_bits  # noqa: E402

PLACE_WARPS = (1, 2, 4, 8)
PREFIX_FORMS = [  # block_tb, block_b, warps
    (64, 32, 4), (32, 32, 4), (128, 32, 4), (64, 64, 4), (64, 16, 4), (32, 16, 2), (16, 64, 4),
    (64, 32, 8), (128, 16, 4), (256, 8, 4),
]


def main():
    device = torch.device("cuda")
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        cfg = problem.config
        E, K = cfg.num_experts, cfg.top_k
        HE, R = cfg.num_banks, S * H * K
        tiles = choose_routing_tiles(cfg, device).fitted(cfg)
        ws = FusedWorkspace(device)
        FR.fused_route(problem.x, problem.gate, problem.bias, cfg, block_m=64, workspace=ws,
                       tiles=tiles)
        torch.cuda.synchronize()
        TB = cdiv(S, tiles.block_s)
        ids = ws.get("route_ids", (S, H, K), torch.int32)
        probs = ws.get("route_probs", (S, H, K), torch.float32)
        counts = ws.get("route_block_counts", (TB, HE), torch.int32)
        prefix0 = ws.get("route_prefix", (TB, HE), torch.int32).clone()
        totals0 = ws.get("route_totals", (HE,), torch.int32).clone()
        offsets = ws.get("route_offsets", (HE + 1,), torch.int64)
        table0 = (ws.get("route_gather_ids", (R,), torch.int32).clone(),
                  ws.get("route_sorted_probs", (R,), torch.float32).clone(),
                  ws.get("route_slots", (R,), torch.int64).clone())
        paths, checks = {}, {}
        for tb_blk, b_blk, warps in PREFIX_FORMS:
            prefix = torch.full_like(prefix0, -7)
            totals = torch.full_like(totals0, -7)

            def prefix_call(prefix=prefix, totals=totals, tb_blk=tb_blk, b_blk=b_blk, warps=warps):
                FR.bank_prefix_kernel[(cdiv(HE, b_blk),)](
                    counts, prefix, totals, TB, HE, BLOCK_TB=tb_blk, BLOCK_B=b_blk,
                    num_warps=warps)
            name = f"prefix tb{tb_blk} b{b_blk} w{warps}"
            paths[name] = prefix_call
            checks[name] = lambda prefix=prefix, totals=totals: (
                same_bits(prefix, prefix0) and same_bits(totals, totals0))
        for warps in PLACE_WARPS:
            outs = (torch.full_like(table0[0], -7), torch.full_like(table0[1], float("nan")),
                    torch.full_like(table0[2], -7))

            def place_call(outs=outs, warps=warps):
                FR.place_routes_kernel[(TB, H)](
                    ids, probs, prefix0, offsets, *outs, S, NUM_HEADS=H, NUM_EXPERTS=E,
                    E_PAD=max(16, 1 << (E - 1).bit_length()), TOP_K=K, BLOCK_S=tiles.block_s,
                    num_warps=warps)
            name = f"place w{warps}" + (" (committed)" if warps == tiles.place_warps else "")
            paths[name] = place_call
            checks[name] = lambda outs=outs: all(map(same_bits, outs, table0))
        for fn in paths.values():
            fn()
        torch.cuda.synchronize()
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        for name in paths:
            ok = checks[name]()
            print(f"H={H} S={S} {name}: {summarize(times[name])['median_ms'] * 1000:.1f} us "
                  f"bits {'same' if ok else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
