"""Weight-cache auditor (CONTRACT section 5): after every way a user changes weights, the next
forward must use the new weights; without a change, nothing is repacked.

It works against the cache protocol: a layer (a ``MagiMoE``) whose ``weight_cache`` has
``pack_count`` (packs done so far) and ``invalidate()``, and ``layer.invalidate_weight_cache()``.
A cache may declare ``promises``, a mapping from route name to ``"needs invalidate()"``, for the
routes where it asks users to call the invalidation; every other route must be detected.

For each route (and, for single-tensor routes, each of ``W_gate``, ``W_up``, ``W_down``) on a
fresh layer from the caller's factory:

1. forward twice: the second must not repack (``pack_count`` unchanged);
2. change the weights by the route;
3. forward: the output must match the float64 reference *on the current weights* within the
   worst-case bound (``bf16-plain`` model, the loosest any implementation is held to; stale
   weights miss it by orders of magnitude) -> "detected";
4. if stale, ``invalidate_weight_cache()`` and forward again: fresh -> "needs invalidate()",
   else (or on an error) "unsupported".
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from magi_moe.routing import build_route_table, route
from magi_moe.weights import ExpertWeights

from .bounds import compute_error_bounds, evaluate_bounds

EXPERT_PARAMS = ("W_gate", "W_up", "W_down")
DETECTED, NEEDS_INVALIDATE, UNSUPPORTED, SKIPPED = (
    "detected", "needs invalidate()", "unsupported", "skip")
FRESHNESS_MODEL = "bf16-plain"

LayerFactory = Callable[[], nn.Module]


# -- the routes ------------------------------------------------------------------------------

def _in_place(layer, name, new):
    with torch.no_grad():
        getattr(layer, name).add_(new - getattr(layer, name))


def _copy_no_grad(layer, name, new):
    with torch.no_grad():
        getattr(layer, name).copy_(new)


def _data_assign(layer, name, new):
    getattr(layer, name).data = new.clone()


def _data_copy(layer, name, new):
    getattr(layer, name).data.copy_(new)


def _load_state_dict(layer, _name, new_state):
    layer.load_state_dict(new_state)


def _new_storage(layer, _name, new_state):
    # An mmap-backed checkpoint swapped in: the parameters become new tensors on new storage.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        torch.save({k: v.cpu() for k, v in new_state.items()}, path)
        loaded = torch.load(path, mmap=True)
        device = next(layer.parameters()).device
        layer.load_state_dict({k: v.to(device) for k, v in loaded.items()}, assign=True)


def _to_dtype_roundtrip(layer, _name, new_state):
    layer.to(torch.float32)
    with torch.no_grad():
        for name in EXPERT_PARAMS:
            getattr(layer, name).copy_(new_state[name].float())
    layer.to(new_state["W_gate"].dtype)
    # module.to(dtype) also converts the router; put it back to fp32 as checkpoint loaders keep it
    for t in (layer.gate, layer.router.expert_bias, layer.router.expert_bias_ema):
        t.data = t.data.float()


def _to_device_roundtrip(layer, _name, new_state):
    device = next(layer.parameters()).device
    layer.cpu()
    with torch.no_grad():
        for name in EXPERT_PARAMS:
            getattr(layer, name).copy_(new_state[name].cpu())
    layer.to(device)


@dataclass(frozen=True)
class WeightChange:
    name: str
    description: str
    apply: Callable
    per_parameter: bool          # applied to each expert weight in turn, else to the whole layer
    cuda_only: bool = False
    inference_mode: bool = False  # layer built, changed and run under torch.inference_mode()


WEIGHT_CHANGES = (
    WeightChange("in_place", "in-place op under no_grad: W.add_(delta)", _in_place, True),
    WeightChange("copy_no_grad", "W.copy_(new) under no_grad", _copy_no_grad, True),
    WeightChange("load_state_dict", "layer.load_state_dict(new)", _load_state_dict, False),
    WeightChange("param_data_assign", "W.data = new (new data_ptr, same _version)", _data_assign, True),
    WeightChange("param_data_copy", "W.data.copy_(new) (id, data_ptr and _version unchanged)",
                 _data_copy, True),
    WeightChange("new_storage", "load_state_dict(torch.load(mmap=True), assign=True)",
                 _new_storage, False),
    WeightChange("to_dtype", "layer.to(float32), change, layer.to(bfloat16) (router back to fp32)",
                 _to_dtype_roundtrip, False),
    WeightChange("to_device", "layer.cpu(), change, layer.to(cuda)", _to_device_roundtrip, False,
                 cuda_only=True),
    WeightChange("inference_mode", "layer built and W.copy_(new) under torch.inference_mode "
                 "(tensors without a version counter)", _copy_no_grad, True, inference_mode=True),
)
ROUTES = tuple(c.name for c in WEIGHT_CHANGES)


# -- results ---------------------------------------------------------------------------------

@dataclass
class RouteResult:
    route: str
    parameter: str
    status: str
    promised: str
    repacks_after_change: int
    repacks_without_change: int
    detail: str

    @property
    def ok(self) -> bool:
        if self.status == SKIPPED:
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
    has_cache: bool
    results: list[RouteResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def by_route(self) -> dict[str, str]:
        """Worst status per route over its parameters."""
        order = [DETECTED, SKIPPED, NEEDS_INVALIDATE, UNSUPPORTED]
        out: dict[str, str] = {}
        for r in self.results:
            prev = out.get(r.route)
            out[r.route] = r.status if prev is None else max(prev, r.status, key=order.index)
        return out

    def summary(self) -> str:
        if not self.has_cache:
            return f"{self.label}: no weight cache (every forward reads the parameters)"
        parts = ", ".join(f"{k}: {v}" for k, v in self.by_route().items())
        bad = [f"{r.route}/{r.parameter}" for r in self.results if not r.ok]
        return f"{self.label}: {parts} -> {'ok' if self.ok else 'VIOLATIONS: ' + ', '.join(bad)}"

    def to_dict(self) -> dict:
        return {"label": self.label, "has_cache": self.has_cache, "ok": self.ok,
                "by_route": self.by_route(), "results": [r.to_dict() for r in self.results]}


# -- the audit -------------------------------------------------------------------------------

def _draw_state(layer, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, value in layer.state_dict().items():
        drawn = torch.randn(value.shape, generator=gen) * (std if name in EXPERT_PARAMS else 0.25)
        if name.startswith("router."):
            drawn = torch.zeros(value.shape)
        state[name] = drawn.to(dtype=value.dtype, device=value.device)
    return state


def _pack_count(layer) -> int:
    return int(layer.weight_cache.pack_count)


def _invalidate(layer) -> None:
    if hasattr(layer, "invalidate_weight_cache"):
        layer.invalidate_weight_cache()
    else:
        layer.weight_cache.invalidate()


def layer_output_ok(layer, x: torch.Tensor, y: torch.Tensor) -> tuple[bool, str]:
    """Does the layer's output ``y`` for ``x`` match the float64 reference on the layer's
    *current* weights (routing recomputed as the layer does) within the worst-case bound?"""
    cfg = layer.config
    with torch.no_grad():
        gate, bias = layer.gate.detach().clone(), layer.selection_bias
        bias = None if bias is None else bias.detach().clone()
        table = build_route_table(route(x.clone(), gate, bias, cfg), cfg)
        weights = ExpertWeights(*(getattr(layer, n).detach().clone().to(x.dtype) for n in EXPERT_PARAMS))
        bounds = compute_error_bounds(x.clone(), table, weights, cfg, [FRESHNESS_MODEL])[FRESHNESS_MODEL]
        report = evaluate_bounds(y.detach().clone(), bounds)
    return report.proven_ok, f"max error / worst-case bound {report.worst_max_ratio:.3g}"


def _audit_one(make_layer: LayerFactory, change: WeightChange, parameter: str, *,
               num_tokens: int, seed: int, promises: dict[str, str]) -> RouteResult:
    promised = promises.get(change.name, DETECTED)

    def result(status, detail, after=0, without=0):
        return RouteResult(change.name, parameter, status, promised, after, without, detail)

    ctx = torch.inference_mode() if change.inference_mode else contextlib.nullcontext()
    with ctx:
        layer = make_layer()
        state = _draw_state(layer, seed)
        with torch.no_grad():
            for name in EXPERT_PARAMS + ("gate",):
                getattr(layer, name).copy_(state[name])
        cfg = layer.config
        gen = torch.Generator().manual_seed(seed + 7)
        x = torch.randn(num_tokens, cfg.hidden_size, generator=gen).to(
            dtype=cfg.dtype, device=layer.W_gate.device)
        new_state = _draw_state(layer, seed + 1)
        new_state["gate"] = state["gate"]  # keep the routing: only expert weights change
        try:
            layer(x)
            before = _pack_count(layer)
            y = layer(x)
            without = _pack_count(layer) - before
            fresh, how = layer_output_ok(layer, x, y)
            if not fresh:
                return result(UNSUPPORTED, f"wrong before any change ({how})", 0, without)
            change.apply(layer, parameter, new_state[parameter] if change.per_parameter else new_state)
            before = _pack_count(layer)
            y = layer(x)
            after = _pack_count(layer) - before
            fresh, how = layer_output_ok(layer, x, y)
            if fresh:
                before = _pack_count(layer)
                layer(x)
                without += _pack_count(layer) - before
                return result(DETECTED, f"fresh without invalidate() ({how}); "
                              f"{after} repack(s)", after, without)
            _invalidate(layer)
            y = layer(x)
            fresh_after, how_after = layer_output_ok(layer, x, y)
            if fresh_after:
                return result(NEEDS_INVALIDATE, f"served stale weights ({how}); fresh after "
                              f"invalidate() ({how_after})", after, without)
            return result(UNSUPPORTED, f"stale even after invalidate() ({how_after})", after, without)
        except Exception as exc:  # noqa: BLE001 -- an error is a finding, reported per route
            return result(UNSUPPORTED, f"{type(exc).__name__}: {exc}")


def audit_weight_cache(make_layer: LayerFactory, *, label: str = "", num_tokens: int = 16,
                       seed: int = 0, routes: tuple[str, ...] = ROUTES,
                       parameters: tuple[str, ...] = EXPERT_PARAMS,
                       on_result: Callable[[RouteResult], None] | None = None) -> CacheReport:
    """Audit the weight cache of the layers ``make_layer()`` builds (each route gets a fresh one).

    ``routes`` / ``parameters``: the routes, and the weights single-tensor routes change.
    ``on_result`` is called with each :class:`RouteResult` as it is found (progress).
    Routes marked CUDA-only are skipped for layers on the CPU."""
    unknown = set(routes) - set(ROUTES)
    if unknown:
        raise ValueError(f"routes must be among {ROUTES}, got {sorted(unknown)}")
    if not parameters or set(parameters) - set(EXPERT_PARAMS):
        raise ValueError(f"parameters must be a non-empty subset of {EXPERT_PARAMS}, got {parameters}")
    probe = make_layer()
    label = label or type(probe).__name__
    cache = getattr(probe, "weight_cache", None)
    if cache is None:
        return CacheReport(label, False, [])
    for attr in ("pack_count", "invalidate"):
        if not hasattr(cache, attr):
            raise ValueError(f"{label}.weight_cache must have {attr!r} (the cache protocol)")
    promises = dict(getattr(cache, "promises", {}) or {})
    on_cuda = probe.W_gate.device.type == "cuda"
    del probe
    results = []
    for change in WEIGHT_CHANGES:
        if change.name not in routes:
            continue
        for parameter in parameters if change.per_parameter else ("all",):
            if change.cuda_only and not on_cuda:
                found = RouteResult(change.name, parameter, SKIPPED,
                                    promises.get(change.name, DETECTED), 0, 0,
                                    "needs a layer on a CUDA device")
            else:
                found = _audit_one(make_layer, change, parameter, num_tokens=num_tokens,
                                   seed=seed, promises=promises)
            results.append(found)
            if on_result is not None:
                on_result(found)
    return CacheReport(label, True, results)
