"""Checks of one expert-computation call ``(x, table, weights, config)``, shared by every path."""
from __future__ import annotations

import torch

from .config import MoEConfig
from .routing import RouteTable, check_table_layout, validate_route_table
from .validation import check_same_device, check_tensor
from .weights import ExpertWeights

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_expert_inputs(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                        config: MoEConfig, *, dtypes=FLOAT_DTYPES,
                        check_bounds: bool | None = None) -> None:
    """Types, shapes, dtypes, devices and the table's layout (no device work), then the table's
    values; raises naming the argument.

    ``check_bounds``: read the table's values (:func:`~magi_moe.routing.validate_route_table`,
    one host sync). By default only for a table that is not :attr:`RouteTable.trusted` (built by
    magi-moe and unchanged since); ``False`` only where the caller built the table itself in the
    same call (the fused layer path): an out-of-range index would send a kernel to a wild
    address, and an inconsistent slot would add a route into another output."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a magi_moe.config.MoEConfig, got {type(config).__name__}")
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be a magi_moe.weights.ExpertWeights, got {type(weights).__name__}")
    if not isinstance(table, RouteTable):
        raise TypeError(f"table must be a magi_moe.routing.RouteTable, got {type(table).__name__}")
    check_table_layout(table, config)
    check_tensor("x", x, shape=(table.num_tokens, config.hidden_size), dtype=dtypes)
    weights.check(config)
    if weights.w_gate.dtype != x.dtype:
        raise ValueError(f"weights dtype {weights.w_gate.dtype} must match x dtype {x.dtype}")
    check_same_device(x=x, w_gate=weights.w_gate, gather_ids=table.gather_ids)
    if check_bounds is None:
        check_bounds = not table.trusted
    if check_bounds:
        validate_route_table(table, config)
