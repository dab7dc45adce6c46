"""Row isolation (CONTRACT 1, clause ``row-isolation``) on every implementation under test: rows
of ``x`` poisoned with NaN, Inf or overflowing garbage never reach another token's output, in
the expert kernel on given routes (poisoned rows unrouted, on their own routes, or sharing a
clean row's experts) and in the implementation's own layer (routing included). Fixed seeds,
tiny shapes. The broken variants of tests/isolation_broken.py are the controls: each fails
these same checks and the ``row_isolation`` fuzz property, and magi-moe's own pass them."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from magi_moe.audit.cache import draw_state
from magi_moe.audit.isolation import (ROUTE_MODES, check_layer_row_isolation, check_row_isolation,
                                      poisoned_rows)
from magi_moe.backends import BACKENDS
from magi_moe.config import preset
from magi_moe.fuzz import fuzzers
from magi_moe.fuzz.properties import make_target
from magi_moe.fuzz.record import PropertyViolation
from magi_moe.impls import TORCH_BF16
from magi_moe.problems import random_problem
from magi_moe.tests import isolation_broken as broken

TOKENS = 24


def _rows(seed: int) -> torch.Tensor:
    rows = poisoned_rows(TOKENS, seed=seed)
    rows[0] = False  # token 0 clean: the row a parked padding route lands on
    return rows


def kernel_failures(impl, device, poison: str, *, seed: int = 40) -> list[str]:
    """The route modes in which poisoned rows reach clean ones (an empty list: isolated)."""
    problem = random_problem(impl.fit(preset("tiny")), TOKENS, seed=seed, device=device)
    results = [check_row_isolation(impl, problem, _rows(seed), poison, mode, seed=seed + 1)
               for mode in ROUTE_MODES]
    for r in results:
        if r.inaccurate is not None:
            raise r.inaccurate  # as wrong without the poison: the verdict counts it under accuracy
    return [r.text for r in results if not r.ok]


def layer_failure(impl, device, poison: str, *, seed: int = 50) -> str | None:
    config = impl.fit(preset("tiny"))
    x = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    result = check_layer_row_isolation(impl, config, draw_state(config, seed, device),
                                       x.to(device=device, dtype=config.dtype), _rows(seed), poison,
                                       seed=seed + 1)
    if result.inaccurate is not None:
        raise result.inaccurate
    return None if result.ok else result.text


# "mixed" puts NaN, Inf and garbage in one row; "garbage" alone is finite (only products overflow)
@pytest.mark.clause("row-isolation")
@pytest.mark.parametrize("poison", ["mixed", "garbage"])
def test_poisoned_rows_never_reach_other_tokens(impl_backend, poison):
    problem = random_problem(impl_backend.impl.fit(preset("tiny")), TOKENS, seed=40, device=impl_backend.device)
    results = [check_row_isolation(impl_backend.impl, problem, _rows(40), poison, mode, seed=41)
               for mode in ROUTE_MODES]
    for r in results:  # inaccurate with no poison too: the verdict counts it under accuracy
        if r.inaccurate is not None:
            raise AssertionError(r.text) from r.inaccurate
    failures = [r.text for r in results if not r.ok]
    assert not failures, "\n".join(failures)


@pytest.mark.clause("row-isolation")
@pytest.mark.parametrize("poison", ["nan", "garbage"])
def test_layer_poisoned_rows_never_reach_other_tokens(impl_backend, poison):
    config = impl_backend.impl.fit(preset("tiny"))
    x = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(50))
    result = check_layer_row_isolation(impl_backend.impl, config, draw_state(config, 50, impl_backend.device),
                                       x.to(device=impl_backend.device, dtype=config.dtype), _rows(50),
                                       poison, seed=51)
    if result.inaccurate is not None:  # inaccurate with no poison too: counted under accuracy
        raise AssertionError(result.text) from result.inaccurate
    assert result.ok, result.text


@pytest.mark.parametrize("call, argument", [
    (lambda p: poisoned_rows(1, seed=0), "num_tokens"),
    (lambda p: poisoned_rows(8, seed=0, share=1.0), "share"),
    (lambda p: check_row_isolation(TORCH_BF16, p, poisoned_rows(8, seed=0), "zeros", "own"), "poison"),
    (lambda p: check_row_isolation(TORCH_BF16, p, poisoned_rows(8, seed=0), "nan", "sideways"), "mode"),
    (lambda p: check_row_isolation(TORCH_BF16, p, torch.ones(8, dtype=torch.bool), "nan", "own"), "rows"),
])
def test_bad_arguments_name_the_argument(call, argument):
    problem = random_problem(preset("tiny"), 8, seed=1)
    with pytest.raises(ValueError, match=f"^{argument} must"):
        call(problem)


# -- the controls ---------------------------------------------------------------------------------
def test_per_expert_scale_fails_where_rows_share_an_expert():
    """An amax over an expert's rows spreads NaN only to rows that share that expert: caught with
    routes ``own`` and ``shared``, and (the reason for those modes) not when poisoned rows are
    unrouted."""
    for poison in ("nan", "garbage"):
        failures = kernel_failures(broken.per_expert_scale, "cpu", poison)
        assert [f for f in failures if "routes unrouted" in f] == [], failures
        assert len(failures) == 2, failures
        assert "not finite" in failures[0]


def test_per_tensor_scale_fails_in_every_route_mode():
    for poison in ("inf", "garbage"):
        assert len(kernel_failures(broken.per_tensor_scale, "cpu", poison)) == len(ROUTE_MODES)


def test_nan_route_parked_on_row_zero_fails_only_in_the_layer():
    """Its expert forward is right; its layer's dispatch sends NaN-weight routes to row 0."""
    impl = broken.nan_route_to_row_zero
    assert kernel_failures(impl, "cpu", "nan") == []
    for poison in ("nan", "inf"):
        why = layer_failure(impl, "cpu", poison)
        assert why is not None and "not finite" in why, why
    assert layer_failure(impl, "cpu", "garbage") is None  # finite logits: every route has a weight


@pytest.mark.parametrize("name", ["per_expert_scale", "per_tensor_scale", "nan_route_to_row_zero"])
def test_the_fuzz_property_catches_each_broken_variant(name):
    """The ``row_isolation`` record's own strategy finds each variant within a few examples."""
    prop = fuzzers.PROPERTIES["row_isolation"]
    target = make_target(getattr(broken, name), "cpu", spec=f"magi_moe.tests.isolation_broken:{name}")
    quick = settings(max_examples=12, derandomize=True, database=None, deadline=None,
                     phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    with pytest.raises(PropertyViolation, match="a poisoned row reached another token"):
        fuzzers.search(prop, target, settings=quick)


class _Audit:
    """What the isolation section reads of a running audit: the CPU, some implementations."""

    def __init__(self, *impls):
        self.impls, self.backend, self.device = impls, BACKENDS["cpu"], torch.device("cpu")
        self.options = type("Options", (), {"seed": 0})()

    def selected_impls(self):
        return list(self.impls)

    def runnable_here(self, impl):
        return impl.skip_reason(self.device)


def test_the_audit_section_fails_exactly_the_broken_rows():
    from magi_moe.audit.sections import isolation as section

    rows = list(section.run(_Audit(TORCH_BF16, broken.per_expert_scale, broken.nan_route_to_row_zero)))
    failed = {r.subject for r in rows if r.status == "FAIL"}
    assert {r.status for r in rows} <= {"pass", "FAIL"}, [(r.subject, r.status, r.result) for r in rows]
    assert failed == {"broken-per-expert-scale: poisoned rows own",
                      "broken-per-expert-scale: poisoned rows shared",
                      "broken-per-expert-scale.layer()", "broken-nan-route-row-zero.layer()"}, \
        [(r.subject, r.result) for r in rows]
    assert len(rows) == 3 * (len(ROUTE_MODES) + 1) and all(r.impl for r in rows)


def test_an_inaccurate_kernel_is_counted_under_accuracy_not_isolation():
    """One root cause, one verdict row: a kernel wrong on clean rows alone (1% off on busy
    experts) fails the isolation check as an accuracy finding, which the verdict counts under
    accuracy; an isolation bug stays an isolation finding."""
    from magi_moe.judge import Inaccurate
    from magi_moe.tests.outside_team_kernel import BUGGY, GOOD
    from magi_moe.verdict import LayerWrongOnItsOwn

    with pytest.raises(Inaccurate, match="as wrong on their own"):
        kernel_failures(BUGGY, "cpu", "mixed")
    with pytest.raises(LayerWrongOnItsOwn, match="no poisoned row is to blame"):
        layer_failure(BUGGY, "cpu", "nan")  # a NOT RUN skip: the fresh-layer clauses say it
    assert kernel_failures(GOOD, "cpu", "mixed") == []
    problem = random_problem(preset("tiny"), TOKENS, seed=40)
    result = check_row_isolation(broken.per_tensor_scale, problem, _rows(40), "mixed", "unrouted", seed=41)
    assert not result.ok and result.inaccurate is None, result.text


def _inaccurate_everywhere():
    """A kernel off by half on every row, poisoned rows or none: inaccurate, not leaking."""
    import dataclasses

    from magi_moe.examples.kernel import IMPL, loop_forward

    def half_again(x, table, weights, config, *, out):
        return loop_forward(x, table, weights, config, out=out).mul_(1.5)

    return dataclasses.replace(IMPL, name="inaccurate-everywhere", forward=half_again)


def test_an_inaccurate_kernel_is_not_reported_as_a_leak():
    """A kernel wrong with no poisoned row at all once failed row-isolation as "a poisoned row
    reached another token" beside its accuracy row: its failures carry the accuracy cause."""
    from magi_moe.judge import Inaccurate
    from magi_moe.audit.sections import isolation as section
    from magi_moe.verdict import INACCURATE, cause_of

    impl = _inaccurate_everywhere()
    problem = random_problem(impl.fit(preset("tiny")), TOKENS, seed=40, device="cpu")
    for mode in ROUTE_MODES:
        result = check_row_isolation(impl, problem, _rows(40), "nan", mode, seed=41)
        assert not result.ok and isinstance(result.inaccurate, Inaccurate), result.text
        assert "as wrong on their own" in result.text
    rows = list(section.run(_Audit(impl)))
    kernel_rows = [r for r in rows if not r.subject.endswith(".layer()")]
    layer_rows = [r for r in rows if r.subject.endswith(".layer()")]
    assert kernel_rows and all(r.status == "FAIL" and r.cause == INACCURATE for r in kernel_rows), \
        [(r.subject, r.status, r.cause) for r in rows]
    # its layer is as wrong on the clean rows alone: NOT RUN, left to the fresh-layer clauses
    assert layer_rows and all(r.status == "info" and r.skip for r in layer_rows), layer_rows
    from magi_moe.audit.clauses import audit_outcomes
    from magi_moe.verdict import FAIL, Outcome, Status, verdict_rows

    for r in rows:
        r.clause = "row-isolation"
    accuracy = Outcome("inaccurate-everywhere@cpu", "accuracy", Status.FAIL, "bounds", "off by half")
    table = verdict_rows([accuracy, *audit_outcomes(rows, impls={}, backend="cpu")])
    verdict = {r.clause.name: r for r in table["inaccurate-everywhere@cpu"]}
    assert verdict["accuracy"].status == FAIL and verdict["row-isolation"].status != FAIL, verdict
    prop = fuzzers.PROPERTIES["row_isolation"]
    target = make_target(impl, "cpu", spec="inaccurate-everywhere")
    quick = settings(max_examples=5, derandomize=True, database=None, deadline=None,
                     phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    with pytest.raises(PropertyViolation, match="the clean rows are inaccurate") as caught:
        fuzzers.search(prop, target, settings=quick)
    assert cause_of(caught.value) == INACCURATE
    # a real leak keeps its own clause: the per-expert scale is accurate without poison
    leaks = [check_row_isolation(broken.per_expert_scale, random_problem(
        broken.per_expert_scale.fit(preset("tiny")), TOKENS, seed=40, device="cpu"), _rows(40), "mixed", "own",
        seed=41)]
    assert not leaks[0].ok and leaks[0].inaccurate is None, leaks[0].text


def test_an_oracle_whose_sums_follow_the_call_shape_is_isolated(monkeypatch):
    """The float64 reference on the H200 failed row isolation ("FAILED on faithfulness") when
    poisoned rows shared its experts: cuBLAS picks a float64 GEMM's kernel by the row count, so
    the clean rows differ in the last bit from the reference run on them alone. Simulated here
    by an oracle that rounds one ulp up on calls with more routes than the clean problem's: the
    clean rows are held to the emulation of the call they were part of, bitwise; an output one
    ulp off that call's emulation still fails."""
    import dataclasses

    from magi_moe.impls import REFERENCE
    from magi_moe.judge import accuracy

    real = accuracy.expert_reference
    problem = random_problem(preset("tiny"), TOKENS, seed=40, device="cpu")
    rows = _rows(40)
    clean_routes = int((~rows).sum()) * problem.config.num_heads * problem.config.top_k

    def shape_ordered(x, table, weights, config, *, precision="float64", **kw):
        y = real(x, table, weights, config, precision=precision, **kw)
        more = table.gather_ids.numel() > clean_routes
        return torch.nextafter(y, torch.full_like(y, torch.inf)) if more else y

    def forward(x, table, weights, config, *, out, shift=0):
        y = shape_ordered(x, table, weights, config)
        for _ in range(shift):
            y = torch.nextafter(y, torch.full_like(y, torch.inf))
        return out.copy_(y)

    monkeypatch.setattr(accuracy, "expert_reference", shape_ordered)
    oracle = dataclasses.replace(REFERENCE, name="shape-ordered", forward=forward)
    for mode in ("own", "shared"):
        result = check_row_isolation(oracle, problem, rows, "mixed", mode, seed=41)
        assert result.ok, result.text
    off = dataclasses.replace(oracle, name="one-ulp-off",
                              forward=lambda *a, out: forward(*a, out=out, shift=1))
    result = check_row_isolation(off, problem, rows, "mixed", "shared", seed=41)
    assert not result.ok and "faithfulness" in result.text, result.text
