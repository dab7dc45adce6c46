"""A problem at kernel level, as the benchmark times the fused path: weights packed once as the
layer packs them, routes precomputed, and one fused run's launch plan and buffers on a
workspace of its own for any tiles. Shared by the breakdown (``--breakdown``), the Nsight
Compute driver (``scripts/profile_kernel.py``) and A/B benches of other kernel forms."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..problems import Problem
from ..weights import ExpertWeights


@dataclass
class KernelLevel:
    problem: Problem
    packed: ExpertWeights

    @classmethod
    def of(cls, problem: Problem) -> "KernelLevel":
        from ..packed_weights import pack_expert_weights
        return cls(problem, pack_expert_weights(problem.weights))

    def tiles(self, **fields):
        """The tile table's choice for this problem, with ``fields`` replaced, fitted to it."""
        from ..kernels.tiles import choose_fused_tiles
        cfg, table = self.problem.config, self.problem.table
        chosen = choose_fused_tiles(cfg, table.num_routes, self.problem.x.device)
        return replace(chosen, **fields).fitted(cfg)

    def call(self, tiles):
        """``(plan, call)`` of one fused run on ``tiles``, nothing launched: a new workspace
        and output, so calls on other tiles (another block size, another schedule) never share
        buffers."""
        from ..kernels.fused import fused_call
        from ..kernels.workspace import FusedWorkspace
        p = self.problem
        return fused_call(p.x, p.table, self.packed, p.config, out=torch.empty_like(p.x),
                          tiles=tiles, workspace=FusedWorkspace(p.x.device))
