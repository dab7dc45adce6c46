"""Run the fused expert kernels on one docs/ANCHORS.md case a few times, for a profiler to watch
(Nsight Compute: where the one-kernel path's cycles go, which no timing can say).

    ncu --kernel-name regex:expert_mlp --launch-skip 3 --launch-count 1 --set full \\
        python scripts/profile_kernel.py --heads 3 --tokens 4096 [--tiles '{"block_m": 128}']

Weights are packed as the benchmark packs them, the routes precomputed (kernel level), the
tiles the table's for this problem unless ``--tiles`` overrides fields. Prints the tiles and
the launch plan, so the profile can be matched to what ran.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from magi_moe.bench.cases import BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.kernel_level import KernelLevel  # noqa: E402
from magi_moe.kernels import fused as F  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--draw", default="anchors")
    ap.add_argument("--tiles", default="{}", help="JSON FusedTiles fields over the table's")
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernel.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    level = KernelLevel.of(draw_problem(BenchCase(args.heads, args.tokens, draw=args.draw),
                                        device))
    tiles = level.tiles(**json.loads(args.tiles))
    plan, call = level.call(tiles)
    print("tiles", tiles)
    print("plan", plan.kernels, plan.reasons)
    for _ in range(args.runs):
        F.run_plan(plan, call)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
