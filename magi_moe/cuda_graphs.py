"""Capturing one call in a CUDA graph, as ``torch.cuda.graphs`` asks: warm up on a side stream
(first-call work such as kernel compilation and workspace growth must not be captured), then
capture. The benchmark's graph rows and the audit's graph-replay checks both use it."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], *, warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` run ``warmup`` times on a side stream, then captured; returns the graph and what
    the captured call returned (its tensors are rewritten by every ``graph.replay()``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
