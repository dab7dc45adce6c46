"""Every weight-change route of CONTRACT section 5, once each, on every implementation's own
layer (``impl.layer``): after the change, the layer's output must match the float64 reference
of the new weights (or, for a route the layer's ``weight_cache.promises`` says needs
``invalidate()``, after that call). One verdict row per route (``weight-change/<route>``), so a
cache that misses one route fails that row, whatever a random weight-swap sequence drew.

The routes and the check are the weight-cache audit's (:mod:`audit.cache`); a layer with no
parameter of a released name gets "not applicable" for that route's parameter, and a route that
needs a layer on a GPU is not run on the CPU.
"""
from __future__ import annotations

import pytest

from magi_moe.audit.cache import (NOT_APPLICABLE, ROUTES, SKIPPED, WRONG_BEFORE_ANY_CHANGE,
                                  audit_weight_cache)
from magi_moe.backends import BACKENDS
from magi_moe.config import preset
from magi_moe.impls import BUILTINS
from magi_moe.tests.layer_wrong_first import layer_wrong_from_the_start

ROUTE_ROWS = [pytest.param(r, id=r, marks=pytest.mark.clause(f"weight-change/{r}")) for r in ROUTES]


def _judged_elsewhere(impl, backend: str) -> str | None:
    """In a whole run (no --impl), magi-moe's own layers under the interpreter are judged by
    cheaper rows already: the kernels without a cache run in the same generic MagiMoE as the
    reference (judged at reference@cpu), and the fused layer's cache follows every route in
    tests/test_packed_weights.py (and in the audit's cache section)."""
    if impl not in BUILTINS or BACKENDS[backend].runs_plain_pytorch:  # the reference runs here too
        return None
    if "weight_cache" in impl.capabilities:
        return "the fused layer's cache is judged on every route by tests/test_packed_weights.py"
    return "the generic MagiMoE layer is judged at reference@cpu"


def route_failures(impl, device, route: str) -> tuple[str | None, list[str]]:
    """``(why it was not judged, failures)`` for ``impl``'s layer under one weight-change route.

    A layer already wrong with its first weights leaves nothing for the route to judge
    (:func:`~magi_moe.tests.layer_wrong_first.layer_wrong_from_the_start`)."""
    report = audit_weight_cache(impl, config=impl.fit(preset("tiny")), device=device,
                                routes=(route,), seed=5)
    judged = [r for r in report.results if r.status not in (SKIPPED, NOT_APPLICABLE)]
    wrong_first = [r for r in judged if r.detail.startswith(WRONG_BEFORE_ANY_CHANGE)]
    if wrong_first:
        first = wrong_first[0]
        return layer_wrong_from_the_start(
            impl, f"{route} not judged ({first.route}/{first.parameter}: {first.detail})")
    if not judged:
        return "; ".join(sorted({r.detail for r in report.results})) or "no result", []
    return None, [f"{r.route}/{r.parameter}: {r.status} (promised {r.promised}): {r.detail}"
                  for r in report.results if not r.ok]


@pytest.mark.parametrize("route", ROUTE_ROWS)
def test_layer_follows_the_weight_change(impl_backend, route, request):
    impl = impl_backend.impl
    elsewhere = None if request.config.getoption("--impl") else _judged_elsewhere(
        impl, impl_backend.backend.name)
    if elsewhere:
        pytest.skip(f"{elsewhere} (name it with --impl to judge it here)")
    why_not, bad = route_failures(impl, impl_backend.device, route)
    if why_not:
        pytest.skip(why_not)
    assert not bad, "; ".join(bad)


def test_a_layer_wrong_from_the_start_is_an_accuracy_failure():
    """A kernel that is simply wrong fails every route before any change: that is the accuracy
    judge's finding, typed so that the verdict moves it under accuracy (magi_moe.verdict)."""
    import dataclasses

    from magi_moe import verdict as V
    from magi_moe.impls import TORCH_BF16

    def off_by_one(x, table, weights, config, *, out):
        TORCH_BF16.forward(x, table, weights, config, out=out)
        return out.add_(1)

    wrong = dataclasses.replace(TORCH_BF16, name="wrong-from-the-start", forward=off_by_one)
    with pytest.raises(V.LayerWrongFromTheStart) as wrong_first:  # the type, whatever the words
        route_failures(wrong, "cpu", "in_place")
    cause = V.cause_of(wrong_first.value)
    assert cause == V.WRONG_FROM_THE_START
    outcomes = [V.Outcome("wrong@cpu", "accuracy", V.Status.FAIL, "t1", "FAILED on bounds", "r1"),
                V.Outcome("wrong@cpu", "weight-change/in_place", V.Status.FAIL, "t2",
                          str(wrong_first.value), "r2", cause=cause)]
    rows = {r.clause.name: r for r in V.verdict_rows(outcomes)["wrong@cpu"]}
    assert rows["accuracy"].failed == 2 and rows["weight-change/in_place"].status == V.NOT_RUN
    # a right kernel in a wrong layer: the layer's inaccuracy, still one row, under accuracy
    outcomes[0] = V.Outcome("wrong@cpu", "accuracy", V.Status.PASS, "t1")
    rows = {r.clause.name: r for r in V.verdict_rows(outcomes)["wrong@cpu"]}
    accuracy = rows["accuracy"]
    assert (accuracy.status, accuracy.failed, accuracy.passed) == (V.FAIL, 1, 1)
    assert rows["weight-change/in_place"].status == V.NOT_RUN
    # a right layer with a stale cache is the route's own failure, not accuracy's
    right_why, right_bad = route_failures(TORCH_BF16, "cpu", "in_place")
    assert right_why is None and right_bad == []
