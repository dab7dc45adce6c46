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


def check_contiguous(name: str, value: torch.Tensor) -> torch.Tensor:
    """Reject strided views: index tensors and weights the kernels read as dense memory
    (metadata only, no device work)."""
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read it as dense memory), got "
                         f"shape {tuple(value.shape)} with strides {value.stride()}; pass "
                         f"{name.rpartition('.')[2]}.contiguous()")
    return value


def check_unit_last_stride(name: str, value: torch.Tensor) -> torch.Tensor:
    """Kernels that address rows through a row stride need unit stride in the last dim (an
    empty tensor passes)."""
    if value.numel() and value.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {value.stride()}")
    return value


def check_out(out: object, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A caller-owned output: a tensor shaped like ``x``, of ``dtype`` (``x``'s by default), on
    ``x``'s device. Checked before anything is computed, so nothing is broadcast into it or
    silently rounded."""
    check_tensor("x", x)
    return check_tensor("out", out, shape=tuple(x.shape), dtype=dtype or x.dtype, device=x.device)


def check_kernel_device(name: str, value: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter
    (``TRITON_INTERPRET=1`` set before Triton is imported); anything else would reach Triton's
    driver lookup and fail there ("0 active drivers")."""
    from .backends import interpreter_enabled

    if value.device.type == "cuda" or (value.device.type == "cpu" and interpreter_enabled()):
        return
    hint = ("set TRITON_INTERPRET=1 before importing magi_moe to run the kernels under the "
            "interpreter, or use the 'reference' implementation"
            if value.device.type == "cpu" else "the kernels run on CUDA devices only")
    raise ValueError(f"{name} is on {value.device}, where the Triton kernels cannot run: {hint}")


def check_device(name: str, device: object) -> torch.device | None:
    """A device argument that exists here (None passes: torch's default device)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or "
                         f"'cuda:0', got {device!r} ({exc})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{name} is {str(dev)!r} but no CUDA GPU is available here; "
                             f"use device='cpu'")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{name} is {str(dev)!r} but only {count} CUDA device(s) exist")
    return dev


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_finite(name: str, value: torch.Tensor) -> None:
    """Reject NaN/inf. Synchronises with the device: use on slow paths and at load time only."""
    if value.numel() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} must be finite, found {bad} non-finite element(s)")


def check_index_range(name: str, lo: int, hi: int, size: int, what: str = "") -> None:
    """Index values within ``[0, size)``, given their smallest ``lo`` and largest ``hi`` (the
    caller reads them from the device with its other figures, in one sync). ``what`` says what
    the range holds."""
    if lo < 0 or hi >= size:
        held = f" ({what})" if what else ""
        raise ValueError(f"{name} must lie in [0, {size}){held}, got values in [{lo}, {hi}]")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return first


def _fmt(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
