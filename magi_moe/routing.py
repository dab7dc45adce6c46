"""Routing (CONTRACT section 1 steps 1-5) and the CSR route table (CONTRACT section 2).

Tie rule: among equal selection scores the lower expert index wins and comes first. It is
implemented with a *stable* descending sort, which every torch device implements
identically, rather than ``torch.topk``, whose tie order differs between CPU and CUDA.

NaN policy: a NaN selection score ranks last (below -inf), and among NaNs the lower expert index
wins. This needs no host synchronisation, so the fast paths can share it; the layer rejects
non-finite router weights when they are loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import MoEConfig
from .validation import check_same_device, check_tensor

NORM_EPS = 1e-12  # F.normalize's eps for the L1 route normalisation


@dataclass(frozen=True)
class Routes:
    """Per token and head: chosen experts (ids within the head) and their probabilities.

    ``expert_ids`` int64 ``[S, H, K]``, highest selection score first; ``probs`` ``[S, H, K]``
    (fp32 for the production router, float64 for the reference router).
    """

    expert_ids: torch.Tensor
    probs: torch.Tensor


@dataclass(frozen=True)
class RouteTable:
    """Routes sorted by flattened expert ``f = h*E + e``, stably (token order inside an expert).

    ``gather_ids`` int32 ``[R]``: token index of each route.
    ``sorted_probs`` ``[R]``: its routing weight, fp32 (float64 only from the reference router).
    ``offsets`` int64 ``[H*E + 1]``: routes of bank ``f`` are ``offsets[f]:offsets[f+1]``.
    ``route_slots`` int64 ``[R]``: position ``(s*H + h)*K + k`` of the route in ``[S, H, K]``;
    deterministic reductions store per-route results there.
    """

    gather_ids: torch.Tensor
    sorted_probs: torch.Tensor
    offsets: torch.Tensor
    route_slots: torch.Tensor
    num_tokens: int
    num_heads: int
    num_experts: int
    top_k: int
    # True only for tables made by magi-moe's own builders (``build_route_table``, the fused
    # router), whose indices are in range by construction: paths that promise no host sync
    # skip the index check for them. Not an init field, so hand-built tables and
    # ``dataclasses.replace`` copies start untrusted and get checked.
    trusted: bool = field(default=False, init=False, compare=False, repr=False)

    def mark_trusted(self) -> "RouteTable":
        object.__setattr__(self, "trusted", True)
        return self

    @property
    def num_routes(self) -> int:
        return self.gather_ids.numel()

    def counts(self) -> torch.Tensor:
        """Routes per bank, ``[H*E]`` int64."""
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, device: torch.device | str) -> "RouteTable":
        move = lambda t: t.to(device)  # noqa: E731
        moved = RouteTable(move(self.gather_ids), move(self.sorted_probs), move(self.offsets),
                           move(self.route_slots), self.num_tokens, self.num_heads,
                           self.num_experts, self.top_k)
        return moved.mark_trusted() if self.trusted else moved


def router_logits(x: torch.Tensor, gate: torch.Tensor, config: MoEConfig,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``l[s, h, e] = x[s, h, :] . gate[h*E + e, :]`` computed in ``dtype``; returns ``[S, H, E]``."""
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    xh = x.reshape(x.shape[0], H, Dh).to(dtype)
    g = gate.reshape(H, E, Dh).to(dtype)
    return torch.einsum("shd,hed->she", xh, g)


def scores_from_logits(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "sigmoid":
        return torch.sigmoid(logits)
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")


def select_experts(selection: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-``k`` indices along the last dim, highest first, ties to the lower index, NaN last."""
    if not 1 <= top_k <= selection.shape[-1]:
        raise ValueError(f"top_k must lie in [1, {selection.shape[-1]}], got {top_k}")
    # Highest score first; the stable sort keeps the lower index first among equals. A second
    # stable sort on the NaN flag then moves NaNs below everything, -inf included.
    is_nan = torch.isnan(selection)
    key = torch.where(is_nan, torch.full_like(selection, float("-inf")), selection)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    nan_last = torch.sort(torch.gather(is_nan, -1, order).to(torch.uint8), dim=-1, stable=True).indices
    order = torch.gather(order, -1, nan_last)
    return order[..., :top_k]


def route_probs(scores: torch.Tensor, expert_ids: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """Unbiased scores of the chosen experts, L1-normalised (with eps) if asked, times route_scale."""
    probs = torch.gather(scores, -1, expert_ids)
    if config.route_norm:
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    return probs * config.route_scale


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    config: MoEConfig,
    *,
    dtype: torch.dtype = torch.float32,
) -> Routes:
    """Route ``x`` ``[S, H*Dh]`` with router ``gate`` ``[H*E, Dh]`` and selection ``bias`` ``[H*E]``.

    ``dtype`` is the router's working precision: fp32 as released, float64 for the reference.
    """
    H, E = config.num_heads, config.num_experts
    check_tensor("x", x, shape=(None, config.hidden_size))
    check_tensor("gate", gate, shape=(config.num_banks, config.head_dim))
    if bias is not None:
        check_tensor("bias", bias, shape=(config.num_banks,))
        check_same_device(x=x, gate=gate, bias=bias)
    else:
        check_same_device(x=x, gate=gate)
    logits = router_logits(x, gate, config, dtype)
    scores = scores_from_logits(logits, config.score_func)
    selection = scores if bias is None else scores + bias.reshape(H, E).to(dtype)
    expert_ids = select_experts(selection, config.top_k)
    return Routes(expert_ids=expert_ids, probs=route_probs(scores, expert_ids, config))


def build_route_table(routes: Routes, config: MoEConfig) -> RouteTable:
    """Sort routes by flattened expert, stably; empty experts get equal consecutive offsets."""
    ids, probs = routes.expert_ids, routes.probs
    H, E, K = config.num_heads, config.num_experts, config.top_k
    S = ids.shape[0]
    check_tensor("routes.expert_ids", ids, shape=(S, H, K), dtype=torch.int64)
    check_tensor("routes.probs", probs, shape=(S, H, K))
    device = ids.device
    heads = torch.arange(H, device=device).view(1, H, 1)
    flat_expert = (ids + heads * E).reshape(-1)  # route r = (s*H + h)*K + k, in token order
    order = torch.sort(flat_expert, stable=True).indices
    counts = torch.bincount(flat_expert, minlength=H * E)
    offsets = torch.zeros(H * E + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=offsets[1:])
    tokens = order // (H * K)
    return RouteTable(
        gather_ids=tokens.to(torch.int32),
        sorted_probs=probs.reshape(-1)[order],  # fp32 from the released router
        offsets=offsets,
        route_slots=order,
        num_tokens=S,
        num_heads=H,
        num_experts=E,
        top_k=K,
    ).mark_trusted()


def validate_route_table(table: RouteTable, config: MoEConfig, *, num_tokens: int | None = None) -> None:
    """Full check of a (possibly hand-built) route table. Synchronises: not for hot paths."""
    HE = config.num_banks
    R = table.gather_ids.numel()
    check_tensor("table.gather_ids", table.gather_ids, shape=(None,), dtype=torch.int32)
    check_tensor("table.sorted_probs", table.sorted_probs, shape=(R,),
                 dtype=(torch.float32, torch.float64))
    check_tensor("table.offsets", table.offsets, shape=(HE + 1,), dtype=torch.int64)
    check_tensor("table.route_slots", table.route_slots, shape=(R,), dtype=torch.int64)
    check_same_device(gather_ids=table.gather_ids, sorted_probs=table.sorted_probs,
                      offsets=table.offsets, route_slots=table.route_slots)
    if (table.num_heads, table.num_experts, table.top_k) != (
        config.num_heads, config.num_experts, config.top_k
    ):
        raise ValueError(
            f"table was built for H={table.num_heads} E={table.num_experts} K={table.top_k}, "
            f"config has H={config.num_heads} E={config.num_experts} K={config.top_k}"
        )
    S = table.num_tokens if num_tokens is None else num_tokens
    if table.num_tokens != S:
        raise ValueError(f"table.num_tokens is {table.num_tokens}, input has {S} tokens")
    check_table_bounds(table, HE)
    if R:
        g = table.gather_ids
        offsets = table.offsets
        slots = table.route_slots
        if torch.unique(slots).numel() != R:
            raise ValueError("table.route_slots must be distinct: two routes share an output slot")
        bank = torch.repeat_interleave(torch.arange(HE, device=offsets.device), table.counts())
        head_of_slot = (slots // config.top_k) % config.num_heads
        token_of_slot = slots // (config.num_heads * config.top_k)
        if bool((head_of_slot != bank // config.num_experts).any()):
            raise ValueError("table.route_slots disagree with the banks' heads given by table.offsets")
        if bool((token_of_slot != g.to(torch.int64)).any()):
            raise ValueError("table.route_slots disagree with table.gather_ids (token index)")
        if not bool(torch.isfinite(table.sorted_probs).all()):
            raise ValueError("table.sorted_probs must be finite")


def check_table_bounds(table: RouteTable, num_banks: int) -> None:
    """The checks that keep a kernel's memory accesses in bounds: offsets start at 0, never
    decrease and end at the route count; token indices lie in ``[0, num_tokens)`` and route slots
    in ``[0, S*H*K)``. One sync."""
    R, S = table.gather_ids.numel(), table.num_tokens
    if table.route_slots.numel() != R:
        raise ValueError(f"table.route_slots must have {R} entries, got {table.route_slots.numel()}")
    offsets = table.offsets
    if offsets.numel() != num_banks + 1:
        raise ValueError(f"table.offsets must have {num_banks + 1} entries, got {offsets.numel()}")
    if R and table.sorted_probs.numel() != R:
        raise ValueError(f"table.sorted_probs must have {R} entries, got {table.sorted_probs.numel()}")
    stats = torch.stack([
        offsets[0], offsets[-1], (offsets[1:] < offsets[:-1]).sum(),
        table.gather_ids.min().long() if R else offsets.new_tensor(0),
        table.gather_ids.max().long() if R else offsets.new_tensor(-1),
        table.route_slots.min() if R else offsets.new_tensor(0),
        table.route_slots.max() if R else offsets.new_tensor(-1),
    ]).tolist()
    first, last, decreasing, lo, hi, slot_lo, slot_hi = stats
    if first != 0 or last != R:
        raise ValueError(f"table.offsets must start at 0 and end at the route count {R}, got {first} .. {last}")
    if decreasing:
        raise ValueError("table.offsets must be non-decreasing")
    if R and (lo < 0 or hi >= S):
        raise ValueError(f"table.gather_ids must lie in [0, {S}), got values in [{lo}, {hi}]")
    n_slots = S * table.num_heads * table.top_k
    if R and (slot_lo < 0 or slot_hi >= n_slots):
        raise ValueError(f"table.route_slots must lie in [0, {n_slots}), got values in [{slot_lo}, {slot_hi}]")
