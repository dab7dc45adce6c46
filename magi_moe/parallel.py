"""Expert parallelism over heads on ``torch.distributed`` (CONTRACT sections 1 and 3).

Routing and experts are per head, so the natural split is by head: each rank of an EP group
holds a contiguous slice of heads (router rows, selection biases and the experts of those
heads) and computes them for *every* rank's tokens.

Layout. With ``H`` heads on ``W`` ranks, every rank holds ``L = ceil(H / W)`` head slots: rank
``r`` owns the real heads ``r*L : min((r+1)*L, H)`` and fills the remaining slots with zero
experts (zero router rows, zero biases, zero weights), as the released deployment pads them.
Uniform slots keep every rank's shapes identical and every all-to-all split regular. The
routes of padded heads are dropped before the expert computation (they cost nothing) and
their output columns are dropped on the way back.

One forward, for rank ``r`` holding ``S_r`` tokens ``x_r [S_r, H*Dh]`` (``S_r`` may differ
between ranks, and may be zero):

1. ``exchange_counts``: all-gather of every rank's token count (one host synchronisation:
   the all-to-all splits live on the host).
2. ``dispatch_heads``: all-to-all; rank ``j`` receives ``x_r[:, heads of j]`` from every
   ``r``, concatenated in rank order, i.e. all tokens of the group in global order.
3. Local routing of this rank's heads, the route table, and any registered implementation.
4. ``combine_heads``: the inverse all-to-all; each rank gets its own tokens' outputs for every
   head back and drops the padded head columns.

Why the result equals the single-process layer bit for bit with a deterministic
implementation: each ``(token, head)`` output depends only on that token's row of that head,
the head's router rows and experts; tokens arrive in the same global order, so every expert
sees the same tokens in the same order, and the exchange itself only moves bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import MoEConfig
from .debug import workspace
from .dispatch import choose_implementation
from .registry import Implementation, get_implementation
from .routing import RouteTable, build_route_table
from .validation import check_finite, check_tensor
from .weights import ExpertWeights

# Released-layout checkpoint names (CONTRACT section 3); all have the banks ``H*E`` as dim 0.
CHECKPOINT_KEYS = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias", "router.expert_bias_ema")
BIAS_SOURCES = ("expert_bias_ema", "expert_bias", "none")


@dataclass(frozen=True)
class HeadShard:
    """The head slots of one rank: real heads ``start:stop`` followed by ``num_padded`` zero heads."""

    num_heads: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HeadShard.{name} must be a positive int, got {value!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not (
            0 <= self.rank < self.world_size
        ):
            raise ValueError(f"HeadShard.rank must lie in [0, {self.world_size}), got {self.rank!r}")

    @property
    def heads_per_rank(self) -> int:
        """``L = ceil(H / W)``: head slots on every rank, padding included."""
        return math.ceil(self.num_heads / self.world_size)

    @property
    def start(self) -> int:
        return min(self.rank * self.heads_per_rank, self.num_heads)

    @property
    def stop(self) -> int:
        return min((self.rank + 1) * self.heads_per_rank, self.num_heads)

    @property
    def num_real(self) -> int:
        return self.stop - self.start

    @property
    def num_padded(self) -> int:
        return self.heads_per_rank - self.num_real

    def local_config(self, config: MoEConfig) -> MoEConfig:
        """The configuration each rank computes with: ``L`` heads, everything else unchanged."""
        if config.num_heads != self.num_heads:
            raise ValueError(f"config has {config.num_heads} heads, the shard was made for {self.num_heads}")
        return config.replace(num_heads=self.heads_per_rank)


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], config: MoEConfig, shard: HeadShard,
                     *, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """This rank's rows of a full released-layout checkpoint, in the padded local layout.

    Every tensor keeps its CONTRACT-3 name and gets ``L*E`` rows. Without padding and without a
    device move, each entry is a view into ``state_dict`` (``narrow`` along the bank dim): no
    copy at all. With padding, only this rank's slice is copied, next to zero rows. With
    ``device``, only the slice travels.
    """
    missing = [k for k in CHECKPOINT_KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"state_dict lacks {missing}; the released layout has {list(CHECKPOINT_KEYS)}")
    HE, Dh, I, E = config.num_banks, config.head_dim, config.intermediate_size, config.num_experts
    shapes = {"gate": (HE, Dh), "W_gate": (HE, Dh, I), "W_up": (HE, Dh, I), "W_down": (HE, I, Dh),
              "router.expert_bias": (HE,), "router.expert_bias_ema": (HE,)}
    local = {}
    for name in CHECKPOINT_KEYS:
        full = check_tensor(f"state_dict[{name!r}]", state_dict[name], shape=shapes[name])
        rows = full.narrow(0, shard.start * E, shard.num_real * E)  # a view, never a copy
        if device is not None:
            rows = rows.to(device)
        if shard.num_padded:
            zeros = rows.new_zeros((shard.num_padded * E, *rows.shape[1:]))
            rows = torch.cat([rows, zeros])
        local[name] = rows
    for name in ("gate", "router.expert_bias", "router.expert_bias_ema"):
        check_finite(f"state_dict[{name!r}] (rows of heads {shard.start}:{shard.stop})", local[name])
    return local


def exchange_counts(num_tokens: int, group=None, *, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's token count, in group-rank order (an all-gather; one host synchronisation)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(counts, mine, group=group)
    return [int(c) for c in torch.cat(counts).tolist()]


def head_slots(x: torch.Tensor, shard: HeadShard, head_dim: int) -> torch.Tensor:
    """``x [S, H*Dh]`` as every rank's head slots, ``[S, W, L*Dh]`` (padded slots zero): slot
    block ``j`` is what rank ``j`` receives for these tokens."""
    S, W, L = x.shape[0], shard.world_size, shard.heads_per_rank
    heads = x.reshape(S, shard.num_heads, head_dim)
    if W * L > shard.num_heads:
        heads = F.pad(heads, (0, 0, 0, W * L - shard.num_heads))  # zero head slots
    return heads.reshape(S, W, L * head_dim)


def dispatch_heads(x: torch.Tensor, shard: HeadShard, head_dim: int, counts: list[int],
                   group=None) -> torch.Tensor:
    """Send ``x [S_r, H*Dh]``'s head slots to their owners; return ``[sum(counts), L*Dh]``.

    The result holds the slots of this rank for every rank's tokens, concatenated in rank
    order (source ``j``'s rows are ``sum(counts[:j]) : sum(counts[:j+1])``).
    """
    S, W, L = x.shape[0], shard.world_size, shard.heads_per_rank
    send = head_slots(x, shard, head_dim).transpose(0, 1).contiguous()  # [W, S, L*Dh]: block j to rank j
    recv = workspace(sum(counts), L * head_dim, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send.view(W * S, L * head_dim), output_split_sizes=list(counts),
                           input_split_sizes=[S] * W, group=group)
    return recv


def combine_heads(y_local: torch.Tensor, shard: HeadShard, head_dim: int, counts: list[int],
                  group=None) -> torch.Tensor:
    """Inverse of :func:`dispatch_heads`: ``[sum(counts), L*Dh]`` in, ``[S_r, H*Dh]`` out."""
    W, L, S = shard.world_size, shard.heads_per_rank, counts[shard.rank]
    send = y_local.contiguous()
    recv = workspace(W * S, L * head_dim, dtype=y_local.dtype, device=y_local.device)
    dist.all_to_all_single(recv, send, output_split_sizes=[S] * W, input_split_sizes=list(counts),
                           group=group)
    slots = recv.view(W, S, L * head_dim).transpose(0, 1).reshape(S, W * L * head_dim)
    return slots[:, :shard.num_heads * head_dim].contiguous()  # padded head columns dropped


def drop_padded_routes(table: RouteTable, shard: HeadShard, top_k: int) -> RouteTable:
    """The table without the routes of padded heads, so they cost no expert computation.

    Padded heads are the last local heads, so their banks sort last; every token has exactly
    ``K`` routes per head, so the real routes are the first ``T*K*num_real``: known on the
    host, no synchronisation. The implementation still writes their columns (zeros).
    """
    if not shard.num_padded:
        return table
    return table.select(table.num_tokens * top_k * shard.num_real)  # a prefix: trust kept


def group_shard(config: MoEConfig, group=None) -> HeadShard:
    """The :class:`HeadShard` of this process in ``group`` (the default group when None)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first "
                           "(gloo for CPU tensors, NCCL for CUDA tensors)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return HeadShard(config.num_heads, dist.get_world_size(group), rank)


class ExpertParallelMoE:
    """One rank's part of an expert-parallel MAGI-2 MoE layer.

    ``ep(x)`` takes this rank's tokens ``x [S_r, H*Dh]`` (``config.dtype``, on the weights'
    device; ``S_r`` may be zero and may differ between ranks) and returns their layer output
    ``[S_r, H*Dh]``, computed with the heads spread over ``group``. Every rank of the group must
    call it the same number of times (it runs collectives).
    """

    def __init__(self, config: MoEConfig, shard: HeadShard, local: Mapping[str, torch.Tensor], *,
                 impl: Implementation, group=None, bias_source: str = "expert_bias_ema"):
        if bias_source not in BIAS_SOURCES:
            raise ValueError(f"bias_source must be one of {BIAS_SOURCES}, got {bias_source!r}")
        self.config = config
        self.shard = shard
        self.local_config = shard.local_config(config)
        self.group = group
        self.impl = impl
        self.bias_source = bias_source
        self.gate = local["gate"]
        self.bias = None if bias_source == "none" else local[f"router.{bias_source}"]
        self.weights = ExpertWeights(local["W_gate"], local["W_up"], local["W_down"]).check(self.local_config)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config: MoEConfig, *, group=None,
                        bias_source: str = "expert_bias_ema", deterministic: bool = False,
                        impl: str | Implementation | None = None,
                        device: torch.device | str | None = None) -> "ExpertParallelMoE":
        """This rank's shard of a full released-layout checkpoint (see :func:`shard_state_dict`).

        ``impl`` by name or object; by default :func:`~magi_moe.dispatch.choose_implementation`
        picks for the weights' device (its deterministic choice when ``deterministic=True``); an
        implementation named with ``deterministic=True`` must declare the capability.
        """
        if bias_source not in BIAS_SOURCES:
            raise ValueError(f"bias_source must be one of {BIAS_SOURCES}, got {bias_source!r}")
        if isinstance(impl, str):
            impl = get_implementation(impl)
        if impl is not None and deterministic and not impl.deterministic:
            raise ValueError(f"impl: deterministic=True but {impl.name!r} does not declare 'deterministic'")
        shard = group_shard(config, group)
        local = shard_state_dict(state_dict, config, shard, device=device)
        if impl is None:
            impl = choose_implementation(local["W_gate"].device, config.dtype, deterministic=deterministic)
        return cls(config, shard, local, impl=impl, group=group, bias_source=bias_source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, shard, Dh = self.config, self.shard, self.config.head_dim
        check_tensor("x", x, shape=(None, cfg.hidden_size), dtype=cfg.dtype, device=self.gate.device)
        counts = exchange_counts(x.shape[0], self.group, device=x.device)
        x_local = dispatch_heads(x, shard, Dh, counts, self.group)  # [T, L*Dh], all tokens
        return combine_heads(self.local_forward(x_local).to(x.dtype), shard, Dh, counts, self.group)

    def local_forward(self, x_local: torch.Tensor) -> torch.Tensor:
        """This rank's part between the two exchanges: its head slots ``x_local [T, L*Dh]`` of
        every token of the group routed (by the implementation's own router) and computed. No
        collective, so one process can reproduce every rank's problem (the invariance tests do,
        on one device)."""
        routes = self.impl.route(x_local, self.gate, self.bias, self.local_config)
        table = drop_padded_routes(build_route_table(routes, self.local_config), self.shard,
                                   self.config.top_k)
        # NaN-filled under debug.poison_workspaces(): columns the implementation skips would show.
        y_local = workspace(*x_local.shape, dtype=self.impl.output_dtype(x_local.dtype),
                            device=x_local.device)
        with torch.no_grad():
            self.impl(x_local, table, self.weights, self.local_config, out=y_local)
        return y_local

    __call__ = forward

    def __repr__(self) -> str:
        s = self.shard
        return (f"ExpertParallelMoE(rank {s.rank}/{s.world_size}, heads {s.start}:{s.stop} "
                f"+ {s.num_padded} padded, {self.config.describe()}, impl={self.impl.name})")
