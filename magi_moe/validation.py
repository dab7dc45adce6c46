"""Argument checks shared by every entry point: each error names the argument and what was expected."""
from __future__ import annotations

from typing import Sequence

import torch


def check_tensor(
    name: str,
    value: object,
    *,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check a tensor argument's type, rank, shape (None = any size), dtype and device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if shape is not None:
        if value.dim() != len(shape):
            raise ValueError(
                f"{name} must have rank {len(shape)} (shape {_fmt(shape)}), "
                f"got rank {value.dim()} with shape {tuple(value.shape)}"
            )
        for want, got in zip(shape, value.shape):
            if want is not None and want != got:
                raise ValueError(f"{name} must have shape {_fmt(shape)}, got {tuple(value.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if value.dtype not in allowed:
            names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(f"{name} must have dtype {names}, got {str(value.dtype).removeprefix('torch.')}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name} must be on device {device}, got {value.device}")
    return value


def check_finite(name: str, value: torch.Tensor) -> None:
    """Reject NaN/inf. Synchronises with the device: use on slow paths and at load time only."""
    if value.numel() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} must be finite, found {bad} non-finite element(s)")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return first


def _fmt(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
