"""CUDA-graph replay after weight changes (audit.graphs) on each implementation's own layer,
one row per route, and the promise of docs/PLUGGING_IN.md ("every storage-keeping change and a
fitting load_state_dict(assign=True) are graph-safe; param.data = new needs a recapture, which
works") for magi-moe's fused layer. CUDA only."""
from __future__ import annotations

import pytest

from magi_moe.audit.cache import WRONG_BEFORE_ANY_CHANGE
from magi_moe.audit.graphs import GRAPH_ROUTES, GRAPH_SAFE, STALE, audit_graph_replay
from magi_moe.config import preset
from magi_moe.impls import FUSED
from magi_moe.tests.layer_wrong_first import layer_wrong_from_the_start

pytestmark = pytest.mark.cuda


ROUTE_ROWS = [pytest.param(r.name, id=r.name, marks=pytest.mark.clause(f"cuda-graph/{r.name}"))
              for r in GRAPH_ROUTES]


@pytest.mark.parametrize("route", ROUTE_ROWS)
def test_layer_keeps_its_graph_promises(impl_backend, route):
    """Every implementation's own layer, one verdict row per route: a captured graph is right
    after the change, or the layer promises a recapture (graph_promises) and a fresh capture
    is right. A forward that cannot be captured at all is not a failure (audit: info), except
    for magi-moe's own fused layer, which is also held to the promise docs/PLUGGING_IN.md
    states."""
    if impl_backend is None or impl_backend.backend.device != "cuda":
        pytest.skip("CUDA graphs need the cuda backend")
    impl = impl_backend.impl
    results = audit_graph_replay(impl.layer, impl.fit(preset("small")), device="cuda",
                                 captures=("cudagraph",), routes=(route,))
    captured = [r for r in results if not r.detail.startswith("capture failed")]
    if not captured:
        why = f"{impl.name}.layer() cannot be captured: {results[0].detail}"
        if impl is FUSED:  # docs/PLUGGING_IN.md promises that it can
            pytest.fail(why)
        pytest.skip(why)
    wrong_first = [r for r in captured if r.detail.startswith(WRONG_BEFORE_ANY_CHANGE)]
    if wrong_first:
        why_not, bad = layer_wrong_from_the_start(impl, f"{route} not judged: "
                                                        f"{wrong_first[0].detail}")
        if why_not:
            pytest.skip(why_not)
        pytest.fail("; ".join(bad))
    assert all(r.ok for r in captured), [r.to_dict() for r in captured if not r.ok]
    if impl is FUSED:
        expected = STALE if route == "param_data_assign" else GRAPH_SAFE
        for r in captured:
            assert r.status == expected, f"{route}/{r.parameter}: {r.status}, promised {expected}"
