"""``python -m magi_moe.bench`` (also ``python -m magi_moe.benchmark``): the expert paths timed
side by side, with their floors.

For every case (heads x tokens; the four cases of docs/ANCHORS.md with ``--anchors``) this draws a
problem as :func:`magi_moe.problems.random_problem` does (x N(0,1), router N(0, 0.25^2),
selection bias N(0, 0.05^2), weights N(0, 0.02^2); drawn on the device so that 12 x 256 experts
take milliseconds), checks every path against the float64 reference on the same routes, and
only then times them:

* CUDA events around each call; the L2 cache flushed before every call by zeroing a buffer of
  ``--flush-mib`` (>= 256 MiB; the H200's L2 is 60 MB); paths alternated inside every iteration
  (the order rotating), so clock drift and thermal state hit them alike; a path over ten times
  slower than the others (a host-bound PyTorch loop) is timed in a group of its own, with fewer
  calls where ``--iters`` would take over six seconds (its ``n`` says how many);
* median and p90 over ``--iters`` per round, the best round's median reported;
* bytes and FLOPs with docs/ANCHORS.md's floors: memory = weights of the experts that received a
  route + x + y over 4281 GB/s; compute = routes * (2*Dh*I*2 + 2*I*Dh) over 793 TFLOP/s.

Paths come from the implementations' declarations (:mod:`.paths`): ``NAME`` is an
implementation at kernel level (its ``forward`` on precomputed routes, after its
``prepare_weights``: ``fused`` packs its weights), ``NAME-layer`` its own layer, routing included.
Built in: ``native``, ``native-det`` (the native kernel, atomic / deterministic), ``fused``,
``torch-bf16`` (the plain per-expert loop; slow), each also as ``NAME-layer``; routers:
``routing`` (the contract's torch router + CSR sort) and ``NAME-routing`` for an implementation
that declares a ``router`` of its own (``fused-routing``, or yours with ``--impl``).

``--impl NAME|package.module:attr`` (repeatable) adds an implementation of your own at both levels,
timed beside ``fused`` and the plain PyTorch baseline (``torch-bf16``) on the same drawn problems. Every implementation path is judged first (:func:`magi_moe.judge.judge`
under its declared precision model, relative L2 against float64): a wrong one is reported WRONG
with its error and not timed (a ``forward`` that returns a new tensor instead of writing ``out``
too); a case outside its declared shapes is reported unsupported, one whose ``supports()``
raises as error.

``--breakdown`` times each launch of the fused path's plan alone (:mod:`.breakdown`). The tile
sweep that writes ``magi_moe/kernels/tiles/fused.json`` is the checkout's tuner, ``python -m
tuner``, outside the package.

Exit status, said on the last line when not 0: 0 when no path was wrong and at least one path
asked for (the ``--impl`` paths, else every path) was timed; 1 when a path was WRONG or raised
(the others are still timed); 5 when nothing asked for was timed (outside its declared shapes in
every case); 2 for a bad argument or no usable device, before any work.

``--json PATH`` writes everything measured. With ``--device cpu`` (and ``TRITON_INTERPRET=1``
for the Triton paths) it runs small cases with wall-clock timers, as the output says: a smoke
test of the harness, or a first timing of a plain PyTorch implementation.
"""
from __future__ import annotations
import argparse
import json
import sys

import torch

from ..registry import get_implementation
from ..text_tables import format_table as text_table
from .breakdown import breakdown_case
from .cases import ANCHOR_CASES, COPY_GBPS, DRAWS, MATMUL_TFLOPS, BenchCase, draw_problem
from .machine import machine_info
from .paths import ALL_PATHS, COMPARED_PATHS, DEFAULT_PATHS, BenchPath, paths_of, resolve
from .timing import run_case, timer_label


def environment(device: torch.device) -> dict:
    return machine_info(device)


def _row_names(r: dict) -> list[str]:
    """Every row of a case in path order: each path, then its graph and compiled rows."""
    names = list(r.get("levels") or r["timings"])
    extra = [n for n in list(r["timings"]) + list(r["parity"]) if n not in names
             and n != "reference_rms" and n.split(" ")[0] in names]
    return [row for n in names for row in [n] + [e for e in extra if e.split(" ")[0] == n]]


def _check_word(check: dict) -> str:
    if "bitwise_equal_eager" in check:
        return "bits = eager" if check["bitwise_equal_eager"] else "bits differ"
    return check.get("status", "")


def format_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        fl = r["floors"]
        for i, name in enumerate(_row_names(r)):
            st = r["timings"].get(name)
            check = r["parity"].get(name, {})
            err = check.get("rel_l2")
            if err is None:  # a graph or compiled row: the eager path's error if its bits agree
                base = r["parity"].get(name.rsplit(" ", 1)[0], {}).get("rel_l2")
                err = base if check.get("bitwise_equal_eager") else None
            rows.append([r["label"] if i == 0 else "",
                         (f"{fl['routed_banks']}/{fl['banks']}, {fl['busiest_over_mean']:.1f}x"
                          if i == 0 and "busiest_over_mean" in fl else ""),
                         f"{fl['memory_floor_ms']:.3f}/{fl['compute_floor_ms']:.3f}" if i == 0 else "",
                         name, r.get("levels", {}).get(name.split(" ")[0], ""),
                         f"{st['median_ms']:.3f}" if st else "-", f"{st['p90_ms']:.3f}" if st else "-",
                         f"{st['x_floor']:.2f}" if st and st.get("x_floor") else "-",
                         f"{err:.2e}" if err is not None else "-", _check_word(check)])
    return text_table(["case", "routed banks, busiest/mean", "floor ms (mem/comp)", "path", "level",
                       "median ms", "p90 ms", "x floor", "rel L2", "check"], rows,
                      numeric_columns=(5, 6, 7, 8))


def not_timed_notes(result: dict) -> list[str]:
    """One line per path of the case that was not timed, with why (WRONG: the judge's text)."""
    notes = [f"  {result['label']} {name}: not timed: {why}"
             for name, why in result["not_built"].items()]
    for name, check in result["parity"].items():
        if isinstance(check, dict) and check.get("status", "ok") != "ok":
            why = check["why"].replace("\n", "\n      ")  # the judge's text: one line per criterion
            notes.append(f"  {result['label']} {name}: {check['status']}, not timed: {why}")
    return notes


# The harness on the CPU: the Triton paths under the interpreter, at widths it finishes in seconds.
CPU_SMOKE = ("TRITON_INTERPRET=1 python -m magi_moe.bench --device cpu --heads 1 --tokens 64 "
             "--experts 8 --top-k 2 --head-dim 64 --inter 128 --warmup 0 --iters 2 --flush-mib 256")
TORCH_ONLY_PATHS = ("routing", "torch-bf16")


def cannot_run_here(device: str | None, paths) -> str | None:
    """Why the benchmark cannot run as asked on this machine, or None: said before any problem
    is drawn (without it a CPU machine drew production-size problems for most of a minute and
    then failed inside Triton's driver lookup)."""
    from ..backends import BACKENDS, interpreter_enabled

    try:
        kind = "cuda" if device is None else torch.device(device).type
    except RuntimeError:
        return f"--device must be cuda, cuda:N or cpu, got {device!r}"
    if kind not in ("cuda", "cpu"):
        return f"--device must be cuda, cuda:N or cpu, got {device!r}"
    if kind == "cuda":
        why = BACKENDS["cuda"].unavailable_reason()
        if why is None:
            return None
        asked = "" if device is None else f"--device {device}: "
        return (f"{asked}{why}. The benchmark times GPU kernels: run it on a CUDA machine, or "
                f"smoke-test the harness on the CPU under the Triton interpreter:\n  {CPU_SMOKE}")
    records = [p if isinstance(p, BenchPath) else resolve(p) for p in paths]
    triton_paths = [p.name for p in records if not p.plain_pytorch]
    if triton_paths and not interpreter_enabled():
        return (f"--device {device} runs the Triton paths ({','.join(triton_paths)}) only under the "
                f"interpreter: set TRITON_INTERPRET=1 before the command, e.g.\n  {CPU_SMOKE}\n"
                f"or time only --paths {','.join(TORCH_ONLY_PATHS)}")
    return None


class BenchParser(argparse.ArgumentParser):
    """A refused argument is its message alone (argparse's usage block is left to ``--help``):
    one line, or the line and the command to run instead where the machine cannot run it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    ap = BenchParser(prog="python -m magi_moe.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096],
                    help="tokens per case; several give several cases (default 4096)")
    ap.add_argument("--heads", type=int, nargs="+", default=[3],
                    help="MoE heads per case; crossed with --tokens (default 3, one EP4-local rank)")
    ap.add_argument("--anchors", action="store_true",
                    help="the four cases of docs/ANCHORS.md instead of --heads x --tokens")
    ap.add_argument("--experts", type=int, default=256, help="experts per head (default 256)")
    ap.add_argument("--top-k", type=int, default=6, help="experts chosen per token and head (default 6)")
    ap.add_argument("--head-dim", type=int, default=256, help="head width Dh (default 256)")
    ap.add_argument("--inter", type=int, default=1280, help="expert intermediate width I (default 1280)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls per path first (default 10)")
    ap.add_argument("--iters", type=int, default=100, help="timed calls per path and round (default 100)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds per case; the best round's median is reported (default 1)")
    ap.add_argument("--paths", default=None,
                    help=f"comma-separated, among {','.join(ALL_PATHS)}, or NAME / NAME-layer of an "
                         f"--impl (default {','.join(DEFAULT_PATHS)}; with --impl: "
                         f"{','.join(COMPARED_PATHS)}, those that can run here)")
    ap.add_argument("--impl", action="append", default=[], metavar="NAME|package.module:attr",
                    help="an implementation to time beside the built-in paths, at kernel level "
                         "(NAME) and layer level (NAME-layer); repeatable")
    ap.add_argument("--flush-mib", type=int, default=512,
                    help="MiB zeroed before every timed call to flush the L2 (>= 256; default 512)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the drawn problems (default 0)")
    ap.add_argument("--device", default=None,
                    help="cuda (the default; refused at once without a GPU) or cpu, a smoke test of "
                         "the harness with host timers that needs TRITON_INTERPRET=1 for the Triton paths")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="on a GPU also time every path replayed from a captured CUDA graph "
                         "('NAME graph') and every layer compiled with mode='reduce-overhead' "
                         "('NAME-layer compiled'); --no-graphs: eager only")
    ap.add_argument("--breakdown", action="store_true",
                    help="time each launch of the fused path alone, per case")
    ap.add_argument("--json", metavar="PATH", help="write everything measured here as JSON")
    ap.add_argument("--draw", default="anchors",
                    help=f"routing draws, comma-separated, among {','.join(DRAWS)} (default anchors, "
                         "docs/ANCHORS.md's; 'concentrated' routes to about a third of the experts)")
    args = ap.parse_args(argv)
    args.draws = tuple(d for d in args.draw.split(",") if d)
    if not args.draws or any(d not in DRAWS for d in args.draws):
        ap.error(f"--draw must be among {','.join(DRAWS)}, got {args.draw!r}")
    impl_paths = []
    for spec in args.impl:
        try:
            impl = get_implementation(spec)
        except (ValueError, TypeError) as exc:
            ap.error(f"--impl: {exc}".splitlines()[0])
        if impl.is_oracle:
            ap.error(f"--impl {spec}: the float64 oracle is what every path is checked against, "
                     f"not a path to time")
        impl_paths += [p for p in paths_of(impl) if p not in impl_paths]
    compared = args.paths is None and bool(impl_paths)  # the default comparators of an --impl
    names = COMPARED_PATHS if compared else DEFAULT_PATHS if args.paths is None else args.paths.split(",")
    try:
        records = [resolve(n) for n in names if n]
    except ValueError as exc:
        ap.error(f"--paths: {exc}")
    args.dropped = {}
    if compared and args.device is not None and cannot_run_here(args.device, ()) is None:
        device = torch.device(args.device)  # comparators that cannot run here are left out, said
        args.dropped = {p.name: p.cannot_run_on(device) for p in records if p.cannot_run_on(device)}
        records = [p for p in records if p.name not in args.dropped]
    args.paths = tuple(dict.fromkeys(records + impl_paths))
    # what the exit status is about: the --impl paths when given, else every path asked for
    args.asked = tuple(p.name for p in (impl_paths or args.paths))
    if args.flush_mib < 256:
        ap.error("--flush-mib must be at least 256 (the flush must exceed the L2 several times)")
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error("--iters and --rounds must be >= 1, --warmup >= 0")
    why = cannot_run_here(args.device, args.paths)
    if why and args.device is None and impl_paths and all(p.plain_pytorch for p in impl_paths):
        why += ("\nor time the plain PyTorch --impl on the CPU with wall-clock timers, e.g.\n  "
                + CPU_SMOKE.removeprefix("TRITON_INTERPRET=1 ")
                + "".join(f" --impl {spec}" for spec in args.impl))
    if why:
        ap.error(why)
    args.device = args.device or "cuda"
    for path in impl_paths:
        why = path.cannot_run_on(torch.device(args.device))
        if why:
            ap.error(f"--impl {path.impl.name} cannot run on {args.device}: {why}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    pairs = ANCHOR_CASES if args.anchors else [(h, s) for h in args.heads for s in args.tokens]
    cases = [BenchCase(h, s, args.experts, args.top_k, args.head_dim, args.inter, args.seed, draw)
             for draw in args.draws for h, s in pairs]
    print(f"timer: {timer_label(device, args.flush_mib)}; floors: docs/ANCHORS.md's, the H200's",
          flush=True)
    for name, why in args.dropped.items():
        print(f"  {name}: not run here: {why}", flush=True)
    report: dict = {"environment": environment(device),
                    "args": {k: [p.name for p in v] if k == "paths" else v
                             for k, v in vars(args).items()},
                    "ceilings": {"copy_gbps": COPY_GBPS, "matmul_tflops": MATMUL_TFLOPS}}
    if args.breakdown:
        report["breakdown"] = {}
        for case in cases:
            problem = draw_problem(case, device)
            bd = breakdown_case(problem, warmup=args.warmup, iters=args.iters,
                                flush_mib=args.flush_mib)
            report["breakdown"][case.label] = bd
            print(f"{case.label:<15} fused launches (ms): "
                  + "  ".join(f"{k} {v:.3f}" for k, v in bd["ms"].items()), flush=True)
            del problem
    results = []
    for case in cases:
        results.append(run_case(case, args.paths, device=device, warmup=args.warmup,
                                iters=args.iters, rounds=args.rounds, flush_mib=args.flush_mib,
                                graphs=args.graphs))
        print(format_table(results[-1:]), flush=True)
        for line in not_timed_notes(results[-1]):
            print(line, flush=True)
    report["results"] = results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if len(results) > 1:
        print(format_table(results))
    status, line = exit_status(results, args.asked)
    if line:
        print(line, flush=True)
    return status


def exit_status(results: list[dict], asked) -> tuple[int, str | None]:
    """(status, last line): 1 when a path was WRONG or raised, 5 when none of ``asked`` was timed
    in any case (a green run that timed nothing would read as a pass), else 0."""
    failed: dict[str, list[str]] = {}
    for r in results:
        for name, check in r["parity"].items():
            if isinstance(check, dict) and check.get("status") in ("WRONG", "error"):
                failed.setdefault(f"{name} {check['status']}", []).append(r["label"])
    if failed:
        return 1, "not timed: " + "; ".join(f"{what} at {', '.join(labels)}"
                                            for what, labels in failed.items())
    if not any(name in r["timings"] for r in results for name in asked):
        return 5, ("nothing asked for was timed: " + ", ".join(asked)
                   + " ran in no case (unsupported everywhere; the table says why)")
    return 0, None


if __name__ == "__main__":
    sys.exit(main())
