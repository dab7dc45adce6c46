"""Router inputs for judging routers (:mod:`audit.router_judge`), one builder per probe, each
making one rule of CONTRACT section 1 matter. Deterministic in ``seed``; built on the CPU and
moved to ``device``; ``x`` in ``dtype``, ``gate`` and ``bias`` fp32.

* ``random``: logits ~ N(0, 1), a small selection bias (N(0, 0.05^2), as trained biases are).
* ``bias-flips``: the same with a large bias (N(0, 0.5^2)): many choices differ from the
  unbiased top-K, so a router that ignores the bias, or weighs with it, shows.
* ``ties``: grid values (exact in fp32 and float64) with gate rows duplicated inside each head
  and equal biases for the duplicates: exact ties for every token.
* ``boundary``: zero gate (every score equal) and a bias with K-1 clear winners and three
  experts tied for the K-th place: the tie rule decides the last choice.
* ``nan``: every fourth token's ``x`` is NaN in one head (all its scores NaN: the NaN rule picks
  experts 0..K-1 and their weights are NaN), and some selection biases are NaN (ranked last).
* ``inf-bias``: biases of +inf (tied with each other) and -inf.
* ``underflow``: logits near -31 (the top-K sigmoid sum falls below the 1e-12 floor of the L1
  normalisation) and near -806 (every score exactly 0, so the floor prevents 0/0).
"""
from __future__ import annotations

import torch

from magi_moe.config import MoEConfig

__all__ = ["ROUTER_PROBES", "ROUTER_PROBE_DESCRIPTIONS", "boundary_bias", "router_probe"]

ROUTER_PROBE_DESCRIPTIONS = {
    "random": "logits ~ N(0,1), small bias N(0, 0.05^2)",
    "bias-flips": "large bias N(0, 0.5^2): choices differ from the unbiased top-K",
    "ties": "grid values, duplicated gate rows with equal biases: exact ties",
    "boundary": "equal scores, three experts tied for the K-th place",
    "nan": "NaN x in one head of every fourth token; some NaN biases",
    "inf-bias": "+inf (tied) and -inf selection biases",
    "underflow": "top-K sigmoid sums below the 1e-12 floor, and exactly zero",
}
ROUTER_PROBES = tuple(ROUTER_PROBE_DESCRIPTIONS)


def router_probe(probe: str, config: MoEConfig, num_tokens: int, *, seed: int = 0,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """``(x [S, H*Dh], gate [H*E, Dh], bias [H*E])`` of ``probe`` (one of :data:`ROUTER_PROBES`)."""
    if probe not in ROUTER_PROBE_DESCRIPTIONS:
        raise ValueError(f"probe must be one of {ROUTER_PROBES}, got {probe!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    dtype = config.dtype if dtype is None else dtype
    gen = torch.Generator().manual_seed(seed)
    S, H, E, K, Dh = num_tokens, config.num_heads, config.num_experts, config.top_k, config.head_dim
    HE = H * E
    x = torch.randn(S, H * Dh, generator=gen)
    gate = torch.randn(HE, Dh, generator=gen) / Dh ** 0.5
    bias = 0.05 * torch.randn(HE, generator=gen)
    if probe == "bias-flips":
        bias = 0.5 * torch.randn(HE, generator=gen)
    elif probe == "ties":
        x = torch.randint(-2, 3, (S, H * Dh), generator=gen).float() / 2
        rows = torch.randint(-2, 3, (H, (E + 1) // 2, Dh), generator=gen).float() / 4
        levels = torch.randint(0, 2, (H, (E + 1) // 2), generator=gen).float() / 8
        # each head: every distinct row (and its bias) twice, at shuffled positions
        source = torch.stack([torch.randperm(E, generator=gen) // 2 for _ in range(H)])
        gate = torch.gather(rows, 1, source[..., None].expand(H, E, Dh)).reshape(HE, Dh)
        bias = torch.gather(levels, 1, source).reshape(HE)
    elif probe == "boundary":
        gate = torch.zeros(HE, Dh)
        bias = boundary_bias(H, E, K, tied=3, gen=gen)
    elif probe == "nan":
        for s in range(0, S, 4):
            h = int(torch.randint(0, H, (1,), generator=gen))
            x[s, h * Dh:(h + 1) * Dh] = float("nan")
        bias[torch.rand(HE, generator=gen) < 0.25] = float("nan")
    elif probe == "inf-bias":
        flags = torch.rand(HE, generator=gen)
        bias[flags < 0.3] = float("inf")
        bias[(flags >= 0.3) & (flags < 0.45)] = float("-inf")
    elif probe == "underflow":
        # logit = c * x[s, head start] + N(0, 1) noise from the other columns, c = -31
        gate[:, 0] = -31.0
        first = torch.arange(H) * Dh
        x[:, first] = torch.where(torch.arange(S) % 2 == 0, 1.0, 26.0)[:, None]
    return x.to(dtype).to(device), gate.to(device), bias.to(device)


def boundary_bias(num_heads: int, num_experts: int, top_k: int, *, tied: int,
                  gen: torch.Generator) -> torch.Tensor:
    """A selection bias ``[H*E]`` that puts, in each head, K-1 experts (at random) clearly first
    (0.5) and ``tied`` more level for the K-th place (0.25; fewer where the head has fewer experts
    left), the rest at 0: with equal scores the tie rule decides the last choice."""
    bias = torch.zeros(num_heads * num_experts)
    for h in range(num_heads):
        order = torch.randperm(num_experts, generator=gen) + h * num_experts
        bias[order[:top_k - 1]] = 0.5
        bias[order[top_k - 1:top_k - 1 + tied]] = 0.25
    return bias
