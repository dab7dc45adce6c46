"""Hypothesis strategies for MoE fuzz cases: public, keyword-only, validated, scaled by a budget.

``budget`` scales sizes: 1 is the per-commit size (small enough for the Triton interpreter),
8 the nightly CPU size, 32 and more for GPUs. Awkward values are favoured: token counts at block
boundaries (127/128/129, and 4095/4096/4097 when the budget allows), zero and one token, one
expert, ``top_k == num_experts``.

Every strategy draws a *description* (see :mod:`fuzz.cases`); tensors are built from it.
"""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from magi_moe.config import MoEConfig, SCORE_FUNCS, WIDTH_MULTIPLE
from magi_moe.implementation import ANY_SHAPE, ShapeRule

from .cases import (ROUTING_KINDS, TIE_KINDS, X_DISTRIBUTIONS, ExpertCase, HugeCase, RoutingSpec,
                    TieCase, ValueSpec, first_overflowing_token)

__all__ = [
    "AWKWARD_TOKEN_COUNTS", "Limits", "configs", "empty_bank_sets", "expert_cases", "huge_cases",
    "limits_for", "routing_specs", "tie_cases", "token_counts", "value_specs",
]

AWKWARD_TOKEN_COUNTS = (0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097)
SWIGLU_CLAMP = 7.0
_seeds = st.integers(min_value=0, max_value=2**32 - 1)


class Limits:
    """Size limits for one budget. ``max_routes`` caps ``S*H*K``: the interpreter's cost."""

    def __init__(self, budget: float):
        if not (isinstance(budget, (int, float)) and budget > 0 and math.isfinite(budget)):
            raise ValueError(f"budget must be a finite number > 0, got {budget!r}")
        root = math.sqrt(budget)
        self.budget = float(budget)
        self.max_heads = max(2, round(3 * root))
        self.max_head_dim = WIDTH_MULTIPLE * max(2, round(4 * root))
        self.max_experts = max(4, round(12 * root))
        self.max_intermediate = WIDTH_MULTIPLE * max(2, round(6 * root))
        self.max_tokens = max(8, round(130 * budget))
        self.max_routes = max(64, round(300 * budget))

    def __repr__(self) -> str:
        return (f"Limits(budget={self.budget}, heads<={self.max_heads}, Dh<={self.max_head_dim}, "
                f"E<={self.max_experts}, I<={self.max_intermediate}, S<={self.max_tokens}, "
                f"routes<={self.max_routes})")


def limits_for(budget: float) -> Limits:
    return Limits(budget)


def _check_dtypes(dtypes) -> tuple[torch.dtype, ...]:
    dtypes = tuple(dtypes)
    allowed = (torch.bfloat16, torch.float16, torch.float32)
    if not dtypes or any(d not in allowed for d in dtypes):
        raise ValueError(f"dtypes must be a non-empty subset of {allowed}, got {dtypes}")
    return dtypes


def _favour(values: list[int], lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in [lo, hi], drawing the listed awkward ones half of the time."""
    special = sorted({v for v in values if lo <= v <= hi})
    anything = st.integers(min_value=lo, max_value=hi)
    return st.one_of(st.sampled_from(special), anything) if special else anything


def _pick_widths(accepted: list[int], favoured: tuple[int, ...]) -> st.SearchStrategy[int]:
    """One of ``accepted`` (drawn from inside a shape rule, never filtered), favoured ones half
    of the time; the smallest first, so shrinking moves towards cheap shapes."""
    special = [w for w in favoured if w in accepted]
    anything = st.sampled_from(accepted)
    return st.one_of(st.sampled_from(special), anything) if special else anything


def _accepted_widths(shapes: ShapeRule, high: int) -> tuple[list[int], list[int]]:
    """Head and intermediate widths the rule accepts up to the budget's limit; where the rule
    admits none that small, its smallest widths (a wide-only kernel still gets cases)."""
    head_dims = shapes.head_dims(WIDTH_MULTIPLE, high[0], multiple=WIDTH_MULTIPLE)
    if not head_dims:
        head_dims = shapes.head_dims(WIDTH_MULTIPLE, 4096, multiple=WIDTH_MULTIPLE)[:1]
    inters = shapes.intermediate_sizes(WIDTH_MULTIPLE, high[1], multiple=WIDTH_MULTIPLE)
    if not inters:
        inters = shapes.intermediate_sizes(WIDTH_MULTIPLE, 8192, multiple=WIDTH_MULTIPLE)[:1]
    if not head_dims:
        raise ValueError(f"shapes {shapes} accept no head width up to 4096")
    return head_dims, inters


def _check_shapes(shapes) -> ShapeRule:
    if not isinstance(shapes, ShapeRule):
        raise TypeError(f"shapes must be a magi_moe.implementation.ShapeRule, got {type(shapes).__name__}")
    return shapes


def configs(*, budget: float = 1.0, dtypes=(torch.bfloat16,), score_funcs=SCORE_FUNCS,
            shapes: ShapeRule = ANY_SHAPE) -> st.SearchStrategy[MoEConfig]:
    """Layer configurations: one head or several, one expert or many, ``top_k`` from 1 to E;
    widths drawn from those ``shapes`` (an implementation's declared rule) accepts."""
    lim = Limits(budget)
    dtypes = _check_dtypes(dtypes)
    score_funcs = tuple(score_funcs)
    if not score_funcs or any(s not in SCORE_FUNCS for s in score_funcs):
        raise ValueError(f"score_funcs must be a non-empty subset of {SCORE_FUNCS}, got {score_funcs}")
    return _configs(lim, dtypes, score_funcs, _check_shapes(shapes))


@st.composite
def _configs(draw, lim: Limits, dtypes, score_funcs, shapes: ShapeRule) -> MoEConfig:
    head_dims, inters = _accepted_widths(shapes, (lim.max_head_dim, lim.max_intermediate))
    heads = draw(_favour([1, 2, 3, 12], 1, lim.max_heads))
    head_dim = draw(_pick_widths(head_dims, (16, 32, 48, 256)))
    max_experts = lim.max_experts
    experts = draw(_favour([1, 2, 8, 16, 256], 1, max_experts))
    max_k = min(experts, shapes.max_top_k or experts)
    top_k = draw(_favour([1, 2, 6, max_k], 1, max_k))
    inter = draw(_pick_widths(inters, (16, 48, 128, 1280)))
    return MoEConfig(
        num_heads=heads, head_dim=head_dim, num_experts=experts, top_k=top_k,
        intermediate_size=inter, score_func=draw(st.sampled_from(score_funcs)),
        route_norm=draw(st.booleans()), route_scale=draw(st.sampled_from([1.0, 2.5, 4.9])),
        dtype=draw(st.sampled_from(dtypes)),
    )


def token_counts(config: MoEConfig, *, budget: float = 1.0, min_tokens: int = 0) -> st.SearchStrategy[int]:
    """Token counts for ``config``, awkward ones favoured, capped by the budget's route count."""
    _check_config(config)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    lim = Limits(budget)
    per_token = config.num_heads * config.top_k
    hi = max(min_tokens, min(lim.max_tokens, lim.max_routes // per_token))
    return _favour(list(AWKWARD_TOKEN_COUNTS), min_tokens, hi)


def routing_specs(config: MoEConfig, *, kinds=ROUTING_KINDS) -> st.SearchStrategy[RoutingSpec]:
    """Route patterns: the router, hot experts, mostly-empty experts, negative logits, one odd
    head, exact ties (see :data:`fuzz.cases.ROUTING_KINDS`)."""
    _check_config(config)
    kinds = _check_kinds(kinds, ROUTING_KINDS)
    E, K = config.num_experts, config.top_k
    return st.builds(
        RoutingSpec,
        kind=st.sampled_from(kinds),
        seed=_seeds,
        gate_std=st.sampled_from([0.25, 0.02, 2.0]),
        bias_std=st.sampled_from([0.05, 0.0, 1.0]),
        hot=_favour([1, 2, K, K + 1], 1, max(1, E)),
        levels=st.integers(min_value=1, max_value=4),
        head=st.integers(min_value=0, max_value=config.num_heads - 1),
    )


def value_specs(*, num_tokens: int | None = None, clamp_outliers: bool = True) -> st.SearchStrategy[ValueSpec]:
    """Inputs from narrow and wide ranges; pre-activations scaled around the SwiGLU7 clamp (7);
    outlier rows scaled so their pre-activations land near +-7 where the clamp branches switch."""
    if num_tokens is not None and (isinstance(num_tokens, bool) or num_tokens < 0):
        raise ValueError(f"num_tokens must be None or >= 0, got {num_tokens!r}")
    return _value_specs(num_tokens, bool(clamp_outliers))


@st.composite
def _value_specs(draw, num_tokens, clamp_outliers) -> ValueSpec:
    preact = draw(st.sampled_from([1.0, SWIGLU_CLAMP, 0.05, 3.0, 20.0, 6.9, 7.1]))
    outliers = ()
    if clamp_outliers and num_tokens != 0:
        n = draw(st.integers(min_value=0, max_value=3))
        factor = st.sampled_from([0.9, 1.0, 1.1]).map(lambda f: f * SWIGLU_CLAMP / preact)
        outliers = tuple(draw(st.tuples(st.integers(0, 2**16), factor)) for _ in range(n))
    return ValueSpec(
        seed=draw(_seeds),
        x_dist=draw(st.sampled_from(X_DISTRIBUTIONS)),
        x_scale=draw(st.sampled_from([1.0, 2.0**-10, 2.0**6])),
        wide_span=draw(st.integers(min_value=1, max_value=24)),
        preact=preact,
        outliers=outliers,
    )


def empty_bank_sets(config: MoEConfig) -> st.SearchStrategy[tuple[int, ...]]:
    """Banks to empty by hand: a random proper subset, or all banks of one head (of several).
    Every bank empty only when there is a single bank (``zero_tokens`` covers that case)."""
    _check_config(config)
    HE, E, H = config.num_banks, config.num_experts, config.num_heads
    options = []
    if HE > 1:
        options.append(st.lists(st.integers(0, HE - 1), min_size=1, max_size=HE - 1, unique=True).map(tuple))
    if H > 1:
        options.append(st.integers(0, H - 1).map(lambda h: tuple(range(h * E, (h + 1) * E))))
    return st.one_of(options) if options else st.just(tuple(range(HE)))


# Released MAGI-2 widths (CONTRACT section 1): one head's row is Dh elements, a token's row
# H*Dh; with H=12 the row stride is 3072 elements and token 699,051 is the first past 2^31.
PRODUCTION_HEAD_DIM, PRODUCTION_INTERMEDIATE, PRODUCTION_HEADS = 256, 1280, (3, 12)


def huge_cases(*, shapes: ShapeRule = ANY_SHAPE, config: MoEConfig | None = None,
               max_extra_tokens: int = 4096,
               production: bool = True) -> st.SearchStrategy[HugeCase]:
    """Cases with at least one routed token past the int32 boundary ``2^31 / (H*Dh)``, often
    mixed in one block with tokens below it (token 0, the boundary's neighbours, the last token).

    Widths come from inside ``shapes`` (the implementation's declared rule): small ones, and
    with ``production`` the released widths (``Dh=256``, ``I=1280``, ``H`` 3 or 12, a few
    experts), so a kernel restricted to wide heads still gets tokens past 2^31 where it runs.
    ``config`` pins one configuration."""
    if isinstance(max_extra_tokens, bool) or not isinstance(max_extra_tokens, int) or max_extra_tokens < 1:
        raise ValueError(f"max_extra_tokens must be an int >= 1, got {max_extra_tokens!r}")
    if config is not None:
        _check_config(config)
        return _huge_cases(st.just(config), max_extra_tokens)
    shapes = _check_shapes(shapes)
    head_dims, inters = _accepted_widths(shapes, (4 * WIDTH_MULTIPLE, 4 * WIDTH_MULTIPLE))
    small = _huge_configs(st.integers(1, 3), st.sampled_from(head_dims), st.sampled_from(inters),
                          shapes)
    if not production:
        return _huge_cases(small, max_extra_tokens)
    wide_dims = [d for d in (PRODUCTION_HEAD_DIM,) if d in shapes.head_dims(d, d)] or \
        shapes.head_dims(PRODUCTION_HEAD_DIM, 4096)[:1] or head_dims[-1:]
    wide_inters = [i for i in (PRODUCTION_INTERMEDIATE,) if i in shapes.intermediate_sizes(i, i)] or \
        shapes.intermediate_sizes(PRODUCTION_INTERMEDIATE, 8192)[:1]
    wide = _huge_configs(st.sampled_from(PRODUCTION_HEADS), st.sampled_from(wide_dims),
                         st.sampled_from(wide_inters), shapes, max_experts=2)
    return _huge_cases(st.one_of(small, wide), max_extra_tokens)


@st.composite
def _huge_configs(draw, heads, head_dims, inters, shapes: ShapeRule, max_experts: int = 8) -> MoEConfig:
    E = draw(st.integers(1, max_experts))
    return MoEConfig(num_heads=draw(heads), head_dim=draw(head_dims), num_experts=E,
                     top_k=draw(st.integers(1, min(E, shapes.max_top_k or E))),
                     intermediate_size=draw(inters), route_scale=2.5)


@st.composite
def _huge_cases(draw, configs_, max_extra_tokens: int) -> HugeCase:
    config = draw(configs_)
    t0 = first_overflowing_token(config)
    S = t0 + draw(st.integers(1, max_extra_tokens))
    # (t0 + 1 is past the end when S = t0 + 1: the fuzz campaign found that one)
    landmarks = st.sampled_from(sorted({t for t in (0, t0 - 1, t0, t0 + 1, S - 1) if 0 <= t < S}))
    anywhere = st.one_of(landmarks, st.integers(max(0, t0 - 3), S - 1), st.integers(0, S - 1))
    tokens = draw(st.lists(anywhere, min_size=0, max_size=5, unique=True))
    tokens.append(draw(st.integers(t0, S - 1)))  # at least one past the boundary
    return HugeCase(config, S, tuple(tokens), seed=draw(st.integers(0, 2**32 - 1)))


def _check_config(config) -> None:
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")


def _check_kinds(kinds, allowed, what="kinds") -> tuple[str, ...]:
    kinds = tuple(kinds)
    if not kinds or any(k not in allowed for k in kinds):
        raise ValueError(f"{what} must be a non-empty subset of {allowed}, got {kinds}")
    return kinds


def expert_cases(*, budget: float = 1.0, dtypes=(torch.bfloat16,), routing_kinds=ROUTING_KINDS,
                 min_tokens: int = 0, empty_banks: bool = False,
                 config: MoEConfig | None = None,
                 shapes: ShapeRule = ANY_SHAPE) -> st.SearchStrategy[ExpertCase]:
    """Expert-computation cases (shape, routes, values). ``empty_banks=True`` also empties
    some banks by hand; ``config`` pins the configuration; ``shapes`` (an implementation's
    declared rule) bounds the widths drawn."""
    Limits(budget)
    _check_dtypes(dtypes)
    routing_kinds = _check_kinds(routing_kinds, ROUTING_KINDS, "routing_kinds")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    if config is not None:
        _check_config(config)
    return _expert_cases(budget, tuple(dtypes), routing_kinds, min_tokens, bool(empty_banks), config,
                         _check_shapes(shapes))


@st.composite
def _expert_cases(draw, budget, dtypes, routing_kinds, min_tokens, empty_banks, config,
                  shapes) -> ExpertCase:
    cfg = config if config is not None else draw(configs(budget=budget, dtypes=dtypes, shapes=shapes))
    S = draw(token_counts(cfg, budget=budget, min_tokens=min_tokens))
    return ExpertCase(
        config=cfg, num_tokens=S,
        routing=draw(routing_specs(cfg, kinds=routing_kinds)),
        values=draw(value_specs(num_tokens=S)),
        empty_banks=draw(empty_bank_sets(cfg)) if empty_banks else (),
    )


def tie_cases(*, budget: float = 1.0, kinds=TIE_KINDS, score_funcs=SCORE_FUNCS,
              min_tokens: int = 1) -> st.SearchStrategy[TieCase]:
    """Router inputs with exact ties: quantised logits, duplicated gate rows, bias levels,
    all-equal scores, a tie at the k-th/(k+1)-th boundary, all-negative logits, NaN bias."""
    kinds = _check_kinds(kinds, TIE_KINDS)
    configs_ = configs(budget=budget, score_funcs=score_funcs)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    return _tie_cases(configs_, budget, kinds, min_tokens)


@st.composite
def _tie_cases(draw, configs_, budget, kinds, min_tokens) -> TieCase:
    cfg = draw(configs_)
    S = draw(token_counts(cfg, budget=budget, min_tokens=min_tokens))
    return TieCase(config=cfg, num_tokens=S, kind=draw(st.sampled_from(kinds)), seed=draw(_seeds),
                   levels=draw(st.integers(1, 4)), use_bias=draw(st.booleans()))
