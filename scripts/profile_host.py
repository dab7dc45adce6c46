"""Host time per call of the fused expert path at small token counts (where the host, not the
GPU, bounds it): python scripts/profile_host.py [TOKENS] -- prints us/call and the top functions."""
import cProfile
import pstats
import sys
import time

import torch

from magi_moe.bench.cases import BenchCase, draw_problem
from magi_moe.impls import FUSED

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 512
p = draw_problem(BenchCase(3, tokens), torch.device("cuda"))
weights = FUSED.prepare_weights(p.weights)
out = torch.empty_like(p.x)
call = lambda: FUSED(p.x, p.table, weights, p.config, out=out)  # noqa: E731
for _ in range(20):
    call()
torch.cuda.synchronize()
print("table trusted:", p.table.trusted)
n = 300
t0 = time.perf_counter()
for _ in range(n):
    call()
host = (time.perf_counter() - t0) / n * 1e6
torch.cuda.synchronize()
wall = (time.perf_counter() - t0) / n * 1e6
print(f"S={tokens}: host {host:.1f} us/call (launch-side), wall {wall:.1f} us/call")
prof = cProfile.Profile()
prof.enable()
for _ in range(n):
    call()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
