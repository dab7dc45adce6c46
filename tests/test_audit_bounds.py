"""The error-bound auditor: real implementations stay under both bounds on every probe; the
broken precision variants exceed the probabilistic one on the probe aimed at them; the bound
arithmetic matches an element-wise mpmath evaluation and an exact simulation."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from magi_moe.judge.bounds import (BoundReport, check_error_bounds, compute_error_bounds,
                                   evaluate_bounds, problem_bounds)
from magi_moe.judge import judge
from magi_moe.judge.precision import (BF16, FP32, gamma, gamma_probabilistic, hoeffding_lambda,
                             precision_model, truncating, with_truncating_downcasts)
from magi_moe.audit.probes import PROBES, probe_problem
from magi_moe.config import preset
from magi_moe.problems import run_poisoned
from magi_moe.reference import expert_reference
from magi_moe.tests.audit_broken import (BF16_DOWN_ACCUMULATION, BF16_GATE_UP_ACCUMULATION,
                                CORRECT_EMULATION, ROUNDS_BEFORE_SWIGLU)


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest


@pytest.fixture(scope="module")
def small_probes():
    """Each probe at the ``small`` preset (Dh=64, I=128, K=4), fresh seed per module run."""
    return {name: probe_problem(name, preset("small"), 128, seed=11) for name in PROBES}


# -- real implementations pass -----------------------------------------------------------------

@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.clause("accuracy")
def test_implementation_within_bounds(impl_backend, impl_dtype, probe):
    """Every registered implementation, on every backend here, at every dtype it declares,
    under its declared model."""
    impl, backend = impl_backend.impl, impl_backend.backend
    # The interpreter pays per program: the tiny preset keeps kernel runs well under a second.
    cfg = preset("tiny") if backend.runs_triton and backend.small_audit_inputs else preset("small")
    problem = probe_problem(probe, impl.fit(cfg, impl_dtype), 64, seed=3,
                            device=impl_backend.device)
    v = judge(run_poisoned(impl, problem), problem, impl)
    assert v.ok, v.text
    assert v.bound_report.nonfinite == 0


@pytest.mark.parametrize("probe", PROBES)
def test_fp32acc_emulation_passes_and_beats_baseline(small_probes, probe):
    problem = small_probes[probe]
    v = judge(run_poisoned(CORRECT_EMULATION, problem), problem, "bf16-fp32acc")
    assert v.ok, v.text
    # Real margin, not a lucky pass: the worst element sits well under the tight bound.
    assert v.bound_report.prob_max_ratio < 0.6, v.text
    # fp32 accumulation beats plain PyTorch bf16
    assert v.check("baseline").figures["baseline_ratio"] < 1.0, v.text


def test_correct_emulation_passes_on_fresh_seeds():
    """The probabilistic bound's false-alarm rate is tiny: a few fresh problems all pass."""
    for seed in (101, 202, 303):
        problem = probe_problem("random", preset("small"), 96, seed=seed)
        report = check_error_bounds(run_poisoned(CORRECT_EMULATION, problem), problem,
                                    "bf16-fp32acc")
        assert report.ok, report.summary()


# -- broken variants are flagged ----------------------------------------------------------------

@pytest.mark.parametrize("broken, probes", [
    (BF16_GATE_UP_ACCUMULATION, ("random", "swamp")),
    (BF16_DOWN_ACCUMULATION, ("random", "swamp", "clamp")),
    (ROUNDS_BEFORE_SWIGLU, ("cancel-up",)),
], ids=lambda v: v.name if hasattr(v, "name") else "-".join(v))
def test_broken_precision_is_flagged(small_probes, broken, probes):
    for probe in probes:
        problem = small_probes[probe]
        report = check_error_bounds(run_poisoned(broken, problem), problem, broken)
        assert not report.ok, f"{broken.name} passed on {probe}: {report.summary()}"
        assert report.prob_max_ratio > 1.2, report.summary()


def test_swamp_probe_exposes_bf16_gate_up_by_far(small_probes):
    problem = small_probes["swamp"]
    report = check_error_bounds(run_poisoned(BF16_GATE_UP_ACCUMULATION, problem), problem,
                                "bf16-fp32acc")
    assert not report.proven_ok  # beyond the worst case: a proof, not a statistical flag
    assert report.worst_max_ratio > 5


def test_rounding_before_swiglu_only_visible_with_cancellation(small_probes):
    """Why the cancel-up probe exists: on random inputs this loss hides inside the bound."""
    random_report = check_error_bounds(run_poisoned(ROUNDS_BEFORE_SWIGLU, small_probes["random"]),
                                       small_probes["random"], "bf16-fp32acc")
    cancel_report = check_error_bounds(run_poisoned(ROUNDS_BEFORE_SWIGLU, small_probes["cancel-up"]),
                                       small_probes["cancel-up"], "bf16-fp32acc")
    assert cancel_report.prob_max_ratio > 5 * random_report.prob_max_ratio


# -- the report itself ---------------------------------------------------------------------------

def test_single_element_violation_is_located(small_probes):
    problem = small_probes["random"]
    bounds = problem_bounds(problem, "bf16-fp32acc")
    out = bounds.reference.clone()
    out[5, 17] += 3 * bounds.worst[5, 17]
    report = evaluate_bounds(out, bounds, label="tampered")
    assert report.worst_violations == 1 and report.prob_violations == 1
    assert report.worst_element == (5, 17)
    assert not report.proven_ok and not report.ok
    assert "BOUND VIOLATED" in report.summary()


def test_unwritten_elements_are_flagged(small_probes):
    problem = small_probes["random"]
    out = run_poisoned(CORRECT_EMULATION, problem)
    out[3, :7] = float("nan")
    report = check_error_bounds(out, problem, "bf16-fp32acc")
    assert report.nonfinite == 7 and not report.proven_ok


def test_report_statistics_are_consistent(small_probes):
    problem = small_probes["clamp"]
    report = check_error_bounds(run_poisoned(CORRECT_EMULATION, problem), problem, "bf16-fp32acc")
    assert isinstance(report, BoundReport)
    assert sum(report.prob_hist) == report.elements == problem.x.numel()
    q = report.prob_quantiles
    assert q["p50"] <= q["p90"] <= q["p99"] <= q["p99.9"] <= report.prob_max_ratio
    assert report.worst_max_ratio <= report.prob_max_ratio  # the worst-case bound is the larger
    assert report.max_ratio == report.prob_max_ratio
    d = report.to_dict()
    assert d["ok"] and "sample" not in d and len(report.sample["error"]) > 0


def test_reference_matches_expert_reference(small_probes):
    problem = small_probes["swamp"]
    bounds = problem_bounds(problem, "bf16-plain")
    ref = expert_reference(problem.x, problem.table, problem.weights, problem.config)
    assert torch.allclose(bounds.reference, ref, rtol=0, atol=1e-12)


def test_bounds_order_models(small_probes):
    """More rounding points, larger bounds; the float64 model's bound is ~1e-12 relative."""
    problem = small_probes["random"]
    b = compute_error_bounds(problem.x, problem.table, problem.weights, problem.config,
                             ["float64", "bf16-fp32acc", "bf16-plain", "bf16-fp32acc+rz"])
    assert bool((b["bf16-fp32acc"].worst < b["bf16-plain"].worst).all())
    assert bool((b["bf16-fp32acc"].worst < b["bf16-fp32acc+rz"].worst).all())
    rel = (b["float64"].worst / b["float64"].reference.abs().clamp_min(1e-30)).median()
    assert float(rel) < 1e-10


def test_lambda_grows_with_problem_size():
    small = probe_problem("random", preset("tiny"), 8, seed=1)
    large = probe_problem("random", preset("tiny"), 256, seed=1)
    assert problem_bounds(small, "bf16-fp32acc").lam < problem_bounds(large, "bf16-fp32acc").lam


# -- argument checking ---------------------------------------------------------------------------

# (bad call on a valid problem, message pattern); all ValueError
BAD_ARGUMENTS = [
    pytest.param(lambda p: check_error_bounds(p.x, p, "bf16-fp16acc"), "precision model",
                 id="unknown-model"),
    pytest.param(lambda p: check_error_bounds(p.x[:5], p, "bf16-fp32acc"), "out must have shape",
                 id="out-rows"),
    pytest.param(lambda p: compute_error_bounds(p.x, p.table, p.weights, p.config, []), "models",
                 id="no-models"),
    pytest.param(lambda p: compute_error_bounds(p.x[:, :10], p.table, p.weights, p.config,
                                                ["bf16-plain"]), "x must have shape", id="x-width"),
    pytest.param(lambda p: hoeffding_lambda(10, 1.5), "failure_probability",
                 id="failure-probability-above-1"),
    pytest.param(lambda p: gamma(2 ** 8, 2.0 ** -8), "n\\*u < 1", id="gamma-n-u-1"),
]


@pytest.mark.parametrize("call, pattern", BAD_ARGUMENTS)
def test_bad_arguments_name_themselves(small_probes, call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(small_probes["random"])


# -- precision helpers --------------------------------------------------------------------------

def test_precision_helpers():
    assert gamma(1, 0.25) == pytest.approx(1 / 3)
    assert gamma_probabilistic(100, 1.0, 2.0 ** -24) < gamma(100, 2.0 ** -24)
    assert hoeffding_lambda(1, 2 * math.exp(-8)) == pytest.approx(4.0)
    rz = truncating(BF16)
    assert rz.unit == 2 * BF16.unit and rz.emin == BF16.emin
    m = with_truncating_downcasts(precision_model("bf16-plain"))
    assert m.name == "bf16-plain+rz" and m.round_activation.unit == 2.0 ** -7
    assert precision_model("bf16-plain+rz") == m
    fp32_model = precision_model("bf16-fp32acc", torch.float32)
    assert fp32_model.round_activation == FP32 and fp32_model.round_output == FP32


def test_flushed_subnormal_route_is_allowed_only_by_the_atomic_model():
    """A routing weight that underflowed to an fp32 subnormal (sigmoid of a very negative
    logit), with top_k = 1: NVIDIA's fp32 atomics flush that route's contribution to zero. The
    plain model (gradual underflow) flags it; bf16-fp32acc-atomic, which the atomic native
    kernel declares, allows it (an absolute 2^-126 per atomic addition, nothing more)."""
    from magi_moe.config import MoEConfig
    from magi_moe.problems import random_problem

    cfg = MoEConfig(num_heads=1, head_dim=32, num_experts=2, top_k=1, intermediate_size=32)
    problem = random_problem(cfg, 8, seed=5)
    problem.weights.w_down.mul_(64)                    # outputs of order 1, as in the fuzz case
    probs = problem.table.sorted_probs
    probs[0] = 2e-39                                   # subnormal in fp32
    out = expert_reference(problem.x, problem.table, problem.weights, cfg, precision="fp32acc")
    token = int(problem.table.gather_ids[0])
    # the contribution is itself subnormal (so an FTZ addition drops it) and survives without FTZ
    assert 0 < out[token].abs().max() < 2.0 ** -126
    flushed = out.clone()
    flushed[token] = 0                                 # what an FTZ atomic sum stores
    assert not check_error_bounds(flushed, problem, "bf16-fp32acc").proven_ok
    assert check_error_bounds(flushed, problem, "bf16-fp32acc-atomic").ok
    assert check_error_bounds(out, problem, "bf16-fp32acc").ok
    # the allowance is tiny: a flushed *normal* contribution is still flagged
    probs[0] = 2.0 ** -100
    fresh = dataclasses.replace(problem)  # a new object: bounds are cached per problem
    big = expert_reference(fresh.x, fresh.table, fresh.weights, cfg, precision="fp32acc")
    big[token] = 0
    assert not check_error_bounds(big, fresh, "bf16-fp32acc-atomic").proven_ok
