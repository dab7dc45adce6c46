"""Where code runs: the CPU reference backend, the Triton interpreter, and CUDA.

A backend is a device plus a statement of whether Triton kernels run there. Adding ROCm or
MUSA is one more ``Backend`` entry here (and one tox environment).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch


def interpreter_enabled() -> bool:
    """True when Triton kernels run under the CPU interpreter (read at kernel decoration)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_INSTALLED: bool | None = None


def triton_installed() -> bool:
    """Whether Triton can be imported. Looked up once: an installation does not change within a
    process, and the layer asks on every call (a module global, not lru_cache, which dynamo
    warns about when it traces the layer)."""
    global _TRITON_INSTALLED
    if _TRITON_INSTALLED is None:
        _TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
    return _TRITON_INSTALLED


@dataclass(frozen=True)
class Backend:
    name: str
    device: str
    runs_triton: bool
    description: str
    _why_unavailable: Callable[[], str | None]

    def unavailable_reason(self) -> str | None:
        """None when usable in this process, else a one-line reason (used for pytest skips)."""
        return self._why_unavailable()

    @property
    def available(self) -> bool:
        return self.unavailable_reason() is None

    def skip_reason(self) -> str | None:
        """None when usable here, else the reason naming this backend (a skip or refusal text)."""
        why = self.unavailable_reason()
        return f"backend {self.name} unavailable: {why}" if why else None


def _cpu_reason() -> str | None:
    return None


def _interpret_reason() -> str | None:
    if not triton_installed():
        return "triton is not installed"
    if not interpreter_enabled():
        return "TRITON_INTERPRET=1 was not set before import (use tox -e cpu)"
    return None


def _cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not triton_installed():
        return "triton is not installed"
    if interpreter_enabled():
        return "TRITON_INTERPRET=1 is set: kernels would be interpreted, not compiled"
    return None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("cpu", "cpu", False, "plain PyTorch on the CPU (reference paths)", _cpu_reason),
        Backend("interpret", "cpu", True, "Triton interpreter on the CPU (TRITON_INTERPRET=1)",
                _interpret_reason),
        Backend("cuda", "cuda", True, "compiled Triton on an NVIDIA GPU", _cuda_reason),
    )
}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}") from None


def available_backends() -> list[Backend]:
    return [b for b in BACKENDS.values() if b.available]


def default_backend() -> Backend:
    """CUDA when usable, else the interpreter when enabled, else the CPU reference."""
    for name in ("cuda", "interpret", "cpu"):
        if BACKENDS[name].available:
            return BACKENDS[name]
    raise AssertionError("the cpu backend is always available")
