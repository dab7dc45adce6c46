"""``python -m magi_moe.bench`` (and its older name ``magi_moe.benchmark``) refuses at once, with the way out, where it cannot run, and
its table shows every name whole."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from magi_moe.bench.__main__ import CPU_SMOKE, cannot_run_here, format_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("module", ["magi_moe.bench", "magi_moe.benchmark"])
def test_no_gpu_is_refused_at_once_with_the_interpreter_command(module):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert done.returncode == 2, done.stderr
    assert "no CUDA GPU" in done.stderr and CPU_SMOKE in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert elapsed < 60, f"the refusal took {elapsed:.0f} s: it must come before any problem is drawn"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_explicit_cuda_without_a_gpu_names_the_option():
    why = cannot_run_here("cuda:0", ("fused",))
    assert why is not None and why.startswith("--device cuda:0: no CUDA GPU")


@pytest.mark.parametrize("device", ["tpu", "cuda-ish", "mps"])
def test_unknown_device_is_refused(device):
    assert cannot_run_here(device, ("fused",)) == f"--device must be cuda, cuda:N or cpu, got {device!r}"


def test_cpu_needs_the_interpreter_only_for_triton_paths(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = cannot_run_here("cpu", ("routing", "fused", "native"))
    assert why is not None and "fused,native" in why and "TRITON_INTERPRET=1" in why
    assert cannot_run_here("cpu", ("routing", "torch-bf16")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cannot_run_here("cpu", ("routing", "fused", "native")) is None


def test_benchmark_table_keeps_long_names_whole():
    def result(label):
        return {"label": label, "floors": {"memory_floor_ms": 0.1, "compute_floor_ms": 0.2},
                "timings": {"fused-layer": {"median_ms": 1.25, "p90_ms": 1.5, "x_floor": 6.25}},
                "parity": {"fused-layer": {"rel_l2": 2.5e-3}}}
    labels = ["H=12,S=4096," + "x" * 40 + "-first", "H=12,S=4096," + "x" * 40 + "-second"]
    text = format_table([result(label) for label in labels])
    for label in labels:
        assert label in text
    assert "1.250" in text and "2.50e-03" in text


def test_a_replay_is_compared_by_what_it_wrote():
    """The graph rows' bitwise check: a replay returns the captured call's output (a bare
    ``CUDAGraph.replay`` returns None, which once made every graph row pass unchecked)."""
    import torch

    from magi_moe.bench.timing import _Replay, matches_eager

    out = torch.zeros(4)

    def eager():
        out.copy_(torch.arange(4.0))
        return out

    class Graph:  # stands in for torch.cuda.CUDAGraph: replay() rewrites out, returns None
        def __init__(self, values):
            self.values = values

        def replay(self):
            out.copy_(self.values)

    assert matches_eager(eager, _Replay(Graph(torch.arange(4.0)), out)) is True
    assert matches_eager(eager, _Replay(Graph(torch.tensor([0.0, 1.0, 2.0, -3.0])), out)) is False
    assert matches_eager(eager, Graph(torch.arange(4.0)).replay) is False  # returns no tensor
    assert matches_eager(lambda: None, eager) is None
