"""Every implementation's own layer (``impl.layer``), built from a released-layout checkpoint
(CONTRACT section 3), computes *that* checkpoint's layer: its output is held to the float64
reference of the tensors it was given, not of the tensors it holds. A layer that loads a name
into the wrong place (gate and up swapped, a transposed down projection) is consistent with its
own ``state_dict()``, so the weight-change rows, which judge a layer by what it holds, pass it;
this row does not. Tensors the layer reports under a released name must be the ones given."""
from __future__ import annotations

import pytest

from magi_moe.audit.checkpoint import WRONG_CHECKPOINT, WRONG_LAYER, check_layer_checkpoint
from magi_moe.config import preset
from magi_moe.tests.layer_wrong_first import layer_wrong_from_the_start

pytestmark = pytest.mark.clause("checkpoint")


def checkpoint_failures(impl, device) -> tuple[str | None, list[str]]:
    """``(why it was not judged, failures)`` for ``impl``'s layer built from a drawn checkpoint."""
    found = check_layer_checkpoint(impl, impl.fit(preset("tiny")), device)
    if found.status == WRONG_LAYER:  # not a loading fault: the layer's accuracy (or routing)
        return layer_wrong_from_the_start(impl, found.detail)
    if found.status == WRONG_CHECKPOINT:
        return None, [f"{impl.name}'s layer computes another checkpoint than it was given: "
                      f"{found.detail}", *found.renamed]
    return None, list(found.renamed)


def test_layer_computes_the_checkpoint_it_was_given(impl_backend):
    why_not, bad = checkpoint_failures(impl_backend.impl, impl_backend.device)
    if why_not:
        pytest.skip(why_not)
    assert not bad, "; ".join(bad)


def test_a_layer_loading_gate_and_up_swapped_fails_here_and_nowhere_else():
    """The planted bug this row exists for: consistent with what it holds, so the weight-change
    rows pass it (the audit's cache section too); compared with what it was given, it fails."""
    from magi_moe.tests.outside_broken import SWAPPED_CHECKPOINT_LAYER as SWAPPED
    from magi_moe.tests.outside_broken import UNCACHED_LAYER
    from .test_weight_changes import route_failures

    why_not, bad = checkpoint_failures(SWAPPED, "cpu")
    assert why_not is None and bad, (why_not, bad)
    assert "computes another checkpoint than it was given" in bad[0]
    assert any("state_dict()['W_up'] is not the checkpoint's W_up" in b for b in bad), bad
    assert route_failures(SWAPPED, "cpu", "in_place") == (None, [])
    assert checkpoint_failures(UNCACHED_LAYER, "cpu") == (None, [])  # the same layer, loaded right
