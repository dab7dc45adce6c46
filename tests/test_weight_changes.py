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


def _same_layer_as_the_reference(impl, backend: str) -> bool:
    """magi-moe's own kernels without a cache of their own run in the same generic MagiMoE as
    the reference: under the interpreter their rows would repeat reference@cpu's at 10x the cost."""
    return impl in BUILTINS and backend == "interpret" and "weight_cache" not in impl.capabilities


@pytest.mark.parametrize("route", ROUTE_ROWS)
def test_layer_follows_the_weight_change(impl_backend, route, request):
    impl = impl_backend.impl
    if not request.config.getoption("--impl") and _same_layer_as_the_reference(
            impl, impl_backend.backend.name):
        pytest.skip("the generic MagiMoE layer is judged at reference@cpu (name it with --impl "
                    "to judge it here)")
    config = impl.fit(preset("tiny"))
    report = audit_weight_cache(impl, config=config, device=impl_backend.device, routes=(route,),
                                seed=5)
    judged = [r for r in report.results if r.status not in (SKIPPED, NOT_APPLICABLE)]
    if not judged:
        pytest.skip("; ".join(sorted({r.detail for r in report.results})) or "no result")
    bad = [f"{r.route}/{r.parameter}: {r.status} (promised {r.promised}): {r.detail}"
           for r in report.results if not r.ok]
    assert not bad, "; ".join(bad)
