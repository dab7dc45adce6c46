"""CUDA-graph replay after weight changes (audit.graphs) on each implementation's own layer:
the promise of docs/PLUGGING_IN.md ("every storage-keeping change and a fitting
load_state_dict(assign=True) are graph-safe; param.data = new needs a recapture, which works")
for magi-moe's fused layer. CUDA only."""
from __future__ import annotations

import pytest

from magi_moe.audit.graphs import GRAPH_SAFE, STALE, audit_graph_replay
from magi_moe.config import preset

pytestmark = pytest.mark.cuda


@pytest.mark.needs("weight_cache")
@pytest.mark.clause("cuda-graph")
def test_fused_layer_keeps_its_graph_promises(impl_backend):
    if impl_backend is None or impl_backend.backend.name != "cuda":
        pytest.skip("CUDA graphs need the cuda backend")
    impl = impl_backend.impl
    results = audit_graph_replay(impl.layer, preset("small"), device="cuda", captures=("cudagraph",))
    assert all(r.ok for r in results), [r.to_dict() for r in results if not r.ok]
    by_route = {(r.route, r.parameter): r.status for r in results}
    for (route, parameter), status in by_route.items():
        expected = STALE if route == "param_data_assign" else GRAPH_SAFE
        assert status == expected, f"{route}/{parameter}: {status}, promised {expected}"
