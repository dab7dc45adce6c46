"""The fused path's per-launch breakdown (``python -m magi_moe.bench --breakdown``): each launch
of the plan the tiles table chooses, timed alone, beside the router and the whole layer."""
from __future__ import annotations

from dataclasses import asdict

import torch

from ..problems import Problem
from .timing import time_one


def breakdown_case(problem: Problem, *, warmup: int, iters: int, flush_mib: int) -> dict:
    """Median ms of each launch of the fused path's plan with the tiles it would choose, timed
    alone (L2 flushed before each): where a case's time goes. A one-kernel entry that cannot
    run here is timed as the two-kernel fallback its plan names. ``route`` is
    the fused layer's router alone and ``layer`` the whole fused layer: ``layer - whole`` is what
    the layer costs over its kernel."""
    from ..kernels.expert_mlp import EXPERT_MLP
    from ..kernels.fused import fused_forward, run_plan
    from ..kernels.gate_up_down import DOWN, GATE_UP
    from ..kernels.schedule import SCHEDULE
    from ..kernels.topk_sum import TOPK_SUM
    from .kernel_level import KernelLevel

    cfg, table, x = problem.config, problem.table, problem.x
    level = KernelLevel.of(problem)
    packed, tiles = level.packed, level.tiles()
    plan, call = level.call(tiles)
    out, ws = call.out, call.workspace
    run_plan(plan.only(SCHEDULE), call)  # the schedule the other launches read
    parts = {"schedule": SCHEDULE, "gate_up+down": EXPERT_MLP, "gate_up": GATE_UP, "down": DOWN,
             "sum": TOPK_SUM}
    stages = {name: (lambda part=plan.only(launcher): run_plan(part, call))
              for name, launcher in parts.items() if launcher.name in plan.kernels}
    stages["whole"] = lambda: fused_forward(x, table, packed, cfg, out=out, tiles=tiles,
                                            workspace=ws)
    # The layer's own work beside it: the fused router (its four launches, block schedule
    # included) and the whole layer, on a workspace of their own so that the stages above keep
    # reading their schedule.
    from ..kernels.fused_layer import fused_layer_forward
    from ..kernels.router import fused_route
    from ..kernels.workspace import FusedWorkspace
    layer_ws, layer_out = FusedWorkspace(x.device), torch.empty_like(x)
    gate, bias = problem.gate, problem.bias
    stages["route"] = lambda: fused_route(x, gate, bias, cfg, block_m=tiles.block_m,
                                          workspace=layer_ws)
    stages["layer"] = lambda: fused_layer_forward(x, gate, bias, packed, cfg, out=layer_out,
                                                  workspace=layer_ws)
    timing = dict(warmup=warmup, iters=iters, flush_mib=flush_mib, device=x.device)
    return {"tiles": asdict(tiles), "plan": list(plan.kernels), "reasons": list(plan.reasons),
            "ms": {name: time_one(fn, **timing) for name, fn in stages.items()}}
