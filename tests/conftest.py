"""Fixtures of the suite. The implementation matrix (``--impl``, ``--backend``,
``impl_backend``, the ``needs``/``kernels_only`` markers) and the no-vacuous-green rule come from
magi-moe's pytest plugin (:mod:`magi_moe.pytest_plugin`): an installed wheel registers it as a
``pytest11`` entry point, and a plain checkout loads it here.
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels can only be tested under the interpreter, which must be on
# before any kernel module is imported (CONTRACT section 8): switch it on here, so a plain
# `pytest` on a CPU machine tests the kernels instead of skipping them. An explicit
# TRITON_INTERPRET (0 included) is left as it is; then the plugin fails a run that tested no
# kernel at all.
if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from magi_moe.backends import BACKENDS
from magi_moe.implementation import Implementation
from magi_moe.impls import BASELINE, REFERENCE

pytest_plugins = ["magi_moe.pytest_plugin"]

try:  # Hypothesis profiles (ci / dev / nightly): --hypothesis-profile, else $HYPOTHESIS_PROFILE, else ci
    from magi_moe.fuzz.profiles import load_default_profile
except ImportError:  # the fuzz package is optional for the core suite
    load_default_profile = None


# Tests and rows of the implementation matrix measured at over six seconds each on the 2-core CI
# machine (--durations, idle): the slow tier, like the tests marked slow in their own files. Each
# clause keeps quicker rows of the same implementation in the quick tier (fused@interpret's
# determinism: test_deterministic_mode_is_bitwise_repeatable; int64 offsets:
# test_every_fused_kernel_addresses_rows_past_2_31).
SLOW_ROWS = (
    # child pytest runs, 7-9 s each
    "test_audit_extra.py::test_the_audit_runs_with_only_the_audit_extra",  # a child audit, 8 s
    "test_vacuous_runs.py::test_a_run_that_tested_something_passes",
    "test_vacuous_runs.py::test_a_plain_run_without_a_gpu_tests_the_kernels",
    "test_vacuous_runs.py::test_a_whole_run_that_tested_no_kernel_fails",
    "test_fuzz_profiles.py::test_plain_pytest_has_no_deadline",
    "test_router_judge.py::test_conformance_run_fails_an_outside_router_that_forgets_the_l1_normalisation",
    "test_usage_errors.py::test_a_bare_pytest_loads_the_teams_module_from_its_directory",
    # negative controls: planted int32 offsets, 7-8 s each; the SASS inspection, 8 s
    "test_fused_offsets.py::test_an_int32_offset_planted_in_a_fused_kernel_is_caught",
    "test_inspect_kernel.py::test_the_plain_one_kernel_loop_is_one_warpgroup_of_mmas_without_spills",
    "test_outside_broken_kernels.py::test_fixed_cases_outside_the_declared_shapes_run_at_the_nearest_accepted_widths",
    "test_fuzz_properties.py::test_property[huge_offsets-torch-bf16@cpu]",  # 28 s: a child process
    "test_fuzz_properties.py::test_property[deterministic-fused@interpret]",  # 16 s
    "test_fuzz_properties.py::test_property[empty_experts-fused@interpret]",  # 11 s
    "test_fuzz_stateful.py::test_weight_swaps[fused@interpret]",  # 18 s
    "test_implementations.py::test_production_widths_with_few_routed_tokens[native-det@interpret]",
    "test_implementations.py::test_production_widths_with_few_routed_tokens[native@interpret]",
    "test_implementations.py::test_random_problems[fused@interpret-small-softmax-103]",  # 10 s
    "test_outside_impl.py::test_protocol_deterministic_reruns_are_bitwise_equal[fused@interpret]",
    "test_outside_impl.py::test_protocol_deterministic_reruns_are_bitwise_equal[native-det@interpret]",
    "test_packed_weights.py::test_layer_output_follows_every_change_route[interpret]",  # 11 s
    "test_parallel.py::test_every_rank_on_one_device_equals_one_process_bitwise[interpret-w2-softmax-fused]",
    # 6-9 s each under -n 2 (--durations): each clause keeps a quicker fused@interpret row
    # (differential and locality: test_random_problems, linearity; the five-heads EP case:
    # w2-small-fused; the descriptor fallback: test_plan's and test_tile_entries' rows; routers:
    # their conformance rows)
    "test_fuzz_properties.py::test_property[differential-fused@interpret]",
    "test_fuzz_properties.py::test_property[token_permutation-fused@interpret]",
    "test_fuzz_properties.py::test_property[head_locality-fused@interpret]",
    "test_implementations.py::test_production_widths_with_few_routed_tokens[fused@interpret]",
    "test_parallel.py::test_every_rank_on_one_device_equals_one_process_bitwise[interpret-w3-five-heads-fused]",
    "test_fused.py::test_the_one_kernel_step_falls_back_on_unaligned_weights[interpret]",
    "test_router_judge.py::test_the_audit_routing_section_passes_the_example_and_the_fused_router",
    "test_router_judge.py::test_the_example_and_magi_moes_routers_pass_the_conformance_test[interpret-softmax-norm]",
    "test_outside_impl.py::test_protocol_matches_the_oracle[fused@interpret-float16]",
    # 3-6 s each, each a second quick row of its clause for the same kernel:
    # int64 addressing of the fused kernels (test_fused_offsets runs every fused kernel past
    # 2^31), native-det's shared native kernel (its determinism, accuracy and offset rows stay),
    # planted-bug controls of the fuzzers, the benchmark's older module name
    "test_fused.py::test_int64_offsets_past_2_31[interpret]",
    "test_fuzz_properties.py::test_property[huge_offsets-fused@interpret]",
    "test_fuzz_properties.py::test_property[deterministic-native-det@interpret]",
    "test_fuzz_properties.py::test_property[differential-native-det@interpret]",
    "test_implementations.py::test_random_problems[native-det@interpret-small-softmax-103]",
    "test_outside_impl.py::test_protocol_matches_the_oracle[native-det@interpret-float32]",
    "test_outside_impl.py::test_protocol_matches_the_oracle[native-det@interpret-float16]",
    "test_fuzz_broken.py::test_int32_offsets_are_invisible_below_the_boundary",
    "test_fuzz_broken.py::test_stale_weight_cache_is_caught_by_the_weight_swap_machine",
    # random serving streams on interpreted kernels (each keeps its fixed growing streams quick)
    "test_history.py::test_random_serving_streams[fused@interpret]",
    "test_history.py::test_random_serving_streams[native@interpret]",
    "test_history.py::test_random_serving_streams[native-det@interpret]",
    "test_benchmark_cli.py::test_no_gpu_is_refused_at_once_with_the_interpreter_command[magi_moe.benchmark]",
)


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.endswith(SLOW_ROWS) or item.nodeid.split("[")[0].endswith(SLOW_ROWS):
            item.add_marker(pytest.mark.slow)
    shard = slow_shard(os.environ.get("MAGI_MOE_SLOW_SHARD", ""))
    if shard is not None:
        owner = shard_owners(shard[1])
        keep, drop = [], []
        for item in items:
            in_shard = item.get_closest_marker("slow") is None or owner(item.nodeid) == shard[0]
            (keep if in_shard else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


# Seconds each slow test took (--durations, -n 2, the 2-core machine): the shards are balanced
# on these, longest first onto the least loaded shard; a test not listed goes by its id's hash.
SLOW_SECONDS = Path(__file__).with_name("slow_tier_seconds.txt")


def shard_owners(n: int):
    """``nodeid -> shard`` for ``n`` shards of the slow tier."""
    measured = []
    if SLOW_SECONDS.exists():
        for line in SLOW_SECONDS.read_text().splitlines():
            seconds, _, nodeid = line.partition(" ")
            if nodeid:
                measured.append((float(seconds), nodeid))
    load, owners = [0.0] * n, {}
    for seconds, nodeid in sorted(measured, key=lambda m: (-m[0], m[1])):
        owners[nodeid] = i = min(range(n), key=lambda k: (load[k], k))
        load[i] += seconds

    def owner(nodeid: str) -> int:
        path, sep, rest = nodeid.partition("::")  # listed by file name: checkout or installed
        key = Path(path).name + sep + rest
        return owners.get(key, zlib.crc32(key.encode()) % n)
    return owner


def slow_shard(spec: str) -> tuple[int, int] | None:
    """``MAGI_MOE_SLOW_SHARD=i/n``: keep only the slow tests of shard ``i`` of ``n``
    (:func:`shard_owners`; CI runs one shard a commit, in turn; ``tox -e slow`` runs them all).
    Empty: no shard."""
    if not spec:
        return None
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise pytest.UsageError(f"MAGI_MOE_SLOW_SHARD must be i/n with 0 <= i < n, got {spec!r}")
    return i, n


def pytest_configure(config):
    config.addinivalue_line("markers", "clause(name): the contract clause a conformance test judges")
    if load_default_profile is not None:
        try:
            load_default_profile(config.getoption("--hypothesis-profile", default=None))
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None


@pytest.fixture(scope="session")
def reference_impl() -> Implementation:
    return REFERENCE


@pytest.fixture(scope="session")
def baseline_impl() -> Implementation:
    return BASELINE


@pytest.fixture
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device("cuda")


@pytest.fixture(params=[pytest.param("interpret", marks=pytest.mark.interpret),
                        pytest.param("cuda", marks=pytest.mark.cuda)])
def triton_device(request) -> torch.device:
    """Each backend that runs Triton kernels; skipped with the reason where it is missing."""
    why = BACKENDS[request.param].unavailable_reason()
    if why:
        pytest.skip(f"backend {request.param} unavailable: {why}")
    return torch.device(BACKENDS[request.param].device)


@pytest.fixture
def single_thread():
    """Many small float64 ops: one torch thread avoids oversubscribing the 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
