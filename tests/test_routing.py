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


@pytest.mark.parametrize("device", devices())
def test_nan_selection_scores_rank_last(device):
    device = _device(device)
    scores = torch.tensor([[float("nan"), 0.1, float("nan"), 0.3, -float("inf"), 0.2]])
    assert select_experts(scores.to(device), 6).cpu().tolist() == [[3, 5, 1, 4, 0, 2]]
    assert brute_force_topk(scores[0].tolist(), 3) == [3, 5, 1]


def test_top_k_outside_range_is_rejected():
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, 4\]"):
        select_experts(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.zeros(2, 4), 0)


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


def test_routing_rejects_mismatched_shapes_and_devices():
    cfg = small_config()
    x, gate, bias = random_router(cfg)
    with pytest.raises(ValueError, match=r"x must have shape \[\*, 96\]"):
        route(x[:, :64], gate, bias, cfg)
    with pytest.raises(ValueError, match="gate must have rank 2"):
        route(x, gate[None], bias, cfg)
    with pytest.raises(ValueError, match=r"bias must have shape \[30\]"):
        route(x, gate, bias[:5], cfg)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        route(x.numpy() if x.dtype != torch.bfloat16 else [1, 2], gate, bias, cfg)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            route(x, gate.cuda(), bias, cfg)


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
