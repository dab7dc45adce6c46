"""Where a fused call's time goes at small token counts, where the host can bound it.

    python scripts/profile_host.py [TOKENS] [--layer]

Kernel level (routes precomputed, weights packed) by default; ``--layer``: the fused layer
(routing included). Prints the host time of one call issued onto an idle GPU (its own issue
time), of calls back to back (the GPU's time once it is the slower side: the launch queue
fills), each kernel's GPU time (torch.profiler), and the top functions by own time (cProfile).
Eager vs graph-replay vs compiled times are the benchmark's graph rows (python -m magi_moe.bench).
"""
import cProfile
import pstats
import sys
import time

import torch

from magi_moe.bench.cases import BenchCase, draw_problem
from magi_moe.bench.paths import _layer
from magi_moe.impls import FUSED

args = [a for a in sys.argv[1:] if not a.startswith("--")]
tokens = int(args[0]) if args else 512
p = draw_problem(BenchCase(3, tokens), torch.device("cuda"))
if "--layer" in sys.argv:
    layer = _layer(p, FUSED)
    call = lambda: layer(p.x)  # noqa: E731
else:
    weights = FUSED.prepare_weights(p.weights)
    out = torch.empty_like(p.x)
    call = lambda: FUSED(p.x, p.table, weights, p.config, out=out)  # noqa: E731
    print("table trusted:", p.table.trusted)
for _ in range(20):
    call()
torch.cuda.synchronize()

issue = []
for _ in range(100):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    issue.append((time.perf_counter() - t0) * 1e6)
torch.cuda.synchronize()
issue.sort()
n = 300
t0 = time.perf_counter()
for _ in range(n):
    call()
back_to_back = (time.perf_counter() - t0) / n * 1e6
torch.cuda.synchronize()
print(f"S={tokens}: one call onto an idle GPU: host {issue[len(issue) // 2]:.1f} us (median, "
      f"min {issue[0]:.1f}); back to back {back_to_back:.1f} us/call")

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kernels:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
for event in kernels.key_averages():
    if event.device_time > 0:
        print(f"  {event.key:<40} {event.device_time / 1e3:.4f} ms per call")

prof = cProfile.Profile()
prof.enable()
for _ in range(n):
    call()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
