"""Outside layers (tests/outside_broken.py): modules of their own with their own packed-weight
caches, declared through ``Implementation(..., layer_factory=...)``. The weight-cache auditor and
the weight-swap state machine run on them through ``impl.layer(config, state_dict, device)``,
exactly as on magi-moe's own layer, with their ordinary routes and strategies:

* the cache keyed on ``(data_ptr, _version)`` is reported stale on exactly the routes that key
  misses (``param.data.copy_``, writes under ``torch.inference_mode``), and the state machine
  finds a stale forward;
* the content-checked cache and the uncached layer pass both.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from magi_moe.audit.cache import (DETECTED, EXPERT_PARAMS, NOT_APPLICABLE, NOT_MEASURED, ROUTES, SKIPPED,
                         STALE, audit_weight_cache, draw_state)
from magi_moe.fuzz.stateful import weight_swap_machine
from magi_moe.config import preset
from magi_moe.implementation import Implementation
from magi_moe.tests.exception_chains import chain_text
from magi_moe.layer import MagiMoE
from magi_moe.tests.outside_broken import (CONTENT_CHECKED_LAYER, UNCACHED_LAYER, VERSION_KEYED_LAYER,
                                  ContentCheckedCache, OutsideMoE)

TINY = preset("tiny")
# The routes a (data_ptr, _version) key cannot see: .data.copy_ keeps both; an inference
# tensor has no version counter.
MISSED_BY_THE_KEY = {"param_data_copy", "inference_mode"}

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest


def quick(examples: int, **kw) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), **kw)


def test_the_layers_are_their_own_modules():
    for impl in (VERSION_KEYED_LAYER, CONTENT_CHECKED_LAYER, UNCACHED_LAYER):
        layer = impl.layer(TINY, draw_state(TINY, 0, "cpu"), "cpu")
        assert type(layer) is OutsideMoE and not isinstance(layer, MagiMoE)
        assert not hasattr(layer, "weight_cache") and not hasattr(layer, "invalidate_weight_cache")
    assert hasattr(VERSION_KEYED_LAYER.layer(TINY, draw_state(TINY, 0, "cpu")), "pack_count")
    assert not hasattr(UNCACHED_LAYER.layer(TINY, draw_state(TINY, 0, "cpu")), "pack_count")


# -- the weight-cache auditor ------------------------------------------------------------------

def test_cache_audit_reports_the_version_key_stale_where_it_is_blind():
    report = audit_weight_cache(VERSION_KEYED_LAYER, config=TINY)
    assert report.label == VERSION_KEYED_LAYER.name
    assert report.has_cache and report.measures_packs and not report.ok
    stale = {(r.route, r.parameter) for r in report.results if r.status == STALE}
    assert stale == {(route, p) for route in MISSED_BY_THE_KEY for p in EXPERT_PARAMS}, report.summary()
    for r in report.results:
        if r.route not in MISSED_BY_THE_KEY:
            assert r.status == (SKIPPED if r.route == "to_device" else DETECTED), r
            assert r.ok
        else:
            assert not r.ok and "stale" in r.detail and "no invalidation" in r.detail
    assert "VIOLATIONS" in report.summary()


def test_cache_audit_passes_the_content_checked_layer():
    report = audit_weight_cache(CONTENT_CHECKED_LAYER, config=TINY)
    assert report.ok and report.has_cache and report.measures_packs, report.summary()
    assert {r.route for r in report.results} == set(ROUTES)
    ran = [r for r in report.results if r.status != SKIPPED]
    assert ran and all(r.status == DETECTED for r in ran)
    # its cache really is a cache: one repack per change, none without
    assert all(r.repacks_after_change == 1 and r.repacks_without_change == 0 for r in ran)


def test_cache_audit_passes_the_uncached_layer_without_pack_counts():
    report = audit_weight_cache(UNCACHED_LAYER, config=TINY, routes=("param_data_copy", "inference_mode"))
    assert report.ok and not report.has_cache and not report.measures_packs, report.summary()
    assert NOT_MEASURED in report.summary()
    assert all(r.status == DETECTED and r.repacks_after_change is None for r in report.results)


class _RenamedDownMoE(OutsideMoE):
    """Keeps W_down as ``w2``, mapped to the released name in its state dict both ways."""

    def __init__(self, config, state_dict):
        super().__init__(config, state_dict, ContentCheckedCache())
        self.w2 = self._parameters.pop("W_down")
        self.register_state_dict_post_hook(self._released_names)
        self.register_load_state_dict_pre_hook(self._own_names)

    def expert_params(self):
        return self.W_gate, self.W_up, self.w2

    @staticmethod
    def _released_names(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "W_down"] = state_dict.pop(prefix + "w2")

    @staticmethod
    def _own_names(module, state_dict, prefix, *args):
        if prefix + "W_down" in state_dict:
            state_dict[prefix + "w2"] = state_dict.pop(prefix + "W_down")


def test_a_parameter_under_another_name_is_not_applicable():
    report = audit_weight_cache(lambda cfg, sd, dev: _RenamedDownMoE(cfg, sd), config=TINY,
                                routes=("param_data_copy", "load_assign"))
    assert report.ok, report.summary()
    status = {(r.route, r.parameter): r.status for r in report.results}
    assert status[("param_data_copy", "W_down")] == NOT_APPLICABLE
    assert status[("param_data_copy", "W_gate")] == DETECTED
    assert status[("load_assign", "all")] == DETECTED  # released names still load


# -- the weight-swap state machine -------------------------------------------------------------

def test_state_machine_catches_the_version_keyed_layer():
    machine = weight_swap_machine(VERSION_KEYED_LAYER, config=TINY)
    with pytest.raises((AssertionError, Flaky)) as caught:
        run_state_machine_as_test(machine, settings=quick(12, stateful_step_count=20))
    text = chain_text(caught.value)
    assert "does not match the reference on the current weights" in text, text[:2000]


@pytest.mark.parametrize("impl", [CONTENT_CHECKED_LAYER, UNCACHED_LAYER], ids=lambda i: i.name)
def test_state_machine_passes_the_correct_layers(impl: Implementation):
    machine = weight_swap_machine(impl, config=TINY)
    run_state_machine_as_test(machine, settings=quick(12, stateful_step_count=20))


# -- python -m audit's cache section --------------------------------------------------------------

@pytest.fixture
def restore_registry():
    """Implementations named as ``package.module:attr`` get registered: undo that afterwards."""
    from magi_moe import registry
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_audit_report_audits_the_outside_layers(tmp_path, restore_registry):
    from magi_moe.audit.report import FAIL, PASS, SKIP, Audit, AuditOptions

    names = [f"magi_moe.tests.outside_broken:{attr}" for attr in
             ("VERSION_KEYED_LAYER", "CONTENT_CHECKED_LAYER", "UNCACHED_LAYER")]
    with open(tmp_path / "log.txt", "w") as log:
        audit = Audit(AuditOptions(impls=names, out=tmp_path), stream=log)
        audit.run_section("cache")
    rows = [r for r in audit.rows if r.section == "cache"]
    failed = {r.subject for r in rows if r.status == FAIL}
    assert failed == {f"{VERSION_KEYED_LAYER.name}: {route}/{p}"
                      for route in MISSED_BY_THE_KEY for p in EXPERT_PARAMS}
    passed = {r.subject.split(":")[0] for r in rows if r.status == PASS}
    assert passed == {VERSION_KEYED_LAYER.name, CONTENT_CHECKED_LAYER.name}
    # the uncached layer neither declares weight_cache nor shows a cache: not in this section
    assert not any(r.subject.startswith(UNCACHED_LAYER.name) for r in rows)
    assert all(r.status in (PASS, FAIL, SKIP) for r in rows)
