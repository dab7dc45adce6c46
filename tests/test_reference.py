"""The float64 oracle, checked against mpmath at 50 digits, and the bf16 baseline against the oracle."""
import mpmath
import pytest
import torch

from magi_moe.config import MoEConfig, preset
from magi_moe.problems import random_problem, relative_l2
from magi_moe.reference import expert_reference, layer_reference, swiglu7

mpmath.mp.dps = 50


def mp_swiglu7(g, u):
    g = min(g, mpmath.mpf(7))
    u = max(min(u, mpmath.mpf(7)), mpmath.mpf(-7))
    return g / (1 + mpmath.exp(-mpmath.mpf("1.702") * g)) * (u + 1)


def mp_layer(problem):
    """The layer's expert part from CONTRACT 1 step 6-7, one token at a time, in 50-digit arithmetic."""
    cfg, t = problem.config, problem.table
    H, E, Dh, I = cfg.num_heads, cfg.num_experts, cfg.head_dim, cfg.intermediate_size
    x = problem.x.double().tolist()
    wg, wu, wd = (w.double().tolist() for w in problem.weights)
    y = [[mpmath.mpf(0)] * (H * Dh) for _ in x]
    offsets = t.offsets.tolist()
    for f in range(H * E):
        h = f // E
        for r in range(offsets[f], offsets[f + 1]):
            s, p = int(t.gather_ids[r]), mpmath.mpf(float(t.sorted_probs[r]))
            xs = [mpmath.mpf(v) for v in x[s][h * Dh:(h + 1) * Dh]]
            a = []
            for i in range(I):
                g = mpmath.fsum(xs[d] * wg[f][d][i] for d in range(Dh))
                u = mpmath.fsum(xs[d] * wu[f][d][i] for d in range(Dh))
                a.append(mp_swiglu7(g, u))
            for d in range(Dh):
                y[s][h * Dh + d] += p * mpmath.fsum(a[i] * wd[f][i][d] for i in range(I))
    return y


@pytest.mark.parametrize("x_std", [1.0, 40.0], ids=["moderate", "past-the-clamp"])
def test_float64_reference_agrees_with_mpmath(x_std):
    cfg = MoEConfig(num_heads=2, head_dim=16, num_experts=3, top_k=2, intermediate_size=16,
                    route_scale=2.5)
    problem = random_problem(cfg, 5, seed=11, x_std=x_std, weight_std=0.3)
    ref = expert_reference(problem.x, problem.table, problem.weights, cfg)
    assert ref.dtype == torch.float64
    exact = mp_layer(problem)
    if x_std > 1:  # the large inputs must really exercise both clamp branches
        g = problem.x.double()[:, :16] @ problem.weights.w_gate[0].double()
        assert (g > 7).any() and (g < 7).any()
    for s, row in enumerate(exact):
        for j, value in enumerate(row):
            assert abs(float(ref[s, j]) - float(value)) <= 1e-13 * (1 + abs(float(value)))


def test_swiglu7_branches():
    g = torch.tensor([-20.0, -1.0, 0.0, 6.5, 7.0, 50.0], dtype=torch.float64)
    u = torch.tensor([-50.0, -7.0, 0.5, 6.0, 7.0, 9.0], dtype=torch.float64)
    got = swiglu7(g, u)
    for gi, ui, out in zip(g.tolist(), u.tolist(), got.tolist()):
        assert out == pytest.approx(float(mp_swiglu7(mpmath.mpf(gi), mpmath.mpf(ui))), rel=1e-14, abs=1e-300)


@pytest.mark.parametrize("name", ["tiny", "small", "small-softmax"])
def test_bf16_baseline_is_close_to_the_oracle_but_not_equal(name):
    cfg = preset(name)
    problem = random_problem(cfg, 64, seed=3)
    ref = expert_reference(problem.x, problem.table, problem.weights, cfg)
    base = expert_reference(problem.x, problem.table, problem.weights, cfg, precision="bf16")
    assert base.dtype == torch.bfloat16
    err = relative_l2(base, ref)
    assert 1e-4 < err < 1.5e-2  # bf16 working precision: rounding visible, no gross error


def test_layer_reference_routes_in_float64_and_matches_the_expert_oracle():
    cfg = preset("tiny")
    problem = random_problem(cfg, 16, seed=5)
    y, routes = layer_reference(problem.x, problem.gate, problem.bias, problem.weights, cfg)
    assert routes.probs.dtype == torch.float64
    assert y.shape == problem.x.shape and torch.isfinite(y).all()


def test_reference_rejects_unknown_precision():
    cfg = preset("tiny")
    p = random_problem(cfg, 4, seed=0)
    with pytest.raises(ValueError, match="precision must be"):
        expert_reference(p.x, p.table, p.weights, cfg, precision="fp8")
