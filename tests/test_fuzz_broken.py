"""Every fuzz property catches the deliberately broken variant built for it (tests/fuzz_broken.py)
through its record (fuzz.fuzzers.PROPERTIES), within the per-commit budget: the search fails with
the property's own message and a one-line replay, the record it prints fails again when rerun,
and the same record passes on the correct counterpart, as does the whole search. A property
without an entry in CATCHES fails test_every_property_has_a_broken_variant: each record's check
is shown to be able to fail.

The searches run derandomised with a fixed, small example count and no shrinking (the first
failing example is enough to show the catch; campaigns shrink)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from magi_moe.fuzz import fuzzers
from magi_moe.fuzz.cases import HugeCase, TieCase, case_from_dict, first_overflowing_token
from magi_moe.fuzz.properties import check_huge_offsets, make_target
from magi_moe.fuzz.record import PropertyViolation
from magi_moe.fuzz.stateful import weight_swap_machine
from magi_moe.backends import BACKENDS, triton_installed
from magi_moe.config import preset
from magi_moe.tests import fuzz_broken as broken
from magi_moe.tests.exception_chains import chain_text

BROKEN = "magi_moe.tests.fuzz_broken"


def quick(examples: int, **kw) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), **kw)


@dataclass(frozen=True)
class Catch:
    """A property's broken variant (``package.module:attr``; a router for the tie rule), what
    its violation says, and the correct counterpart that must pass the same search."""

    broken: str
    says: str
    correct: str
    backend: str = "cpu"
    examples: int = 8


CATCHES = {
    "differential": Catch(f"{BROKEN}:drops_last_token", "FAILED on (bounds|baseline|faithfulness)",
                          "torch-bf16"),
    "tie_rule": Catch(f"{BROKEN}:route_ties_to_higher_index", "ties must go to the lower index",
                      "magi_moe.routing:route"),
    "routing": Catch("magi_moe.tests.outside_broken:ROUTER_FORGETS_L1", "routes break l1_normalisation",
                     "magi_moe.tests.outside_impl_example:IMPL"),
    "token_permutation": Catch(f"{BROKEN}:writes_one_row_late", "permuting tokens did not permute",
                               "torch-bf16"),
    "head_locality": Catch(f"{BROKEN}:reads_next_head", "when only other heads' inputs", "torch-bf16"),
    "linearity": Catch(f"{BROKEN}:weight_applied_twice", "did not double the output", "torch-bf16"),
    # the other two row-isolation variants: tests/test_row_isolation.py
    "row_isolation": Catch("magi_moe.tests.isolation_broken:per_expert_scale",
                           "a poisoned row reached another token", "torch-bf16"),
    "empty_experts": Catch(f"{BROKEN}:empty_expert_garbage", "has no route", "torch-bf16"),
    "zero_tokens": Catch(f"{BROKEN}:no_routes_leaves_output_unwritten", "elements are NaN", "torch-bf16"),
    "deterministic": Catch("magi_moe.tests.outside_broken_kernels:WANDERING_SUM", "differs bitwise",
                           "reference", examples=20),
    # child processes with TRITON_INTERPRET=1, whatever this process has
    "huge_offsets": Catch(f"{BROKEN}:int32_offsets", "SIGSEGV", "native", backend="interpret", examples=1),
}


def test_every_property_has_a_broken_variant():
    assert set(CATCHES) == set(fuzzers.PROPERTIES), "give each property record a broken variant it catches"


def _rerun(prop: fuzzers.Property, record: dict) -> dict:
    """The check of a failure record, on the target, case and parameters it names."""
    return prop.run(prop.target_of(record), case_from_dict(record["case"]), record["params"])


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
@pytest.mark.parametrize("name", list(CATCHES))
def test_each_property_catches_its_broken_variant(name):
    prop, catch = fuzzers.PROPERTIES[name], CATCHES[name]
    if BACKENDS[catch.backend].runs_triton and not triton_installed():
        pytest.skip("triton is not installed")
    with pytest.raises(PropertyViolation, match=catch.says) as caught:
        fuzzers.search(prop, prop.on.load(catch.broken, catch.backend), settings=quick(catch.examples))
    record = caught.value.record
    assert str(caught.value).startswith(f"{name} violated by"), str(caught.value)
    assert "python -m magi_moe.fuzz replay" in str(caught.value)
    assert record["property"] == name and record[prop.on.record_key] == catch.broken
    with pytest.raises(PropertyViolation, match=catch.says):
        _rerun(prop, record)
    _rerun(prop, {**record, prop.on.record_key: catch.correct})  # the same case, done right
    fuzzers.search(prop, prop.on.load(catch.correct, catch.backend), settings=quick(catch.examples))


def test_tie_rule_holds_a_router_to_the_table_it_built_itself():
    """Right choices, wrong table: the tie rule's ranking passes, its table check does not. The
    nan-bias kind always makes head 0's last expert NaN (where a padded kernel keeps its
    sentinels); with K < E it is never picked and must hold no route."""
    prop = fuzzers.PROPERTIES["tie_rule"]
    case = TieCase(preset("tiny").replace(num_experts=16, top_k=2), 8, "nan-bias", seed=3)
    broken = prop.on.load(f"{BROKEN}:table_counts_unpicked_nan", "cpu")
    with pytest.raises(PropertyViolation, match="own route table is not the table of its "
                                                "choices: offsets differs first at index"):
        prop.run(broken, case, {})
    prop.run(prop.on.load("magi_moe.routing:route", "cpu"), case, {})  # no table: not asked


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


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
def test_snapshot_cache_passes_the_same_search():
    machine = weight_swap_machine(broken.snapshot_cache_layer, config=preset("tiny"))
    run_state_machine_as_test(machine, settings=quick(12, stateful_step_count=20))

