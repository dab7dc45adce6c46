"""CUDA-graph replay auditor (CONTRACT section 8b): capture a layer's forward, change its
weights by each route, replay, and compare with the float64 reference of the *new* weights.

Two ways of capturing: ``torch.cuda.CUDAGraph`` directly, and ``torch.compile(layer,
mode="reduce-overhead")`` (inductor's CUDA graphs). A captured graph replays the device addresses it captured, and no Python runs on replay: a
change that writes the existing storage is seen, a change that swaps storage is not (the
replay reads the old buffer, or whatever the allocator put there since). Each route ends as:

- ``graph-safe``: the replay computed with the new weights;
- ``stale``: it did not (a finding, unless the layer promises ``"recapture"`` for that route in
  its ``graph_promises`` mapping; then a fresh capture must see the new weights);
- ``refused``: the change or the replay raised (the layer refuses the change under a graph).

Works on any layer a factory ``make_layer(config, state_dict, device)`` builds (an
implementation's :meth:`~magi_moe.implementation.Implementation.layer`): the weights are reached
by their released names through ``get_parameter`` / ``load_state_dict``, the reference is
computed from ``layer.state_dict()`` as it is after the change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from magi_moe.config import MoEConfig
from magi_moe.cuda_graphs import capture as capture_call

from .cache import WRONG_BEFORE_ANY_CHANGE, draw_state, layer_output_ok

GRAPH_SAFE, STALE, REFUSED, RECAPTURE = "graph-safe", "stale", "refused", "recapture"
LayerFactory = Callable[[MoEConfig, Mapping[str, torch.Tensor], object], torch.nn.Module]


def _param(layer, name):
    return layer.get_parameter(name)


def _in_place(layer, name, new):
    with torch.no_grad():
        p = _param(layer, name)
        p.add_(new - p)


def _copy(layer, name, new):
    with torch.no_grad():
        _param(layer, name).copy_(new)


def _data_copy(layer, name, new):
    _param(layer, name).data.copy_(new)


def _data_assign(layer, name, new):
    _param(layer, name).data = new.clone()


def _inference_write(layer, name, new):
    with torch.inference_mode():
        _param(layer, name).copy_(new)


def _load(layer, name, new):
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    state[name] = new.clone()
    layer.load_state_dict(state)


def _load_assign(layer, name, new):
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    state[name] = new.clone()
    layer.load_state_dict(state, assign=True)


@dataclass(frozen=True)
class GraphRoute:
    name: str
    description: str
    apply: Callable


GRAPH_ROUTES = (
    GraphRoute("in_place", "W.add_(delta) under no_grad", _in_place),
    GraphRoute("copy_no_grad", "W.copy_(new) under no_grad", _copy),
    GraphRoute("param_data_copy", "W.data.copy_(new)", _data_copy),
    GraphRoute("inference_mode", "W.copy_(new) inside torch.inference_mode", _inference_write),
    GraphRoute("load_state_dict", "layer.load_state_dict(new)", _load),
    GraphRoute("load_assign", "layer.load_state_dict(new, assign=True)", _load_assign),
    GraphRoute("param_data_assign", "W.data = new (a new storage)", _data_assign),
)


@dataclass
class GraphResult:
    route: str
    parameter: str
    status: str        # graph-safe / stale / refused
    promised: str      # graph-safe or recapture
    detail: str
    recapture_ok: bool | None = None

    @property
    def ok(self) -> bool:
        if self.status in (GRAPH_SAFE, REFUSED):
            return True
        return self.promised == RECAPTURE and bool(self.recapture_ok)

    def to_dict(self) -> dict:
        return dict(self.__dict__, ok=self.ok)


def fresh(config: MoEConfig, layer, x: torch.Tensor, y: torch.Tensor) -> tuple[bool, str]:
    """Is ``y`` the layer's output for ``x`` on its *current* weights (``state_dict()``)?"""
    return layer_output_ok(layer, x, y, config=config)


def _capture(layer, x: torch.Tensor):
    """Warm up on a side stream (as torch.cuda.graphs asks), then capture ``y = layer(x)``;
    returns ``replay() -> y``."""
    def forward():
        with torch.no_grad():
            return layer(x)

    graph, y = capture_call(forward, warmup=2)

    def replay():
        graph.replay()
        torch.cuda.synchronize()
        return y
    return replay


def _compile(layer, x: torch.Tensor):
    """``torch.compile(layer, mode="reduce-overhead")``: inductor's CUDA graphs, recorded over
    the first calls; returns ``replay() -> y`` (a copy: the graph's output is reused)."""
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=False)

    def replay():
        with torch.no_grad():
            y = compiled(x).clone()
        torch.cuda.synchronize()
        return y
    for _ in range(3):
        replay()
    return replay


CAPTURES = {"cudagraph": _capture, "compile": _compile}


def _audit_route(make_layer: LayerFactory, config: MoEConfig, graph_route: GraphRoute,
                 parameter: str, *, num_tokens: int, seed: int, device, capture: str) -> GraphResult:
    state = draw_state(config, seed, device)
    new = draw_state(config, seed + 1, device)[parameter]
    layer = make_layer(config, state, device)
    promised = dict(getattr(layer, "graph_promises", {}) or {}).get(graph_route.name, GRAPH_SAFE)
    gen = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(num_tokens, config.hidden_size, generator=gen).to(dtype=config.dtype, device=device)
    route_name = graph_route.name if capture == "cudagraph" else f"{graph_route.name} ({capture})"

    def result(status, detail, recapture_ok=None):
        return GraphResult(route_name, parameter, status, promised, detail, recapture_ok)

    try:
        replay = CAPTURES[capture](layer, x)
        ok, how = fresh(config, layer, x, replay())
        if not ok:
            return GraphResult(route_name, parameter, STALE, GRAPH_SAFE,
                               f"{WRONG_BEFORE_ANY_CHANGE} ({how})")
    except Exception as exc:  # noqa: BLE001 -- a layer that cannot be captured is a finding
        return result(REFUSED, f"capture failed: {type(exc).__name__}: {str(exc)[:300]}")
    try:
        graph_route.apply(layer, parameter, new)
        y = replay()
    except Exception as exc:  # noqa: BLE001 -- a refusal, reported with its reason
        return result(REFUSED, f"{type(exc).__name__}: {str(exc)[:300]}")
    ok, how = fresh(config, layer, x, y)
    if ok:
        return result(GRAPH_SAFE, f"replay used the new weights ({how})")
    # stale: does a fresh capture see the new weights (what "recapture" promises)?
    try:
        recaptured, how2 = fresh(config, layer, x, CAPTURES[capture](layer, x)())
    except Exception as exc:  # noqa: BLE001
        recaptured, how2 = False, f"recapture failed: {type(exc).__name__}: {exc}"
    return result(STALE, f"replay served the old weights ({how}); after recapture: "
                         f"{'fresh' if recaptured else 'STILL WRONG'} ({how2})", recaptured)


def audit_graph_replay(make_layer: LayerFactory, config: MoEConfig, *, device="cuda",
                       num_tokens: int = 64, seed: int = 0,
                       parameters: tuple[str, ...] = ("W_gate", "W_down"),
                       captures: tuple[str, ...] = ("cudagraph", "compile"),
                       on_result: Callable[[GraphResult], None] | None = None,
                       routes: tuple[str, ...] | None = None) -> list[GraphResult]:
    """Every route of :data:`GRAPH_ROUTES` (or those named in ``routes``) for each of
    ``parameters`` and each way of capturing (``cudagraph``: ``torch.cuda.CUDAGraph``;
    ``compile``: ``torch.compile(mode="reduce-overhead")``), on a fresh layer each."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"device must be a CUDA device (CUDA graphs), got {device!r}")
    unknown = set(captures) - set(CAPTURES)
    if not captures or unknown:
        raise ValueError(f"captures must be a non-empty subset of {tuple(CAPTURES)}, got {captures}")
    known = [r.name for r in GRAPH_ROUTES]
    if routes is not None and (not routes or set(routes) - set(known)):
        raise ValueError(f"routes must be a non-empty subset of {known}, got {routes}")
    results = []
    for capture in captures:
        for graph_route in GRAPH_ROUTES:
            if routes is not None and graph_route.name not in routes:
                continue
            for parameter in parameters:
                found = _audit_route(make_layer, config, graph_route, parameter,
                                     num_tokens=num_tokens, seed=seed, device=device, capture=capture)
                results.append(found)
                if on_result is not None:
                    on_result(found)
    return results
