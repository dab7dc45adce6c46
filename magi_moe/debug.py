"""Test-time switches. ``poison_workspaces()`` makes kernels fill internal buffers that every
element is meant to overwrite with NaN, so an unwritten element shows in the output."""
from __future__ import annotations

import contextlib

import torch

_poison = False


@contextlib.contextmanager
def poison_workspaces(enabled: bool = True):
    global _poison
    previous, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = previous


def workspace(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised buffer, NaN-filled while ``poison_workspaces`` is active."""
    if _poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)
