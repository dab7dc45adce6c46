"""Audit inputs: the random problem plus probes built so that one precision point dominates.

Random inputs hide some precision losses: rounding g and u to bf16 before SwiGLU7 adds errors
about as large as the ones the model already allows, so only a factor ~1.4 shows. Each probe
makes one precision point matter, so that a real loss there lands far above the probabilistic
bound while a correct implementation stays under it (the bounds are a-priori in the input
magnitudes, so they hold for any input):

* ``random``: docs/ANCHORS.md's distribution (x N(0,1), weights N(0, 0.02^2)).
* ``cancel-up``: a constant feature drives ``u`` to about -1, so ``v = clamp(u) + 1`` is small:
  rounding ``u`` to bf16 (ulp 2^-8 near 1) before SwiGLU7 costs a large relative error in
  ``v``, while fp32 ``u`` keeps it accurate.
* ``swamp``: two constant features with opposite large gate/up weights (+-8, first and last in
  the head) cancel exactly: a bf16 accumulator holding the partial sum ~8 (ulp 2^-4) swamps
  the small terms between them; fp32 accumulation loses almost nothing.
* ``clamp``: large gate/up weights put ``g`` and ``u`` across the SwiGLU7 clamp at +-7.
"""
from __future__ import annotations

from typing import Callable

import torch

from magi_moe.config import MoEConfig
from magi_moe.problems import Problem, random_problem
from magi_moe.routing import build_route_table, route
from magi_moe.weights import ExpertWeights

PROBE_DESCRIPTIONS = {
    "random": "x N(0,1), weights N(0, 0.02^2) (docs/ANCHORS.md)",
    "cancel-up": "u ~ -1: SwiGLU7's (u + 1) cancels; exposes rounding g,u before SwiGLU7",
    "swamp": "+-8 gate/up weights on constant features; exposes bf16 gate/up accumulation",
    "clamp": "g, u spread across the +-7 clamp (weights std 2.5/sqrt(Dh))",
}
PROBES = tuple(PROBE_DESCRIPTIONS)


def _rebuilt(base: Problem, x: torch.Tensor, weights: ExpertWeights) -> Problem:
    routes = route(x, base.gate, base.bias, base.config)
    return Problem(base.config, x, base.gate, base.bias, weights, routes,
                   build_route_table(routes, base.config))


def _head_columns(config: MoEConfig, index: int) -> list[int]:
    return [h * config.head_dim + index for h in range(config.num_heads)]


def _cancel_up(base: Problem) -> Problem:
    cfg = base.config
    x = base.x.clone()
    x[:, _head_columns(cfg, 0)] = 1.0
    w_up = base.weights.w_up.float() * 0.1   # u's noise ~ 0.002 sqrt(Dh): v stays small
    w_up[:, 0, :] = -1.0
    weights = ExpertWeights(base.weights.w_gate, w_up.to(base.weights.w_up.dtype),
                            base.weights.w_down)
    return _rebuilt(base, x, weights)


def _swamp(base: Problem) -> Problem:
    cfg = base.config
    x = base.x.clone()
    first, last = 0, cfg.head_dim - 1
    x[:, _head_columns(cfg, first)] = 1.0
    x[:, _head_columns(cfg, last)] = 1.0
    w_gate, w_up = base.weights.w_gate.clone(), base.weights.w_up.clone()
    for w in (w_gate, w_up):
        w[:, first, :] = 8.0
        w[:, last, :] = -8.0
    return _rebuilt(base, x, ExpertWeights(w_gate, w_up, base.weights.w_down))


def _clamp(base: Problem) -> Problem:
    scale = 2.5 / (base.config.head_dim ** 0.5) / 0.02
    dtype = base.weights.w_gate.dtype
    weights = ExpertWeights((base.weights.w_gate.float() * scale).to(dtype),
                            (base.weights.w_up.float() * scale).to(dtype), base.weights.w_down)
    return _rebuilt(base, base.x, weights)


_BUILDERS: dict[str, Callable[[Problem], Problem]] = {
    "random": lambda p: p, "cancel-up": _cancel_up, "swamp": _swamp, "clamp": _clamp,
}


def probe_problem(name: str, config: MoEConfig, num_tokens: int, *, seed: int,
                  device="cpu") -> Problem:
    """The probe ``name`` (one of :data:`PROBES`) with ``num_tokens`` tokens, drawn from ``seed``."""
    if name not in _BUILDERS:
        raise ValueError(f"probe must be one of {PROBES}, got {name!r}")
    return _BUILDERS[name](random_problem(config, num_tokens, seed=seed, device=device))
