"""Hypothesis strategies for MoE fuzz cases: public, keyword-only, validated, scaled by a budget.

``budget`` scales sizes: 1 is the per-commit size (small enough for the Triton interpreter),
8 the nightly CPU size, 32 and more for GPUs. Awkward values are favoured: token counts at block
boundaries (127/128/129, and 4095/4096/4097 when the budget allows), zero and one token, one
expert, ``top_k == num_experts``.

Every strategy draws a *description* (see :mod:`fuzz.cases`); tensors are built from it.

Strategies take strategies for their parts (xarray's style): ``expert_cases(configs=configs(...),
tokens=..., routings=..., values=..., empty_banks=...)``. A part that depends on an earlier draw
is a function of it returning a strategy (``tokens=lambda config: token_counts(config,
min_tokens=1)``); a part that does not may be a plain strategy (``tokens=st.just(4)``). The
plain-value arguments (``dtypes=``, ``min_tokens=``, ``routing_kinds=``, ...) remain as
shorthands for the common parts; giving a part both ways is refused.
"""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from magi_moe.config import MoEConfig, SCORE_FUNCS, WIDTH_MULTIPLE
from magi_moe.implementation import ANY_SHAPE, ShapeRule

from .cases import (ROUTER_KINDS, ROUTING_KINDS, TIE_KINDS, X_DISTRIBUTIONS, ExpertCase, HugeCase, RoutingSpec,
                    TieCase, ValueSpec, first_overflowing_token)

__all__ = [
    "AWKWARD_TOKEN_COUNTS", "Limits", "configs", "empty_bank_sets", "expert_cases", "huge_cases",
    "huge_configs", "limits_for", "routing_specs", "tie_cases", "token_counts", "value_specs",
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
            shapes: ShapeRule = ANY_SHAPE, min_heads: int = 1) -> st.SearchStrategy[MoEConfig]:
    """Layer configurations: one head or several (at least ``min_heads``, at most the budget's),
    one expert or many, ``top_k`` from 1 to E; widths drawn from those ``shapes`` (an
    implementation's declared rule) accepts. ``dtypes`` and ``score_funcs``: a strategy, or the
    values to sample from."""
    lim = Limits(budget)
    dtypes = _part(dtypes, _check_dtypes)
    score_funcs = _part(score_funcs, lambda v: _check_kinds(v, SCORE_FUNCS, "score_funcs"))
    if isinstance(min_heads, bool) or not isinstance(min_heads, int) or not 1 <= min_heads <= lim.max_heads:
        raise ValueError(f"min_heads must be an int in [1, {lim.max_heads}], got {min_heads!r}")
    return _configs(lim, dtypes, score_funcs, _check_shapes(shapes), min_heads)


@st.composite
def _configs(draw, lim: Limits, dtypes, score_funcs, shapes: ShapeRule, min_heads: int = 1) -> MoEConfig:
    head_dims, inters = _accepted_widths(shapes, (lim.max_head_dim, lim.max_intermediate))
    heads = draw(_favour([1, 2, 3, 12], min_heads, lim.max_heads))
    head_dim = draw(_pick_widths(head_dims, (16, 32, 48, 256)))
    max_experts = lim.max_experts
    experts = draw(_favour([1, 2, 8, 16, 256], 1, max_experts))
    max_k = min(experts, shapes.max_top_k or experts)
    top_k = draw(_favour([1, 2, 6, max_k], 1, max_k))
    inter = draw(_pick_widths(inters, (16, 48, 128, 1280)))
    return MoEConfig(
        num_heads=heads, head_dim=head_dim, num_experts=experts, top_k=top_k,
        intermediate_size=inter, score_func=draw(score_funcs),
        route_norm=draw(st.booleans()), route_scale=draw(st.sampled_from([1.0, 2.5, 4.9])),
        dtype=draw(dtypes),
    )


def _part(value, check) -> st.SearchStrategy:
    """A strategy given as such, or the values to sample from (checked by ``check``)."""
    if isinstance(value, st.SearchStrategy):
        return value
    return st.sampled_from(check(value))


def _per_draw(value, what: str):
    """A part that may depend on an earlier draw: a function returning a strategy, or a plain
    strategy (the same whatever was drawn before)."""
    if isinstance(value, st.SearchStrategy):
        return lambda _drawn: value
    if callable(value):
        return value
    raise TypeError(f"{what} must be a strategy or a function returning one, got {type(value).__name__}")


def token_counts(config: MoEConfig, *, budget: float = 1.0, min_tokens: int = 0) -> st.SearchStrategy[int]:
    """Token counts for ``config``, awkward ones favoured, capped by the budget's route count."""
    _check_config(config)
    _check_min_tokens(min_tokens)
    lim = Limits(budget)
    per_token = config.num_heads * config.top_k
    hi = max(min_tokens, min(lim.max_tokens, lim.max_routes // per_token))
    return _favour(list(AWKWARD_TOKEN_COUNTS), min_tokens, hi)


def routing_specs(config: MoEConfig, *, kinds=ROUTING_KINDS) -> st.SearchStrategy[RoutingSpec]:
    """Route patterns: the router, hot experts, mostly-empty experts, negative logits, one odd
    head, exact ties (see :data:`fuzz.cases.ROUTING_KINDS`). ``kinds``: a strategy, or the
    kinds to sample from."""
    _check_config(config)
    kinds = _part(kinds, lambda v: _check_kinds(v, ROUTING_KINDS))
    E, K = config.num_experts, config.top_k
    return st.builds(
        RoutingSpec,
        kind=kinds,
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


def huge_cases(*, configs: st.SearchStrategy[MoEConfig] | None = None, shapes: ShapeRule | None = None,
               config: MoEConfig | None = None, max_extra_tokens: int = 4096,
               production: bool | None = None, dtypes=None) -> st.SearchStrategy[HugeCase]:
    """Cases with at least one routed token past the int32 boundary ``2^31 / (H*Dh)``, often
    mixed in one block with tokens below it (token 0, the boundary's neighbours, the last token).

    ``configs``: the configurations to cross the boundary with. By default widths come from
    inside ``shapes`` (the implementation's declared rule): small ones, and with ``production``
    (the default) the released widths (``Dh=256``, ``I=1280``, ``H`` 3 or 12, a few experts), so
    a kernel restricted to wide heads still gets tokens past 2^31 where it runs; ``dtypes``
    (default bf16) likewise the declared dtypes. ``config`` pins one configuration
    (``configs=st.just(config)``)."""
    if isinstance(max_extra_tokens, bool) or not isinstance(max_extra_tokens, int) or max_extra_tokens < 1:
        raise ValueError(f"max_extra_tokens must be an int >= 1, got {max_extra_tokens!r}")
    if configs is not None:
        _refuse_both("configs", shapes=shapes, config=config, production=production, dtypes=dtypes)
        return _huge_cases(_check_strategy(configs, "configs"), max_extra_tokens)
    if config is not None:
        _refuse_both("config", shapes=shapes, production=production, dtypes=dtypes)
        _check_config(config)
        return _huge_cases(st.just(config), max_extra_tokens)
    return _huge_cases(huge_configs(shapes=ANY_SHAPE if shapes is None else shapes,
                                    production=production is not False,
                                    **({} if dtypes is None else {"dtypes": dtypes})),
                       max_extra_tokens)


def huge_configs(*, shapes: ShapeRule = ANY_SHAPE, production: bool = True,
                 dtypes=(torch.bfloat16,)) -> st.SearchStrategy[MoEConfig]:
    """Configurations for :func:`huge_cases`: small widths inside ``shapes``, and with
    ``production`` the released ones (as close as ``shapes`` allows), in one of ``dtypes``."""
    shapes = _check_shapes(shapes)
    dtypes = _part(dtypes, _check_dtypes)
    head_dims, inters = _accepted_widths(shapes, (4 * WIDTH_MULTIPLE, 4 * WIDTH_MULTIPLE))
    small = _huge_configs(st.integers(1, 3), st.sampled_from(head_dims), st.sampled_from(inters),
                          shapes, dtypes)
    if not production:
        return small
    wide_dims = [d for d in (PRODUCTION_HEAD_DIM,) if d in shapes.head_dims(d, d)] or \
        shapes.head_dims(PRODUCTION_HEAD_DIM, 4096)[:1] or head_dims[-1:]
    wide_inters = [i for i in (PRODUCTION_INTERMEDIATE,) if i in shapes.intermediate_sizes(i, i)] or \
        shapes.intermediate_sizes(PRODUCTION_INTERMEDIATE, 8192)[:1]
    wide = _huge_configs(st.sampled_from(PRODUCTION_HEADS), st.sampled_from(wide_dims),
                         st.sampled_from(wide_inters), shapes, dtypes, max_experts=2)
    return st.one_of(small, wide)


@st.composite
def _huge_configs(draw, heads, head_dims, inters, shapes: ShapeRule, dtypes,
                  max_experts: int = 8) -> MoEConfig:
    E = draw(st.integers(1, max_experts))
    return MoEConfig(num_heads=draw(heads), head_dim=draw(head_dims), num_experts=E,
                     top_k=draw(st.integers(1, min(E, shapes.max_top_k or E))),
                     intermediate_size=draw(inters), route_scale=2.5, dtype=draw(dtypes))


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


def _check_strategy(value, what: str) -> st.SearchStrategy:
    if not isinstance(value, st.SearchStrategy):
        raise TypeError(f"{what} must be a Hypothesis strategy, got {type(value).__name__}")
    return value


def _check_kinds(kinds, allowed, what="kinds") -> tuple[str, ...]:
    kinds = tuple(kinds)
    if not kinds or any(k not in allowed for k in kinds):
        raise ValueError(f"{what} must be a non-empty subset of {allowed}, got {kinds}")
    return kinds


def _check_min_tokens(min_tokens) -> int:
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    return min_tokens


def _refuse_both(part: str, **shorthands) -> None:
    """A part given as a strategy leaves no room for the shorthands that would build it."""
    given = [name for name, value in shorthands.items() if value is not None]
    if given:
        raise ValueError(f"give {part} or {', '.join(given)}, not both")


def expert_cases(*, budget: float = 1.0, configs: st.SearchStrategy[MoEConfig] | None = None,
                 tokens=None, routings=None, values=None, empty_banks=False,
                 dtypes=None, shapes: ShapeRule | None = None, config: MoEConfig | None = None,
                 min_tokens: int | None = None, routing_kinds=None) -> st.SearchStrategy[ExpertCase]:
    """Expert-computation cases (shape, routes, values), drawn part by part:

    * ``configs``: the configurations (default: :func:`configs` with ``dtypes`` and ``shapes``,
      an implementation's declared rule; ``config`` pins one);
    * ``tokens``: the token count, given the config (default: :func:`token_counts` from
      ``min_tokens``);
    * ``routings``: the route pattern, given the config (default: :func:`routing_specs` of
      ``routing_kinds``);
    * ``values``: the inputs and weights, given the token count (default: :func:`value_specs`);
    * ``empty_banks``: banks emptied by hand, given the config; ``True`` for
      :func:`empty_bank_sets`, ``False`` (the default) for none.
    """
    Limits(budget)
    if configs is not None:
        _refuse_both("configs", dtypes=dtypes, shapes=shapes, config=config)
        configs_ = _check_strategy(configs, "configs")
    elif config is not None:
        _refuse_both("config", dtypes=dtypes, shapes=shapes)
        _check_config(config)
        configs_ = st.just(config)
    else:
        configs_ = _default_configs(budget, dtypes=dtypes, shapes=shapes)
    if tokens is not None:
        _refuse_both("tokens", min_tokens=min_tokens)
    else:
        least = _check_min_tokens(0 if min_tokens is None else min_tokens)
        tokens = lambda cfg: token_counts(cfg, budget=budget, min_tokens=least)  # noqa: E731
    if routings is not None:
        _refuse_both("routings", routing_kinds=routing_kinds)
    else:
        kinds = _check_kinds(ROUTING_KINDS if routing_kinds is None else routing_kinds, ROUTING_KINDS,
                             "routing_kinds")
        routings = lambda cfg: routing_specs(cfg, kinds=kinds)  # noqa: E731
    if values is None:
        values = lambda num_tokens: value_specs(num_tokens=num_tokens)  # noqa: E731
    if empty_banks is True:
        empty_banks = empty_bank_sets
    elif empty_banks is False or empty_banks is None:
        empty_banks = st.just(())
    return _expert_cases(configs_, _per_draw(tokens, "tokens"), _per_draw(routings, "routings"),
                         _per_draw(values, "values"), _per_draw(empty_banks, "empty_banks"))


def _default_configs(budget, *, dtypes=None, shapes=None, score_funcs=None) -> st.SearchStrategy[MoEConfig]:
    """:func:`configs` from the shorthands (here, where no parameter named ``configs`` hides it)."""
    return configs(budget=budget, dtypes=(torch.bfloat16,) if dtypes is None else dtypes,
                   shapes=ANY_SHAPE if shapes is None else shapes,
                   score_funcs=SCORE_FUNCS if score_funcs is None else score_funcs)


@st.composite
def _expert_cases(draw, configs_, tokens, routings, values, empty_banks) -> ExpertCase:
    cfg = draw(configs_)
    S = draw(tokens(cfg))
    return ExpertCase(config=cfg, num_tokens=S, routing=draw(routings(cfg)), values=draw(values(S)),
                      empty_banks=draw(empty_banks(cfg)))


def tie_cases(*, budget: float = 1.0, configs: st.SearchStrategy[MoEConfig] | None = None,
              tokens=None, kinds=TIE_KINDS, score_funcs=None,
              min_tokens: int | None = None) -> st.SearchStrategy[TieCase]:
    """Router inputs with exact ties: quantised logits, duplicated gate rows, bias levels,
    all-equal scores, a tie at the k-th/(k+1)-th boundary, all-negative logits, NaN bias.
    ``configs`` (default: :func:`configs` with ``score_funcs``), ``tokens`` (given the config;
    default: :func:`token_counts` from ``min_tokens``, 1), ``kinds`` (a strategy, or the kinds
    to sample from: default the exact-grid :data:`fuzz.cases.TIE_KINDS`, any of
    :data:`fuzz.cases.ROUTER_KINDS`)."""
    kinds = _part(kinds, lambda v: _check_kinds(v, ROUTER_KINDS))
    if configs is not None:
        _refuse_both("configs", score_funcs=score_funcs)
        configs_ = _check_strategy(configs, "configs")
    else:
        configs_ = _default_configs(budget, score_funcs=score_funcs)
    if tokens is not None:
        _refuse_both("tokens", min_tokens=min_tokens)
    else:
        least = _check_min_tokens(1 if min_tokens is None else min_tokens)
        tokens = lambda cfg: token_counts(cfg, budget=budget, min_tokens=least)  # noqa: E731
    return _tie_cases(configs_, _per_draw(tokens, "tokens"), kinds)


@st.composite
def _tie_cases(draw, configs_, tokens, kinds) -> TieCase:
    cfg = draw(configs_)
    S = draw(tokens(cfg))
    return TieCase(config=cfg, num_tokens=S, kind=draw(kinds), seed=draw(_seeds),
                   levels=draw(st.integers(1, 4)), use_bias=draw(st.booleans()))
