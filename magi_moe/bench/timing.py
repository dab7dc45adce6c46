"""How the benchmark times: CUDA events around each call with the L2 flushed first, paths
alternated inside every iteration; host timers on the CPU (a smoke test of the harness)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from typing import Callable

import torch

from .cases import BenchCase, draw_problem, floors
from .paths import ROUTING_PATHS, make_paths, parity

def time_paths(fns: dict[str, Callable[[], object]], *, warmup: int, iters: int,
               flush_mib: int, device: torch.device) -> dict[str, list[float]]:
    """Per-call milliseconds of every path, alternated, with the L2 flushed before each call."""
    names = list(fns)
    cuda = device.type == "cuda"
    flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device=device) if cuda else None
    for _ in range(warmup):
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


def summarize(samples: list[float]) -> dict:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"median_ms": statistics.median(ordered), "p90_ms": p90, "min_ms": ordered[0],
            "mean_ms": statistics.fmean(ordered), "n": len(ordered)}


def run_case(case: BenchCase, paths: tuple[str, ...], *, device: torch.device, warmup: int,
             iters: int, rounds: int, flush_mib: int) -> dict:
    problem = draw_problem(case, device)
    fl = floors(problem)
    fns = make_paths(problem, paths)
    checks = parity(problem, fns)
    best: dict[str, dict] = {}
    for _ in range(rounds):
        times = time_paths(fns, warmup=warmup, iters=iters, flush_mib=flush_mib, device=device)
        for name, samples in times.items():
            stats = summarize(samples)
            if name not in best or stats["median_ms"] < best[name]["median_ms"]:
                best[name] = stats
    for name, stats in best.items():
        stats["x_floor"] = stats["median_ms"] / fl["floor_ms"] if fl["floor_ms"] else None
        if name not in ROUTING_PATHS:
            stats["tflops"] = fl["flops"] / (stats["median_ms"] * 1e-3) / 1e12
    return {"case": asdict(case), "label": case.label, "floors": fl, "parity": checks,
            "timings": best}


def time_one(fn: Callable[[], object], *, warmup: int, iters: int, flush_mib: int,
             device: torch.device) -> float:
    """Median ms of ``fn`` alone, timed as :func:`time_paths` times a path."""
    return summarize(time_paths({"k": fn}, warmup=warmup, iters=iters, flush_mib=flush_mib,
                                device=device)["k"])["median_ms"]
