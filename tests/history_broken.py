"""Deliberately broken variants for the ``history`` clause (a call's result must not depend on
earlier calls on the same objects): each keeps something from an earlier call that it must not.
tests/test_serving_stream.py shows the serving-stream checks (fuzz/serving.py) catch each one,
and pass the correct counterparts.

* :func:`fused_layer_with_memoised_plan`: magi-moe's fused layer whose launch plan
  (:func:`magi_moe.kernels.fused_prepare.prepare_layer`'s ``LayerLaunch``: tiles, plan, workspace
  views) is memoised by config, device, dtype and the weights, but not the token count: a
  larger second call with the same weights runs on the first call's buffers.
* :data:`stale_plan_torch`: a plain-PyTorch implementation whose workspace is cached by the
  weights' addresses and sized by the first call: later, larger calls write only its rows.
* :func:`graph_padding_leak_layer`: a layer whose captured path reduces over the whole captured
  bucket, so on replay the NaN padding rows reach the real rows (CUDA only).
"""
from __future__ import annotations

import torch

from magi_moe.config import MoEConfig
from magi_moe.implementation import Implementation
from magi_moe.layer import MagiMoE
from magi_moe.reference import expert_reference
from magi_moe.validation import check_out

__all__ = ["fused_layer_with_memoised_plan", "forget_plans", "graph_padding_leak_layer",
           "stale_plan_torch"]


# -- (a) the fused layer's launch plan memoised without the token count --------------------------
class MemoisedPlanLayer(MagiMoE):
    """The fused layer, its ``prepare_layer`` memoised per layer WITHOUT the token count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from magi_moe.kernels import fused_layer

        real = fused_layer.prepare_layer
        plans = self.__dict__.setdefault("_plans", {})

        def memoised(config, num_tokens, device, dtype, weights, workspace=None, **kw):
            key = (config, device, dtype, tuple(w.data_ptr() for w in weights))  # BROKEN: no num_tokens
            if key not in plans:
                plans[key] = real(config, num_tokens, device, dtype, weights, workspace, **kw)
            return plans[key]

        fused_layer.prepare_layer = memoised
        try:
            return super().forward(x)
        finally:
            fused_layer.prepare_layer = real


def fused_layer_with_memoised_plan(config: MoEConfig, state_dict, device=None) -> MagiMoE:
    """A layer factory (``make_layer(config, state_dict, device)``): the fused layer, broken."""
    return MemoisedPlanLayer.from_state_dict(state_dict, config, impl="fused")


# -- (b) a plain-PyTorch workspace sized by the first call ---------------------------------------
_WORKSPACES: dict[tuple, torch.Tensor] = {}


def forget_plans() -> None:
    """Drop every cached workspace (a control starts from none)."""
    _WORKSPACES.clear()


def _stale_plan_forward(x, table, weights, config, *, out):
    check_out(out, x)
    key = tuple(w.data_ptr() for w in weights)  # BROKEN: the token count is not in the key
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        workspace = _WORKSPACES[key] = torch.empty(x.shape, dtype=out.dtype, device=x.device)
    rows = min(workspace.shape[0], x.shape[0])
    workspace[:rows] = expert_reference(x, table, weights, config, precision="bf16")[:rows]
    out[:rows] = workspace[:rows]
    return out


stale_plan_torch = Implementation(
    "broken-stale-plan", _stale_plan_forward, ("cpu", "cuda"), "bf16-plain",
    description="BROKEN on purpose: a workspace cached by the weights' addresses, sized by the "
                "first call's token count")


# -- (c) a captured graph whose padding rows reach the real rows ---------------------------------
class GraphPaddingLeakLayer(MagiMoE):
    """Right when run eagerly; while a CUDA graph captures it, it adds ``0 * x.sum(0)`` (a
    reduction over the whole bucket), so NaN padding rows poison every row on replay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            y = y + 0 * x.sum(0)  # BROKEN: the padding rows reach the real rows
        return y


def graph_padding_leak_layer(config: MoEConfig, state_dict, device=None) -> MagiMoE:
    """A layer factory: magi-moe's default layer, broken under graph capture only."""
    return GraphPaddingLeakLayer.from_state_dict(state_dict, config)
