"""Each deliberately broken variant (tests/fuzz_broken.py) is caught by the fuzzer built for it,
within the per-commit budget, and its correct counterpart passes the same search.

The searches run derandomised with a fixed, small example count and no shrinking (the first
failing example is enough to show the catch; campaigns shrink)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from magi_moe.fuzz import fuzzers
from magi_moe.fuzz.cases import HugeCase, first_overflowing_token
from magi_moe.fuzz.properties import check_huge_offsets, make_target
from magi_moe.fuzz.record import PropertyViolation
from magi_moe.fuzz.stateful import weight_swap_machine
from magi_moe.backends import triton_installed
from magi_moe.config import preset
from magi_moe.tests import fuzz_broken as broken
from magi_moe.tests.exception_chains import chain_text


def quick(examples: int, **kw) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), **kw)


def test_wrong_tie_order_is_caught_by_the_tie_fuzzer():
    with pytest.raises(PropertyViolation, match="ties must go to the lower index") as caught:
        fuzzers.search("tie_rule", "magi_moe.tests.fuzz_broken:route_ties_to_higher_index", settings=quick(8))
    assert "python -m fuzz replay" in str(caught.value)
    fuzzers.search("tie_rule", "magi_moe.routing:route", settings=quick(8))  # the real router passes


def test_empty_expert_garbage_is_caught_by_the_empty_expert_fuzzer():
    target = make_target(broken.empty_expert_garbage, "cpu", spec="magi_moe.tests.fuzz_broken:empty_expert_garbage")
    with pytest.raises(PropertyViolation, match="empty_experts violated") as caught:
        fuzzers.search("empty_experts", target, settings=quick(8))
    assert caught.value.record["impl"] == "magi_moe.tests.fuzz_broken:empty_expert_garbage"
    fuzzers.search("empty_experts", make_target("torch-bf16", "cpu"), settings=quick(8))


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_int32_offsets_are_caught_by_the_huge_fuzzer():
    """Runs in child processes with TRITON_INTERPRET=1, whatever this process has."""
    target = make_target(broken.int32_offsets, "interpret", spec="magi_moe.tests.fuzz_broken:int32_offsets")
    with pytest.raises(PropertyViolation, match="SIGSEGV") as caught:
        fuzzers.search("huge_offsets", target, settings=quick(1))
    case = caught.value.record["case"]
    from magi_moe.fuzz.cases import case_from_dict
    # The same case passes through the real (int64) native kernel.
    check_huge_offsets(make_target("native", "interpret"), case_from_dict(case))


def test_int32_offsets_are_invisible_below_the_boundary():
    """Why the huge fuzzer exists: the same broken kernel is right when token*stride < 2^31."""
    if not triton_installed():
        pytest.skip("triton is not installed")
    cfg = preset("tiny")
    case = HugeCase(cfg, first_overflowing_token(cfg) - 1, (0, 5, 1000), seed=2)
    target = make_target(broken.int32_offsets, "interpret", spec="magi_moe.tests.fuzz_broken:int32_offsets")
    check_huge_offsets(target, case)


def test_stale_weight_cache_is_caught_by_the_weight_swap_machine():
    machine = weight_swap_machine(broken.stale_cache_layer, config=preset("tiny"))
    with pytest.raises((AssertionError, Flaky)) as caught:
        run_state_machine_as_test(machine, settings=quick(12, stateful_step_count=20))
    text = chain_text(caught.value)
    assert "does not match the reference on the current weights" in text, text[:2000]


def test_snapshot_cache_passes_the_same_search():
    machine = weight_swap_machine(broken.snapshot_cache_layer, config=preset("tiny"))
    run_state_machine_as_test(machine, settings=quick(12, stateful_step_count=20))

