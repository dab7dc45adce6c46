"""Outside *layers*: MoE modules of their own (not ``MagiMoE``), each declared through an
``Implementation(..., layer_factory=...)`` as an outside team would, with its own parameters
(released names) and its own packed-weight copy cache.

* :data:`VERSION_KEYED_LAYER` (BROKEN on purpose): the cache repacks when an expert weight's
  ``(data_ptr, _version)`` changes. ``param.data.copy_(new)`` changes neither (``.data`` is a
  new tensor with its own version counter over the same memory), so the layer keeps serving the
  old weights. Inference tensors have no version counter (reading ``_version`` raises); the
  cache takes that as "no version" and keeps its copy, so writes inside
  ``torch.inference_mode`` are missed too. Every other route moves the pointer or bumps the
  version and is noticed.
* :data:`CONTENT_CHECKED_LAYER` (correct): the same layer whose cache compares the weights'
  dtype, device and values with the copy it packed (slow, always fresh).
* :data:`UNCACHED_LAYER` (correct): no cache and no cache protocol; it reads its parameters on
  every call.
* :data:`SWAPPED_CHECKPOINT_LAYER` (BROKEN on purpose): the uncached layer, loading the
  checkpoint's ``W_gate`` into its ``W_up`` and ``W_up`` into its ``W_gate``. It is right on
  what it holds, so every weight-change route passes it; only the checkpoint row
  (``tests/test_layer_checkpoint.py``) compares it with what it was given.

Outside *routers*, each declared as ``Implementation(..., router=...)`` with this module's
expert sum, BROKEN on purpose (each passes every expert-level check: the routes are an input
there); the router judge (:mod:`audit.router_judge`) must name the rule each breaks, in
``magi-moe check``, the audit and the fuzzers:

* :data:`ROUTER_FORGETS_L1`: the chosen scores times ``route_scale``, never L1-normalised.
* :data:`ROUTER_TIES_TO_HIGHER_INDEX`: a scan keeping the last of equal selection scores.
* :data:`ROUTER_BIAS_IN_WEIGHTS`: the weights taken from the biased selection scores.

Both cached layers offer ``layer.pack_count`` and nothing else of the cache protocol (no
invalidation, no promises). They compute the expert part in fp32 with one bf16 rounding of the
SwiGLU7 output, on routes from :func:`magi_moe.routing.route`.
Not registered: tests import them directly.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from magi_moe.config import MoEConfig
from magi_moe.implementation import Implementation
from magi_moe.routing import (RouteTable, Routes, build_route_table, route, router_logits,
                              scores_from_logits, select_experts)

__all__ = ["CONTENT_CHECKED_LAYER", "ROUTER_BIAS_IN_WEIGHTS", "ROUTER_FORGETS_L1",
           "ROUTER_TIES_TO_HIGHER_INDEX", "SWAPPED_CHECKPOINT_LAYER", "UNCACHED_LAYER",
           "VERSION_KEYED_LAYER", "OutsideMoE"]

EXPERTS = ("W_gate", "W_up", "W_down")
KEYS = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias", "router.expert_bias_ema")


def expert_sum(x: torch.Tensor, table: RouteTable, w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """``y`` ``[S, H*Dh]`` in ``x.dtype``: each route's SwiGLU7 expert, weighted, summed in fp32."""
    S, (H, E, Dh) = x.shape[0], (config.num_heads, config.num_experts, config.head_dim)
    acc = torch.zeros(S, H, Dh, dtype=torch.float32, device=x.device)
    offsets = table.offsets.tolist()
    for bank in range(H * E):
        lo, hi = offsets[bank], offsets[bank + 1]
        if lo == hi:
            continue
        h = bank // E
        tokens = table.gather_ids[lo:hi].long()
        xs = x[tokens, h * Dh:(h + 1) * Dh].float()
        g = (xs @ w_gate[bank].float()).clamp(max=7.0)
        u = (xs @ w_up[bank].float()).clamp(-7.0, 7.0)
        act = (g * torch.sigmoid(1.702 * g) * (u + 1.0)).to(x.dtype).float()
        rows = (act @ w_down[bank].float()) * table.sorted_probs[lo:hi, None].float()
        acc[:, h].index_add_(0, tokens, rows)
    return acc.reshape(S, H * Dh).to(x.dtype)


def _forward(x, table, weights, config, *, out):
    return out.copy_(expert_sum(x, table, weights.w_gate, weights.w_up, weights.w_down, config))


# -- the caches ----------------------------------------------------------------------------------

class _CopyCache:
    """A packed copy of the expert weights: gate and up in one ``[H*E, Dh, 2I]`` bank, down
    copied. Repacks whenever :meth:`current` says the parameters moved on."""

    def __init__(self) -> None:
        self.pack_count = 0
        self._packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def weights(self, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self._packed is None or not self.current(params):
            w_gate, w_up, w_down = (p.detach() for p in params)
            inter = w_gate.shape[-1]
            bank = torch.cat([w_gate, w_up], dim=-1)  # a copy
            self._packed = (bank[..., :inter], bank[..., inter:], w_down.clone())
            self.remember(params)
            self.pack_count += 1
        return self._packed


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter
        return None


class VersionKeyedCache(_CopyCache):
    """BROKEN on purpose: keyed on ``(data_ptr, _version)`` of each expert weight."""

    @staticmethod
    def _key(params) -> tuple:
        return tuple((p.data_ptr(), _version(p)) for p in params)

    def remember(self, params) -> None:
        self._seen = self._key(params)

    def current(self, params) -> bool:
        return self._key(params) == self._seen


class ContentCheckedCache(_CopyCache):
    """Correct: compares dtype, device, shape and values with a snapshot of what it packed."""

    def remember(self, params) -> None:
        self._snapshot = tuple(p.detach().clone() for p in params)

    def current(self, params) -> bool:
        return all(p.dtype == s.dtype and p.device == s.device and torch.equal(p.detach(), s)
                   for p, s in zip(params, self._snapshot))


# -- the layer -----------------------------------------------------------------------------------

class _Router(nn.Module):
    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        super().__init__()
        for name in ("expert_bias", "expert_bias_ema"):
            self.register_buffer(name, state_dict[f"router.{name}"].detach().clone())


class OutsideMoE(nn.Module):
    """An outside MAGI-2 head-routed MoE layer, built from a released-layout state dict.
    ``cache``: a :class:`VersionKeyedCache`, a :class:`ContentCheckedCache` or None."""

    def __init__(self, config: MoEConfig, state_dict: Mapping[str, torch.Tensor],
                 cache: _CopyCache | None):
        super().__init__()
        missing = [k for k in KEYS if k not in state_dict]
        unexpected = sorted(set(state_dict) - set(KEYS))
        if missing or unexpected:
            raise ValueError(f"state_dict must hold exactly {KEYS}: missing {missing}, "
                             f"unexpected {unexpected}")
        self.config = config
        for name in ("gate",) + EXPERTS:  # own storage, never the caller's tensors
            self.register_parameter(name, nn.Parameter(state_dict[name].detach().clone(),
                                                       requires_grad=False))
        self.router = _Router(state_dict)
        self._cache = cache

    @property
    def pack_count(self) -> int:
        """Packs so far (the optional cache protocol); absent (hasattr False) without a cache."""
        if self._cache is None:
            raise AttributeError(f"{type(self).__name__} keeps no cache: no pack_count")
        return self._cache.pack_count

    def expert_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.W_gate, self.W_up, self.W_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
            raise ValueError(f"x must have shape [S, {cfg.hidden_size}], got {tuple(x.shape)}")
        table = build_route_table(route(x, self.gate, self.router.expert_bias_ema, cfg), cfg)
        params = self.expert_params()
        w_gate, w_up, w_down = params if self._cache is None else self._cache.weights(params)
        return expert_sum(x, table, w_gate, w_up, w_down, cfg)


def _factory(cache_type):
    def make(config: MoEConfig, state_dict: Mapping[str, torch.Tensor], device=None) -> nn.Module:
        return OutsideMoE(config, state_dict, cache=cache_type() if cache_type else None)
    return make


def _declare(name: str, cache_type, description: str) -> Implementation:
    return Implementation(name, _forward, ("cpu",), "bf16-plain", layer_factory=_factory(cache_type),
                          capabilities={"weight_cache"} if cache_type else set(),
                          description=description)


VERSION_KEYED_LAYER = _declare(
    "outside-version-keyed-cache", VersionKeyedCache,
    "BROKEN on purpose: an outside layer whose packed copy is keyed on (data_ptr, _version)")
CONTENT_CHECKED_LAYER = _declare(
    "outside-content-checked-cache", ContentCheckedCache,
    "an outside layer whose packed copy is checked against the weights' contents")
UNCACHED_LAYER = _declare(
    "outside-uncached", None, "an outside layer without a cache")


def _swapped_checkpoint(config: MoEConfig, state_dict: Mapping[str, torch.Tensor],
                        device=None) -> nn.Module:
    swapped = {**state_dict, "W_gate": state_dict["W_up"], "W_up": state_dict["W_gate"]}
    return OutsideMoE(config, swapped, cache=None)


SWAPPED_CHECKPOINT_LAYER = Implementation(
    "outside-swapped-checkpoint", _forward, ("cpu",), "bf16-plain",
    layer_factory=_swapped_checkpoint,
    description="BROKEN on purpose: an outside layer loading W_gate and W_up the wrong way round")


# -- the routers -----------------------------------------------------------------------------------

def _scores(x, gate, bias, config):
    """fp32 scores and selection scores ``[S, H, E]``, as the contract computes them."""
    scores = scores_from_logits(router_logits(x, gate, config), config.score_func)
    H, E = config.num_heads, config.num_experts
    return scores, scores if bias is None else scores + bias.reshape(H, E).float()


def _forgets_l1(x, gate, bias, config) -> Routes:
    scores, selection = _scores(x, gate, bias, config)
    ids = select_experts(selection, config.top_k)
    # BUG (on purpose): no division by max(sum, 1e-12) even when config.route_norm
    return Routes(ids, torch.gather(scores, -1, ids) * config.route_scale)


def _ties_to_higher_index(x, gate, bias, config) -> Routes:
    scores, selection = _scores(x, gate, bias, config)
    E = config.num_experts
    key = torch.nan_to_num(selection.flip(-1), nan=float("-inf"))
    # BUG (on purpose): a scan from the top index that keeps the last of equal scores
    ids = (E - 1) - torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :config.top_k]
    return Routes(ids, _weigh(scores, ids, config))


def _weigh(scores, ids, config):
    probs = torch.gather(scores, -1, ids)
    if config.route_norm:
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    return probs * config.route_scale


def _bias_in_weights(x, gate, bias, config) -> Routes:
    _, selection = _scores(x, gate, bias, config)
    ids = select_experts(selection, config.top_k)
    return Routes(ids, _weigh(selection, ids, config))  # BUG (on purpose): biased weights


def _declare_router(name: str, router, description: str) -> Implementation:
    return Implementation(name, _forward, ("cpu",), "bf16-plain", router=router,
                          description=description)


ROUTER_FORGETS_L1 = _declare_router(
    "outside-router-forgets-l1", _forgets_l1,
    "BROKEN on purpose: an outside router that never L1-normalises its weights")
ROUTER_TIES_TO_HIGHER_INDEX = _declare_router(
    "outside-router-ties-high", _ties_to_higher_index,
    "BROKEN on purpose: an outside router whose ties go to the higher expert index")
ROUTER_BIAS_IN_WEIGHTS = _declare_router(
    "outside-router-bias-weights", _bias_in_weights,
    "BROKEN on purpose: an outside router that weighs with the biased selection scores")
