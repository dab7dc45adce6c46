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

from magi_moe.audit.cache import NOT_APPLICABLE, ROUTES, SKIPPED, audit_weight_cache
from magi_moe.config import preset
from magi_moe.impls import BUILTINS

ROUTE_ROWS = [pytest.param(r, id=r, marks=pytest.mark.clause(f"weight-change/{r}")) for r in ROUTES]


def _judged_elsewhere(impl, backend: str) -> str | None:
    """In a whole run (no --impl), magi-moe's own layers under the interpreter are judged by
    cheaper rows already: the kernels without a cache run in the same generic MagiMoE as the
    reference (judged at reference@cpu), and the fused layer's cache follows every route in
    tests/test_packed_weights.py (and in the audit's cache section)."""
    if impl not in BUILTINS or backend != "interpret":
        return None
    if "weight_cache" in impl.capabilities:
        return "the fused layer's cache is judged on every route by tests/test_packed_weights.py"
    return "the generic MagiMoE layer is judged at reference@cpu"


@pytest.mark.parametrize("route", ROUTE_ROWS)
def test_layer_follows_the_weight_change(impl_backend, route, request):
    impl = impl_backend.impl
    elsewhere = None if request.config.getoption("--impl") else _judged_elsewhere(
        impl, impl_backend.backend.name)
    if elsewhere:
        pytest.skip(f"{elsewhere} (name it with --impl to judge it here)")
    config = impl.fit(preset("tiny"))
    report = audit_weight_cache(impl, config=config, device=impl_backend.device, routes=(route,),
                                seed=5)
    judged = [r for r in report.results if r.status not in (SKIPPED, NOT_APPLICABLE)]
    wrong_first = [r for r in judged if r.detail.startswith("wrong before any change")]
    if wrong_first and impl.router is not None:
        # the layer routes with the implementation's own router, which the routing clause
        # judges: one root cause, one FAIL row there, not one per weight-change route
        pytest.skip(f"{impl.name}'s layer is wrong before any weight change, with its own router "
                    f"(see the routing clause): {wrong_first[0].detail}")
    if not judged:
        pytest.skip("; ".join(sorted({r.detail for r in report.results})) or "no result")
    bad = [f"{r.route}/{r.parameter}: {r.status} (promised {r.promised}): {r.detail}"
           for r in report.results if not r.ok]
    assert not bad, "; ".join(bad)
