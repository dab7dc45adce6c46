"""Weight-version swaps (fuzz.stateful) against the cache protocol.

The toy snapshot cache (tests/fuzz_broken.py) must pass; implementations that declare a weight
cache (the fused path) run the same machine on their own layer, ``impl.layer(config,
state_dict, device)``. The stale toy cache being caught is in tests/test_fuzz_broken.py; outside
layers with their own caches are in tests/test_outside_layers.py."""
from __future__ import annotations

import pytest

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from magi_moe.fuzz import fuzzers, profiles
from magi_moe.fuzz.stateful import (AUDIT_ROUTES, CHANGES, EXPERT_PARAMS, layer_factory_for,
                           sweep_routes, weight_swap_machine)
from magi_moe.config import preset
try:  # the toy caches live beside Triton kernels; the machine on an implementation's own layer
    from magi_moe.tests.fuzz_broken import snapshot_cache_layer  # (test_weight_swaps) needs none
except ImportError:  # the [test] extra without [triton]
    snapshot_cache_layer = None
needs_toy = pytest.mark.skipif(snapshot_cache_layer is None, reason="needs triton (the [triton] extra)")

CONFIG = preset("tiny")
# What each cache packs (a change elsewhere must not repack): the fused bank holds gate and up.
PACKED = {"fused": ("W_gate", "W_up")}

if snapshot_cache_layer is not None:
    TestSnapshotCacheSwaps = weight_swap_machine(snapshot_cache_layer, config=CONFIG).TestCase
    # The correct toy cache, ten steps a run (the stale one's control, tests/test_fuzz_broken.py,
    # runs twenty): every step rebuilds and checks the layer, 0.1 s each on the CPU.
    TestSnapshotCacheSwaps.settings = settings(profiles.examples(1.0), stateful_step_count=10)


@fuzzers.campaign_target
@pytest.mark.needs("weight_cache")
@pytest.mark.clause("weight-swaps")
def test_weight_swaps(impl_backend):
    """Every way weights change (CONTRACT section 5) in random order on the implementation's own
    layer, each forward against the float64 reference of the current weights."""
    target = fuzzers.pytest_target(impl_backend, "differential")
    machine = weight_swap_machine(layer_factory_for(target.impl), config=CONFIG, device=target.device,
                                  packed=PACKED.get(target.impl.name, EXPERT_PARAMS))
    sweep_routes(machine)  # every route once, judged: whatever the round's size
    run_state_machine_as_test(machine, settings=weight_swap_settings())


# Hypothesis's first example of a run is its simplest, which changes nothing worth judging: on a
# cache keyed on data_ptr() a run of two examples caught the stale weights 7 times in 12, a run of
# four 11 in 12. A campaign's first round (one example) once ran two and passed such a cache.
WEIGHT_SWAP_EXAMPLES = 4


def weight_swap_settings() -> settings:
    """Half the loaded profile's examples, at least four (ten steps each, about a second on the CPU)."""
    return settings(profiles.examples(0.5, at_least=WEIGHT_SWAP_EXAMPLES), stateful_step_count=10)


def test_a_campaigns_first_round_runs_enough_weight_swap_examples():
    from hypothesis.errors import InvalidArgument

    previous = settings.get_current_profile_name()
    try:
        campaign = settings.get_profile("campaign")
    except InvalidArgument:  # not registered in this process
        campaign = None
    settings.register_profile("campaign", max_examples=1)  # a campaign's first round
    settings.load_profile("campaign")
    try:
        assert weight_swap_settings().max_examples == WEIGHT_SWAP_EXAMPLES
    finally:
        if campaign is not None:
            settings.register_profile("campaign", campaign)
        settings.load_profile(previous)


@needs_toy
def test_machine_rejects_bad_arguments():
    with pytest.raises(TypeError, match="make_layer"):
        weight_swap_machine(None, config=CONFIG)
    with pytest.raises(ValueError, match="implementation must be"):
        weight_swap_machine("no-such-impl", config=CONFIG)
    with pytest.raises(TypeError, match="config"):
        weight_swap_machine(snapshot_cache_layer, config="tiny")
    with pytest.raises(ValueError, match="packed"):
        weight_swap_machine(snapshot_cache_layer, config=CONFIG, packed=("W_nope",))
    with pytest.raises(ValueError, match="precision model must be"):
        weight_swap_machine(snapshot_cache_layer, config=CONFIG, precision="fp8")


@needs_toy
def test_every_spec_change_route_is_a_rule():
    machine = weight_swap_machine(snapshot_cache_layer, config=CONFIG)
    rules = {r.function.__name__ for r in machine.setup_state().rules}
    assert rules == {f"change_{how}" for how in CHANGES} | {"invalidate", "forward"}
    for how in CHANGES:
        assert callable(getattr(machine, f"_{how}", None)), how


def test_layer_factory_builds_the_implementations_own_layer():
    from magi_moe.audit.cache import ROUTES, draw_state
    make = layer_factory_for("reference")
    layer = make(CONFIG, draw_state(CONFIG, 0, "cpu"), "cpu")
    assert type(layer).__name__ == "MagiMoE" and layer.impl.name == "reference"
    assert set(AUDIT_ROUTES) <= set(CHANGES) and set(AUDIT_ROUTES.values()) <= set(ROUTES)


# -- serving streams (fuzz.serving): the history clause's campaign target -------------------------
@fuzzers.campaign_target
@pytest.mark.slow  # the quick tier's history rows are tests/test_history.py's few-step streams
@pytest.mark.clause("history")
def test_serving_stream(impl_backend, request):
    """Longer serving streams on the implementation's own layer and its kernel entry, token
    counts up to the loaded profile's size budget (campaigns: their --size-budget)."""
    from magi_moe.fuzz.serving import (layer_judged_elsewhere, serving_kernel_machine,
                                       serving_layer_machine)

    target = fuzzers.pytest_target(impl_backend, "differential")
    config, device = target.impl.fit(CONFIG), target.device  # sizes: fuzz.serving.stream_budget
    steps = settings(profiles.examples(0.25), stateful_step_count=8)
    run_state_machine_as_test(serving_kernel_machine(target.impl, config=config, device=device),
                              settings=steps)
    if layer_judged_elsewhere(target.impl, target.backend.name) and not request.config.getoption("--impl"):
        return
    run_state_machine_as_test(serving_layer_machine(target.impl, config=config, device=device,
                                                    packed=PACKED.get(target.impl.name, EXPERT_PARAMS)),
                              settings=steps)



def test_the_route_sweep_judges_a_stale_cache_whatever_the_round_size():
    """A 90 s campaign once passed a layer whose packed cache was keyed on data_ptr(): its
    weight-swap round ran four examples, the first Hypothesis's simplest (no step)."""
    from magi_moe.tests import outside_broken

    sweep_routes(weight_swap_machine(layer_factory_for(outside_broken.CONTENT_CHECKED_LAYER), config=CONFIG))
    stale = weight_swap_machine(layer_factory_for(outside_broken.VERSION_KEYED_LAYER), config=CONFIG)
    with pytest.raises(AssertionError, match="does not match the reference on the current weights"):
        sweep_routes(stale)
