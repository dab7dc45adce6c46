"""The audit's layer-level sections (checkpoint, weight cache) build each implementation's own
layer at a fixed preset: an implementation whose shape rule no preset meets (head_dim a
multiple of 128, say) gets the smallest preset moved inside its rule, as ``magi-moe check``
fits its cases, instead of a NOT RUN row. A layer that loads its checkpoint wrongly still fails
there: the fitted shape does not make the row vacuous."""
from __future__ import annotations

import dataclasses

import torch

from magi_moe.audit.report import Audit, AuditOptions
from magi_moe.audit.rows import FAIL, PASS, SKIP
from magi_moe.audit.sections import checkpoint
from magi_moe.audit.sections.layer_shapes import layer_config
from magi_moe.config import PRESETS
from magi_moe.implementation import ShapeRule
from magi_moe.layer import MagiMoE
from magi_moe.tests.outside_narrow_example import IMPL as NARROW

# wider than the narrow example's own rule (which "small" meets): no preset meets this one
NARROWER = dataclasses.replace(NARROW, name="narrower-loop",
                               shapes=ShapeRule(head_dim_multiple=128, intermediate_multiple=256,
                                                max_top_k=4))


def _swapped_gate_up(config, state_dict, device):
    """Planted bug: W_gate and W_up loaded into each other's place."""
    swapped = {**state_dict, "W_gate": state_dict["W_up"], "W_up": state_dict["W_gate"]}
    return MagiMoE.from_state_dict(swapped, config, impl=NARROWER_SWAPPED)


NARROWER_SWAPPED = dataclasses.replace(NARROWER, name="narrower-swapped", layer_factory=_swapped_gate_up)


def _audit(impl) -> Audit:
    return Audit(AuditOptions(backend="cpu", impls=[impl], tokens=16, controls=False,
                              mp_validation=False))


def _checkpoint_rows(impl):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return list(checkpoint.run(_audit(impl)))
    finally:
        torch.set_num_threads(threads)


def test_no_preset_meets_the_narrower_rule():
    assert all(NARROWER.supports(config) for config in PRESETS.values() if config.head_dim < 256)


def test_the_layer_preset_is_fitted_inside_a_narrow_rule():
    config, why = layer_config(_audit(NARROWER), NARROWER)
    assert why is None and NARROWER.supports(config) is None
    assert (config.head_dim, config.intermediate_size) == (128, 256)  # tiny's widths moved up


def test_the_checkpoint_section_runs_a_narrow_rule_and_passes_it():
    [row] = _checkpoint_rows(NARROWER)
    assert row.status == PASS, row


def test_the_fitted_checkpoint_row_still_fails_a_swapped_load():
    [row] = _checkpoint_rows(NARROWER_SWAPPED)
    assert row.status == FAIL and row.status != SKIP, row
    assert "wrong checkpoint" in row.result, row
