"""What the benchmark times: one zero-argument callable per path (an implementation at kernel
level, an implementation's own layer, a router), and each path's error against float64."""
from __future__ import annotations

from typing import Callable

import torch

from ..implementation import Implementation
from ..problems import Problem, relative_l2
from ..reference import expert_reference
from ..registry import get_implementation
from ..routing import build_route_table, route

EXPERT_PATHS = ("native", "native-det", "fused", "torch-bf16")
LAYER_PATHS = ("fused-layer", "native-layer")
ROUTING_PATHS = ("routing", "fused-routing")
ALL_PATHS = EXPERT_PATHS + LAYER_PATHS + ROUTING_PATHS
DEFAULT_PATHS = ("native", "native-det", "fused", "fused-layer")


def _layer(problem: Problem, impl: Implementation):
    """The implementation's own layer (:meth:`Implementation.layer`) loaded with the problem's
    weights; the selection bias is the problem's in both bias slots."""
    sd = {"gate": problem.gate, "W_gate": problem.weights.w_gate, "W_up": problem.weights.w_up,
          "W_down": problem.weights.w_down, "router.expert_bias": problem.bias,
          "router.expert_bias_ema": problem.bias}
    return impl.layer(problem.config, {k: v.clone() for k, v in sd.items()}, problem.x.device)


def _expert_path(problem: Problem, impl: Implementation, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Kernel level: routes precomputed, weights prepared once as the implementation declares
    (packed for ``fused``), the output pre-allocated."""
    p = problem
    weights = impl.prepare_weights(p.weights) if impl.prepare_weights else p.weights
    out = out if impl.output_dtype(p.x.dtype) == out.dtype else torch.empty_like(
        out, dtype=impl.output_dtype(p.x.dtype))
    return lambda: impl(p.x, p.table, weights, p.config, out=out)


class _LayerCall:
    """``layer(x)`` as a path; keeps ``layer`` reachable for the compiled rows."""

    def __init__(self, layer: torch.nn.Module, x: torch.Tensor):
        self.layer, self.x = layer, x

    def __call__(self) -> torch.Tensor:
        return self.layer(self.x)


def make_paths(problem: Problem, names: tuple[str, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """One zero-argument callable per path, all state (outputs, packed weights, layers) built
    here so that the timed call does only the path's own work. An expert path is named by its
    implementation; ``NAME-layer`` is that implementation's own layer (routing included)."""
    from ..kernels.fused_routing import fused_route

    p, cfg = problem, problem.config
    x = p.x
    out = torch.empty_like(x)
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for name in names:
        if name in EXPERT_PATHS:
            fns[name] = _expert_path(p, get_implementation(name), out)
        elif name in LAYER_PATHS:
            layer = _layer(p, get_implementation(name.removesuffix("-layer")))
            fns[name] = _LayerCall(layer, x)
        elif name == "routing":
            fns[name] = lambda: build_route_table(route(x, p.gate, p.bias, cfg), cfg).offsets
        elif name == "fused-routing":
            fns[name] = lambda: fused_route(x, p.gate, p.bias, cfg, block_m=64).table.offsets
        else:
            raise ValueError(f"paths must be among {ALL_PATHS}, got {name!r}")
    return fns


def parity(problem: Problem, fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, dict]:
    """Relative L2 error of every expert/layer path against float64 on the routes it used: the
    problem's table for kernel-level paths and the torch-routed layer, the fused router's own
    table for ``fused-layer`` (whose route differences from the torch router are counted, with
    the largest float64 selection-score gap among them: a near-tie is a gap at fp32 rounding)."""
    from ..kernels.fused_routing import fused_route
    from ..routing import router_logits, scores_from_logits

    p, cfg = problem, problem.config
    ref = expert_reference(p.x, p.table, p.weights, cfg, precision="float64")
    report: dict[str, dict] = {"reference_rms": float(ref.pow(2).mean().sqrt())}
    for name, fn in fns.items():
        if name in ROUTING_PATHS:
            continue
        out = fn().clone()
        want = ref
        entry: dict = {}
        if name == "fused-layer":
            routes = fused_route(p.x, p.gate, p.bias, cfg)
            want = expert_reference(p.x, routes.table, p.weights, cfg, precision="float64")
            ids, torch_ids = routes.expert_ids.long(), p.routes.expert_ids
            differ = (ids != torch_ids).any(-1)
            entry["route_mismatches"] = int(differ.sum())
            if entry["route_mismatches"]:
                sel = scores_from_logits(router_logits(p.x, p.gate, cfg, torch.float64),
                                         cfg.score_func) + p.bias.view(cfg.num_heads, -1).double()
                picked = torch.gather(sel, -1, ids).sum(-1)
                torch_picked = torch.gather(sel, -1, torch_ids).sum(-1)
                entry["max_mismatch_gap"] = float((picked - torch_picked)[differ].abs().max())
        entry.update(rel_l2=relative_l2(out, want), max_abs=float((out.double() - want).abs().max()),
                     nan=bool(torch.isnan(out).any()))
        report[name] = entry
    return report
