"""A new backend is one ``Backend`` entry: a fake one, registered for the test with values no real
backend has, is followed by every place that used to compare backend names -- the audit's
defaults (presets, tokens, determinism runs and inputs, layer presets, threads, process
variables), the fuzz campaign's size budget, device and child environment, and the order
defaults are picked in."""
from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

from magi_moe import backends
from magi_moe.backends import BACKENDS, Backend
from magi_moe.config import preset
from magi_moe.implementation import Implementation
from magi_moe.registry import get_implementation

VARIABLE = "FAKE_NPU_VISIBLE"

# Runs Triton on CPU tensors like the interpreter, with defaults unlike any real backend's.
FAKE = Backend("fake-npu", "cpu", True, "a fake accelerator (tests only)", lambda: None,
               runs_plain_pytorch=False, speed_rank=-1, process_env=(f"{VARIABLE}=1",),
               marker="runs on the fake accelerator", audit_presets=("tiny", "small"), audit_tokens=40,
               audit_determinism_runs=4, small_audit_inputs=False, audit_threads=2,
               fuzz_size_budget=5.0)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(BACKENDS, FAKE.name, FAKE)
    monkeypatch.setenv(VARIABLE, "0")  # unset again afterwards, whatever a run sets
    return FAKE


def _impl_on(backend: Backend) -> Implementation:
    """torch-bf16's arithmetic, declared on ``backend`` only."""
    return Implementation(f"bf16-on-{backend.name}", get_implementation("torch-bf16").forward,
                          (backend.name,), "bf16-plain")


def test_the_audit_defaults_follow_the_fields(fake):
    from magi_moe.audit.report import AuditOptions

    options = AuditOptions(backend=fake.name)
    assert options.resolved_presets() == ["tiny", "small"] and options.resolved_tokens() == 40
    assert AuditOptions(backend="cuda").resolved_tokens() == BACKENDS["cuda"].audit_tokens == 4096


def test_the_audit_sections_follow_the_fields(fake, monkeypatch):
    from magi_moe.audit.report import Audit, AuditOptions
    from magi_moe.audit.sections import determinism
    from magi_moe.audit.sections.layer_shapes import layer_config

    calls = []

    def recorded(impl, problem, *, runs, label=None):
        calls.append((problem.config, problem.num_tokens, runs))
        return types.SimpleNamespace(declared_deterministic=False, ok=True, differing=0, elements=1,
                                     max_abs_spread=0.0, to_dict=dict, label=label or impl.name)

    monkeypatch.setattr(determinism, "audit_determinism", recorded)
    small_inputs = dataclasses.replace(fake, name="fake-npu-small", small_audit_inputs=True)
    monkeypatch.setitem(BACKENDS, small_inputs.name, small_inputs)
    for backend, first_call, layer_preset in ((fake, (preset("tiny"), 40, 4), "small"),
                                              (small_inputs, (preset("tiny"), 64, 4), "tiny")):
        impl = _impl_on(backend)
        audit = Audit(AuditOptions(backend=backend.name, impls=[impl]))
        assert audit.runs_on(impl.name) == backend.name and audit.runnable_here(impl) is None
        calls.clear()
        rows = list(determinism.run(audit))
        assert calls[0] == first_call and "over 4 runs" in rows[0].result, (calls, rows)
        assert layer_config(audit, impl) == (preset(layer_preset), None)


def test_the_audit_command_follows_the_fields(fake, monkeypatch, tmp_path):
    import os

    from magi_moe.audit.cli import main
    from magi_moe.audit.report import Audit

    seen = {}

    def run(audit):
        seen.update(threads=torch.get_num_threads(), variable=os.environ.get(VARIABLE),
                    tokens=audit.options.resolved_tokens())
        return 0

    monkeypatch.setattr(Audit, "run", run)
    # as in a fresh process: once kernels are decorated, the process's flags stay as they are
    monkeypatch.delitem(sys.modules, "magi_moe.kernels", raising=False)
    threads = torch.get_num_threads()
    assert main(["--backend", fake.name, "--out", str(tmp_path)]) == 0
    assert seen == {"threads": 2, "variable": "1", "tokens": 40}
    assert torch.get_num_threads() == threads


def test_the_fuzz_campaign_follows_the_fields(fake, tmp_path):
    from magi_moe.fuzz.campaign import _parser, build_pytest_command

    def command(*options):
        args = _parser().parse_args(["--backend", fake.name, *options])
        cmd = build_pytest_command(args, backend=fake.name, out=tmp_path, start=0.0, seed=1, gpus=0)
        return cmd[cmd.index("--fuzz-size-budget") + 1], cmd[cmd.index("--fuzz-device") + 1]

    assert command() == ("5.0", "cpu")
    assert command("--profile", "ci") == ("1.0", "cpu")  # the ci profile's budget wins
    assert command("--size-budget", "3") == ("3.0", "cpu")


def test_child_processes_get_their_backends_variables(fake, monkeypatch):
    from magi_moe.fuzz.huge import child_env

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mine = child_env(fake.name)
    assert mine[VARIABLE] == "1" and "TRITON_INTERPRET" not in mine
    monkeypatch.setenv(VARIABLE, "1")
    interpreted = child_env("interpret")
    assert interpreted["TRITON_INTERPRET"] == "1" and VARIABLE not in interpreted
    assert fake.env_prefix() == f"{VARIABLE}=1 "


def test_the_process_flag_stays_once_the_kernels_are_decorated(monkeypatch):
    """An in-process audit or replay for the interpreter, after compiled kernels were imported,
    had set TRITON_INTERPRET: kernels decorated later were interpreted and could not call the
    earlier ones (a self-check "Cannot call @triton.jit'd outside of the scope of a kernel")."""
    pytest.importorskip("triton")
    import magi_moe.kernels  # noqa: F401  (decorated now, whichever way this process started)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    BACKENDS["interpret"].enable_here()
    assert "TRITON_INTERPRET" not in os.environ
    assert BACKENDS["interpret"].skip_reason() is not None  # and the backend says why
    child = {}
    BACKENDS["interpret"].enable_here(child)  # another process's environment is still set
    assert child == {"TRITON_INTERPRET": "1"}


def test_defaults_are_picked_by_speed(fake):
    assert backends.by_speed()[0] is fake
    assert backends.default_backend() is fake  # usable, runs kernels, fastest
    slow = dataclasses.replace(fake, speed_rank=99)
    BACKENDS[fake.name] = slow
    assert backends.by_speed(kernels_first=True)[-2:] == [slow, BACKENDS["cpu"]]
    assert _impl_on(slow).backend_on(torch.device("cpu")) == slow.name  # the one it declares
