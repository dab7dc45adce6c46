"""Deliberately broken variants for the ``row-isolation`` clause (CONTRACT 1): each lets one
token's NaN, Inf or garbage reach other tokens' outputs, as public MoE paths have. Correct on
clean inputs (they pass the accuracy judge), so only the row-isolation checks catch them
(tests/test_row_isolation.py, the ``row_isolation`` fuzz property in tests/test_fuzz_broken.py).

* :data:`per_expert_scale`: each expert's input block is quantised to a dynamic power-of-two
  scale, the amax over the rows routed to that expert (as fp8 paths quantise). Exact on finite
  inputs; one NaN, Inf or overflowing row makes the scale NaN or Inf and every row of that
  expert NaN.
* :data:`per_tensor_scale`: the same with one scale over all of ``x``, a cross-token reduction
  (a normalisation over all tokens): a poisoned row reaches every row, routed or not.
* :data:`nan_route_to_row_zero`: a layer whose dispatch turns a NaN route (the routes of a NaN
  row) into an out-of-range expert id, clamps it to the last expert and parks it on padding row
  0, trusting its weight to mask it: the weight is NaN, and token 0's output turns NaN. Its
  expert forward is right: only the layer form sees it.

Not registered: tests import them; campaigns name them ``magi_moe.tests.isolation_broken:<attr>``.
"""
from __future__ import annotations

import torch

from magi_moe.config import MoEConfig
from magi_moe.implementation import Implementation
from magi_moe.layer import MagiMoE
from magi_moe.reference import expert_reference, swiglu7
from magi_moe.routing import build_route_table, route

__all__ = ["nan_route_to_row_zero", "per_expert_scale", "per_tensor_scale"]


def _pow2_scale(block: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(amax))``: dividing by it and multiplying back is exact for finite values."""
    return torch.exp2(torch.ceil(torch.log2(block.abs().amax())))


def _scaled_forward(x, table, weights, config: MoEConfig, *, out, per_tensor: bool):
    """bf16 operands, fp32 accumulation, SwiGLU7 rounded once, fp32 top-k sum, one final
    rounding, with each expert's input block quantised to a dynamic scale and back."""
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    xf = x.float()
    acc = torch.zeros(x.shape[0], H * Dh, dtype=torch.float32, device=x.device)
    tensor_scale = _pow2_scale(xf) if per_tensor and x.numel() else None
    offsets = table.offsets.tolist()
    for bank in range(config.num_banks):
        lo, hi = offsets[bank], offsets[bank + 1]
        if lo == hi:
            continue
        tokens = table.gather_ids[lo:hi].long()
        cols = slice((bank // E) * Dh, (bank // E + 1) * Dh)
        block = xf[tokens, cols]
        # BUG (on purpose): the scale is a reduction over other tokens' rows
        scale = tensor_scale if per_tensor else _pow2_scale(block)
        block = block / scale * scale
        g = block @ weights.w_gate[bank].float()
        u = block @ weights.w_up[bank].float()
        a = swiglu7(g, u).to(x.dtype).float()
        acc[tokens, cols] += table.sorted_probs[lo:hi, None].float() * (a @ weights.w_down[bank].float())
    return out.copy_(acc.to(out.dtype))


def _per_expert(x, table, weights, config, *, out):
    return _scaled_forward(x, table, weights, config, out=out, per_tensor=False)


def _per_tensor(x, table, weights, config, *, out):
    return _scaled_forward(x, table, weights, config, out=out, per_tensor=True)


# fp32 sums in another order than the emulation: the atomic model (bounds, no faithfulness)
per_expert_scale = Implementation(
    "broken-per-expert-scale", _per_expert, ("cpu",), "bf16-fp32acc-atomic",
    description="BROKEN on purpose: a per-expert dynamic scale spreads one row's NaN over the expert")
per_tensor_scale = Implementation(
    "broken-per-tensor-scale", _per_tensor, ("cpu",), "bf16-fp32acc-atomic",
    description="BROKEN on purpose: a per-tensor dynamic scale spreads one row's NaN over all rows")


class NanRouteToRowZero(MagiMoE):
    """magi-moe's layer with a dispatch that parks invalid (NaN-weight) routes on padding row 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        E, K, Dh = cfg.num_experts, cfg.top_k, cfg.head_dim
        routes = route(x, self.gate, self.selection_bias, cfg)
        table = build_route_table(routes, cfg)
        invalid = torch.isnan(routes.probs)  # [S, H, K]: the routes of a NaN row
        with torch.no_grad():
            valid_table = table.select(~invalid.flatten()[table.route_slots])
            w = self.expert_weights()
            y = expert_reference(x, valid_table, w, cfg, precision="bf16").float()
            # BUG (on purpose): an invalid route's id becomes E, is clamped to expert E-1 and sent
            # to padding row 0, where its weight was to mask it; a NaN weight masks nothing
            for s, h, k in invalid.nonzero().tolist():
                bank = h * E + E - 1  # id E, clamped
                xs = x[0, h * Dh:(h + 1) * Dh].float()
                a = swiglu7(xs @ w.w_gate[bank].float(), xs @ w.w_up[bank].float())
                y[0, h * Dh:(h + 1) * Dh] += routes.probs[s, h, k] * (a @ w.w_down[bank].float())
        return y.to(x.dtype)


def _nan_route_layer(config: MoEConfig, state_dict, device=None) -> NanRouteToRowZero:
    return NanRouteToRowZero.from_state_dict(state_dict, config, impl="torch-bf16")


def _plain(x, table, weights, config, *, out):
    return out.copy_(expert_reference(x, table, weights, config, precision="bf16"))


nan_route_to_row_zero = Implementation(
    "broken-nan-route-row-zero", _plain, ("cpu",), "bf16-plain", layer_factory=_nan_route_layer,
    description="BROKEN on purpose: its layer parks NaN routes on row 0 with their NaN weight")
