"""``python -m tuner``: the fused kernels' tile sweep on a CUDA GPU, from a checkout.

For each case (heads x tokens; the four cases of docs/ANCHORS.md with ``--anchors``) a problem
is drawn as the benchmark draws it, every candidate of the kernels asked for is checked and
timed (:mod:`tuner.sweep`), and the winners per class of routes per bank are printed and, with
``--write``, written into ``magi_moe/kernels/tiles/fused.json`` (``--merge``: only into the
tabled classes the swept cases fall in, the rest of the GPU's entry kept).

    python -m tuner --anchors --write               # the H200 table, as scripts/gpu_fused.sh runs it
    python -m tuner --anchors --kernels mlp,sum     # only the one-kernel candidates
    python -m tuner --tokens 16384 --merge --write  # one class re-swept

Exit status: 0 when the sweep ran, 2 for a bad argument or no CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict

import torch

from magi_moe.bench.cases import ANCHOR_CASES, DRAWS, BenchCase, draw_problem
from magi_moe.kernels.tiles import load_device_entry, load_tile_table, write_tile_table

from .candidates import SWEPT_KERNELS
from .choose import best_routing, classes_of, merged_classes
from .sweep import sweep_case

EXPERT_KERNELS = {"gate_up", "down", "mlp"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tuner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per case (default 4096)")
    ap.add_argument("--heads", type=int, nargs="+", default=[3], help="heads per case (default 3)")
    ap.add_argument("--anchors", action="store_true",
                    help="the four cases of docs/ANCHORS.md instead of --heads x --tokens")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--inter", type=int, default=1280)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draw", default="anchors", help=f"routing draw, among {','.join(DRAWS)}")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per candidate (default 3)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per candidate (default 20)")
    ap.add_argument("--flush-mib", type=int, default=512, help="MiB zeroed before every timed call")
    ap.add_argument("--kernels", default=",".join(SWEPT_KERNELS),
                    help=f"the kernels whose candidates are timed, among {','.join(SWEPT_KERNELS)} "
                         f"(default all; down needs gate_up, and the top-k sum is always swept: "
                         f"a table entry needs its tiles)")
    ap.add_argument("--write", action="store_true", help="write the winners into tiles/fused.json")
    ap.add_argument("--merge", action="store_true",
                    help="with --write: replace only the tabled classes the swept cases fall in")
    ap.add_argument("--json", metavar="PATH", help="write every candidate's time as JSON")
    ap.add_argument("--device", default="cuda", help="a CUDA device (default cuda)")
    args = ap.parse_args(argv)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if not kernels or any(k not in SWEPT_KERNELS for k in kernels):
        ap.error(f"--kernels must be among {','.join(SWEPT_KERNELS)}, got {args.kernels}")
    if "down" in kernels and "gate_up" not in kernels:
        ap.error("--kernels: down reads the activations gate_up writes; add gate_up")
    args.kernels = tuple(dict.fromkeys(kernels + ("sum",)))
    if args.draw not in DRAWS:
        ap.error(f"--draw must be among {','.join(DRAWS)}, got {args.draw!r}")
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        ap.error(f"--device {args.device}: the tuner times GPU kernels and needs a CUDA GPU")
    return args


def _tabled(name: str) -> list[tuple[float | None, object]]:
    return [(None if math.isinf(edge) else edge, tiles)
            for edge, tiles in load_tile_table(name) or []]


def run_sweep(cases: list[BenchCase], *, device: torch.device, warmup: int, iters: int,
              flush_mib: int, write: bool, merge: bool = False,
              kernels: tuple[str, ...] = SWEPT_KERNELS) -> dict:
    """Sweep every case, group the cases by routes per bank, write the winners per group
    (``merge``: into the tabled classes they fall in, keeping the rest of the table)."""
    name = torch.cuda.get_device_name(device)
    per_case = {}
    for case in cases:
        problem = draw_problem(case, device)
        t0 = time.time()
        per_case[case.label] = {"routes_per_bank": problem.table.num_routes / problem.config.num_banks,
                                "sweep": sweep_case(problem, warmup=warmup, iters=iters,
                                                    flush_mib=flush_mib, routing=not merge,
                                                    kernels=kernels)}
        print(f"swept {case.label} in {time.time() - t0:.1f} s", flush=True)
        del problem
    experts_swept = bool(EXPERT_KERNELS & set(kernels))
    swept = [(e["routes_per_bank"], e["sweep"]) for e in per_case.values()]
    # routing only: the tabled classes stay
    classes = classes_of(swept) if experts_swept else _tabled(name)
    tabled_routing = (load_device_entry(name) or {}).get("routing")
    routing = (best_routing([s for _, s in swept]) if "routing" in kernels and not merge
               else tabled_routing)
    if merge and experts_swept:
        centres = [(c, tiles) for c, (_, tiles) in zip(sorted({round(r, 3) for r, _ in swept}),
                                                        classes)]
        merged = merged_classes(centres, name)
        if merged is not None:
            classes = [(None if math.isinf(edge) else edge, tiles) for edge, tiles in merged]
    summary = {"per_case": per_case, "routing": routing,
               "classes": [{"max_routes_per_bank": e, "tiles": asdict(t)} for e, t in classes]}
    if write and classes:
        match = "H200" if "H200" in name else name
        path = write_tile_table(match, classes, routing=routing,
                                note=f"swept on {name} by python -m tuner "
                                     f"(kernels {','.join(k for k in kernels if experts_swept or k != 'sum')}), "
                                     f"{time.strftime('%Y-%m-%d')}"
                                     + ("" if "routing" in kernels and not merge
                                        else "; routing tiles kept from the previous entry")
                                     + ("" if experts_swept
                                        else "; expert tiles kept from the previous entry"))
        summary["written"] = str(path)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    pairs = ANCHOR_CASES if args.anchors else [(h, s) for h in args.heads for s in args.tokens]
    cases = [BenchCase(h, s, args.experts, args.top_k, args.head_dim, args.inter, args.seed,
                       args.draw) for h, s in pairs]
    summary = run_sweep(cases, device=torch.device(args.device), warmup=args.warmup,
                        iters=args.iters, flush_mib=args.flush_mib, write=args.write,
                        merge=args.merge, kernels=args.kernels)
    print(json.dumps({k: summary[k] for k in ("classes", "routing")}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
