"""Checks of the fused path's inputs, each error naming the argument: the router's ``(x, gate,
bias)``, the expert kernels' ``(x, table, weights)``, and the whole layer's, made once at its entry
before any host work or launch."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from ..inputs import check_expert_inputs
from ..routing import RouteTable
from ..validation import (check_kernel_device, check_out, check_same_device, check_tensor,
                          check_unit_last_stride)
from ..weights import ExpertWeights

FUSED_DTYPES = (torch.bfloat16, torch.float16)


def check_router_inputs(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                        config: MoEConfig) -> None:
    """``x`` ``[S, H*Dh]`` (bf16, fp16 or fp32, unit stride in the last dim), ``gate``
    ``[H*E, Dh]`` fp32 and ``bias`` ``[H*E]`` fp32 (both contiguous), on one device the kernels
    run on, and fewer than 2^31 routes."""
    check_tensor("x", x, shape=(None, config.hidden_size),
                 dtype=(torch.bfloat16, torch.float16, torch.float32))
    check_tensor("gate", gate, shape=(config.num_banks, config.head_dim), dtype=torch.float32)
    check_unit_last_stride("x", x)
    if not gate.is_contiguous():
        raise ValueError("gate must be contiguous")
    if bias is not None:
        check_tensor("bias", bias, shape=(config.num_banks,), dtype=torch.float32)
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")
        check_same_device(x=x, gate=gate, bias=bias)
    else:
        check_same_device(x=x, gate=gate)
    check_kernel_device("x", x)
    S = x.shape[0]
    R = S * config.num_heads * config.top_k
    if R >= 2**31:
        raise ValueError(f"{S} tokens give {R} routes; the route table's int32 fields need < 2^31")


def check_fused_inputs(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                       config: MoEConfig, *, check_bounds: bool | None = None) -> None:
    """Shapes, dtypes, devices, strides and (with ``check_bounds``, one host sync; by default
    for untrusted tables) the table's values: see :func:`~magi_moe.inputs.check_expert_inputs`."""
    check_expert_inputs(x, table, weights, config, dtypes=FUSED_DTYPES, check_bounds=check_bounds)
    check_kernel_device("x", x)
    check_unit_last_stride("x", x)
    for name, w in weights._asdict().items():
        check_unit_last_stride(name, w)
    R = table.num_routes
    check_tensor("table.sorted_probs", table.sorted_probs, dtype=torch.float32)
    slots = table.num_tokens * config.num_heads * config.top_k
    if max(R, slots) >= 2**31:
        raise ValueError(f"table has {R} routes and {slots} slots; the slot map is int32, so "
                         f"both must stay below 2^31")


def check_layer_inputs(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                       weights: ExpertWeights, config: MoEConfig,
                       out: torch.Tensor | None = None) -> None:
    """Everything the fused layer reads, checked once before anything is decided or launched:
    the router's inputs, then what the expert kernels need of ``x`` and ``weights`` (the route
    table is the router's own, valid by construction), then ``out`` where given."""
    check_router_inputs(x, gate, bias, config)
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be a magi_moe.weights.ExpertWeights, got {type(weights).__name__}")
    check_tensor("x", x, dtype=FUSED_DTYPES)
    weights.check(config)
    if weights.w_gate.dtype != x.dtype:
        raise ValueError(f"weights dtype {weights.w_gate.dtype} must match x dtype {x.dtype}")
    check_same_device(x=x, w_gate=weights.w_gate)
    for name, w in weights._asdict().items():
        check_unit_last_stride(name, w)
    if out is not None:
        check_out(out, x)
        check_unit_last_stride("out", out)
