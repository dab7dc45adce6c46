"""Weight-cache auditor (CONTRACT section 5): after every way a user changes weights, the next
forward must use the new weights; without a change, nothing is repacked.

It audits *any* layer an implementation builds (:meth:`~magi_moe.implementation.Implementation.
layer`, or a factory ``make_layer(config, state_dict, device)``), through the layer's own
parameters and its own cache. The auditor knows the config and the released-layout state dict it
built the layer from, and reads the layer's *current* weights through ``layer.state_dict()``
(released names) for the float64 reference. Everything else is an optional protocol, used only
where the layer offers it (:class:`CacheProtocol`):

- pack counts: ``layer.pack_count`` or ``layer.weight_cache.pack_count`` (else "not measured");
- explicit invalidation: ``layer.invalidate_weight_cache()`` or ``layer.weight_cache.invalidate()``;
- promises: ``layer.weight_cache_promises`` or ``layer.weight_cache.promises``, a mapping from
  route name to ``"needs invalidate()"`` for the routes where the layer asks users to
  invalidate; every other route must be detected.

Single-tensor routes reach ``W_gate``, ``W_up``, ``W_down`` by ``layer.get_parameter(name)``; a
layer with no parameter of that name gets "not applicable" for that route, not a failure.
Drawn states keep the two router bias tensors equal, so whichever the layer selects with, the
reference selects with the same values.

For each route (and, for single-tensor routes, each expert weight) on a fresh layer:

1. forward twice: the second must not repack (where pack counts are offered);
2. change the expert weights by the route (the router stays as it is);
3. forward: the output must match the float64 reference *on the current weights* within the
   worst-case bound (``bf16-plain`` model, the loosest any implementation is held to; stale
   weights miss it by orders of magnitude) -> "detected";
4. if stale and the layer offers invalidation, invalidate and forward again: fresh ->
   "needs invalidate()" (fine only where promised), else "stale". An error anywhere is
   "unsupported".
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from magi_moe.config import MoEConfig
from magi_moe.implementation import Implementation
from magi_moe.routing import build_route_table, route
from magi_moe.weights import ExpertWeights

from magi_moe.judge.bounds import compute_error_bounds, evaluate_bounds

EXPERT_PARAMS = ("W_gate", "W_up", "W_down")
ROUTER_BIASES = ("router.expert_bias", "router.expert_bias_ema")
RELEASED_NAMES = ("gate",) + EXPERT_PARAMS + ROUTER_BIASES
DETECTED, NEEDS_INVALIDATE, STALE, UNSUPPORTED, NOT_APPLICABLE, SKIPPED = (
    "detected", "needs invalidate()", "stale", "unsupported", "not applicable", "skip")
NOT_MEASURED = "not measured"
# How a result begins when the layer was wrong before the route changed anything (graphs too)
WRONG_BEFORE_ANY_CHANGE = "wrong before any change"
FRESHNESS_MODEL = "bf16-plain"

LayerFactory = Callable[[MoEConfig, Mapping[str, torch.Tensor], object], nn.Module]


# -- the optional cache protocol ---------------------------------------------------------------

@dataclass(frozen=True)
class CacheProtocol:
    """What a layer offers of the cache protocol; each part is optional."""

    pack_count: Callable[[], int] | None
    invalidate: Callable[[], None] | None
    promises: dict[str, str]
    declares_cache: bool  # a ``weight_cache`` attribute that is not None

    @property
    def offered(self) -> bool:
        """A cache the layer shows: ``weight_cache`` or a pack count (an invalidation method
        alone is no cache: ``MagiMoE`` has one, a no-op, for every implementation)."""
        return self.declares_cache or self.pack_count is not None

    def packs(self) -> int | None:
        return None if self.pack_count is None else int(self.pack_count())


def cache_protocol(layer: nn.Module) -> CacheProtocol:
    """Read what ``layer`` offers: pack counts, invalidation and promises (see the module doc)."""
    cache = getattr(layer, "weight_cache", None)
    owner = next((o for o in (layer, cache) if o is not None and hasattr(o, "pack_count")), None)
    count = None if owner is None else (lambda: owner.pack_count)
    invalidate = getattr(layer, "invalidate_weight_cache", None)
    if not callable(invalidate):
        invalidate = getattr(cache, "invalidate", None)
    promises = getattr(layer, "weight_cache_promises", None)
    if promises is None:
        promises = getattr(cache, "promises", None)
    return CacheProtocol(count, invalidate if callable(invalidate) else None,
                         dict(promises or {}), cache is not None)


def reach_tensor(layer: nn.Module, name: str) -> torch.Tensor | None:
    """The layer's parameter (or buffer) by released name, or None when it has none by that name."""
    for get in (layer.get_parameter, layer.get_buffer):
        try:
            return get(name)
        except AttributeError:
            continue
    return None


# -- the routes --------------------------------------------------------------------------------
# Single-tensor routes get the layer's parameter; whole-layer routes get the new state dict.

def _in_place(param, new):
    with torch.no_grad():
        param.add_(new - param)


def _copy_no_grad(param, new):
    with torch.no_grad():
        param.copy_(new)


def _data_assign(param, new):
    param.data = new.clone()


def _data_copy(param, new):
    param.data.copy_(new)


def _load_state_dict(layer, new_state):
    layer.load_state_dict(new_state)


def _load_assign(layer, new_state):
    layer.load_state_dict({k: v.clone() for k, v in new_state.items()}, assign=True)


def _new_storage(layer, new_state):
    # An mmap-backed checkpoint swapped in: the parameters become new tensors on new storage.
    device = new_state["W_gate"].device
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        torch.save({k: v.cpu() for k, v in new_state.items()}, path)
        loaded = torch.load(path, mmap=True)
        layer.load_state_dict({k: v.to(device) for k, v in loaded.items()}, assign=True)


def _reload_experts(layer, new_state):
    """Copy the new expert weights in, at whatever dtype and device the layer now holds."""
    current = layer.state_dict()
    layer.load_state_dict({k: new_state[k].to(dtype=v.dtype, device=v.device)
                           if k in EXPERT_PARAMS else v for k, v in current.items()})


def _to_dtype_roundtrip(layer, new_state):
    layer.to(torch.float32)
    _reload_experts(layer, new_state)
    layer.to(new_state["W_gate"].dtype)


def _to_device_roundtrip(layer, new_state):
    device = new_state["W_gate"].device
    layer.cpu()
    _reload_experts(layer, new_state)
    layer.to(device)


@dataclass(frozen=True)
class WeightChange:
    name: str
    description: str
    apply: Callable
    per_parameter: bool          # apply(param, new) to each expert weight, else apply(layer, state)
    cuda_only: bool = False
    inference_mode: bool = False  # layer built, changed and run under torch.inference_mode()


WEIGHT_CHANGES = (
    WeightChange("in_place", "in-place op under no_grad: W.add_(delta)", _in_place, True),
    WeightChange("copy_no_grad", "W.copy_(new) under no_grad", _copy_no_grad, True),
    WeightChange("load_state_dict", "layer.load_state_dict(new)", _load_state_dict, False),
    WeightChange("load_assign", "layer.load_state_dict(new, assign=True) with fresh tensors",
                 _load_assign, False),
    WeightChange("param_data_assign", "W.data = new (new data_ptr, same _version)", _data_assign, True),
    WeightChange("param_data_copy", "W.data.copy_(new) (id, data_ptr and _version unchanged)",
                 _data_copy, True),
    WeightChange("new_storage", "load_state_dict(torch.load(mmap=True), assign=True)",
                 _new_storage, False),
    WeightChange("to_dtype", "layer.to(float32), load new experts, layer.to(config.dtype)",
                 _to_dtype_roundtrip, False),
    WeightChange("to_device", "layer.cpu(), load new experts, layer.to(cuda)", _to_device_roundtrip,
                 False, cuda_only=True),
    WeightChange("inference_mode", "layer built and W.copy_(new) under torch.inference_mode "
                 "(tensors without a version counter)", _copy_no_grad, True, inference_mode=True),
)
ROUTES = tuple(c.name for c in WEIGHT_CHANGES)


# -- results -----------------------------------------------------------------------------------

@dataclass
class RouteResult:
    route: str
    parameter: str
    status: str
    promised: str
    repacks_after_change: int | None     # None: the layer offers no pack count
    repacks_without_change: int | None
    detail: str

    @property
    def ok(self) -> bool:
        if self.status in (SKIPPED, NOT_APPLICABLE):
            return True
        if self.repacks_without_change:
            return False
        return self.status == DETECTED or (self.status == NEEDS_INVALIDATE
                                           and self.promised == NEEDS_INVALIDATE)

    def to_dict(self) -> dict:
        return dict(self.__dict__, ok=self.ok)


@dataclass
class CacheReport:
    label: str
    has_cache: bool        # the layer shows a cache (CacheProtocol.offered)
    measures_packs: bool   # ... including a pack count
    results: list[RouteResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def by_route(self) -> dict[str, str]:
        """Worst status per route over its parameters."""
        order = [NOT_APPLICABLE, SKIPPED, DETECTED, NEEDS_INVALIDATE, STALE, UNSUPPORTED]
        out: dict[str, str] = {}
        for r in self.results:
            prev = out.get(r.route)
            out[r.route] = r.status if prev is None else max(prev, r.status, key=order.index)
        return out

    def summary(self) -> str:
        parts = ", ".join(f"{k}: {v}" for k, v in self.by_route().items())
        bad = [f"{r.route}/{r.parameter}" for r in self.results if not r.ok]
        cache = ("" if self.has_cache else "no cache protocol; ") + (
            "" if self.measures_packs else f"pack counts {NOT_MEASURED}; ")
        return f"{self.label}: {cache}{parts} -> {'ok' if self.ok else 'VIOLATIONS: ' + ', '.join(bad)}"

    def to_dict(self) -> dict:
        return {"label": self.label, "has_cache": self.has_cache,
                "measures_packs": self.measures_packs, "ok": self.ok,
                "by_route": self.by_route(), "results": [r.to_dict() for r in self.results]}


# -- states and the reference -------------------------------------------------------------------

def released_shapes(config: MoEConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    HE, Dh, I = config.num_banks, config.head_dim, config.intermediate_size
    fp32 = torch.float32
    return {"gate": ((HE, Dh), fp32), "W_gate": ((HE, Dh, I), config.dtype),
            "W_up": ((HE, Dh, I), config.dtype), "W_down": ((HE, I, Dh), config.dtype),
            "router.expert_bias": ((HE,), fp32), "router.expert_bias_ema": ((HE,), fp32)}


def draw_state(config: MoEConfig, seed: int, device, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A released-layout state dict of random values; the two router biases are equal."""
    gen = torch.Generator().manual_seed(seed)
    scale = {"gate": 0.25, "router.expert_bias": 0.05}
    state = {}
    for name, (shape, dtype) in released_shapes(config).items():
        if name == "router.expert_bias_ema":
            state[name] = state["router.expert_bias"].clone()
            continue
        drawn = torch.randn(shape, generator=gen) * scale.get(name, std)
        state[name] = drawn.to(dtype=dtype, device=device)
    return state


def selection_bias(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The selection bias of a state whose two router biases are equal (as drawn here)."""
    bias, ema = state["router.expert_bias"], state["router.expert_bias_ema"]
    if not torch.equal(bias.float(), ema.float()):
        raise ValueError("the layer's router.expert_bias and router.expert_bias_ema differ; the "
                         "audit keeps them equal, so the layer changed one of them itself")
    return ema.float()


def output_ok(config: MoEConfig, state: Mapping[str, torch.Tensor], x: torch.Tensor,
              y: torch.Tensor) -> tuple[bool, str]:
    """Does ``y`` match the float64 reference for ``x`` on the weights in ``state`` (the layer's
    current ``state_dict()``, released names) within the worst-case bound?"""
    missing = [n for n in RELEASED_NAMES if n not in state]
    if missing:
        raise ValueError(f"layer.state_dict() must hold the released names; missing {missing}")
    with torch.no_grad():
        gate = state["gate"].detach().float()
        bias = selection_bias(state)
        table = build_route_table(route(x.clone(), gate, bias, config), config)
        weights = ExpertWeights(*(state[n].detach().clone().to(x.dtype) for n in EXPERT_PARAMS))
        bounds = compute_error_bounds(x.clone(), table, weights, config,
                                      [FRESHNESS_MODEL])[FRESHNESS_MODEL]
        report = evaluate_bounds(y.detach().clone(), bounds)
    return report.proven_ok, f"max error / worst-case bound {report.worst_max_ratio:.3g}"


def layer_output_ok(layer: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                    config: MoEConfig | None = None) -> tuple[bool, str]:
    """:func:`output_ok` on ``layer.state_dict()`` (``config`` defaults to ``layer.config``), for
    checks that hold a layer rather than the state it was built from. The layer's two router
    biases must be equal (``MagiMoE.reset_parameters`` zeroes both)."""
    return output_ok(config if config is not None else layer.config, layer.state_dict(), x, y)


# -- the audit ---------------------------------------------------------------------------------

def as_layer_factory(impl_or_factory) -> tuple[LayerFactory, str]:
    """``(make_layer, label)`` from an Implementation, a registered name or ``package.module:attr``,
    or a callable ``make_layer(config, state_dict, device)``."""
    if isinstance(impl_or_factory, str):
        from magi_moe.registry import get_implementation
        impl_or_factory = get_implementation(impl_or_factory)
    if isinstance(impl_or_factory, Implementation):
        return impl_or_factory.layer, impl_or_factory.name
    if callable(impl_or_factory):
        return impl_or_factory, getattr(impl_or_factory, "__name__", type(impl_or_factory).__name__)
    raise TypeError("impl_or_factory must be an Implementation, its name, or a callable "
                    f"make_layer(config, state_dict, device), got {type(impl_or_factory).__name__}")


def _measured(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def _audit_one(make_layer: LayerFactory, change: WeightChange, parameter: str, *, config: MoEConfig,
               device, num_tokens: int, seed: int) -> RouteResult:
    promised = DETECTED

    def result(status, detail, after=None, without=None):
        return RouteResult(change.name, parameter, status, promised, after, without, detail)

    ctx = torch.inference_mode() if change.inference_mode else contextlib.nullcontext()
    with ctx:
        try:
            state = draw_state(config, seed, device)
            layer = make_layer(config, state, device)
            protocol = cache_protocol(layer)
            promised = protocol.promises.get(change.name, DETECTED)
            target = reach_tensor(layer, parameter) if change.per_parameter else layer
            if target is None:
                return result(NOT_APPLICABLE, f"the layer has no parameter named {parameter!r}")
            gen = torch.Generator().manual_seed(seed + 7)
            x = torch.randn(num_tokens, config.hidden_size, generator=gen).to(
                dtype=config.dtype, device=device)
            new_state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
            drawn = draw_state(config, seed + 1, device)
            for name in EXPERT_PARAMS:  # only expert weights change: the routing stays
                new_state[name] = drawn[name].to(new_state[name].dtype)

            layer(x)
            before = protocol.packs()
            y = layer(x)
            without = _measured(protocol.packs(), before)
            fresh, how = output_ok(config, layer.state_dict(), x, y)
            if not fresh:
                return result(UNSUPPORTED, f"{WRONG_BEFORE_ANY_CHANGE} ({how})", None, without)
            if change.per_parameter:
                change.apply(target, new_state[parameter])
            else:
                change.apply(layer, new_state)
            before = protocol.packs()
            y = layer(x)
            after = _measured(protocol.packs(), before)
            fresh, how = output_ok(config, layer.state_dict(), x, y)
            repacks = "" if after is None else f"; {after} repack(s)"
            if fresh:
                before = protocol.packs()
                layer(x)
                again = _measured(protocol.packs(), before)
                without = None if without is None else without + again
                return result(DETECTED, f"fresh without invalidation ({how}){repacks}", after, without)
            if protocol.invalidate is None:
                return result(STALE, f"served stale weights ({how}){repacks}; the layer offers "
                              f"no invalidation", after, without)
            protocol.invalidate()
            y = layer(x)
            fresh_after, how_after = output_ok(config, layer.state_dict(), x, y)
            if fresh_after:
                return result(NEEDS_INVALIDATE, f"served stale weights ({how}); fresh after "
                              f"invalidation ({how_after})", after, without)
            return result(STALE, f"stale even after invalidation ({how_after})", after, without)
        except Exception as exc:  # noqa: BLE001 -- an error is a finding, reported per route
            return result(UNSUPPORTED, f"{type(exc).__name__}: {exc}")


def audit_weight_cache(impl_or_factory, *, config: MoEConfig, device="cpu", label: str = "",
                       num_tokens: int = 16, seed: int = 0, routes: tuple[str, ...] = ROUTES,
                       parameters: tuple[str, ...] = EXPERT_PARAMS,
                       on_result: Callable[[RouteResult], None] | None = None) -> CacheReport:
    """Audit the weight cache of the layers ``impl.layer(config, state_dict, device)`` builds
    (``impl_or_factory``: an Implementation, its name, or ``make_layer(config, state_dict,
    device)``); each route gets a fresh layer from a fresh state.

    ``routes`` / ``parameters``: the routes, and the weights single-tensor routes change.
    ``on_result`` is called with each :class:`RouteResult` as it is found (progress).
    Routes marked CUDA-only are skipped for layers on the CPU. Every layer is audited, cache
    or not: a layer that keeps a cache without offering the protocol is still caught stale."""
    make_layer, default_label = as_layer_factory(impl_or_factory)
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    unknown = set(routes) - set(ROUTES)
    if unknown:
        raise ValueError(f"routes must be among {ROUTES}, got {sorted(unknown)}")
    if not parameters or set(parameters) - set(EXPERT_PARAMS):
        raise ValueError(f"parameters must be a non-empty subset of {EXPERT_PARAMS}, got {parameters}")
    device = torch.device(device)
    label = label or default_label
    protocol = cache_protocol(make_layer(config, draw_state(config, seed, device), device))
    results = []
    for change in WEIGHT_CHANGES:
        if change.name not in routes:
            continue
        for parameter in parameters if change.per_parameter else ("all",):
            if change.cuda_only and device.type != "cuda":
                found = RouteResult(change.name, parameter, SKIPPED,
                                    protocol.promises.get(change.name, DETECTED), None, None,
                                    "needs a layer on a CUDA device")
            else:
                found = _audit_one(make_layer, change, parameter, config=config, device=device,
                                   num_tokens=num_tokens, seed=seed)
            results.append(found)
            if on_result is not None:
                on_result(found)
    return CacheReport(label, protocol.offered, protocol.pack_count is not None, results)
