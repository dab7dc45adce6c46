"""Grow-only device buffers that the fused kernels reuse call after call, one set per device."""
from __future__ import annotations

import math
import threading

import torch

from .. import debug


class FusedWorkspace:
    """Grow-only device buffers reused call after call, so a warm call allocates nothing.

    Each named buffer is one flat allocation; a call takes a view of the size it needs and a
    larger request reallocates (``allocations`` counts those). One workspace serves every
    layer on its device: calls on one device must be ordered (one stream), as they are within a
    model's forward. Under :func:`magi_moe.debug.poison_workspaces` float buffers are refilled
    with NaN (and integer ones with -1) on every request, so an element a kernel should have
    written and did not shows up in the output."""

    def __init__(self, device: torch.device | str):
        self.device = _with_index(device)  # buffers are made on another thread
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[str, tuple] = {}
        self.allocations = 0
        # Once a CUDA graph captured calls on this workspace, a buffer it replaced may still be
        # written by a replay: such buffers are kept (never handed back to the allocator).
        self.captured = False
        self._retired: list[torch.Tensor] = []

    def note_capture(self) -> None:
        """Call once per forward: remembers that a CUDA graph is capturing calls on this
        workspace (about a microsecond of host time; nothing on a CPU)."""
        if not self.captured and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self.captured = True

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # The same request as last time gets the same view (no new tensor: a forward asks for
        # about fifteen buffers, and making views was a fifth of its host time).
        last = self._views.get(name)
        if last is not None and last[0] == shape and last[1] is dtype:
            view = last[2]
        else:
            view = self._new_view(name, shape, dtype)
        if debug._poison:  # noqa: SLF001 (the debug switch is module state by design)
            view.fill_(float("nan") if dtype.is_floating_point else -1)
        return view

    def _new_view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            if buf is not None and self.captured:
                self._retired.append(buf)
            buf = self._allocate(max(numel, 1), dtype)
            self._buffers[name] = buf
            self.allocations += 1
        view = buf[:numel].view(shape)
        self._views[name] = (shape, dtype, view)
        return view

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            # capturing: the graph's own pool (cudaMalloc elsewhere would break the capture)
            return torch.empty(numel, dtype=dtype, device=self.device)
        # Inductor's cudagraph trees warm a compiled layer up with this thread's allocations
        # routed to their pool; a buffer made there would outlive the graph's outputs, which
        # they refuse ("tensors in the cudagraph pool not tracked as outputs") on a compiled
        # layer's first call in a process. The routing is per thread (a side stream did not
        # escape it on the H200, docs/DESIGN.md), so buffers are made by another
        # thread from the ordinary allocator, and marked as used on the caller's stream, so
        # that memory freed when a buffer grows waits for this stream's work before reuse.
        made: list = []

        def make() -> None:
            try:
                made.append(torch.empty(numel, dtype=dtype, device=self.device))
            except BaseException as error:  # out of memory: raised below, in the caller
                made.append(error)
        maker = threading.Thread(target=make, name="magi-moe-workspace")
        maker.start()
        maker.join()
        buf = made[0]
        if isinstance(buf, BaseException):
            raise buf
        buf.record_stream(torch.cuda.current_stream(self.device))
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _with_index(device: torch.device | str) -> torch.device:
    """``device`` with ``cuda`` read as the current GPU (``cuda:N``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_WORKSPACES: dict[torch.device, FusedWorkspace] = {}


def shared_workspace(device: torch.device | str) -> FusedWorkspace:
    """The workspace every fused call on ``device`` shares (``cuda`` means the current GPU)."""
    device = _with_index(device)
    ws = _WORKSPACES.get(device)
    if ws is None:
        ws = _WORKSPACES[device] = FusedWorkspace(device)
    return ws
