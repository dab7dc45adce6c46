"""The fused router seen as a plain router, ``route(x, gate, bias, config) -> Routes``, so the
tie-rule fuzzer holds it to the same contract as :func:`magi_moe.routing.route` (exact ties to
the lower index, NaN last, underflowing and infinite scores)."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from ..routing import Routes
from .fused_routing import fused_route


def fused_routes(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                 config: MoEConfig) -> Routes:
    """:func:`~magi_moe.kernels.fused_routing.fused_route`'s choices, copied out of its workspace."""
    found = fused_route(x, gate, bias, config)
    return Routes(expert_ids=found.expert_ids.to(torch.int64), probs=found.probs.clone())
