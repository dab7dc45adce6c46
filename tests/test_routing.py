"""Routing (CONTRACT 1 steps 1-5) and the CSR route table (CONTRACT 2)."""
import itertools

import pytest
import torch

from magi_moe.config import MoEConfig, preset
from magi_moe.routing import (build_route_table, route, route_probs, router_logits, scores_from_logits,
                              select_experts, validate_route_table)


def brute_force_topk(row: list[float], k: int) -> list[int]:
    """Rank by (score desc, index asc) with NaN last: the documented tie rule, in plain Python."""
    key = lambda e: (1, 0.0, e) if row[e] != row[e] else (0, -row[e], e)  # noqa: E731
    return sorted(range(len(row)), key=key)[:k]


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device(name)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("levels", [1, 2, 3, 7])
def test_ties_go_to_the_lower_expert_index(device, levels):
    device = _device(device)
    gen = torch.Generator().manual_seed(levels)
    E, K = 33, 6
    scores = torch.randint(0, levels, (200, E), generator=gen).float() / levels
    scores[0] = 0.5  # all equal
    scores[1, :] = 0.0
    scores[1, [3, 9, 20, 30]] = 1.0  # a tie spanning the k / k+1 boundary
    scores[1, [5, 6, 7]] = 0.75
    got = select_experts(scores.to(device), K).cpu()
    for row, ids in zip(scores.tolist(), got.tolist()):
        assert ids == brute_force_topk(row, K)


def test_equal_logits_get_equal_sigmoid_scores_wherever_they_sit():
    """Exact ties need equal scores for equal logits: torch's CPU sigmoid rounds a tensor's
    vectorised tail differently (index 160 of 165 was an ulp off index 0), which put expert 6
    before expert 0 on a tie the fuzz campaign drew (all-negative logits, E = 11, 15 tokens)."""
    logits = torch.full((15, 1, 11), -18.625)
    assert scores_from_logits(logits, "sigmoid").unique().numel() == 1
    config = MoEConfig(num_heads=1, head_dim=16, num_experts=11, top_k=6, intermediate_size=16,
                       score_func="sigmoid", route_norm=False, route_scale=1.0)
    x = torch.ones(15, 16)
    gate = torch.full((11, 16), -18.625 / 16)
    gate[[3, 4, 7, 9, 10]] = 0.0  # five clear winners, then six experts tied for the last place
    ids = route(x, gate, None, config).expert_ids
    assert ids[:, 0, 5].eq(0).all(), ids[:, 0, 5].tolist()  # the lowest index of the tied ones

@pytest.mark.parametrize("device", devices())
def test_nan_selection_scores_rank_last(device):
    device = _device(device)
    scores = torch.tensor([[float("nan"), 0.1, float("nan"), 0.3, -float("inf"), 0.2]])
    assert select_experts(scores.to(device), 6).cpu().tolist() == [[3, 5, 1, 4, 0, 2]]
    assert brute_force_topk(scores[0].tolist(), 3) == [3, 5, 1]


@pytest.mark.parametrize("top_k", [5, 0], ids=["above-E", "zero"])
def test_top_k_outside_range_is_rejected(top_k):
    with pytest.raises(ValueError, match=rf"top_k must lie in \[1, 4\], got {top_k}"):
        select_experts(torch.zeros(2, 4), top_k)


def small_config(**kw):
    return MoEConfig(**{**dict(num_heads=3, head_dim=32, num_experts=10, top_k=3,
                               intermediate_size=32, route_scale=2.5), **kw})


def random_router(cfg, S=64, seed=0, bias_std=0.05):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, cfg.hidden_size, generator=gen).bfloat16()
    gate = torch.randn(cfg.num_banks, cfg.head_dim, generator=gen) / 4
    bias = torch.randn(cfg.num_banks, generator=gen) * bias_std
    return x, gate, bias


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("route_norm", [True, False])
def test_route_matches_the_formula_step_by_step(score_func, route_norm):
    cfg = small_config(score_func=score_func, route_norm=route_norm)
    x, gate, bias = random_router(cfg)
    routes = route(x, gate, bias, cfg, dtype=torch.float64)
    H, E, Dh = cfg.num_heads, cfg.num_experts, cfg.head_dim
    xs = x.double().view(-1, H, Dh)
    for s, h in itertools.product(range(0, 64, 7), range(H)):
        logits = [float(xs[s, h] @ gate[h * E + e].double()) for e in range(E)]
        lt = torch.tensor(logits, dtype=torch.float64)
        scores = torch.sigmoid(lt) if score_func == "sigmoid" else torch.softmax(lt, 0)
        selection = (scores + bias[h * E:(h + 1) * E].double()).tolist()
        chosen = brute_force_topk(selection, cfg.top_k)
        assert routes.expert_ids[s, h].tolist() == chosen
        p = scores[chosen]
        if route_norm:
            p = p / max(float(p.sum()), 1e-12)
        torch.testing.assert_close(routes.probs[s, h], p * cfg.route_scale, rtol=1e-12, atol=0)


def test_bias_changes_selection_but_never_probabilities():
    cfg = small_config(route_norm=False)
    x, gate, _ = random_router(cfg)
    big_bias = torch.zeros(cfg.num_banks)
    big_bias[2::cfg.num_experts] = 10.0  # expert 2 of every head always chosen, and ranked first
    plain = route(x, gate, None, cfg)
    biased = route(x, gate, big_bias, cfg)
    assert (biased.expert_ids[..., 0] == 2).all()
    assert not torch.equal(plain.expert_ids, biased.expert_ids)
    scores = scores_from_logits(router_logits(x, gate, cfg), cfg.score_func)
    expected = torch.gather(scores, -1, biased.expert_ids) * cfg.route_scale
    assert torch.equal(biased.probs, expected)


def test_l1_normalisation_uses_the_eps_floor():
    cfg = small_config(score_func="softmax", route_scale=1.0)
    scores = torch.zeros(1, 1, cfg.num_experts)  # a zero sum must not divide by zero
    ids = torch.arange(cfg.top_k).view(1, 1, -1)
    assert torch.equal(route_probs(scores, ids, cfg), torch.zeros(1, 1, cfg.top_k))
    scores[..., :cfg.top_k] = torch.tensor([1.0, 2.0, 5.0])
    torch.testing.assert_close(route_probs(scores, ids, cfg), torch.tensor([[[0.125, 0.25, 0.625]]]))


@pytest.mark.parametrize("device", devices())
def test_routing_agrees_between_cpu_and_device(device):
    device = _device(device)
    cfg = small_config()
    x, gate, bias = random_router(cfg, S=300)
    # Quantised logits make exact ties common: the tie rule must hold identically everywhere.
    gate = (gate * 4).round() / 4
    x = x.float().round().bfloat16()
    cpu = route(x, gate, bias, cfg)
    dev = route(x.to(device), gate.to(device), bias.to(device), cfg)
    assert torch.equal(cpu.expert_ids, dev.expert_ids.cpu())


def test_route_table_is_a_stable_csr_sort():
    cfg = small_config()
    x, gate, bias = random_router(cfg, S=50)
    routes = route(x, gate, bias, cfg)
    table = build_route_table(routes, cfg)
    validate_route_table(table, cfg)
    H, E, K = cfg.num_heads, cfg.num_experts, cfg.top_k
    assert table.num_routes == 50 * H * K
    offsets = table.offsets.tolist()
    for f in range(H * E):
        h, e = divmod(f, E)
        tokens = table.gather_ids[offsets[f]:offsets[f + 1]].tolist()
        expected = [s for s in range(50) if e in routes.expert_ids[s, h].tolist()]
        assert tokens == expected  # token order inside an expert
        for r in range(offsets[f], offsets[f + 1]):
            slot = int(table.route_slots[r])
            s, rest = divmod(slot, H * K)
            assert (s, rest // K) == (tokens[r - offsets[f]], h)
            assert int(routes.expert_ids[s, h, rest % K]) == e
            assert table.sorted_probs[r] == routes.probs[s, h, rest % K]


def test_empty_experts_have_equal_consecutive_offsets():
    cfg = small_config()
    ids = torch.zeros(20, cfg.num_heads, cfg.top_k, dtype=torch.int64)
    ids[..., :] = torch.tensor([4, 1, 7])
    from magi_moe.problems import routes_to
    table = build_route_table(routes_to(ids, cfg), cfg)
    counts = table.counts().view(cfg.num_heads, cfg.num_experts)
    assert counts[:, [1, 4, 7]].eq(20).all()
    assert counts.sum() == counts[:, [1, 4, 7]].sum()  # every other expert is empty


def test_zero_tokens_give_an_empty_table():
    cfg = small_config()
    x, gate, bias = random_router(cfg, S=0)
    table = build_route_table(route(x, gate, bias, cfg), cfg)
    assert table.num_routes == 0 and table.offsets.eq(0).all()
    validate_route_table(table, cfg)


# (make bad (x, gate, bias) from valid ones, exception, message pattern)
BAD_ROUTER_INPUTS = [
    pytest.param(lambda x, g, b: (x[:, :64], g, b), ValueError, r"x must have shape \[\*, 96\]",
                 id="x-width"),
    pytest.param(lambda x, g, b: (x, g[None], b), ValueError, "gate must have rank 2", id="gate-rank"),
    pytest.param(lambda x, g, b: (x, g, b[:5]), ValueError, r"bias must have shape \[30\]",
                 id="bias-length"),
    pytest.param(lambda x, g, b: ([1, 2], g, b), TypeError, "x must be a torch.Tensor", id="x-list"),
    pytest.param(lambda x, g, b: (x, g.cuda(), b), ValueError, "one device", id="gate-on-cuda",
                 marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                             reason="no CUDA GPU")]),
]


@pytest.mark.parametrize("make_bad, exc, pattern", BAD_ROUTER_INPUTS)
def test_routing_rejects_mismatched_shapes_and_devices(make_bad, exc, pattern):
    cfg = small_config()
    with pytest.raises(exc, match=pattern):
        route(*make_bad(*random_router(cfg)), cfg)


def test_production_shape_routing_on_released_preset():
    cfg = preset("magi2-ep4-local")
    x, gate, bias = random_router(cfg, S=8)
    routes = route(x, gate, bias, cfg)
    assert routes.expert_ids.shape == (8, 3, 6)
    # L1-normalised then scaled: each (token, head) sums to route_scale.
    torch.testing.assert_close(routes.probs.sum(-1), torch.full((8, 3), 4.9))


def test_only_magi_moe_built_tables_are_trusted():
    """Paths that promise no host sync skip the index check only for trusted tables."""
    import dataclasses
    from magi_moe.routing import RouteTable
    cfg = small_config()
    x, gate, bias = random_router(cfg, S=8)
    table = build_route_table(route(x, gate, bias, cfg), cfg)
    assert table.trusted and table.to("cpu").trusted
    assert not dataclasses.replace(table, gather_ids=table.gather_ids + 1).trusted
    assert not RouteTable(table.gather_ids, table.sorted_probs, table.offsets, table.route_slots,
                          8, cfg.num_heads, cfg.num_experts, cfg.top_k).trusted


# -- RouteTable.select: partial tables ---------------------------------------------------------

def table_from_scratch(routes, cfg, kept_slots: set[int]):
    """The table of the kept routes built in plain Python: sorted by (bank, slot), which is token
    order inside a bank; offsets counted per bank."""
    H, E, K = cfg.num_heads, cfg.num_experts, cfg.top_k
    ids, probs = routes.expert_ids.reshape(-1).tolist(), routes.probs.reshape(-1).tolist()
    bank = lambda p: (p // K) % H * E + ids[p]  # noqa: E731  slot p = (s*H + h)*K + k
    order = sorted(kept_slots, key=lambda p: (bank(p), p))
    counts = [0] * (H * E)
    for p in order:
        counts[bank(p)] += 1
    return {"gather_ids": [p // (H * K) for p in order], "sorted_probs": [probs[p] for p in order],
            "offsets": list(itertools.accumulate(counts, initial=0)), "route_slots": order}


def as_lists(table) -> dict:
    return {n: getattr(table, n).tolist() for n in ("gather_ids", "sorted_probs", "offsets",
                                                    "route_slots")}


@pytest.fixture
def routed():
    cfg = small_config()
    x, gate, bias = random_router(cfg, S=40, seed=5)
    routes = route(x, gate, bias, cfg)
    return cfg, routes, build_route_table(routes, cfg)


def test_select_with_a_mask_matches_a_table_rebuilt_from_scratch(routed):
    """Routes dropped from the middle of banks, whole banks emptied, first and last routes gone."""
    cfg, routes, table = routed
    gen = torch.Generator().manual_seed(6)
    keep = torch.rand(table.num_routes, generator=gen) < 0.6
    keep[[0, -1]] = False
    emptied = [b for b in range(cfg.num_banks) if table.counts()[b] > 0][:2]
    for b in emptied:
        keep[int(table.offsets[b]):int(table.offsets[b + 1])] = False
    kept = table.select(keep)
    kept_slots = set(table.route_slots[keep].tolist())
    assert as_lists(kept) == table_from_scratch(routes, cfg, kept_slots)
    assert all(kept.counts()[b] == 0 for b in emptied)
    assert not kept.trusted  # checked on use
    validate_route_table(kept, cfg)
    assert (kept.num_tokens, kept.num_heads, kept.num_experts, kept.top_k) == (
        40, cfg.num_heads, cfg.num_experts, cfg.top_k)


def test_select_with_indices_is_the_mask_of_those_routes(routed):
    """Order and repeats of the indices do not matter: the table stays sorted by bank."""
    _, _, table = routed
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, table.num_routes, (150,), generator=gen)  # unordered, with repeats
    mask = torch.zeros(table.num_routes, dtype=torch.bool)
    mask[idx] = True
    assert as_lists(table.select(idx)) == as_lists(table.select(mask))
    assert as_lists(table.select(idx.int())) == as_lists(table.select(mask))


@pytest.mark.parametrize("n", [0, 1, 100, 360], ids=lambda n: f"prefix-{n}")
def test_select_a_prefix_clamps_the_offsets_and_keeps_trust(routed, n):
    cfg, routes, table = routed
    assert table.num_routes == 360
    kept = table.select(n)
    assert as_lists(kept) == table_from_scratch(routes, cfg, set(table.route_slots[:n].tolist()))
    assert kept.trusted  # a prefix of a trusted table is valid by construction
    validate_route_table(kept, cfg)
    kept.gather_ids.add_(0)  # a view of the source: a write ends the trust of both
    assert not kept.trusted and not table.trusted


def test_select_keeps_an_untrusted_table_untrusted(routed):
    import dataclasses
    cfg, _, table = routed
    copy = dataclasses.replace(table)
    assert not copy.trusted
    assert not copy.select(100).trusted
    assert not table.select(torch.ones(table.num_routes, dtype=torch.bool)).trusted
    # garbage offsets stay in bounds: the result is checked on use, not read out of range
    garbage = dataclasses.replace(table, offsets=table.offsets * 1000 - 7)
    with pytest.raises(ValueError, match="table.offsets"):
        validate_route_table(garbage.select(torch.ones(table.num_routes, dtype=torch.bool)), cfg)


@pytest.mark.parametrize("keep, exc, pattern", [
    pytest.param(361, ValueError, r"keep must lie in \[0, 360\] as a prefix length, got 361",
                 id="prefix-too-long"),
    pytest.param(-1, ValueError, r"keep must lie in \[0, 360\]", id="prefix-negative"),
    pytest.param(True, TypeError, "keep must be an int .* got bool", id="bool-scalar"),
    pytest.param([0, 1], TypeError, "keep must be an int .* got list", id="list"),
    pytest.param(torch.ones(359, dtype=torch.bool), ValueError, r"keep as a mask must have shape \[360\]",
                 id="mask-short"),
    pytest.param(torch.ones(2, 180, dtype=torch.bool), ValueError, r"keep must be a 1-D tensor",
                 id="mask-2d"),
    pytest.param(torch.tensor([0, 360]), ValueError, r"keep as indices must lie in \[0, 360\), got "
                 r"values in \[0, 360\]", id="index-past-the-end"),
    pytest.param(torch.tensor([-1, 3]), ValueError, r"keep as indices must lie in \[0, 360\)",
                 id="index-negative"),
    pytest.param(torch.tensor([0.0, 1.0]), TypeError, "boolean mask or an integer index tensor, got "
                 "torch.float32", id="float-tensor"),
    pytest.param(torch.ones(360, dtype=torch.uint8), TypeError, "got torch.uint8", id="uint8-mask"),
])
def test_select_rejects_bad_keep(routed, keep, exc, pattern):
    _, _, table = routed
    with pytest.raises(exc, match=pattern):
        table.select(keep)
    assert table.trusted  # unchanged


@pytest.mark.cuda
def test_select_refuses_a_mask_on_another_device(routed, cuda_device):
    _, _, table = routed
    with pytest.raises(ValueError, match="keep must be a 1-D tensor on cpu"):
        table.select(torch.ones(table.num_routes, dtype=torch.bool, device=cuda_device))


def test_first_difference_names_the_field_and_index_of_a_table_that_differs(routed):
    """What the fused-router tests and the tie-rule fuzzer report when a device-built table is
    not build_route_table's: the first differing field (in TABLE_FIELDS order) and index."""
    _, _, table = routed
    assert table.first_difference(table) is None
    assert table.first_difference(table.to("cpu")) is None
    moved = table._with(table.gather_ids, table.sorted_probs, table.offsets.clone(),
                        table.route_slots.clone())
    moved.offsets[5] += 1
    moved.route_slots[0] += 1  # offsets come first: they are named, not route_slots
    assert moved.first_difference(table) == (
        f"offsets differs first at index 5: {int(table.offsets[5]) + 1}, "
        f"expected {int(table.offsets[5])}")
    last = table.num_routes - 1
    shorter = table._with(table.gather_ids[:last], table.sorted_probs[:last], table.offsets,
                          table.route_slots[:last])
    assert shorter.first_difference(table) == (
        f"gather_ids has shape ({last},), expected ({last + 1},)")
    # a narrower dtype is compared in the reference's dtype: equal values are equal
    narrow = table._with(table.gather_ids, table.sorted_probs, table.offsets.int(),
                         table.route_slots)
    assert narrow.first_difference(table) is None
