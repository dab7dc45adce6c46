"""Fuzz cases: small JSON-serialisable descriptions from which every tensor is built deterministically.

Hypothesis draws the *description* (shapes, routing pattern, value ranges, outliers, seeds); the
tensors are then built from seeded CPU generators and moved to the device. So a case shrinks on
what matters (sizes, patterns) and replays bit for bit anywhere from its JSON, which is what the
one-line reproduction commands carry.

Cases:

* :class:`ExpertCase` -- the expert computation on given routes (differential, equivariance,
  linearity, empty experts, determinism).
* :class:`TieCase` -- router inputs on an exact grid, so that selection scores tie exactly.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from magi_moe.audit.router_probes import boundary_bias
from magi_moe.config import MoEConfig
from magi_moe.problems import Problem, cancelling_problem, routes_to  # noqa: F401 (re-exported)
from magi_moe.routing import RouteTable, Routes, build_route_table, route
from magi_moe.weights import ExpertWeights

__all__ = [
    "DTYPES", "ROUTER_KINDS", "ROUTING_KINDS", "TIE_KINDS", "X_DISTRIBUTIONS",
    "ExpertCase", "RoutingSpec", "TieCase", "ValueSpec",
    "build_problem", "build_router_inputs", "build_values", "case_from_dict", "case_to_dict",
    "config_from_dict", "config_to_dict", "drop_banks", "dumps", "loads",
]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# How the routes of an ExpertCase are made (CONTRACT section 7's skew and empty-expert classes).
ROUTING_KINDS = (
    "router",        # the fp32 router on random gate/bias (as docs/ANCHORS.md draws them)
    "uniform",       # K distinct experts uniformly at random
    "hot",           # every token prefers the same `hot` experts (hot=1: all tokens to one expert)
    "concentrated",  # only `hot` (>= K) experts per head are used: most experts empty
    "negative",      # the router with all-negative logits
    "head-differs",  # one head sends every token to the same K experts, the others uniform
    "ties",          # the router with all scores equal and `levels` bias levels: exact ties
)
X_DISTRIBUTIONS = ("normal", "narrow", "wide")

# How the router inputs of a TieCase are made; all logits are exact in fp32 (grid values).
TIE_KINDS = (
    "levels",          # gate rows = level * v: experts with equal level tie for every token
    "duplicate-rows",  # grid gate with some rows copied onto others
    "bias-levels",     # grid gate plus a bias with a few levels
    "all-equal",       # zero gate: every score equal
    "boundary",        # zero gate, bias with a tie exactly at the k-th / (k+1)-th place
    "negative",        # positive x, non-positive gate: all logits <= 0, with levels
    "nan-bias",        # bias levels with some NaN (rank last) and -inf entries
    "underflow",       # logits down to -1024: sigmoid scores underflow to 0 (the L1 norm's eps)
    "inf-bias",        # bias levels with +inf and -inf entries: infinite selection scores tie
)
# The router fuzzers' kinds: the grid kinds above (exact fp32 logits) and two more.
ROUTER_KINDS = TIE_KINDS + (
    "continuous",      # continuous values, a bias that flips choices: ties only within rounding
    "nan-x",           # grid values with NaN x in some (token, head) pairs: NaN logits rows
)


# -- configuration <-> JSON --------------------------------------------------------------------
def config_to_dict(config: MoEConfig) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    d["dtype"] = str(config.dtype).removeprefix("torch.")
    return d


def config_from_dict(d: dict[str, Any]) -> MoEConfig:
    d = dict(d)
    try:
        d["dtype"] = DTYPES[d["dtype"]]
    except KeyError:
        raise ValueError(f"config dtype must be one of {sorted(DTYPES)}, got {d.get('dtype')!r}") from None
    return MoEConfig(**d)


# -- case descriptions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingSpec:
    """How routes are made. ``hot``: hot experts ("hot") or experts in use ("concentrated");
    ``levels``: bias levels ("ties"); ``head``: the odd head ("head-differs")."""

    kind: str
    seed: int
    gate_std: float = 0.25
    bias_std: float = 0.05
    hot: int = 1
    levels: int = 2
    head: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ROUTING_KINDS:
            raise ValueError(f"RoutingSpec.kind must be one of {ROUTING_KINDS}, got {self.kind!r}")
        if self.hot < 1 or self.levels < 1:
            raise ValueError(f"RoutingSpec.hot and .levels must be >= 1, got {self.hot}, {self.levels}")


@dataclass(frozen=True)
class ValueSpec:
    """Input and weight values.

    ``x_dist``: "normal" (N(0, x_scale^2)), "narrow" (magnitudes in one binade [x_scale,
    2 x_scale)) or "wide" (log-uniform magnitudes over ``wide_span`` binades below x_scale).
    ``preact``: the standard deviation the gate/up pre-activations are scaled to (7 puts many
    of them on the SwiGLU7 clamp). ``outliers``: ``(token, factor)`` pairs, ``x[token mod S] *=
    factor``. Weights: gate/up N(0, (preact / (rms(x) sqrt(Dh)))^2), down N(0, 1/I).
    """

    seed: int
    x_dist: str = "normal"
    x_scale: float = 1.0
    wide_span: int = 8
    preact: float = 1.0
    outliers: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.x_dist not in X_DISTRIBUTIONS:
            raise ValueError(f"ValueSpec.x_dist must be one of {X_DISTRIBUTIONS}, got {self.x_dist!r}")
        if not (self.x_scale > 0 and self.preact > 0 and self.wide_span >= 1):
            raise ValueError("ValueSpec.x_scale and .preact must be > 0 and .wide_span >= 1, got "
                             f"{self.x_scale}, {self.preact}, {self.wide_span}")
        object.__setattr__(self, "outliers", tuple((int(t), float(f)) for t, f in self.outliers))


@dataclass(frozen=True)
class ExpertCase:
    """One expert-computation problem. ``empty_banks``: banks ``h*E+e`` whose routes are removed
    from the route table by hand (so whole (token, head) pairs may have no route at all)."""

    config: MoEConfig
    num_tokens: int
    routing: RoutingSpec
    values: ValueSpec
    empty_banks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"ExpertCase.num_tokens must be >= 0, got {self.num_tokens}")
        bad = [b for b in self.empty_banks if not 0 <= b < self.config.num_banks]
        if bad:
            raise ValueError(f"ExpertCase.empty_banks must lie in [0, {self.config.num_banks}), got {bad}")
        object.__setattr__(self, "empty_banks", tuple(sorted(set(self.empty_banks))))


@dataclass(frozen=True)
class TieCase:
    """Router inputs of one of ``ROUTER_KINDS`` (those of ``TIE_KINDS`` on an exact grid);
    ``levels`` distinct gate/bias levels."""

    config: MoEConfig
    num_tokens: int
    kind: str
    seed: int
    levels: int = 2
    use_bias: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"TieCase.kind must be one of {ROUTER_KINDS}, got {self.kind!r}")
        if self.num_tokens < 0 or self.levels < 1:
            raise ValueError(f"TieCase.num_tokens must be >= 0 and .levels >= 1, got "
                             f"{self.num_tokens}, {self.levels}")


INT32_LIMIT = 2**31


def first_overflowing_token(config: MoEConfig) -> int:
    """The first token whose row offset ``token * H*Dh`` (in elements) reaches 2^31."""
    return -(-INT32_LIMIT // config.hidden_size)


@dataclass(frozen=True)
class HugeCase:
    """``num_tokens`` tokens of which only ``tokens`` (sorted, distinct) are routed, each to
    ``top_k`` experts in every head; ``seed`` draws their values, experts and weights
    (run by :mod:`fuzz.huge`)."""

    config: MoEConfig
    num_tokens: int
    tokens: tuple[int, ...]
    seed: int

    def __post_init__(self) -> None:
        tokens = tuple(sorted(set(int(t) for t in self.tokens)))
        if not tokens or tokens[0] < 0 or tokens[-1] >= self.num_tokens:
            raise ValueError(f"HugeCase.tokens must be non-empty and lie in [0, {self.num_tokens}), "
                             f"got {self.tokens}")
        if self.num_tokens >= INT32_LIMIT:
            raise ValueError(f"HugeCase.num_tokens must fit the int32 gather ids, got {self.num_tokens}")
        object.__setattr__(self, "tokens", tokens)


_CASE_TYPES = {"ExpertCase": ExpertCase, "TieCase": TieCase, "HugeCase": HugeCase}


def case_to_dict(case) -> dict[str, Any]:
    """A JSON-ready dict (``{"type": ..., fields...}``) of any case in this module."""
    d: dict[str, Any] = {"type": type(case).__name__}
    for f in dataclasses.fields(case):
        value = getattr(case, f.name)
        if isinstance(value, MoEConfig):
            value = config_to_dict(value)
        elif dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif isinstance(value, tuple):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        d[f.name] = value
    return d


def case_from_dict(d: dict[str, Any]):
    d = dict(d)
    kind = d.pop("type", None)
    types = _CASE_TYPES
    if kind not in types:
        raise ValueError(f"case type must be one of {sorted(types)}, got {kind!r}")
    d["config"] = config_from_dict(d["config"])
    if "routing" in d:
        d["routing"] = RoutingSpec(**d["routing"])
    if "values" in d:
        d["values"] = ValueSpec(**{**d["values"], "outliers": tuple(map(tuple, d["values"]["outliers"]))})
    for key in ("empty_banks", "tokens"):
        if key in d:
            d[key] = tuple(d[key])
    return types[kind](**d)


def dumps(obj) -> str:
    """Compact one-line JSON (no single quotes, so it fits in a shell command in '...')."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def loads(text: str):
    return json.loads(text)


# -- building tensors ------------------------------------------------------------------------------
def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) % (2**63))


def build_values(case: ExpertCase) -> tuple[torch.Tensor, ExpertWeights]:
    """``x`` ``[S, H*Dh]`` and the expert weights, on the CPU, rounded to the config's dtype."""
    cfg, spec, S = case.config, case.values, case.num_tokens
    gen = _generator(spec.seed)
    D, Dh, I, HE = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_banks
    if spec.x_dist == "normal":
        x = torch.randn(S, D, generator=gen) * spec.x_scale
    else:
        sign = torch.where(torch.rand(S, D, generator=gen) < 0.5, -1.0, 1.0)
        if spec.x_dist == "narrow":
            magnitude = 1.0 + torch.rand(S, D, generator=gen)  # one binade
        else:
            magnitude = torch.exp2(-spec.wide_span * torch.rand(S, D, generator=gen))
        x = sign * magnitude * spec.x_scale
    if S:
        for token, factor in dict((t % S, f) for t, f in spec.outliers).items():  # one per row
            x[token] *= factor
    limit = torch.finfo(cfg.dtype).max / 64  # finite inputs, with headroom for the outputs
    x = x.clamp(-limit, limit).to(cfg.dtype)
    x_rms = float(x.float().pow(2).mean().sqrt()) if S else spec.x_scale
    # Tiny inputs would need huge weights to reach the pre-activation target; the weights stay
    # finite (well inside the dtype's range), so such cases simply land below the target.
    w_limit = limit / 2**10
    gu_std = min(spec.preact / (max(x_rms, 1e-30) * math.sqrt(Dh)), w_limit / 8)

    def draw(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).clamp(-w_limit, w_limit).to(cfg.dtype)

    weights = ExpertWeights(draw(HE, Dh, I, std=gu_std), draw(HE, Dh, I, std=gu_std),
                            draw(HE, I, Dh, std=1 / math.sqrt(I)))
    return x, weights


def _distinct_experts(keys: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ``top_k`` largest keys' indices along the last dim (keys are continuous: no ties)."""
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[..., :top_k]


def _routes(case: ExpertCase, x: torch.Tensor) -> tuple[Routes, torch.Tensor, torch.Tensor | None]:
    """Routes ``[S, H, K]`` plus the gate and bias that were used (zeros/None when drawn directly)."""
    cfg, spec, S = case.config, case.routing, case.num_tokens
    H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
    gen = _generator(spec.seed)
    zero_gate = torch.zeros(cfg.num_banks, Dh)
    if spec.kind in ("router", "negative"):
        gate = torch.randn(cfg.num_banks, Dh, generator=gen) * spec.gate_std
        bias = torch.randn(cfg.num_banks, generator=gen) * spec.bias_std if spec.bias_std else None
        x_router = x
        if spec.kind == "negative":  # x . gate <= 0 for every token and expert
            gate, x_router = -gate.abs(), x.abs()
        return route(x_router, gate, bias, cfg), gate, bias
    if spec.kind == "ties":
        bias = torch.randint(0, spec.levels, (cfg.num_banks,), generator=gen).float() / 8
        return route(x, zero_gate, bias, cfg), zero_gate, bias
    keys = torch.rand(S, H, E, generator=gen)
    if spec.kind == "hot":
        hot = torch.stack([torch.randperm(E, generator=gen)[: min(spec.hot, E)] for _ in range(H)])
        keys[:, torch.arange(H)[:, None], hot] += 1.0  # hot experts outrank every other one
    elif spec.kind == "concentrated":
        used = max(K, min(spec.hot, E))
        for h in range(H):
            unused = torch.randperm(E, generator=gen)[used:]
            keys[:, h, unused] -= 2.0  # never chosen while `used` >= K others exist
    elif spec.kind == "head-differs":
        odd = spec.head % H
        keys[:, odd] = torch.rand(E, generator=gen)  # same order for every token
    ids = _distinct_experts(keys, K)
    return routes_to(ids, cfg, seed=spec.seed + 1), zero_gate, None


def drop_banks(table: RouteTable, banks: tuple[int, ...] | list[int]) -> RouteTable:
    """``table`` without the routes of ``banks``: those experts become empty, and a (token, head)
    whose routes all went has no route left (its output must be exactly zero)."""
    if not banks:
        return table
    counts = table.counts()
    keep_bank = torch.ones_like(counts, dtype=torch.bool)
    keep_bank[torch.as_tensor(list(banks), dtype=torch.long, device=counts.device)] = False
    bank_of_route = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    return table.select(keep_bank[bank_of_route])


def build_problem(case: ExpertCase, device: str | torch.device = "cpu") -> Problem:
    """The case's tensors, built on the CPU from its seeds and then moved to ``device``."""
    x, weights = build_values(case)
    routes, gate, bias = _routes(case, x)
    table = drop_banks(build_route_table(routes, case.config), case.empty_banks)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    routes = Routes(move(routes.expert_ids), move(routes.probs))
    return Problem(case.config, move(x), move(gate), move(bias), weights.to(device), routes,
                   table.to(device))


def build_router_inputs(case: TieCase, device: str | torch.device = "cpu"):
    """``(x [S, H*Dh], gate [H*E, Dh] fp32, bias [H*E] fp32 or None)`` with exact fp32 logits:
    x in {-1, -1/2, 0, 1/2, 1}, gate entries multiples of 1/4 (|.| <= 7/2), bias multiples of 1/8,
    so every dot product over Dh <= 2^16 is exact whatever the summation order. (Except the
    ``continuous`` kind, whose near-ties lie within rounding, and NaN rows of ``nan-x``.)"""
    cfg, S, gen = case.config, case.num_tokens, _generator(case.seed)
    H, E, K, Dh, HE = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim, cfg.num_banks
    L = case.levels
    x = torch.randint(-2, 3, (S, H * Dh), generator=gen).float() / 2
    grid_gate = torch.randint(-2, 3, (HE, Dh), generator=gen).float() / 4
    bias_levels = torch.randint(0, L, (HE,), generator=gen).float() / 8
    kind = case.kind
    if kind == "boundary" and E == K:
        kind = "all-equal"  # no (k+1)-th expert: the boundary tie does not exist
    if kind in ("levels", "negative"):
        v = torch.randint(-2, 3, (H, 1, Dh), generator=gen).float() / 4
        if kind == "negative":
            v = -v.abs()
            x = x.abs()
        level = torch.randint(0, min(L, 7) + 1, (H, E, 1), generator=gen).float()
        gate = (level * v).reshape(HE, Dh)
    elif kind == "duplicate-rows":
        gate = grid_gate.clone()
        src = torch.randint(0, HE, (max(1, HE // 2),), generator=gen)
        dst = torch.randint(0, HE, (src.numel(),), generator=gen)
        same_head = (src // E) == (dst // E)
        gate[dst[same_head]] = gate[src[same_head]]
    elif kind in ("all-equal", "boundary"):
        gate = torch.zeros(HE, Dh)
    elif kind == "underflow":
        # x >= 0 and gate rows of -64 or -2 times a 0/1 pattern: logits exact, most of them so
        # negative that sigmoid gives exactly 0 (every chosen score 0 in some heads)
        x = x.abs()
        deep = torch.rand(HE, 1, generator=gen) < 0.75
        gate = torch.where(deep, -64.0, -2.0) * torch.randint(0, 2, (HE, Dh), generator=gen).float()
    else:
        gate = grid_gate
    bias = bias_levels if case.use_bias else None
    if kind == "all-equal" and bias is not None:
        bias = torch.zeros(HE)
    if kind == "boundary":
        # per head: K-1 winners, then (at least) two experts tied for the K-th place, rest below
        bias = boundary_bias(H, E, K, tied=2, gen=gen)
    if kind == "nan-bias":
        bias = bias_levels.clone()
        flags = torch.rand(HE, generator=gen)
        bias[flags < 0.2] = float("nan")
        bias[(flags >= 0.2) & (flags < 0.3)] = float("-inf")
        # and always head 0's last expert: a kernel that pads E to a power of two keeps its
        # sentinels next to that index (a NaN there was once counted as a route)
        bias[E - 1] = float("nan")
    if kind == "inf-bias":
        bias = bias_levels.clone()
        flags = torch.rand(HE, generator=gen)
        bias[flags < 0.25] = float("inf")
        bias[(flags >= 0.25) & (flags < 0.35)] = float("-inf")
    if kind == "continuous":
        x = torch.randn(S, H * Dh, generator=gen)
        gate = torch.randn(HE, Dh, generator=gen) / Dh ** 0.5
        bias = 0.3 * torch.randn(HE, generator=gen) if case.use_bias else None
    if kind == "nan-x":
        # every (token, head) whose flag is set sees NaN logits: the NaN rule picks 0..K-1
        rows = torch.rand(S, H, generator=gen) < 0.3
        x = x.view(S, H, Dh).masked_fill(rows[..., None], float("nan")).view(S, H * Dh)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x.to(cfg.dtype)), move(gate), move(bias)
