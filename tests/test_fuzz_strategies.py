"""The strategies draw what they promise: argument checks, JSON round trips, and the structure
each routing/value/tie pattern claims (hot experts, empty experts, exact ties, clamp outliers)."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from magi_moe.fuzz import fuzzers, profiles
from magi_moe.fuzz.cases import (ExpertCase, RoutingSpec, TieCase, ValueSpec, build_problem, build_router_inputs,
                        build_values, case_from_dict, case_to_dict, drop_banks, dumps)
from magi_moe.fuzz.cases import HugeCase, first_overflowing_token
from magi_moe.fuzz.strategies import huge_cases
from magi_moe.fuzz.strategies import (AWKWARD_TOKEN_COUNTS, Limits, configs, empty_bank_sets, expert_cases,
                             routing_specs, tie_cases, token_counts, value_specs)
from magi_moe.config import preset
from magi_moe.routing import router_logits, validate_route_table

TINY = preset("tiny")
SMALL = preset("small")


@pytest.mark.parametrize("make, match", [
    (lambda: Limits(0), "budget"),
    (lambda: configs(dtypes=[torch.float64]), "dtypes"),
    (lambda: configs(score_funcs=["relu"]), "score_funcs"),
    (lambda: token_counts("tiny"), "config"),
    (lambda: token_counts(TINY, min_tokens=-1), "min_tokens"),
    (lambda: configs(min_heads=0), "min_heads"),
    (lambda: configs(min_heads=Limits(1).max_heads + 1), "min_heads"),
    (lambda: routing_specs(TINY, kinds=["sideways"]), "kinds"),
    (lambda: value_specs(num_tokens=-3), "num_tokens"),
    (lambda: expert_cases(routing_kinds=[]), "routing_kinds"),
    (lambda: tie_cases(kinds=["nope"]), "kinds"),
    (lambda: huge_cases(max_extra_tokens=0), "max_extra_tokens"),
    (lambda: expert_cases(configs=configs(), dtypes=[torch.float16]), "configs or dtypes"),
    (lambda: expert_cases(tokens=st.just(3), min_tokens=1), "tokens or min_tokens"),
    (lambda: expert_cases(routings=st.just(RoutingSpec("hot", 0)), routing_kinds=["hot"]),
     "routings or routing_kinds"),
    (lambda: expert_cases(configs=[TINY]), "configs must be a Hypothesis strategy"),
    (lambda: expert_cases(values=7), "values must be a strategy or a function"),
    (lambda: tie_cases(configs=configs(), score_funcs=["softmax"]), "configs or score_funcs"),
    (lambda: huge_cases(configs=st.just(TINY), production=False), "configs or production"),
    (lambda: RoutingSpec("sideways", seed=0), "kind"),
    (lambda: ValueSpec(seed=0, x_dist="bimodal"), "x_dist"),
    (lambda: ExpertCase(TINY, 3, RoutingSpec("uniform", 0), ValueSpec(0), empty_banks=(99,)), "empty_banks"),
    (lambda: HugeCase(TINY, 10, (10,), seed=0), "tokens"),
])
def test_bad_arguments_name_the_argument(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@profiles.examples(2.0)
@given(case=expert_cases(empty_banks=True, dtypes=(torch.bfloat16, torch.float16, torch.float32)))
def test_expert_cases_round_trip_through_json_and_build_identically(case):
    again = case_from_dict(json.loads(dumps(case_to_dict(case))))
    assert again == case
    a, b = build_problem(case), build_problem(again)
    assert torch.equal(a.x, b.x) and all(torch.equal(u, v) for u, v in zip(a.weights, b.weights))
    assert torch.equal(a.table.gather_ids, b.table.gather_ids)
    assert bool(torch.isfinite(a.x).all()), "inputs must be finite in their dtype"
    assert all(bool(torch.isfinite(w).all()) for w in a.weights), "weights must be finite in their dtype"
    validate_route_table(a.table, case.config)
    emptied = a.table.counts()[list(case.empty_banks)]
    assert int(emptied.sum()) == 0


@settings(max_examples=20, database=None, derandomize=True)
@given(case=expert_cases(configs=configs(dtypes=st.just(torch.float16), score_funcs=st.just("softmax")),
                         tokens=lambda cfg: st.integers(1, 5),
                         routings=lambda cfg: routing_specs(cfg, kinds=st.just("concentrated")),
                         values=lambda num_tokens: value_specs(num_tokens=num_tokens, clamp_outliers=False),
                         empty_banks=lambda cfg: st.just((0,))))
def test_expert_cases_draw_each_part_from_the_strategy_given(case):
    assert case.config.dtype == torch.float16 and case.config.score_func == "softmax"
    assert 1 <= case.num_tokens <= 5 and case.routing.kind == "concentrated"
    assert case.values.outliers == () and case.empty_banks == (0,)


@settings(max_examples=20, database=None, derandomize=True)
@given(case=tie_cases(configs=st.just(SMALL), tokens=st.just(7), kinds=st.just("boundary")))
def test_tie_cases_draw_each_part_from_the_strategy_given(case):
    assert case.config == SMALL and case.num_tokens == 7 and case.kind == "boundary"


@profiles.examples(2.0)
@given(case=tie_cases())
def test_tie_cases_round_trip_and_have_exact_fp32_logits(case):
    assert case_from_dict(json.loads(dumps(case_to_dict(case)))) == case
    x, gate, bias = build_router_inputs(case)
    exact = router_logits(x, gate, case.config, torch.float64)
    assert torch.equal(router_logits(x, gate, case.config, torch.float32).double(), exact)


def test_awkward_token_counts_are_reachable():
    seen = set()

    @settings(max_examples=300, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(n=token_counts(TINY.replace(num_heads=1, top_k=1), budget=1.0))
    def collect(n):
        seen.add(n)
    collect()
    assert {0, 1, 127, 128, 129} <= seen
    assert max(seen) <= Limits(1.0).max_tokens
    big = Limits(32.0)
    assert big.max_tokens >= 4097 and 4097 in AWKWARD_TOKEN_COUNTS


def _case(kind: str, config=SMALL, tokens=40, **routing) -> ExpertCase:
    return ExpertCase(config, tokens, RoutingSpec(kind, seed=7, **routing), ValueSpec(seed=3))


def test_hot_one_sends_every_token_to_one_expert_per_head():
    p = build_problem(_case("hot", hot=1))
    first = p.routes.expert_ids[:, :, 0]
    assert bool((first == first[0]).all())


def test_concentrated_leaves_most_experts_empty():
    cfg = SMALL
    p = build_problem(_case("concentrated", hot=cfg.top_k))
    used = (p.table.counts().view(cfg.num_heads, cfg.num_experts) > 0).sum(-1)
    assert bool((used == cfg.top_k).all())


def test_head_differs_routes_one_head_identically():
    p = build_problem(_case("head-differs", head=1))
    ids = p.routes.expert_ids[:, 1]
    assert bool((ids == ids[0]).all())
    assert not bool((p.routes.expert_ids[:, 0] == p.routes.expert_ids[0, 0]).all())


def test_negative_routing_has_all_logits_non_positive():
    case = _case("negative", gate_std=0.5)
    x, _ = build_values(case)
    from magi_moe.fuzz.cases import _routes  # the router inputs it used
    _, gate, _ = _routes(case, x)
    assert float(router_logits(x.abs(), gate, case.config).max()) <= 0.0


@pytest.mark.parametrize("kind", ["levels", "all-equal", "boundary", "duplicate-rows"])
def test_tie_kinds_produce_exact_ties(kind):
    cfg = SMALL
    x, gate, bias = build_router_inputs(TieCase(cfg, 30, kind, seed=11, levels=2))
    scores = torch.sigmoid(router_logits(x, gate, cfg))
    sel = scores if bias is None else scores + bias.view(cfg.num_heads, cfg.num_experts)
    ranked = torch.sort(sel, dim=-1, descending=True).values
    ties = (ranked[..., 1:] == ranked[..., :-1]).any(-1)
    assert float(ties.float().mean()) > 0.5, f"{kind}: too few exact ties"
    if kind == "boundary":
        K = cfg.top_k
        assert bool((ranked[..., K - 1] == ranked[..., K]).all())


def test_values_land_on_the_swiglu7_clamp():
    case = ExpertCase(SMALL, 64, RoutingSpec("uniform", 0), ValueSpec(seed=5, preact=7.0, outliers=((3, 1.0),)))
    x, w = build_values(case)
    g = x[:, :SMALL.head_dim].float() @ w.w_gate[0].float()
    std = float(g.std())
    assert 3.5 < std < 14, std
    assert 0.1 < float((g.abs() > 7).float().mean()) < 0.9


def test_narrow_and_wide_inputs_cover_one_and_many_binades():
    def binades(dist):
        x, _ = build_values(ExpertCase(TINY, 64, RoutingSpec("uniform", 0),
                                       ValueSpec(seed=1, x_dist=dist, wide_span=16)))
        e = torch.log2(x.float().abs()).floor()
        return int(e.max() - e.min())
    assert binades("narrow") <= 1
    assert binades("wide") >= 12


@given(cfg=configs(budget=2.0), data=st.data())
def test_empty_bank_sets_leave_some_routes_when_they_can(cfg, data):
    banks = data.draw(empty_bank_sets(cfg))
    assert banks and all(0 <= b < cfg.num_banks for b in banks)
    if cfg.num_banks > 1:
        assert len(set(banks)) < cfg.num_banks


def test_drop_banks_keeps_a_valid_table():
    p = build_problem(_case("uniform"))
    table = drop_banks(p.table, (0, 5, 17))
    validate_route_table(table, SMALL)
    assert int(table.counts()[[0, 5, 17]].sum()) == 0
    assert table.num_routes == p.table.num_routes - int(p.table.counts()[[0, 5, 17]].sum())


@given(case=huge_cases())
@settings(max_examples=20)
def test_huge_cases_cross_the_int32_boundary(case):
    t0 = first_overflowing_token(case.config)
    assert max(case.tokens) >= t0 and case.tokens[-1] < case.num_tokens
    assert max(case.tokens) * case.config.hidden_size >= 2**31
    assert case_from_dict(json.loads(dumps(case_to_dict(case)))) == case


# -- every property draws inside the declaration ------------------------------------------------
def _narrow_target():
    from magi_moe.fuzz.properties import make_target
    from magi_moe.tests.outside_narrow_example import IMPL

    return make_target(IMPL, "cpu", spec="magi_moe.tests.outside_narrow_example:IMPL")


@pytest.mark.parametrize("name", sorted(n for n, p in fuzzers.PROPERTIES.items()
                                        if p.on is fuzzers.ON_IMPLEMENTATIONS))
def test_every_property_draws_inside_the_declared_shapes_and_dtypes(name):
    """A kernel restricted to Dh % 64, I % 128, top-k <= 4 and bfloat16 gets cases it accepts
    from every property's strategy: a strategy that ignores the rule fails here (the huge
    strategy too), instead of handing the kernel cases it refuses."""
    target = _narrow_target()
    prop = fuzzers.PROPERTIES[name]
    drawn = []

    @settings(max_examples=25, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(pair=prop.strategy(target, budget=1.0))
    def draw(pair):
        case, _ = pair
        config = case.config
        dtype = getattr(case, "dtype", config.dtype)
        assert target.impl.supports(config, dtype) is None, (name, config, dtype)
        drawn.append(config)

    draw()
    assert drawn


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(min_heads=2))
def test_configs_draw_at_least_min_heads(cfg):
    """head_locality's cases: a head with no neighbour has nothing to be isolated from."""
    assert cfg.num_heads >= 2
