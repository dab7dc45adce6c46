"""The oracle: the expert computation with explicit precision switches (FlashAttention-style).

``precision="float64"`` is the reference: the same bf16-valued inputs upcast to float64, no
intermediate rounding, output in float64.

``precision="bf16"`` is the plain PyTorch baseline at working precision: each matmul rounds its
result to bf16 (fp32 accumulation inside), SwiGLU7 in fp32 rounded once to bf16, the routing
weight applied in fp32 and rounded per route, the top-k sum in fp32 with one final rounding.

``precision="fp32acc"`` emulates the fast paths' precision points exactly (CONTRACT section 1):
operands in the input dtype, products and sums in fp32 (bf16 x bf16 products are exact in
fp32), SwiGLU7 in fp32 rounded once to the input dtype, the routing weight and top-k sum in
fp32, one final rounding. Kernels differ from it only in fp32 summation order.

A per-expert loop over the route table keeps all three short.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .config import MoEConfig
from .routing import RouteTable, Routes, build_route_table, route
from .inputs import check_expert_inputs
from .weights import ExpertWeights

Precision = Literal["float64", "bf16", "fp32acc"]
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702


def swiglu7(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``min(g,7) * sigmoid(1.702*min(g,7)) * (clamp(u,-7,7) + 1)`` in the inputs' dtype."""
    g = g.clamp(max=SWIGLU_LIMIT)
    return g * torch.sigmoid(SWIGLU_ALPHA * g) * (u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT) + 1)


@dataclass(frozen=True)
class PrecisionFaults:
    """Departures from the ``fp32acc`` precision points, for building the broken variants the
    auditors must catch: gate/up or down summed term by term in the working dtype (no fp32
    accumulator), or g and u rounded to the working dtype before SwiGLU7's clamp."""

    gate_up_in_working_dtype: bool = False
    down_in_working_dtype: bool = False
    round_gate_up: bool = False


def sum_in_working_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` summed term by term in ``a.dtype``: every product and partial sum is rounded,
    as a kernel without an fp32 accumulator would. ``a`` ``[n, k]``, ``b`` ``[k, m]``."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    for d in range(a.shape[1]):
        acc = acc + a[:, d:d + 1] * b[d]
    return acc


def expert_reference(
    x: torch.Tensor,
    table: RouteTable,
    weights: ExpertWeights,
    config: MoEConfig,
    *,
    precision: Precision = "float64",
    faults: PrecisionFaults | None = None,
) -> torch.Tensor:
    """``y[s, h*Dh:(h+1)*Dh] = sum_k p * expert_{h,e}(x[s, h])`` over the routes of ``table``.

    Returns float64 for ``precision="float64"``, else ``x.dtype``. Under ``fp32acc`` the fp32
    matmuls must not use TF32 (``torch.backends.cuda.matmul.allow_tf32`` is False by default).
    ``faults`` (``fp32acc`` only) breaks chosen precision points on purpose.
    """
    faults = faults or PrecisionFaults()
    if faults != PrecisionFaults() and precision != "fp32acc":
        raise ValueError(f"faults apply to precision='fp32acc' only, got precision={precision!r}")
    check_expert_inputs(x, table, weights, config)
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    if precision == "float64":
        work, acc_dtype, out_dtype = torch.float64, torch.float64, torch.float64
    elif precision == "bf16":
        work, acc_dtype, out_dtype = x.dtype, torch.float32, x.dtype
    elif precision == "fp32acc":
        work, acc_dtype, out_dtype = torch.float32, torch.float32, x.dtype
    else:
        raise ValueError(f"precision must be 'float64', 'bf16' or 'fp32acc', got {precision!r}")

    xw = x.to(work)
    # Accumulate over the routed tokens only (the same sums in the same order): memory follows
    # the routes, so a huge input with a few routed tokens past 2^31 stays cheap.
    routed = torch.unique(table.gather_ids.long())
    acc = torch.zeros(routed.numel(), H, Dh, dtype=acc_dtype, device=x.device)
    counts = table.counts().tolist()
    offsets = table.offsets.tolist()
    for f, count in enumerate(counts):
        if count == 0:
            continue  # empty experts cost nothing
        h = f // E
        lo, hi = offsets[f], offsets[f + 1]
        tokens = table.gather_ids[lo:hi].long()
        xs = xw[tokens, h * Dh:(h + 1) * Dh]
        if faults.gate_up_in_working_dtype:
            g = sum_in_working_dtype(x[tokens, h * Dh:(h + 1) * Dh], weights.w_gate[f])
            u = sum_in_working_dtype(x[tokens, h * Dh:(h + 1) * Dh], weights.w_up[f])
        else:
            g = xs @ weights.w_gate[f].to(work)
            u = xs @ weights.w_up[f].to(work)
        if faults.round_gate_up:
            g, u = g.to(x.dtype), u.to(x.dtype)
        a = swiglu7(g.to(acc_dtype), u.to(acc_dtype))
        if precision == "fp32acc":
            a = a.to(x.dtype)  # the single rounding of the down-projection operand
        if faults.down_in_working_dtype:
            out = sum_in_working_dtype(a, weights.w_down[f]).to(acc_dtype)
        else:
            out = (a.to(work) @ weights.w_down[f].to(work)).to(acc_dtype)
        contribution = out * table.sorted_probs[lo:hi].to(acc_dtype)[:, None]
        if precision == "bf16":
            contribution = contribution.to(x.dtype).to(acc_dtype)  # one rounding per route
        # Tokens are distinct within one bank, so index_add_ adds each row once.
        acc[:, h].index_add_(0, torch.searchsorted(routed, tokens), contribution)
    result = torch.zeros(x.shape[0], H * Dh, dtype=out_dtype, device=x.device)
    result[routed] = acc.reshape(-1, H * Dh).to(out_dtype)
    return result


def layer_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    weights: ExpertWeights,
    config: MoEConfig,
    *,
    router_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, Routes]:
    """The whole layer in float64: routing (in ``router_dtype``) then the expert oracle."""
    routes = route(x, gate, bias, config, dtype=router_dtype)
    table = build_route_table(routes, config)
    return expert_reference(x, table, weights, config, precision="float64"), routes
