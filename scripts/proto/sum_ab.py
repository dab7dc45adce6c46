"""A/B on the H200 for the top-k sum inside the one-kernel step (``sum_variant="last_arriver"``,
NOTES-perf.md version 12) against its own launch (``"kernel"``), at kernel level on the
docs/ANCHORS.md cases with the tabled tiles otherwise.

1. Bits: the last-arriver output must equal the sum kernel's bit for bit; then ``--repeats``
   further calls, the output poisoned (NaN) before each, must all give those bits again (a
   missing acquire/release shows up as a stale row in some call), and the arrival counters
   must be back at zero.
2. Time: the whole fused run of each form (schedule, expert kernel and, for "kernel", the sum
   launch), CUDA events, 512 MiB zeroed before every call, median of 30 after 5 warm-up;
   the two forms alternate over ``--rounds`` rounds, best median kept.

    PYTHONPATH=. python scripts/proto/sum_ab.py [--case 3,4096] [--repeats 200]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from magi_moe.bench.cases import ANCHOR_CASES, BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.kernel_level import KernelLevel  # noqa: E402
from magi_moe.bench.timing import time_one  # noqa: E402
from magi_moe.kernels.fused import run_plan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default=None, help="H,S (default: every ANCHORS case)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cases = [tuple(map(int, args.case.split(",")))] if args.case else ANCHOR_CASES
    device = torch.device("cuda")
    timing = dict(warmup=5, iters=30, flush_mib=512, device=device)
    for heads, tokens in cases:
        kl = KernelLevel.of(draw_problem(BenchCase(heads, tokens), device))
        runs = {}
        for variant in ("kernel", "last_arriver"):
            plan, call = kl.call(kl.tiles(sum_variant=variant))
            call.out.fill_(float("nan"))
            run_plan(plan, call)
            runs[variant] = (plan, call)
        torch.cuda.synchronize()
        want = runs["kernel"][1].out.clone()
        plan, call = runs["last_arriver"]
        assert plan.sums_in_expert, plan
        differ = int((call.out.view(torch.int16) != want.view(torch.int16)).sum())
        bad_calls = 0
        for _ in range(args.repeats):
            call.out.fill_(float("nan"))
            run_plan(plan, call)
            bad_calls += int(not torch.equal(call.out.view(torch.int16), want.view(torch.int16)))
        arrivals_zero = bool((call.arrivals == 0).all())
        best = {}
        for _ in range(args.rounds):
            for variant, (p, c) in runs.items():
                ms = time_one(lambda p=p, c=c: run_plan(p, c), **timing)
                best[variant] = min(ms, best.get(variant, float("inf")))
        print(f"H={heads} S={tokens}: first call differs in {differ} elements; "
              f"{bad_calls} of {args.repeats} repeats differ; counters zero after: {arrivals_zero}; "
              f"sum kernel {best['kernel']:.4f} ms, last arriver {best['last_arriver']:.4f} ms "
              f"({100 * (best['last_arriver'] / best['kernel'] - 1):+.1f}%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
