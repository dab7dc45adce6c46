"""The fused layer as one PyTorch custom operator, the form ``torch.compile`` sees it in, and
:func:`layer_forward`, the entry that takes that form while tracing and the eager one otherwise.

Why a ``custom_op`` and not ``triton_op``: the launch sequence is host logic (the tile table,
tensor descriptors, the shared-memory check of a compiled kernel, persistent grids sized from
the GPU), which must stay outside the traced region. Dynamo tracing into it broke the graph at
the tile-table lookup, the routing-tile choice and the grid sizing, and the kernels' scratch
buffers showed up as mutated graph inputs, so inductor refused CUDA graphs. As one opaque
operator the compiled layer is a single graph node:

* it mutates none of its inputs (``mutates_args=()``): its scratch lives in the device's
  :class:`~magi_moe.kernels.workspace.FusedWorkspace`, which keeps every buffer a CUDA graph
  captured alive (see ``FusedWorkspace.get``), and its output is a fresh tensor;
* the weights are passed as the layer's parameters themselves: the packed bank is only a layout
  of the same memory (:mod:`magi_moe.packed_weights`), and the kernels read any row-strided
  weights, so nothing needs packing inside a graph;
* it never synchronises with the host, so a CUDA graph can hold it.

A replayed graph does not run this Python: what the layer promises when weights change under
a captured graph is :mod:`audit.graphs`'s (``MagiMoE``'s class docstring).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import MoEConfig
from ..weights import ExpertWeights


@torch.library.custom_op("magi_moe::fused_layer", mutates_args=())
def fused_layer_op(x: torch.Tensor, gate: torch.Tensor, bias: Optional[torch.Tensor],
                   w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   num_heads: int, head_dim: int, num_experts: int, top_k: int,
                   intermediate_size: int, score_func: str, route_norm: bool,
                   route_scale: float) -> torch.Tensor:
    """Routing and experts of the fused layer on ``x [S, H*Dh]``; a new ``[S, H*Dh]`` tensor:
    :func:`layer_forward`'s eager path (an operator's body runs outside tracing)."""
    config = MoEConfig(num_heads, head_dim, num_experts, top_k, intermediate_size,
                       score_func=score_func, route_norm=route_norm, route_scale=route_scale,
                       dtype=x.dtype)
    return layer_forward(x, gate, bias, ExpertWeights(w_gate, w_up, w_down), config)


@fused_layer_op.register_fake
def _(x, gate, bias, w_gate, w_up, w_down, num_heads, head_dim, num_experts, top_k,
      intermediate_size, score_func, route_norm, route_scale):
    return x.new_empty(x.shape)  # the real op returns a dense [S, H*Dh] tensor of x.dtype


def layer_forward(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                  weights: ExpertWeights, config: MoEConfig) -> torch.Tensor:
    """The fused implementation's ``layer_forward``: the whole layer on plain tensors and the
    config, no module (``MagiMoE`` keeps its packed bank current and hands its parameters in).
    Eager: :func:`~.fused_layer.fused_layer_forward`. While ``torch.compile`` traces: this
    operator, on the tensors as given (the bank is only their layout), detached as the eager
    path runs under ``no_grad``: the operator has no backward."""
    if torch.compiler.is_compiling():
        return fused_layer_op(x.detach(), gate.detach(), None if bias is None else bias.detach(),
                              *(w.detach() for w in weights), config.num_heads,
                              config.head_dim, config.num_experts, config.top_k,
                              config.intermediate_size, config.score_func, config.route_norm,
                              float(config.route_scale))
    from .fused_layer import fused_layer_forward

    with torch.no_grad():
        return fused_layer_forward(x, gate, bias, weights, config)
