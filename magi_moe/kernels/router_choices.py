"""The fused router seen as a plain router, ``route(x, gate, bias, config) -> Routes``, so the
tie-rule fuzzer holds it to the same contract as :func:`magi_moe.routing.route` (exact ties to
the lower index, NaN last, underflowing and infinite scores), and, through
:func:`fused_routes_with_table`, holds the CSR table it builds on the device to its choices."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..config import MoEConfig
from ..routing import Routes, RouteTable
from .router import fused_route


class TabledRoutes(NamedTuple):
    """A router's choices and the route table it built from them itself (the expert kernels
    read that table, not the choices, so it can be wrong where the choices are right)."""

    expert_ids: torch.Tensor
    probs: torch.Tensor
    table: RouteTable


def fused_routes(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                 config: MoEConfig) -> Routes:
    """:func:`~magi_moe.kernels.router.fused_route`'s choices, copied out of its workspace."""
    found = fused_route(x, gate, bias, config)
    return Routes(expert_ids=found.expert_ids.to(torch.int64), probs=found.probs.clone())


def fused_routes_with_table(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                            config: MoEConfig) -> TabledRoutes:
    """:func:`fused_routes` and the fused router's own table (copied out of its workspace)."""
    found = fused_route(x, gate, bias, config)
    t = found.table
    table = dataclasses.replace(t, gather_ids=t.gather_ids.clone(), sorted_probs=t.sorted_probs.clone(),
                                offsets=t.offsets.clone(), route_slots=t.route_slots.clone())
    return TabledRoutes(found.expert_ids.to(torch.int64), found.probs.clone(), table)
