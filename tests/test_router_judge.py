"""The router judge (audit.router_judge) and the places that use it: each rule it names can fail,
its probes make each rule matter, and an outside router that breaks a rule (tests/outside_broken.py)
fails the conformance test, the audit's routing section and the fuzz property, while the correct
example (tests/outside_impl_example.py) and magi-moe's own routers pass all three."""
from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from magi_moe.audit.report import Audit, AuditOptions
from magi_moe.audit.router_judge import float64_routes, judge_router, judge_router_call
from magi_moe.audit.router_probes import ROUTER_PROBES, router_probe
from magi_moe.backends import BACKENDS
from magi_moe.routing import Routes, route, router_logits, scores_from_logits, select_experts
from magi_moe.tests import outside_broken
from magi_moe.tests.outside_impl_example import IMPL as EXAMPLE
from .test_router_conformance import ROUTER_CONFIGS, judge_impl_router

REPO = Path(__file__).resolve().parent.parent
BROKEN = "magi_moe.tests.outside_broken"
SIGMOID = ROUTER_CONFIGS["sigmoid"]

# (broken outside implementation, a probe and configuration where its fault shows, the rule named)
CAUGHT = [
    pytest.param("ROUTER_FORGETS_L1", "random", "sigmoid", "l1_normalisation", id="forgets-l1"),
    pytest.param("ROUTER_FORGETS_L1", "underflow", "softmax-norm", "l1_normalisation",
                 id="forgets-l1-softmax"),
    pytest.param("ROUTER_TIES_TO_HIGHER_INDEX", "ties", "sigmoid", "tie_rule", id="ties-high"),
    pytest.param("ROUTER_TIES_TO_HIGHER_INDEX", "boundary", "softmax", "tie_rule",
                 id="ties-high-boundary"),
    pytest.param("ROUTER_BIAS_IN_WEIGHTS", "bias-flips", "softmax-norm", "bias_in_weights",
                 id="bias-weights"),
]


def _inputs(probe: str, config=SIGMOID, tokens: int = 24, seed: int = 0):
    return router_probe(probe, config, tokens, seed=seed)


# -- the probes make each rule matter ------------------------------------------------------------

@pytest.mark.parametrize("config_name", list(ROUTER_CONFIGS))
def test_each_probe_makes_its_rule_matter(config_name):
    config = ROUTER_CONFIGS[config_name]
    K = config.top_k

    def ref(probe):
        return float64_routes(*_inputs(probe, config), config)

    flips = ref("bias-flips")
    unbiased = select_experts(flips.scores, K)
    assert (flips.expert_ids.sort(-1).values != unbiased.sort(-1).values).any(-1).float().mean() > 0.2
    for probe in ("ties", "boundary", "inf-bias"):  # an exact tie across the K-th place
        r = ref(probe)
        kth = r.selection.gather(-1, r.expert_ids[..., -1:])
        tied_outside = (r.selection == kth).sum(-1) > (r.selection.gather(-1, r.expert_ids) == kth).sum(-1)
        assert tied_outside.any(), probe
    nan = ref("nan")
    assert torch.isnan(nan.probs).all(-1).any() and torch.isnan(nan.selection).any()
    if config.route_norm and config.score_func == "sigmoid":
        sums = ref("underflow").scores.gather(-1, ref("underflow").expert_ids).sum(-1)
        assert (sums < 1e-12).any() and (sums == 0).any() and (sums > 0).any()


# -- each rule can fail ------------------------------------------------------------------------------

def test_a_correct_router_passes_every_probe_and_configuration():
    for config in ROUTER_CONFIGS.values():
        for probe in ROUTER_PROBES:
            v = judge_router_call(route, *_inputs(probe, config), config)
            assert v.ok and v.failed == (), v.text


@pytest.mark.parametrize("change, probe, config, rule", [
    pytest.param(lambda sc, sel, ids, p: Routes(ids.flip(-1), p.flip(-1)), "random", SIGMOID, "order",
                 id="reversed"),
    pytest.param(lambda sc, sel, ids, p: Routes(ids, p / SIGMOID.route_scale), "random", SIGMOID,
                 "route_scale", id="no-route-scale"),
    pytest.param(lambda sc, sel, ids, p: Routes(select_experts(sc, SIGMOID.top_k), p), "bias-flips",
                 SIGMOID, "bias_ignored", id="bias-ignored"),
    pytest.param(lambda sc, sel, ids, p: Routes(ids, p.nan_to_num(0.0)), "nan", SIGMOID, "weights",
                 id="nan-hidden"),
])
def test_each_rule_is_named_when_broken(change, probe, config, rule):
    x, gate, bias = _inputs(probe, config)
    scores = scores_from_logits(router_logits(x, gate, config), config.score_func)
    selection = scores + bias.view(config.num_heads, config.num_experts)
    right = route(x, gate, bias, config)
    routes = change(scores, selection, right.expert_ids.clone(), right.probs.clone())
    v = judge_router(routes, x, gate, bias, config)
    assert rule in v.failed, v.text


def test_nan_selection_first_breaks_nan_last():
    x, gate, bias = _inputs("nan")
    right = route(x, gate, bias, SIGMOID)
    ids, probs = right.expert_ids.clone(), right.probs.clone()
    nan_experts = torch.isnan(bias.view(SIGMOID.num_heads, SIGMOID.num_experts))
    # a (token, head) whose head has a NaN-biased expert: choose it first
    h = int(nan_experts.any(-1).nonzero()[0, 0])
    e = int(nan_experts[h].nonzero()[0, 0])
    s = next(s for s in range(x.shape[0]) if not torch.isnan(x[s, h * SIGMOID.head_dim]))
    ids[s, h, 0] = e
    v = judge_router(Routes(ids, probs), x, gate, bias, SIGMOID)
    assert "nan_last" in v.failed, v.text


def test_norm_without_eps_is_named():
    config = SIGMOID
    x, gate, bias = _inputs("underflow", config)
    right = route(x, gate, bias, config)
    chosen = scores_from_logits(router_logits(x, gate, config), "sigmoid").gather(-1, right.expert_ids)
    routes = Routes(right.expert_ids, chosen / chosen.sum(-1, keepdim=True) * config.route_scale)
    v = judge_router(routes, x, gate, bias, config)
    assert v.failed == ("norm_eps",), v.text


@pytest.mark.parametrize("routes, message", [
    (lambda r: Routes(r.expert_ids.int(), r.probs), "must have dtype int64"),
    (lambda r: Routes(r.expert_ids + 8, r.probs), "must lie in \\[0, 8\\)"),
    (lambda r: Routes(r.expert_ids[..., :1].expand_as(r.expert_ids).contiguous(), r.probs), "distinct"),
    (lambda r: Routes(r.expert_ids[:-1], r.probs[:-1]), "must have shape"),
])
def test_malformed_routes_fail_form_and_nothing_else(routes, message):
    x, gate, bias = _inputs("random")
    v = judge_router(routes(route(x, gate, bias, SIGMOID)), x, gate, bias, SIGMOID)
    assert v.failed == ("form",) and len(v.checks) == 1
    assert re.search(message, v.checks[0].text), v.text


def test_a_router_reading_other_heads_breaks_head_locality():
    def shared_softmax(x, gate, bias, config):  # one softmax over every head's experts
        H, E = config.num_heads, config.num_experts
        logits = router_logits(x, gate, config)
        scores = torch.softmax(logits.reshape(x.shape[0], H * E), -1).view_as(logits) * H
        ids = select_experts(scores + bias.view(H, E), config.top_k)
        p = scores.gather(-1, ids)
        return Routes(ids, p / p.sum(-1, keepdim=True) * config.route_scale)

    config = ROUTER_CONFIGS["softmax-norm"]
    v = judge_router_call(shared_softmax, *_inputs("random", config), config)
    assert "head_locality" in v.failed, v.text


def test_a_choice_within_the_rounding_margin_is_a_near_tie_not_a_failure():
    config = SIGMOID
    x, gate, bias = _inputs("random", config)
    # expert 1 of head 0 one fp32 step below expert 0, for every token: within fp32 rounding
    gate = gate.clone()
    gate[1] = gate[0]
    bias = bias.clone()
    bias[1] = torch.nextafter(bias[0], torch.tensor(float("-inf")))
    right = route(x, gate, bias, config)
    ref = float64_routes(x, gate, bias, config)
    ids = right.expert_ids.clone()
    rows = (ids[:, 0] == 0).any(-1) & ~(ids[:, 0] == 1).any(-1)
    assert rows.any()
    ids[:, 0][rows] = torch.where(ids[:, 0][rows] == 0, 1, ids[:, 0][rows])  # 1 instead of 0
    v = judge_router(Routes(ids, right.probs), x, gate, bias, config, reference=ref)
    assert v.ok, v.text
    assert v.near_ties == int(rows.sum())
    # the same swap on an exact tie (equal biases) breaks the tie rule, whatever the margin
    bias[1] = bias[0]
    v = judge_router(Routes(ids, right.probs), x, gate, bias, config)
    assert "tie_rule" in v.failed, v.text


# -- the conformance test, the audit and the fuzzers -------------------------------------------------

@pytest.mark.parametrize("attr, probe, config_name, rule", CAUGHT)
def test_broken_outside_routers_fail_the_conformance_test(attr, probe, config_name, rule):
    verdict = judge_impl_router(getattr(outside_broken, attr), "cpu", probe, config_name)
    assert rule in verdict.failed, verdict.text


@pytest.mark.parametrize("config_name", list(ROUTER_CONFIGS))
def test_the_example_and_magi_moes_routers_pass_the_conformance_test(config_name, triton_device):
    from magi_moe.impls import FUSED

    for impl, device in ((EXAMPLE, "cpu"), (FUSED, triton_device)):
        for probe in ("ties", "nan", "underflow"):
            verdict = judge_impl_router(impl, device, probe, config_name)
            assert verdict.ok, verdict.text


def _routing_rows(spec: str, tmp_path) -> list:
    audit = Audit(AuditOptions(impls=[spec], presets=["tiny"], tokens=24, out=tmp_path),
                  stream=io.StringIO())
    audit.run_section("routing")
    return [r for r in audit.rows if r.section == "routing"]


@pytest.mark.parametrize("attr, rule", [("ROUTER_FORGETS_L1", "l1_normalisation"),
                                        ("ROUTER_TIES_TO_HIGHER_INDEX", "tie_rule"),
                                        ("ROUTER_BIAS_IN_WEIGHTS", "bias_in_weights")])
def test_the_audit_routing_section_fails_broken_outside_routers(attr, rule, tmp_path):
    rows = _routing_rows(f"{BROKEN}:{attr}", tmp_path)
    assert rows and any(r.status == "FAIL" and rule in r.result for r in rows), [r.result for r in rows]


def test_the_audit_routing_section_passes_the_example_and_the_fused_router(tmp_path):
    specs = ["magi_moe.tests.outside_impl_example:IMPL"]
    if BACKENDS["interpret"].available:
        specs.append("fused")  # the cpu audit runs Triton under the interpreter
    for spec in specs:
        rows = _routing_rows(spec, tmp_path)
        assert len(rows) == 2 and all(r.status == "pass" for r in rows), [r.result for r in rows]


def _quick(examples: int) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("attr, rule", [("ROUTER_FORGETS_L1", "l1_normalisation"),
                                        ("ROUTER_TIES_TO_HIGHER_INDEX", "tie_rule"),
                                        ("ROUTER_BIAS_IN_WEIGHTS", "bias_in_weights")])
def test_the_routing_fuzz_property_catches_broken_outside_routers(attr, rule):
    from magi_moe.fuzz import fuzzers
    from magi_moe.fuzz.properties import make_target
    from magi_moe.fuzz.record import PropertyViolation

    with pytest.raises(PropertyViolation, match=f"routes break [a-z_, ]*{rule}"):
        fuzzers.search("routing", make_target(f"{BROKEN}:{attr}", "cpu"), settings=_quick(30))
    fuzzers.search("routing", make_target("magi_moe.tests.outside_impl_example:IMPL", "cpu"),
                   settings=_quick(30))


def test_conformance_run_fails_an_outside_router_that_forgets_the_l1_normalisation():
    """As a kernel team runs it (``magi-moe check`` is ``pytest --conformance --impl``)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--conformance",
         "tests/test_router_conformance.py", "--impl", f"{BROKEN}:ROUTER_FORGETS_L1"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "routes FAILED on l1_normalisation" in done.stdout, done.stdout[-3000:]
