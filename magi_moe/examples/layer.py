"""A worked layer implementation: a team's own ``nn.Module`` (``magi-moe example layer``).

The whole MAGI-2 head-routed MoE layer, built from a released-layout checkpoint: the router,
the selection bias, the submodule the biases sit on, the expert weights, and what comes out.
The expert part calls the kernel of the worked kernel example (``magi-moe example kernel``);
swap in yours. Copy this file next to your code and run

    magi-moe check layer:IMPL --backend cpu       # from the directory holding layer.py

Every layer-level check (checkpoint, weight changes, layer inputs, determinism) then runs on
this module, through ``IMPL.layer(config, state_dict, device)``.
"""
from typing import Mapping

import torch
from torch import nn

from magi_moe.config import MoEConfig
from magi_moe.examples.kernel import loop_forward
from magi_moe.implementation import Implementation
from magi_moe.routing import build_route_table
from magi_moe.weights import ExpertWeights


class Router(nn.Module):
    """The selection biases, as checkpoints name them: ``router.expert_bias`` and
    ``router.expert_bias_ema``, fp32 ``[H*E]`` buffers on a submodule called ``router``."""

    def __init__(self, num_banks: int, device=None):
        super().__init__()
        for name in ("expert_bias", "expert_bias_ema"):
            self.register_buffer(name, torch.zeros(num_banks, dtype=torch.float32, device=device))


class ExampleLayer(nn.Module):
    """``y = MoE(x)`` for ``x`` ``[S, H*Dh]`` in ``config.dtype``; ``y`` has ``x``'s shape and dtype.

    Parameters under the released names and shapes (CONTRACT section 3): ``gate`` ``[H*E, Dh]``
    fp32 (the router: its scores decide which experts run, so it stays fp32), ``W_gate`` and
    ``W_up`` ``[H*E, Dh, I]``, ``W_down`` ``[H*E, I, Dh]`` in ``config.dtype``.
    """

    def __init__(self, config: MoEConfig, device=None):
        super().__init__()
        HE, Dh, I = config.num_banks, config.head_dim, config.intermediate_size
        self.config = config
        self.gate = nn.Parameter(torch.zeros(HE, Dh, dtype=torch.float32, device=device))
        self.W_gate = nn.Parameter(torch.zeros(HE, Dh, I, dtype=config.dtype, device=device))
        self.W_up = nn.Parameter(torch.zeros(HE, Dh, I, dtype=config.dtype, device=device))
        self.W_down = nn.Parameter(torch.zeros(HE, I, Dh, dtype=config.dtype, device=device))
        self.router = Router(HE, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
            raise ValueError(f"x must have shape [S, {cfg.hidden_size}], got {tuple(x.shape)}")
        # Routing: IMPL.route(x, gate, bias, config) is the declared router (IMPL.router) when
        # there is one, else magi-moe's torch router. The bias steers which experts are chosen,
        # never their weights; MagiMoE selects with the EMA bias by default, and so does this.
        routes = IMPL.route(x, self.gate, self.router.expert_bias_ema, cfg)
        table = build_route_table(routes, cfg)  # CSR by bank, what the kernel reads
        weights = ExpertWeights(self.W_gate, self.W_up, self.W_down)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # x's dtype and shape
        with torch.no_grad():  # inference: the checks never differentiate through the layer
            return loop_forward(x, table, weights, cfg, out=out)


def build_layer(config: MoEConfig, state_dict: Mapping[str, torch.Tensor], device=None) -> nn.Module:
    """``layer_factory``: the module built from a released-layout state dict (``gate``,
    ``W_gate``, ``W_up``, ``W_down``, ``router.expert_bias``, ``router.expert_bias_ema``)."""
    layer = ExampleLayer(config, device=device)
    layer.load_state_dict(state_dict)  # strict: a missing or misshapen tensor raises
    return layer


IMPL = Implementation(
    name="example-layer",
    forward=loop_forward,            # the kernel-level checks call this on precomputed routes
    backends=("cpu", "cuda"),
    precision="bf16-fp32acc",
    dtypes=(torch.bfloat16,),
    capabilities={"deterministic", "input_checks"},
    layer_factory=build_layer,       # the layer-level checks build and run this module
    description="worked example (magi-moe example layer): its own nn.Module around the loop kernel",
)
