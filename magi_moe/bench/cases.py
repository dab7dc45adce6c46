"""The benchmark's problems: a case (heads x tokens and the routing draw), the problem drawn for
it on the device, and docs/ANCHORS.md's floors for that problem."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MoEConfig, preset
from ..problems import Problem, random_problem
from ..routing import build_route_table, route
from ..weights import ExpertWeights

COPY_GBPS = 4281.0      # docs/ANCHORS.md: device-to-device copy on the H200, bytes read + written
MATMUL_TFLOPS = 793.0   # docs/ANCHORS.md: 8192^3 bf16 matmul on the H200
ANCHOR_CASES = ((3, 512), (3, 4096), (3, 16384), (12, 4096))


# Routing draws (router weight std): "anchors" is docs/ANCHORS.md's (std 1/16, logits std 1:
# 89-98% of experts routed, busiest 6-9x the mean), the one the public figures use;
# "concentrated" (std 0.25, logits std 4) routes to about a third of the experts, as a
# checkpoint whose router concentrates would: it reads a third of the weight bytes.
DRAWS = {"anchors": 1.0 / 16, "concentrated": 0.25}


@dataclass(frozen=True)
class BenchCase:
    heads: int
    tokens: int
    experts: int = 256
    top_k: int = 6
    head_dim: int = 256
    inter: int = 1280
    seed: int = 0
    draw: str = "anchors"

    def __post_init__(self) -> None:
        if self.draw not in DRAWS:
            raise ValueError(f"BenchCase.draw must be one of {sorted(DRAWS)}, got {self.draw!r}")

    def config(self) -> MoEConfig:
        return preset("magi2-full").replace(num_heads=self.heads, num_experts=self.experts,
                                            top_k=self.top_k, head_dim=self.head_dim,
                                            intermediate_size=self.inter)

    @property
    def label(self) -> str:
        suffix = "" if self.draw == "anchors" else f" ({self.draw})"
        return f"H={self.heads},S={self.tokens}{suffix}"


def draw_problem(case: BenchCase, device: torch.device) -> Problem:
    """x N(0,1), weights N(0, 0.02^2), bias N(0, 0.05^2), router weights N(0, std^2) with the
    case's named draw (:data:`DRAWS`), drawn on ``device`` (CPU draws go through random_problem)."""
    cfg = case.config()
    gate_std = DRAWS[case.draw]
    if device.type != "cuda":
        return random_problem(cfg, case.tokens, seed=case.seed, device=device, gate_std=gate_std)
    gen = torch.Generator(device=device).manual_seed(case.seed)

    def randn(*shape, std=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    HE, Dh, I = cfg.num_banks, cfg.head_dim, cfg.intermediate_size
    x = randn(case.tokens, cfg.hidden_size, dtype=cfg.dtype)
    gate = randn(HE, Dh, std=gate_std)
    bias = randn(HE, std=0.05)
    weights = ExpertWeights(randn(HE, Dh, I, std=0.02, dtype=cfg.dtype),
                            randn(HE, Dh, I, std=0.02, dtype=cfg.dtype),
                            randn(HE, I, Dh, std=0.02, dtype=cfg.dtype))
    routes = route(x, gate, bias, cfg)
    return Problem(cfg, x, gate, bias, weights, routes, build_route_table(routes, cfg))


def floors(problem: Problem) -> dict:
    """docs/ANCHORS.md's floors for this problem (synchronises: call before timing)."""
    cfg = problem.config
    counts = problem.table.counts()
    routed_banks = int((counts > 0).sum())
    R = problem.table.num_routes
    Dh, I = cfg.head_dim, cfg.intermediate_size
    elem = torch.finfo(cfg.dtype).bits // 8
    weight_bytes = routed_banks * 3 * Dh * I * elem
    io_bytes = 2 * problem.x.numel() * elem
    flops = R * (2 * Dh * I * 2 + 2 * I * Dh)
    mem_ms = (weight_bytes + io_bytes) / (COPY_GBPS * 1e9) * 1e3
    compute_ms = flops / (MATMUL_TFLOPS * 1e12) * 1e3
    busiest = int(counts.max()) if counts.numel() else 0
    return {"routes": R, "routed_banks": routed_banks, "banks": cfg.num_banks,
            "max_routes_per_bank": busiest,
            "busiest_over_mean": busiest / (R / cfg.num_banks) if R else 0.0,
            "bytes": weight_bytes + io_bytes, "flops": flops,
            "memory_floor_ms": mem_ms, "compute_floor_ms": compute_ms,
            "floor_ms": max(mem_ms, compute_ms)}
