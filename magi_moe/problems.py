"""Random test problems and the poisoned run: shared by tests, fuzzers, auditors and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoEConfig
from .registry import Implementation
from .routing import RouteTable, Routes, build_route_table, route
from .weights import ExpertWeights, random_weights


@dataclass(frozen=True)
class Problem:
    """One layer input with its routing, as docs/ANCHORS.md draws it: x N(0,1), router N(0, 1/16),
    selection bias N(0, bias_std^2), weights N(0, weight_std^2), all values rounded to ``dtype``."""

    config: MoEConfig
    x: torch.Tensor
    gate: torch.Tensor
    bias: torch.Tensor | None
    weights: ExpertWeights
    routes: Routes
    table: RouteTable

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def with_routes(self, routes: Routes) -> "Problem":
        return Problem(self.config, self.x, self.gate, self.bias, self.weights, routes,
                       build_route_table(routes, self.config))


def random_problem(config: MoEConfig, num_tokens: int, *, seed: int, device="cpu",
                   x_std: float = 1.0, gate_std: float = 0.25, bias_std: float = 0.05,
                   weight_std: float = 0.02, dtype: torch.dtype | None = None,
                   draw_unrouted: bool = True) -> Problem:
    """A fresh problem drawn on the CPU from ``seed`` (identical on every device), then moved.

    ``draw_unrouted=False``: only the routed banks' weights are drawn, the others are negated
    copies of them (:func:`~magi_moe.weights.random_weights`' ``banks``): for a few tokens at
    production widths, where drawing every bank takes seconds."""
    dtype = dtype or config.dtype
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, config.hidden_size, generator=gen) * x_std).to(dtype)
    gate = torch.randn(config.num_banks, config.head_dim, generator=gen) * gate_std
    bias = torch.randn(config.num_banks, generator=gen) * bias_std if bias_std else None
    banks = None
    if not draw_unrouted:  # the banks the CPU router picks (a device's near-tie may differ: the
        # bank it picks instead still holds finite random weights, a negated copy)
        head = torch.arange(config.num_heads).view(1, -1, 1) * config.num_experts
        banks = torch.unique(route(x, gate, bias, config).expert_ids + head)
    weights = random_weights(config, dtype=dtype, std=weight_std, generator=gen, banks=banks)
    x, gate = x.to(device), gate.to(device)
    bias = bias.to(device) if bias is not None else None
    weights = weights.to(device)
    routes = route(x, gate, bias, config)
    return Problem(config, x, gate, bias, weights, routes, build_route_table(routes, config))


def routes_to(expert_ids: torch.Tensor, config: MoEConfig, *, probs: torch.Tensor | None = None,
              seed: int = 0) -> Routes:
    """Routes with chosen experts ``[S, H, K]`` (e.g. all tokens to one expert) and random probs."""
    S, H, K = expert_ids.shape
    if probs is None:
        gen = torch.Generator().manual_seed(seed)
        probs = torch.rand(S, H, K, generator=gen).to(expert_ids.device) * config.route_scale
    return Routes(expert_ids=expert_ids.to(torch.int64), probs=probs.to(torch.float32))


class HarnessError(RuntimeError):
    """The suite was about to hand an implementation a malformed call: a bug of the suite (or of
    a hand-built case), never a finding against the implementation."""


def check_handed_inputs(impl: Implementation, problem: Problem) -> None:
    """Validate what the harness hands ``impl`` (docs/INPUTS.md): an implementation may trust
    its caller, so every call the suite makes must be well formed. Tables built by magi-moe
    and unchanged since are trusted (no device work); others cost one host sync."""
    from .inputs import check_expert_inputs

    try:
        check_expert_inputs(problem.x, problem.table, problem.weights, problem.config,
                            dtypes=impl.dtypes)
    except (TypeError, ValueError) as exc:
        raise HarnessError(f"the harness built a malformed call for {impl.name}: {exc}") from exc


def run_poisoned(impl: Implementation, problem: Problem) -> torch.Tensor:
    """Run ``impl`` into a NaN-filled output (and NaN-filled workspaces) so unwritten elements show,
    on used memory (:func:`~magi_moe.dirty_memory.handed_memory`: what ``torch.empty`` hands it
    reads as poison, not as fresh zeros). The call is validated first
    (:func:`check_handed_inputs`): implementations may trust it.

    A shape or dtype outside ``impl.supports`` raises :class:`~magi_moe.implementation.
    UnsupportedShape` before the call (a skip under magi-moe's pytest plugin, not a failure)."""
    from .debug import poison_workspaces
    from .dirty_memory import handed_memory, reserve_for
    from .implementation import UnsupportedShape

    why = impl.supports(problem.config, problem.x.dtype)
    if why:
        raise UnsupportedShape(why)
    check_handed_inputs(impl, problem)

    x = problem.x
    out = torch.full(x.shape, float("nan"), dtype=impl.output_dtype(x.dtype), device=x.device)
    reserve = reserve_for(problem.config, problem.num_tokens, problem.table.num_routes)
    with poison_workspaces(), handed_memory(x.device, reserve_bytes=reserve):
        result = impl(x, problem.table, problem.weights, problem.config, out=out)
    if result.data_ptr() != out.data_ptr():
        raise AssertionError(f"{impl.name} returned a new tensor instead of writing into out")
    return out


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width (NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype, and bit for bit the same values."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bit_pattern(a), bit_pattern(b))


def relative_l2(result: torch.Tensor, reference: torch.Tensor) -> float:
    ref = reference.detach().double()
    denom = ref.norm()
    diff = (result.detach().double() - ref).norm()
    return float(diff / denom) if denom > 0 else float(diff)


def cancelling_problem(config: MoEConfig, num_tokens: int, *, seed: int, device="cpu") -> Problem:
    """A problem whose top-k sums cancel (CONTRACT section 7: summation-order non-determinism
    shows in bf16 only where the sum is small against its terms). Every token routes, in every
    head, to experts 0, 1, 2 (in a per-token order) with probability 1; the three share gate/up
    weights and have down weights ``D``, ``-D`` and ``2^-20 D``, so the sum is ``2^-20 a`` while
    ``a + 2^-20 a`` rounds in fp32 several bf16 ulps away: a kernel whose summation order varies changes most
    of the bf16 outputs, a fixed-order kernel none."""
    cfg = config.replace(num_experts=max(3, config.num_experts), top_k=3)
    H, E, Dh, I = cfg.num_heads, cfg.num_experts, cfg.head_dim, cfg.intermediate_size
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape, std=1.0: torch.randn(*shape, generator=gen) * std  # noqa: E731
    w_gate, w_up, w_down = randn(H, E, Dh, I, std=0.1), randn(H, E, Dh, I, std=0.1), randn(H, E, I, Dh, std=0.1)
    w_gate[:, 1:3], w_up[:, 1:3] = w_gate[:, :1], w_up[:, :1]
    w_down[:, 1], w_down[:, 2] = -w_down[:, 0], w_down[:, 0] * 2.0**-20
    orders = torch.stack([torch.randperm(3, generator=gen) for _ in range(num_tokens)])  # [S, 3]
    ids = orders[:, None, :].expand(num_tokens, H, 3).contiguous()
    routes = routes_to(ids, cfg, probs=torch.ones(num_tokens, H, 3))
    weights = ExpertWeights(*(w.flatten(0, 1).to(cfg.dtype).to(device) for w in (w_gate, w_up, w_down)))
    routes = Routes(routes.expert_ids.to(device), routes.probs.to(device))
    x = randn(num_tokens, cfg.hidden_size).to(cfg.dtype).to(device)
    gate = randn(H * E, Dh, std=0.25).to(device)
    return Problem(cfg, x, gate, None, weights, routes, build_route_table(routes, cfg))
