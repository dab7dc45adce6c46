"""Contract clause ``history`` (CONTRACT section 5): a call's result does not depend on earlier
calls on the same objects. Each implementation's own layer (``impl.layer``) and its kernel entry
(weights held fixed) serve a stream of calls whose token counts grow and shrink across the
edges where plans switch, with a weight change in between and rows of NaN in ``x``; every call's
real rows are judged against the float64 reference on the current weights (fuzz/serving.py).

Two tests a row: a fixed growing stream (no Hypothesis: the same calls each run) and a few
random streams of a few steps. A failure's message ends with the one-line replay of the stream
(``python -m magi_moe.fuzz.serving_replay '<json>'``). The planted bugs they catch are in
tests/test_serving_stream.py; the campaign's longer streams are tests/test_fuzz_stateful.py's
``test_serving_stream``.
"""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from magi_moe.config import preset
from magi_moe.fuzz import fuzzers, profiles
from magi_moe.fuzz.serving import (drive, growing_steps, layer_judged_elsewhere,
                                   serving_kernel_machine, serving_layer_machine)

CONFIG = preset("tiny")
# A random stream: a few steps (a step may be a stream of up to five calls) on tiny shapes.
STREAM_STEPS = 3


def _target(impl_backend):
    return fuzzers.pytest_target(impl_backend, "differential")


def _config(impl):
    return impl.fit(CONFIG)


def _layer_judged_elsewhere(target, request) -> None:
    """Named with --impl, every layer is judged here (fuzz.serving.layer_judged_elsewhere)."""
    why = layer_judged_elsewhere(target.impl, target.backend.name)
    if why and not request.config.getoption("--impl"):
        pytest.skip(f"{why} (name it with --impl to judge it here)")


@pytest.mark.clause("history")
def test_a_growing_stream_on_one_layer(impl_backend, request):
    target = _target(impl_backend)
    _layer_judged_elsewhere(target, request)
    machine = serving_layer_machine(target.impl, config=_config(target.impl), device=target.device)
    drive(machine, 0, growing_steps(machine))


@pytest.mark.clause("history")
def test_a_growing_stream_on_the_kernel_entry(impl_backend):
    target = _target(impl_backend)
    machine = serving_kernel_machine(target.impl, config=_config(target.impl), device=target.device)
    drive(machine, 0, growing_steps(machine))


@pytest.mark.clause("history")
def test_random_serving_streams(impl_backend, request):
    target = _target(impl_backend)
    config, quick = _config(target.impl), settings(profiles.examples(0.25),
                                                  stateful_step_count=STREAM_STEPS)
    run_state_machine_as_test(serving_kernel_machine(target.impl, config=config,
                                                     device=target.device), settings=quick)
    _layer_judged_elsewhere(target, request)
    run_state_machine_as_test(serving_layer_machine(target.impl, config=config,
                                                    device=target.device), settings=quick)



def test_the_audit_row_of_a_layer_wrong_from_its_first_call_is_not_run(tmp_path):
    """One root cause, one row: a kernel off by half on every row serves a wrong first call
    through its layer too. The audit's history row for the layer had been a FAIL beside the
    accuracy rows that report the kernel; it is NOT RUN (the clauses judging a fresh layer say
    it), and the kernel-entry row carries the accuracy cause."""
    import dataclasses

    from magi_moe.audit.report import Audit, AuditOptions
    from magi_moe.audit.rows import FAIL, INFO
    from magi_moe.audit.sections import history
    from magi_moe.examples.kernel import IMPL, loop_forward
    from magi_moe.verdict import INACCURATE, NOT_RUN, skip_kind

    def half_again(x, table, weights, config, *, out):
        return loop_forward(x, table, weights, config, out=out).mul_(1.5)

    impl = dataclasses.replace(IMPL, name="half-again", forward=half_again)
    audit = Audit(AuditOptions(backend="cpu", impls=[impl], tokens=16, out=tmp_path))
    rows = {r.subject.split(": ", 1)[1]: r for r in history.run(audit)}
    layer, kernel = rows["own layer (impl.layer)"], rows["kernel entry, weights held fixed"]
    assert layer.status == INFO and skip_kind(layer.skip) == NOT_RUN, layer
    assert "first call" in layer.result
    assert kernel.status == FAIL and kernel.cause == INACCURATE, kernel
