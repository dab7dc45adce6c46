"""What an implementation under test is and what it promises: one declaration, read by every
test, fuzzer, auditor, the layer and the benchmark (OpInfo-style). A leaf module: at load time
it imports only :mod:`magi_moe.verdict` (itself a leaf, for the kinds its skip reasons carry),
so the registry, the built-ins and outside plugins all build on it without an import circle.

An implementation computes the expert part of the layer on given routes:

    forward(x, table, weights, config, *, out) -> out

``x`` ``[S, H*Dh]``, ``table`` a :class:`~magi_moe.routing.RouteTable`, ``weights`` an
:class:`~magi_moe.weights.ExpertWeights`, ``out`` a caller-allocated ``[S, H*Dh]`` tensor of
``impl.output_dtype(x.dtype)`` that the harness poisons with NaN; every element must be written.

Beside the forward it declares:

- ``backends``, ``dtypes``, ``precision`` and ``capabilities``: where it runs and what the
  suite holds it to;
- ``shapes`` (:class:`ShapeRule`): the widths it accepts. Strategies draw inside the rule, so a
  kernel restricted to wide heads is fuzzed at the widths it really runs
  (:meth:`Implementation.supports` says why a shape is outside);
- ``layer_factory``: its own ``nn.Module`` built from a released-layout state dict
  (:meth:`Implementation.layer`); by default magi-moe's :class:`~magi_moe.layer.MagiMoE` around
  this forward. Every layer-level check (weight cache, weight swaps, CUDA graphs, determinism,
  discipline) runs on that module through its own parameters and its own cache;
- ``layer_forward``: a whole-layer fast path (routing included) on plain tensors,
  ``layer_forward(x, gate, bias, weights, config) -> y``, that ``MagiMoE`` takes for this
  implementation instead of routing + ``forward`` (the layer keeps its weight cache current
  first, where it keeps one);
- ``launcher``: a kernel-level entry with a caller-owned accumulator that lets the huge-offset
  fuzzer run tokens past 2^31 on lazily allocated memory (:class:`RowLauncher`);
- ``prepare_weights``: what a serving stack does once before timing (e.g. packing), used by
  the benchmark's kernel-level paths;
- ``router``: its own routing, ``router(x, gate, bias, config) -> Routes``, where it has one
  (default: :func:`magi_moe.routing.route`). Every path that routes for this implementation
  (``MagiMoE``'s generic path, expert parallelism, :meth:`Implementation.route`) takes it, so
  a deterministic implementation's result does not depend on which path routed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

import torch

from .verdict import not_declared, not_run, unsupported

if TYPE_CHECKING:  # imported for annotations only: this module stays a leaf
    from torch import nn

    from .backends import Backend
    from .config import MoEConfig

ForwardFn = Callable[..., torch.Tensor]
LayerFactory = Callable[["MoEConfig", Mapping[str, torch.Tensor], Any], "nn.Module"]
PrecisionModel = Literal["float64", "bf16-fp32acc", "bf16-fp32acc-atomic", "bf16-plain"]
PRECISION_MODELS = ("float64", "bf16-fp32acc", "bf16-fp32acc-atomic", "bf16-plain")

# Capabilities an implementation may declare; the suite runs the matching checks.
CAPABILITIES = frozenset({
    "deterministic",    # bitwise identical output run after run on the same device
    "int64_offsets",    # safe when token * row_stride passes 2^31
    "weight_cache",     # its layer keeps a packed copy of the weights (cache rules, CONTRACT 5)
    "no_host_sync",     # no device->host synchronisation once warm
    "strided_weights",  # forward accepts non-contiguous weight views (else the layer densifies)
    "input_checks",     # forward itself refuses malformed calls (docs/INPUTS.md) before launching
    "compilable",       # its layer_forward traces under torch.compile with no graph break
})


@dataclass(frozen=True)
class ShapeRule:
    """The shapes an implementation accepts, declared in a form strategies can draw from.

    Widths are also multiples of :data:`magi_moe.config.WIDTH_MULTIPLE` (16) for every
    implementation; a rule narrows that. ``min_*``/``max_*`` bound the widths (0: no bound)."""

    head_dim_multiple: int = 1
    intermediate_multiple: int = 1
    head_dim_power_of_two: bool = False
    min_head_dim: int = 0
    max_head_dim: int = 0
    max_top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("head_dim_multiple", "intermediate_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ShapeRule.{name} must be an int >= 1, got {value!r}")
        for name in ("min_head_dim", "max_head_dim", "max_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ShapeRule.{name} must be an int >= 0, got {value!r}")
        if self.max_head_dim and self.max_head_dim < max(self.min_head_dim, self.head_dim_multiple):
            raise ValueError(f"ShapeRule: max_head_dim {self.max_head_dim} admits no head width "
                             f"(min_head_dim {self.min_head_dim}, multiple {self.head_dim_multiple})")

    def reason(self, config: "MoEConfig") -> str | None:
        """Why ``config`` is outside the rule, or None."""
        Dh, I = config.head_dim, config.intermediate_size
        if Dh % self.head_dim_multiple:
            return f"head_dim must be a multiple of {self.head_dim_multiple}, got {Dh}"
        if self.head_dim_power_of_two and Dh & (Dh - 1):
            return f"head_dim must be a power of two, got {Dh}"
        if Dh < self.min_head_dim:
            return f"head_dim must be >= {self.min_head_dim}, got {Dh}"
        if self.max_head_dim and Dh > self.max_head_dim:
            return f"head_dim must be <= {self.max_head_dim}, got {Dh}"
        if I % self.intermediate_multiple:
            return f"intermediate_size must be a multiple of {self.intermediate_multiple}, got {I}"
        if self.max_top_k and config.top_k > self.max_top_k:
            return f"top_k must be <= {self.max_top_k}, got {config.top_k}"
        return None

    def head_dims(self, low: int, high: int, *, multiple: int = 16) -> list[int]:
        """Every accepted head width in ``[low, high]`` that is also a multiple of ``multiple``."""
        step = math.lcm(multiple, self.head_dim_multiple)
        low = max(low, self.min_head_dim)
        high = min(high, self.max_head_dim) if self.max_head_dim else high
        first = -(-low // step) * step
        return [d for d in range(first, high + 1, step)
                if not self.head_dim_power_of_two or d & (d - 1) == 0]

    def intermediate_sizes(self, low: int, high: int, *, multiple: int = 16) -> list[int]:
        step = math.lcm(multiple, self.intermediate_multiple)
        first = -(-low // step) * step
        return list(range(first, high + 1, step))


    def nearest(self, config: "MoEConfig") -> "MoEConfig":
        """``config`` with its widths (and ``top_k``) moved to the nearest ones the rule accepts
        at or above them: how a check built on a fixed preset stays inside the rule."""
        if self.reason(config) is None:
            return config
        head_dims = self.head_dims(config.head_dim, 8192) or self.head_dims(16, 8192)
        inters = self.intermediate_sizes(config.intermediate_size, 1 << 15)
        if not head_dims or not inters:
            return config  # nothing accepted nearby: the caller's supports() check reports it
        top_k = min(config.top_k, self.max_top_k) if self.max_top_k else config.top_k
        return config.replace(head_dim=head_dims[0], intermediate_size=inters[0], top_k=top_k)


ANY_SHAPE = ShapeRule()


class UnsupportedShape(ValueError):
    """Raised by the harness (``magi_moe.problems.run_poisoned``) before calling an
    implementation on a shape outside its declaration: "unsupported", never a failure. magi-moe's
    pytest plugin turns it into a skip of kind UNSUPPORTED with the reason."""


@dataclass(frozen=True)
class RowLauncher:
    """A kernel-level entry point for the huge-offset fuzzer: ``package.module:attr`` with the
    signature ``launch(x, table, weights, config, accumulator, *, deterministic)``.

    ``writes="route_rows"``: ``accumulator`` is ``[R, Dh]`` fp32, one row per route;
    ``writes="accumulate"``: it is the ``[S, H*Dh]`` fp32 sum, added into."""

    spec: str
    writes: Literal["route_rows", "accumulate"]

    def __post_init__(self) -> None:
        module, _, attr = self.spec.partition(":")
        if not module or not attr:
            raise ValueError(f"RowLauncher.spec must look like 'package.module:attr', got {self.spec!r}")
        if self.writes not in ("route_rows", "accumulate"):
            raise ValueError(f"RowLauncher.writes must be 'route_rows' or 'accumulate', got {self.writes!r}")

    @property
    def deterministic(self) -> bool:
        return self.writes == "route_rows"


# The layer an implementation without its own gets: magi_moe.layer registers MagiMoE here when
# it is imported (magi_moe/__init__ imports it), so this module imports no layer code.
_DEFAULT_LAYER: Callable[..., "nn.Module"] | None = None


def set_default_layer(factory: Callable[..., "nn.Module"]) -> None:
    """``factory(impl, config, state_dict, device)``: the layer of implementations that declare
    no ``layer_factory``."""
    global _DEFAULT_LAYER
    _DEFAULT_LAYER = factory


def _check_callable(owner: str, name: str, value) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"Implementation {owner!r}: {name} must be callable or None, "
                         f"got {type(value).__name__}")


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
    shapes: ShapeRule = ANY_SHAPE
    layer_factory: LayerFactory | None = None
    layer_forward: Callable[..., torch.Tensor] | None = None
    launcher: RowLauncher | None = None
    prepare_weights: Callable[..., Any] | None = None
    router: Callable[..., Any] | None = None
    precision_at: Callable[["MoEConfig"], str | None] | None = None

    def __post_init__(self) -> None:
        from .backends import BACKENDS  # a leaf at import time; backends needs only torch

        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"Implementation.name must be a non-empty word, got {self.name!r}")
        if not callable(self.forward):
            raise ValueError(f"Implementation {self.name!r}: forward must be callable")
        if isinstance(self.backends, str):  # tuple("cpu") would be ('c', 'p', 'u')
            raise ValueError(f"Implementation {self.name!r}: backends must be a tuple of backend names "
                             f"from {sorted(BACKENDS)}, got the string {self.backends!r} (write "
                             f"backends=({self.backends!r},))")
        object.__setattr__(self, "backends", tuple(self.backends))
        unknown = set(self.backends) - set(BACKENDS)
        if not self.backends or unknown:
            raise ValueError(f"Implementation {self.name!r}: backends must be a non-empty subset "
                             f"of {sorted(BACKENDS)}, got {self.backends}")
        if self.precision not in PRECISION_MODELS:
            raise ValueError(f"Implementation {self.name!r}: precision must be one of "
                             f"{PRECISION_MODELS}, got {self.precision!r}")
        if isinstance(self.dtypes, torch.dtype):  # one dtype, not a tuple of them
            raise ValueError(f"Implementation {self.name!r}: dtypes must be a tuple of floating torch "
                             f"dtypes, got the single dtype {self.dtypes} (write dtypes=({self.dtypes},))")
        if isinstance(self.dtypes, str) or not hasattr(self.dtypes, "__iter__"):
            raise ValueError(f"Implementation {self.name!r}: dtypes must be a tuple of floating torch "
                             f"dtypes, got {type(self.dtypes).__name__} {self.dtypes!r}")
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if not self.dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point
                                      for d in self.dtypes):
            raise ValueError(f"Implementation {self.name!r}: dtypes must be a non-empty tuple of "
                             f"floating torch dtypes, got {self.dtypes}")
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        unknown = self.capabilities - CAPABILITIES
        if unknown:
            raise ValueError(f"Implementation {self.name!r}: unknown capabilities {sorted(unknown)}; "
                             f"known: {sorted(CAPABILITIES)}")
        if not isinstance(self.shapes, ShapeRule):
            raise ValueError(f"Implementation {self.name!r}: shapes must be a ShapeRule, "
                             f"got {type(self.shapes).__name__}")
        if self.launcher is not None and not isinstance(self.launcher, RowLauncher):
            raise ValueError(f"Implementation {self.name!r}: launcher must be a RowLauncher or None, "
                             f"got {type(self.launcher).__name__}")
        if self.launcher is not None and self.launcher.deterministic != self.deterministic:
            raise ValueError(f"Implementation {self.name!r}: a launcher writing "
                             f"{self.launcher.writes!r} contradicts deterministic="
                             f"{self.deterministic}: the huge fuzzer would test another variant")
        for name in ("layer_factory", "layer_forward", "prepare_weights", "router", "precision_at"):
            _check_callable(self.name, name, getattr(self, name))

    @property
    def deterministic(self) -> bool:
        return "deterministic" in self.capabilities

    def precision_for(self, config: "MoEConfig | None") -> str:
        """The precision model this implementation keeps at ``config``: ``precision_at(config)``
        where that names one (a fallback path at some shapes), else ``precision``."""
        if config is None or self.precision_at is None:
            return self.precision
        model = self.precision_at(config)
        if model is None:
            return self.precision
        if model not in PRECISION_MODELS or (model == "float64") != self.is_oracle:
            raise ValueError(f"Implementation {self.name!r}: precision_at({config}) must return "
                             f"None or one of {PRECISION_MODELS} (float64 only for the oracle), "
                             f"got {model!r}")
        return model

    @property
    def is_oracle(self) -> bool:
        """The float64 oracle (precision ``float64``): float64 outputs, bitwise the reference,
        never one of the kernels a check is about."""
        return self.precision == "float64"

    @property
    def plain_pytorch(self) -> bool:
        """Declares a backend that runs no Triton (``cpu``), so it runs plain PyTorch, no Triton
        kernel: on the interpreter it would repeat its ``cpu`` row, and on a GPU it needs no Triton."""
        from .backends import BACKENDS

        return any(name in BACKENDS and not BACKENDS[name].runs_triton for name in self.backends)

    def output_dtype(self, input_dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if self.is_oracle else input_dtype

    def supports(self, config: "MoEConfig", dtype: torch.dtype | None = None) -> str | None:
        """None when this implementation accepts ``config`` (and ``dtype``, default the
        config's), else the reason (a SkipReason of kind UNSUPPORTED). An error raised outside this is "unsupported"; an error
        raised inside it is a failure."""
        dtype = config.dtype if dtype is None else dtype
        if dtype not in self.dtypes:
            return unsupported(f"{self.name} does not declare dtype {dtype}")
        why = self.shapes.reason(config)
        return unsupported(f"{self.name}: {why}") if why else None

    def fit(self, config: "MoEConfig", dtype: torch.dtype | None = None) -> "MoEConfig":
        """``config`` moved inside this declaration: the nearest widths (and ``top_k``) the shape
        rule accepts, and ``dtype`` (default the config's) or else the first declared dtype. How
        a fixed case stays inside what the implementation accepts; raises
        :class:`UnsupportedShape` when nothing near fits."""
        dtype = config.dtype if dtype is None else dtype
        fitted = self.shapes.nearest(config)
        fitted = fitted.replace(dtype=dtype if dtype in self.dtypes else self.dtypes[0])
        why = self.supports(fitted)
        if why:
            raise UnsupportedShape(why)
        return fitted

    def backend_on(self, device: "torch.device | str") -> str:
        """The backend that runs this implementation on tensors on ``device``: a GPU's own
        (``cuda``); on a CPU, plain PyTorch (``cpu``) where declared, else the Triton
        interpreter where declared."""
        from .backends import backends_on

        device = torch.device(device)
        here = backends_on(device.type)  # fastest first
        if not here:
            return device.type
        ranked = sorted(here, key=lambda b: not (self.plain_pytorch and b.runs_plain_pytorch))
        return next((b.name for b in ranked if b.name in self.backends), here[0].name)

    def skip_reason(self, where: "Backend | str | torch.device", dtype: torch.dtype | None = None,
                    needs: tuple[str, ...] = ()) -> str | None:
        """Why this implementation cannot run here, or None when it can: the one answer to "can
        it run here" (tests, audit, fuzzers, layer, dispatch).

        ``where`` is a backend (a :class:`~magi_moe.backends.Backend` or its name): a row of the
        test matrix, usable as the backend says (``cuda`` means compiled Triton, so not under
        ``TRITON_INTERPRET=1``). Or a ``torch.device``: tensors already there, run by
        :meth:`backend_on`; on a GPU the device is there, so what is left to ask is Triton,
        and only of an implementation that is not :attr:`plain_pytorch`.

        The reason is a :class:`~magi_moe.verdict.SkipReason` carrying its kind for the verdict:
        a capability in ``needs`` not declared is NOT DECLARED, a dtype not declared UNSUPPORTED,
        a backend not declared or not usable here NOT RUN."""
        from .backends import BACKENDS

        if isinstance(where, torch.device):
            name = self.backend_on(where)
            if name not in self.backends:
                return not_run(f"{self.name} does not declare backend {name}")
            backend = BACKENDS[name]
            # the device holds the tensors, so it exists: what is left is the backend's toolchain
            plain_here = self.plain_pytorch and backend.runs_plain_pytorch
            why = None if plain_here else backend.skip_reason_on_its_tensors()
        else:
            backend = BACKENDS[where] if isinstance(where, str) else where
            if backend.name not in self.backends:
                return not_run(f"{self.name} does not declare backend {backend.name}")
            why = backend.skip_reason()
        if why:
            return why
        if dtype is not None and dtype not in self.dtypes:
            return unsupported(f"{self.name} does not declare dtype {dtype}")
        missing = [n for n in needs if n not in self.capabilities]
        if missing:
            return not_declared(f"{self.name} does not declare {', '.join(missing)}")
        return None

    def route(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
              config: "MoEConfig"):
        """This implementation's routing of ``x`` (its declared ``router``, else magi-moe's torch
        router): a :class:`~magi_moe.routing.Routes`."""
        if self.router is not None:
            return self.router(x, gate, bias, config)
        from .routing import route

        return route(x, gate, bias, config)

    def layer(self, config: "MoEConfig", state_dict: Mapping[str, torch.Tensor],
              device=None) -> "nn.Module":
        """This implementation's own layer, loaded from a released-layout state dict (``gate``,
        ``W_gate``, ``W_up``, ``W_down``, ``router.expert_bias``, ``router.expert_bias_ema``);
        ``forward(x)`` returns ``y``. Tensors are moved to ``device`` when given."""
        if device is not None:
            state_dict = {k: v.to(device) for k, v in state_dict.items()}
        if self.layer_factory is not None:
            layer = self.layer_factory(config, state_dict, device)
            if not isinstance(layer, torch.nn.Module):  # every layer check needs its parameters
                raise TypeError(f"Implementation {self.name!r}: layer_factory must return a "
                                f"torch.nn.Module, got {type(layer).__name__}")
            return layer
        if _DEFAULT_LAYER is None:
            raise RuntimeError("no default layer registered (magi_moe.layer registers MagiMoE when "
                               "magi_moe is imported)")
        return _DEFAULT_LAYER(self, config, state_dict, device)

    def __call__(self, x: torch.Tensor, table, weights, config: "MoEConfig", *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            from .validation import check_tensor

            check_tensor("x", x)
            out = torch.empty(x.shape, dtype=self.output_dtype(x.dtype), device=x.device)
        return self.forward(x, table, weights, config, out=out)
