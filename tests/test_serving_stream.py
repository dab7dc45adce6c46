"""The serving-stream machines (fuzz/serving.py) and the ``history`` clause's checks
catch each planted bug of tests/history_broken.py, and the printed one-line replay fails again
on the broken variant and passes on the correct one: (a) the fused layer's launch plan memoised
without the token count (the interpreter), (b) a plain-PyTorch workspace sized by the first
call (the CPU), (c) a captured graph whose NaN padding rows reach the real rows (CUDA only).
The correct counterparts pass the same streams in tests/test_history.py's rows."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from magi_moe.config import preset
from magi_moe.fuzz import serving_replay
from magi_moe.fuzz.serving import (REPLAY_COMMAND, drive, growing_steps, record_for,
                                   serving_kernel_machine, serving_layer_machine)
from magi_moe.tests import history_broken as broken
from magi_moe.tests.exception_chains import chain_text

CONFIG = preset("tiny")
KEPT = "kept from an earlier call"  # the kernel machine's words for a wrong call
STALE = "does not match the reference on the current weights"  # the layer machine's


def quick(examples: int, **kw) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), **kw)


def replay_line(exc: BaseException) -> str:
    """The replay line a failing step's note printed (the last: Hypothesis' shrunk run)."""
    notes = [n for n in getattr(exc, "__notes__", ()) if REPLAY_COMMAND in n]
    assert notes, f"no replay line in the notes of {exc!r}"
    return notes[-1].split("reproduce: ", 1)[1]


def replay_in_process(line: str) -> int:
    argv = shlex.split(line)
    assert argv[:3] == REPLAY_COMMAND.split(), line
    before = dict(os.environ)  # the replay sets its backend's flag for the process it runs in
    try:
        return serving_replay.main(argv[3:])
    finally:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def no_cached_workspaces():
    broken.forget_plans()
    yield
    broken.forget_plans()


def test_a_workspace_sized_by_the_first_call_is_caught_on_the_kernel_entry(no_cached_workspaces):
    machine = serving_kernel_machine(broken.stale_plan_torch, config=CONFIG)
    with pytest.raises(AssertionError, match=KEPT) as caught:
        drive(machine, 0, growing_steps(machine))
    line = replay_line(caught.value)
    broken.forget_plans()
    assert replay_in_process(line) == 1  # the printed line fails again
    record = json.loads(shlex.split(line)[3])
    assert replay_in_process(f"{REPLAY_COMMAND} "
                             f"{shlex.quote(json.dumps(record | {'subject': 'torch-bf16'}))}") == 0


def test_a_workspace_sized_by_the_first_call_is_caught_in_a_random_layer_stream(no_cached_workspaces):
    machine = serving_layer_machine(broken.stale_plan_torch, config=CONFIG)
    with pytest.raises((AssertionError, Flaky)) as caught:
        run_state_machine_as_test(machine, settings=quick(10, stateful_step_count=6))
    assert STALE in chain_text(caught.value), chain_text(caught.value)[:2000]
    broken.forget_plans()
    assert replay_in_process(replay_line(caught.value)) == 1  # the shrunk stream fails again


def run_replay(record: dict) -> subprocess.CompletedProcess:
    """The replay command in a child process, as a person would paste it."""
    argv = [sys.executable, *shlex.split(REPLAY_COMMAND)[1:], json.dumps(record)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # two child processes under the interpreter, about ten seconds each
def test_the_fused_layers_plan_memoised_without_the_token_count_is_caught():
    """(a): a larger second call with the same weights runs on the first call's buffers; under
    the interpreter that reads and writes past them (wrong rows, or a segfault: hence a child
    process), and the same stream passes on the correct fused layer."""
    pytest.importorskip("triton", reason="needs triton (the [triton] extra)")
    machine = serving_layer_machine(broken.fused_layer_with_memoised_plan, config=CONFIG)
    record = record_for(machine, 0, growing_steps(machine))
    caught = run_replay(record)
    assert caught.returncode != 0 and "PASS" not in caught.stdout, caught.stdout + caught.stderr
    fine = run_replay(record | {"subject": "fused"})
    assert fine.returncode == 0 and "PASS" in fine.stdout, fine.stdout + fine.stderr


@pytest.mark.cuda
def test_nan_padding_leaking_into_real_rows_of_a_replayed_graph_is_caught():
    """(c): a graph captured at a bucket and replayed with fewer real rows and NaN padding."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    steps = [["forward", 16, 0], ["graph", 64, 33, 1]]
    correct = serving_layer_machine("fused", config=CONFIG, device="cuda")
    drive(correct, 0, steps)
    machine = serving_layer_machine(broken.graph_padding_leak_layer, config=CONFIG, device="cuda")
    with pytest.raises(AssertionError, match=STALE) as caught:
        drive(machine, 0, steps)
    assert "NaN padding" in str(caught.value) and REPLAY_COMMAND in replay_line(caught.value)


@pytest.mark.slow  # two child processes, a few seconds each
def test_the_printed_replay_line_runs_as_a_command(no_cached_workspaces):
    machine = serving_kernel_machine(broken.stale_plan_torch, config=CONFIG)
    with pytest.raises(AssertionError) as caught:
        drive(machine, 0, growing_steps(machine))
    argv = [sys.executable, *shlex.split(replay_line(caught.value))[1:]]
    failed = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1 and "FAIL" in failed.stdout, failed.stdout + failed.stderr
    passed = run_replay(json.loads(argv[-1]) | {"subject": "torch-bf16"})
    assert passed.returncode == 0 and "PASS" in passed.stdout, passed.stdout + passed.stderr


def test_replay_refuses_a_record_that_is_not_one(capsys):
    with pytest.raises(SystemExit):
        serving_replay.main(["not json"])
    assert "RECORD must be" in capsys.readouterr().err
    assert serving_replay.main([json.dumps({"machine": "layer"})]) == serving_replay.REPLAY_UNAVAILABLE


def test_the_machines_have_every_rule_and_the_edges_that_matter():
    from magi_moe.fuzz.serving import edge_token_counts, growing_stream
    from magi_moe.fuzz.stateful import CHANGES
    from magi_moe.impls import FUSED, TORCH_BF16

    layer = serving_layer_machine("torch-bf16", config=CONFIG)
    rules = {r.function.__name__ for r in layer.setup_state().rules}
    assert rules == {f"change_{how}" for how in CHANGES} | {
        "invalidate", "forward", "stream", "forward_dirty", "graph_replay"}
    kernel = serving_kernel_machine("torch-bf16", config=CONFIG)
    assert {r.function.__name__ for r in kernel.setup_state().rules} == {"call", "stream", "call_dirty"}
    edges = edge_token_counts(CONFIG, 5000, impl=TORCH_BF16)
    assert {4095, 4096, 4097, 127, 128, 129} <= set(edges) and max(edges) <= 5000
    assert {4095, 4096, 4097} <= set(growing_stream(edges))
    fused = set(edge_token_counts(CONFIG, 200, impl=FUSED))  # the interpreter's row blocks
    assert {47, 48, 49, 191, 192, 193} <= fused - set(edges)


def test_bad_arguments_are_refused_naming_them():
    from magi_moe.fuzz.serving import edge_token_counts

    with pytest.raises(ValueError, match="max_tokens"):
        edge_token_counts(CONFIG, 0)
    with pytest.raises(TypeError, match="config"):
        serving_kernel_machine("torch-bf16", config="tiny")
    with pytest.raises(TypeError, match="config"):
        serving_layer_machine("torch-bf16", config="tiny")
    with pytest.raises(ValueError, match="implementation must be"):
        serving_kernel_machine("no-such-impl", config=CONFIG)


def _everywhere_wrong():
    """A kernel off by half on every call, its first included: inaccurate, with no history."""
    import dataclasses

    from magi_moe.examples.kernel import IMPL, loop_forward

    def half_again(x, table, weights, config, *, out):
        return loop_forward(x, table, weights, config, out=out).mul_(1.5)

    return dataclasses.replace(IMPL, name="everywhere-wrong", forward=half_again)


def test_a_first_call_already_wrong_counts_under_accuracy_not_history():
    """A kernel wrong on every call once failed the history row too ("after [built from a state
    dict]"): one root cause, two FAIL rows. The first call has no earlier call to blame: the
    kernel entry's counts under accuracy, the layer's ends as NOT RUN (the clauses that judge a
    fresh layer report it: accuracy here, routing for a wrong router, checkpoint for a wrong
    mapping)."""
    from magi_moe.judge import Inaccurate
    from magi_moe.verdict import INACCURATE, LayerWrongOnItsOwn, cause_of

    wrong = _everywhere_wrong()
    machine = serving_kernel_machine(wrong, config=CONFIG)
    with pytest.raises(Inaccurate, match="call 1 .*the first call") as caught:
        drive(machine, 0, growing_steps(machine))
    assert cause_of(caught.value) == INACCURATE
    machine = serving_layer_machine(wrong, config=CONFIG)
    with pytest.raises(LayerWrongOnItsOwn, match="the layer's first call"):
        drive(machine, 0, growing_steps(machine))
