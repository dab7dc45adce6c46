"""The GPU benchmark tests' one timing loop: pytest-benchmark's rounds with the L2 flushed in each
round's setup and CUDA events around the call."""
from __future__ import annotations

from typing import Callable

import torch


def device_median_ms(benchmark, fn: Callable[[], object], device, flush_bytes: int, *,
                     rounds: int = 30, warmup: int = 5) -> float:
    """Time ``fn`` with ``benchmark.pedantic`` (the round synchronises, so pytest-benchmark sees
    the GPU's time plus launch overhead); return the median GPU time, in ms, that CUDA events
    measured over the rounds after the warm-up."""
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device)
    events = []

    def setup():
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events.append((start, end))

    def run():
        start, end = events[-1]
        start.record()
        fn()
        end.record()
        end.synchronize()

    benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1, warmup_rounds=warmup)
    device_ms = sorted(s.elapsed_time(e) for s, e in events[warmup:])
    return device_ms[len(device_ms) // 2]
