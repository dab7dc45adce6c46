"""How the benchmark times: CUDA events around each call with the L2 flushed first, paths
alternated inside every iteration; host timers on the CPU (a smoke test of the harness).

Why not ``triton.testing.do_bench``: it times one function at a time, so two variants compared
across its calls see different clocks and thermal states, where this harness alternates every
path inside each iteration (the order rotating); and its per-call L2 clearing is a fixed 256 MB
buffer, where the flush here is sized by ``--flush-mib`` (the H200's L2 is 60 MB). Nor
``do_bench_cudagraph``: it replays many calls inside one graph with no flush between them, so
the weights of one call sit in L2 for the next and a memory-bound path looks faster than it
can be. The graph rows here (:func:`graph_paths`) replay one captured call per timed sample,
flushed like the eager ones, so eager and graph times differ only by the host's launch work.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from typing import Callable

import torch

from ..cuda_graphs import capture
from ..problems import same_bits
from .cases import BenchCase, draw_problem, floors
from .paths import BenchPath, check_paths, resolve

# Paths slower than this many times the fastest of their group are timed in a group of their own
PACE_RATIO = 10.0
# Seconds of timed calls one slow group may take; its call count shrinks to fit (at least MIN_ITERS)
SLOW_GROUP_SECONDS = 6.0
MIN_ITERS = 5


def time_paths(fns: dict[str, Callable[[], object]], *, warmup: int, iters: int,
               flush_mib: int, device: torch.device) -> dict[str, list[float]]:
    """Per-call milliseconds of every path, alternated, with the L2 flushed before each call.

    Paths alternate only with paths of their own pace (:func:`pace_groups`): between the calls
    of a host-bound path taking hundreds of milliseconds the GPU idles and drops its clocks, and
    a sub-millisecond kernel timed right after read 1.5-2x its true time on the H200. A group far
    slower than ``iters`` calls allow gets fewer (``n`` in the summary), at least ``MIN_ITERS``."""
    times: dict[str, list[float]] = {}
    for group, group_iters in pace_groups(fns, iters=iters, device=device):
        times.update(_time_group({n: fns[n] for n in group}, warmup=warmup, iters=group_iters,
                                 flush_mib=flush_mib, device=device))
    return {n: times[n] for n in fns}


def _host_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call's wall time, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def pace_groups(fns: dict[str, Callable[[], object]], *, iters: int,
                device: torch.device) -> list[tuple[list[str], int]]:
    """The paths in groups of like pace, fastest first, each with its timed call count: one call
    each to compile and warm, one timed by the host; a path more than ``PACE_RATIO`` times
    slower than its group's fastest starts a new group. A single path is one group."""
    if len(fns) <= 1:
        return [(list(fns), iters)]
    pace = {}
    for name, fn in fns.items():
        fn()
        pace[name] = _host_ms(fn, device)
    return group_by_pace(pace, iters=iters)


def group_by_pace(pace: dict[str, float], *, iters: int) -> list[tuple[list[str], int]]:
    """:func:`pace_groups` on measured milliseconds per call (``pace``)."""
    pace = {name: max(ms, 1e-3) for name, ms in pace.items()}
    groups: list[list[str]] = []
    for name in sorted(pace, key=pace.__getitem__):
        if groups and pace[name] <= PACE_RATIO * pace[groups[-1][0]]:
            groups[-1].append(name)
        else:
            groups.append([name])
    sized = []
    for group in groups:
        per_iter_s = sum(pace[n] for n in group) / 1e3
        fits = int(SLOW_GROUP_SECONDS / per_iter_s) if per_iter_s else iters
        sized.append((group, min(iters, max(MIN_ITERS, fits))))
    return sized


def _time_group(fns: dict[str, Callable[[], object]], *, warmup: int, iters: int,
                flush_mib: int, device: torch.device) -> dict[str, list[float]]:
    names = list(fns)
    cuda = device.type == "cuda"
    flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device=device) if cuda else None
    for _ in range(warmup):  # right before the timed calls: the clocks are up when they start
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    if cuda:
        torch.cuda.synchronize(device)
        events = {n: [] for n in names}
        for i in range(iters):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize(device)
        for name in names:
            times[name] = [s.elapsed_time(e) for s, e in events[name]]
    else:
        for i in range(iters):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                t0 = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def graph_paths(fns: dict[str, Callable[[], object]], layers: dict[str, torch.nn.Module],
                x: torch.Tensor) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """For each path, ``NAME graph``: one call captured in a ``torch.cuda.CUDAGraph`` and
    replayed; for each layer, ``NAME compiled``: ``torch.compile(layer, mode="reduce-overhead",
    fullgraph=True)``, which replays inductor's CUDA graph. Returns the new callables and, for
    those that could not be built, why (a capture that synchronises, a graph break): reported,
    never timed."""
    made: dict[str, Callable[[], object]] = {}
    failed: dict[str, str] = {}
    for name, fn in fns.items():
        try:
            graph, captured = capture(fn, warmup=3)
            made[f"{name} graph"] = _Replay(graph, captured)
        except Exception as exc:  # noqa: BLE001 -- reported in the JSON and the table's notes
            failed[f"{name} graph"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for name, layer in layers.items():
        try:
            compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):  # warm-up, recording, first replay
                compiled(x)
            made[f"{name} compiled"] = lambda compiled=compiled: compiled(x)
        except Exception as exc:  # noqa: BLE001
            failed[f"{name} compiled"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return made, failed


class _Replay:
    """``graph.replay()`` as a path that returns what the captured call returned (its tensors,
    rewritten by the replay), so the replay's output can be compared with the eager path's."""

    def __init__(self, graph: torch.cuda.CUDAGraph, captured: object):
        self.graph, self.captured = graph, captured

    def __call__(self) -> object:
        self.graph.replay()
        return self.captured


def matches_eager(eager: Callable[[], object], other: Callable[[], object]) -> bool | None:
    """Whether ``other()`` gives bit for bit what ``eager()`` gives; None where the eager path
    returns no tensor (nothing to compare). An ``other`` that returns no tensor does not match."""
    want = eager()
    if not isinstance(want, torch.Tensor):
        return None
    want = want.clone()  # the other path may write the same buffer
    got = other()
    return isinstance(got, torch.Tensor) and same_bits(got, want)


def summarize(samples: list[float]) -> dict:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"median_ms": statistics.median(ordered), "p90_ms": p90, "min_ms": ordered[0],
            "mean_ms": statistics.fmean(ordered), "n": len(ordered)}


def timer_label(device: torch.device, flush_mib: int) -> str:
    """How :func:`time_paths` times on ``device``, as the output says it."""
    if device.type == "cuda":
        return f"CUDA events, L2 flushed ({flush_mib} MiB zeroed) before every call"
    return ("wall clock (time.perf_counter) on the CPU, no L2 flush: for trying the loop, "
            "not comparable with GPU figures")


def run_case(case: BenchCase, paths, *, device: torch.device, warmup: int, iters: int,
             rounds: int, flush_mib: int, graphs: bool = False) -> dict:
    """Draw ``case``, check every path (names or :class:`BenchPath` records) against float64,
    then time those that are right. A path outside its implementation's declared shapes is
    ``unsupported``, a wrong one ``WRONG``, one whose check raised ``error``: reported in
    ``checks``, never timed."""
    records = [p if isinstance(p, BenchPath) else resolve(p) for p in paths]
    problem = draw_problem(case, device)
    fl = floors(problem)
    checks: dict[str, dict] = {}
    fns = {}
    for path in records:
        try:
            why = path.unsupported(problem)
        except Exception as exc:  # noqa: BLE001 -- its own supports() raised: a failure, reported
            checks[path.name] = {"level": path.level, "status": "error",
                                 "why": f"supports() raised {type(exc).__name__}: {str(exc)[:300]}"}
            continue
        if why:
            checks[path.name] = {"level": path.level, "status": "unsupported", "why": why}
            continue
        try:
            fns[path.name] = path.build(problem)
        except Exception as exc:  # noqa: BLE001 -- a path that cannot be built is reported
            checks[path.name] = {"level": path.level, "status": "error",
                                 "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
    checks.update(check_paths(problem, [r for r in records if r.name in fns], fns))
    fns = {n: f for n, f in fns.items() if checks.get(n, {}).get("status", "ok") == "ok"}
    not_built: dict[str, str] = {}
    if graphs and device.type == "cuda":
        layers = {n: getattr(f, "layer") for n, f in fns.items() if hasattr(f, "layer")}
        made, not_built = graph_paths(fns, layers, problem.x)
        for name, fn in made.items():  # each replay gives the eager path's bits (deterministic)
            same = matches_eager(fns[name.rsplit(" ", 1)[0]], fn)
            if same is not None:
                checks[name] = {"bitwise_equal_eager": same}
        fns = {**fns, **made}
    best: dict[str, dict] = {}
    for _ in range(rounds if fns else 0):
        times = time_paths(fns, warmup=warmup, iters=iters, flush_mib=flush_mib, device=device)
        for name, samples in times.items():
            stats = summarize(samples)
            if name not in best or stats["median_ms"] < best[name]["median_ms"]:
                best[name] = stats
    levels = {r.name: r.level for r in records}
    on_gpu = device.type == "cuda"  # the floors are the H200's: no ratio to a CPU time
    for name, stats in best.items():
        stats["x_floor"] = stats["median_ms"] / fl["floor_ms"] if fl["floor_ms"] and on_gpu else None
        if levels.get(name.split(" ")[0]) != "routing":
            stats["tflops"] = fl["flops"] / (stats["median_ms"] * 1e-3) / 1e12
    return {"case": asdict(case), "label": case.label, "floors": fl, "parity": checks,
            "timings": best, "not_built": not_built, "levels": levels,
            "timer": timer_label(device, flush_mib)}


def time_one(fn: Callable[[], object], *, warmup: int, iters: int, flush_mib: int,
             device: torch.device) -> float:
    """Median ms of ``fn`` alone, timed as :func:`time_paths` times a path."""
    return summarize(time_paths({"k": fn}, warmup=warmup, iters=iters, flush_mib=flush_mib,
                                device=device)["k"])["median_ms"]
