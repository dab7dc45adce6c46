"""Implementations under test, declared once (OpInfo-style) and run by every test, fuzzer and auditor.

An implementation computes the expert part of the layer on given routes:

    forward(x, table, weights, config, *, out) -> out

``x`` ``[S, H*Dh]``, ``table`` a :class:`~magi_moe.routing.RouteTable`, ``weights`` an
:class:`~magi_moe.weights.ExpertWeights`, ``out`` a caller-allocated ``[S, H*Dh]`` tensor of
``impl.output_dtype(x.dtype)`` that the harness poisons with NaN; every element must be written.
Routing is tested on its own (CONTRACT section 1: one flipped expert changes a whole row).

What an implementation declares (its backends, dtypes, precision model and capabilities) is what
the suite holds it to; tests skip, with the reason, whatever it does not declare.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from .backends import BACKENDS, Backend
from .config import MoEConfig
from .routing import RouteTable
from .validation import check_tensor
from .weights import ExpertWeights

ForwardFn = Callable[..., torch.Tensor]
PrecisionModel = Literal["float64", "bf16-fp32acc", "bf16-fp32acc-atomic", "bf16-plain"]

# Capabilities an implementation may declare; the suite runs the matching checks.
CAPABILITIES = frozenset({
    "deterministic",    # bitwise identical output run after run on the same device
    "int64_offsets",    # safe when token * row_stride passes 2^31
    "weight_cache",     # keeps a packed copy of the weights (cache rules of CONTRACT section 5)
    "no_host_sync",     # no device->host synchronisation once warm
})
PRECISION_MODELS = ("float64", "bf16-fp32acc", "bf16-fp32acc-atomic", "bf16-plain")


@dataclass(frozen=True)
class Implementation:
    """One implementation of the expert computation and what it promises.

    ``precision``: ``float64`` (the oracle), ``bf16-fp32acc`` (the fast paths' precision points
    of CONTRACT section 1: bf16 operands, fp32 accumulation, one bf16 rounding of the SwiGLU7
    output, fp32 routing weight and top-k sum, one final rounding), ``bf16-fp32acc-atomic``
    (the same with the top-k sum done by fp32 atomics, which flush subnormals to zero on NVIDIA
    GPUs) or ``bf16-plain`` (the plain PyTorch baseline that rounds every matmul result).
    """

    name: str
    forward: ForwardFn
    backends: tuple[str, ...]
    precision: PrecisionModel
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    capabilities: frozenset[str] = field(default_factory=frozenset)
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"Implementation.name must be a non-empty word, got {self.name!r}")
        if not callable(self.forward):
            raise ValueError(f"Implementation {self.name!r}: forward must be callable")
        unknown = set(self.backends) - set(BACKENDS)
        if not self.backends or unknown:
            raise ValueError(f"Implementation {self.name!r}: backends must be a non-empty subset "
                             f"of {sorted(BACKENDS)}, got {self.backends}")
        if self.precision not in PRECISION_MODELS:
            raise ValueError(f"Implementation {self.name!r}: precision must be one of "
                             f"{PRECISION_MODELS}, got {self.precision!r}")
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        unknown = self.capabilities - CAPABILITIES
        if unknown:
            raise ValueError(f"Implementation {self.name!r}: unknown capabilities {sorted(unknown)}; "
                             f"known: {sorted(CAPABILITIES)}")

    @property
    def deterministic(self) -> bool:
        return "deterministic" in self.capabilities

    def output_dtype(self, input_dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if self.precision == "float64" else input_dtype

    def skip_reason(self, backend: Backend | str, dtype: torch.dtype | None = None,
                    needs: tuple[str, ...] = ()) -> str | None:
        """Why this implementation cannot run a check here, or None when it can."""
        backend = BACKENDS[backend] if isinstance(backend, str) else backend
        if backend.name not in self.backends:
            return f"{self.name} does not declare backend {backend.name}"
        why = backend.unavailable_reason()
        if why:
            return f"backend {backend.name} unavailable: {why}"
        if dtype is not None and dtype not in self.dtypes:
            return f"{self.name} does not declare dtype {dtype}"
        missing = [n for n in needs if n not in self.capabilities]
        if missing:
            return f"{self.name} does not declare {', '.join(missing)}"
        return None

    def __call__(self, x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                 config: MoEConfig, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            check_tensor("x", x)
            out = torch.empty(x.shape, dtype=self.output_dtype(x.dtype), device=x.device)
        return self.forward(x, table, weights, config, out=out)


_REGISTRY: dict[str, Implementation] = {}


def register(impl: Implementation, *, replace: bool = False) -> Implementation:
    if impl.name in _REGISTRY and not replace:
        raise ValueError(f"an implementation named {impl.name!r} is already registered")
    _REGISTRY[impl.name] = impl
    return impl


def get_implementation(name: str) -> Implementation:
    """A registered implementation by name, or an outside one (:mod:`magi_moe.plugins`):
    ``package.module:attribute``, or the name of an installed entry point of the group
    ``magi_moe.implementations``."""
    _register_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    from . import plugins

    impl = plugins.resolve(name)
    if impl is not None:
        return impl
    installed = plugins.entry_point_names()
    raise ValueError(f"implementation must be one of {sorted(_REGISTRY)}, an entry point of group "
                     f"{plugins.ENTRY_POINT_GROUP!r} (installed: {installed or 'none'}) or "
                     f"'package.module:attr', got {name!r}")


def load_implementation(spec: str) -> Implementation:
    """Import ``package.module:attribute``: an Implementation, or a zero-argument factory of one.

    Loaded once per process and registered under its own name (see :func:`magi_moe.plugins.load_spec`)."""
    from . import plugins

    return plugins.load_spec(spec)


def implementations() -> list[Implementation]:
    _register_builtins()
    return list(_REGISTRY.values())


_builtins_done = False


def _register_builtins() -> None:
    global _builtins_done
    if not _builtins_done:
        _builtins_done = True
        from . import impls  # noqa: F401  (registers magi-moe's own on import)
