"""``python -m magi_moe.bench --impl``: an outside implementation timed beside the built-in paths
on the CPU (wall clock, said so), judged before any timing: a wrong one is reported WRONG and
never timed, a case outside its declared shapes is reported unsupported and never called."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magi_moe.backends import interpreter_enabled
from magi_moe.bench.__main__ import main, parse_args
from magi_moe.bench.paths import BUILTIN_PATHS, KernelCall, LAYER_SUFFIX, paths_of, resolve
from magi_moe.implementation import Implementation, ShapeRule
from magi_moe.impls import BUILTINS, FUSED, TORCH_BF16
from magi_moe.reference import expert_reference

TINY = ["--device", "cpu", "--heads", "1", "--tokens", "32", "--experts", "8", "--top-k", "2",
        "--head-dim", "64", "--inter", "128", "--warmup", "0", "--iters", "2", "--no-graphs"]
EXAMPLE = "magi_moe.tests.outside_impl_example:IMPL"
ROOT = Path(__file__).resolve().parents[1]
CALLS: dict[str, int] = {"forgets-probs": 0, "narrow": 0}


def _forgets_probs(x, table, weights, config, *, out):
    """Wrong on purpose: every route weighs 1 instead of its routing probability."""
    CALLS["forgets-probs"] += 1
    ones = dataclasses.replace(table, sorted_probs=torch.ones_like(table.sorted_probs))
    return out.copy_(expert_reference(x, ones, weights, config, precision="fp32acc"))


def _narrow(x, table, weights, config, *, out):
    CALLS["narrow"] += 1
    return out.copy_(expert_reference(x, table, weights, config, precision="fp32acc"))


FORGETS_PROBS = Implementation("forgets-probs", _forgets_probs, ("cpu",), "bf16-fp32acc",
                               description="test: drops the routing probabilities")
NARROW = Implementation("narrow-topk", _narrow, ("cpu",), "bf16-fp32acc",
                        shapes=ShapeRule(max_top_k=1),
                        description="test: declares top_k <= 1")
TRITON_ONLY = Implementation("triton-only", _narrow, ("interpret", "cuda"), "bf16-fp32acc",
                             description="test: declares Triton backends only")


@pytest.fixture(autouse=True)
def _one_thread():
    """The CPU runs are tiny: threads only contend on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(capsys, *args, json_path=None, status=0) -> tuple[str, dict | None]:
    argv = [*TINY, *args] + (["--json", str(json_path)] if json_path else [])
    assert main(argv) == status
    report = json.loads(json_path.read_text()) if json_path else None
    return capsys.readouterr().out, report


def _row(text: str, name: str) -> list[str]:
    """The cells of the table row of path ``name``."""
    for line in text.splitlines():
        cells = line.split()
        if name in cells:
            return cells[cells.index(name):]
    raise AssertionError(f"no row for {name} in:\n{text}")


def test_builtin_paths_are_records_of_the_declarations():
    for impl in BUILTINS:
        if impl.is_oracle:
            assert impl.name not in BUILTIN_PATHS
            continue
        kernel, layer = BUILTIN_PATHS[impl.name], BUILTIN_PATHS[impl.name + LAYER_SUFFIX]
        assert (kernel.impl, kernel.level, layer.impl, layer.level) == (impl, "kernel", impl, "layer")
    outside = resolve(EXAMPLE)
    assert (outside.name, outside.level) == ("torch-einsum", "kernel")
    assert resolve("torch-einsum-layer") == paths_of(outside.impl)[1]
    with pytest.raises(ValueError, match="float64 oracle"):
        resolve("reference")
    with pytest.raises(ValueError, match="paths must be among"):
        resolve("no-such-path")


def test_kernel_level_times_forward_on_weights_prepared_once():
    from magi_moe.config import preset
    from magi_moe.problems import random_problem

    prepared = []
    impl = Implementation("prepared", _narrow, ("cpu",), "bf16-fp32acc",
                          prepare_weights=lambda w: prepared.append(w) or w)
    problem = random_problem(preset("tiny"), 8, seed=0)
    call = paths_of(impl)[0].build(problem)
    assert isinstance(call, KernelCall) and prepared == [problem.weights]
    call(), call()
    assert len(prepared) == 1 and call().data_ptr() == call.out.data_ptr()
    assert paths_of(FUSED)[0].impl.prepare_weights is not None  # fused packs, as it declares


def test_outside_implementation_is_timed_beside_the_baseline_with_errors(capsys, tmp_path):
    text, report = _run(capsys, "--impl", EXAMPLE, json_path=tmp_path / "b.json")
    assert "timer: wall clock" in text  # the CPU says it is not CUDA-event timing
    if interpreter_enabled():  # the fused comparators run under the interpreter, judged too
        assert _row(text, "fused")[-1] == "ok" and _row(text, "fused-layer")[-1] == "ok"
    else:  # the comparators that need Triton are left out, said
        assert "fused: not run here: backend interpret unavailable" in text, text
    for name, level in (("torch-einsum", "kernel"), ("torch-einsum-layer", "layer"),
                        (TORCH_BF16.name, "kernel"), (TORCH_BF16.name + "-layer", "layer")):
        cells = _row(text, name)
        assert cells[1] == level and cells[-1] == "ok", cells
        assert float(cells[2]) > 0 and 0 < float(cells[-2]) < 1e-2, cells  # median ms, rel L2
    result = report["results"][0]
    assert set(result["timings"]) - {"fused", "fused-layer"} == {
        "torch-einsum", "torch-einsum-layer", "torch-bf16", "torch-bf16-layer"}
    assert result["timings"]["torch-einsum"]["n"] == 2
    assert report["environment"]["device"] == "cpu" and report["environment"]["gpu"] is None


def test_a_wrong_implementation_is_reported_and_not_timed(capsys, tmp_path):
    CALLS["forgets-probs"] = 0
    text, report = _run(capsys, "--impl", "tests.test_bench_outside:FORGETS_PROBS",
                        "--paths", "torch-bf16", json_path=tmp_path / "b.json", status=1)
    cells = _row(text, "forgets-probs")
    assert cells[-1] == "WRONG" and cells[2] == "-", cells  # no median: not timed
    assert float(cells[-2]) > 0.1, cells  # its error is shown
    assert "forgets-probs: WRONG, not timed:" in text
    result = report["results"][0]
    assert "forgets-probs" not in result["timings"] and "torch-bf16" in result["timings"]
    assert result["parity"]["forgets-probs"]["status"] == "WRONG"
    # its own layer is wrong too: one judged call per level, none timed
    assert result["parity"]["forgets-probs-layer"]["status"] == "WRONG"
    assert CALLS["forgets-probs"] == 2
    # the last line names what was wrong, for a CI log read from its end
    assert text.strip().splitlines()[-1] == (
        "not timed: forgets-probs WRONG at H=1,S=32; forgets-probs-layer WRONG at H=1,S=32")


def test_shapes_outside_the_declaration_are_unsupported_and_never_called(capsys, tmp_path):
    CALLS["narrow"] = 0
    text, report = _run(capsys, "--impl", "tests.test_bench_outside:NARROW", "--paths", "torch-bf16",
                        json_path=tmp_path / "b.json", status=5)
    for name in ("narrow-topk", "narrow-topk-layer"):
        assert _row(text, name)[-1] == "unsupported"
        assert f"{name}: unsupported, not timed: narrow-topk: top_k must be <= 1, got 2" in text
    assert CALLS["narrow"] == 0
    assert set(report["results"][0]["timings"]) == {"torch-bf16"}
    # the baseline was timed, but nothing the run asked about: not a green run
    assert text.strip().splitlines()[-1].startswith(
        "nothing asked for was timed: narrow-topk, narrow-topk-layer"), text


def test_an_implementation_that_cannot_run_here_is_refused_at_once(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        parse_args([*TINY, "--impl", "tests.test_bench_outside:TRITON_ONLY"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "triton-only" in err and "TRITON_INTERPRET=1" in err


@pytest.mark.parametrize("spec,why", [("no_such_module:IMPL", "--impl: cannot load implementation"),
                                      ("reference", "float64 oracle")])
def test_bad_impl_is_refused_naming_the_option(capsys, spec, why):
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--impl", spec])
    assert why in capsys.readouterr().err


def _pytest(*args, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}  # not a worker there
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # tiny runs: threads only contend
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           str(ROOT / "tests" / "benchmarks" / "test_bench_impl.py"),
                           "--backend", "cpu", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_pytest_benchmark_saves_and_compares_an_outside_implementation(tmp_path):
    """The whole loop of docs/PLUGGING_IN.md on the CPU: autosave, then compare with the saved
    run; a wrong implementation in the same run fails with the judge's text and is not saved."""
    storage = f"--benchmark-storage={tmp_path / 'store'}"
    first = _pytest("--impl", EXAMPLE, "--impl", "tests.test_bench_outside:FORGETS_PROBS",
                    "--benchmark-autosave", storage, cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr  # the wrong one fails
    assert "forgets-probs is WRONG on H=1,S=32, not timed" in first.stdout, first.stdout
    saved = list((tmp_path / "store").rglob("*.json"))
    assert len(saved) == 1, first.stdout
    data = json.loads(saved[0].read_text())
    names = sorted(b["name"] for b in data["benchmarks"])
    assert names == ["test_impl_tiny_case[torch-einsum@cpu-kernel]",
                     "test_impl_tiny_case[torch-einsum@cpu-layer]"]
    assert {b["group"] for b in data["benchmarks"]} == {"H=1,S=32 kernel", "H=1,S=32 layer"}
    info = data["machine_info"]
    assert info["torch"] == torch.__version__ and "gpu" in info and "triton" in info
    assert all(0 < b["extra_info"]["rel_l2"] < 1e-2 for b in data["benchmarks"])

    second = _pytest("--impl", EXAMPLE, "--benchmark-compare", storage, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    run_id = saved[0].stem.split("_")[0]
    assert f"test_impl_tiny_case[torch-einsum@cpu-kernel] ({run_id}" in second.stdout, second.stdout
    assert "test_impl_tiny_case[torch-einsum@cpu-kernel] (NOW)" in second.stdout, second.stdout


@pytest.mark.slow
def test_pytest_benchmark_skips_cases_outside_the_declaration_as_unsupported(tmp_path):
    """Every case outside the rule is skipped as unsupported; a run in which that leaves nothing
    timed says so and exits 5 (no green that timed nothing)."""
    done = _pytest("--impl", "tests.test_bench_outside:NARROW", "--benchmark-autosave",
                   f"--benchmark-storage={tmp_path / 'store'}", cwd=tmp_path)
    assert done.returncode == 5, done.stdout + done.stderr
    assert "2 x unsupported: narrow-topk: top_k must be <= 1, got 2" in done.stdout, done.stdout
    assert not list((tmp_path / "store").rglob("*.json")) or all(
        not json.loads(p.read_text())["benchmarks"] for p in (tmp_path / "store").rglob("*.json"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_the_refusal_gives_the_cpu_command_for_the_impl(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--impl", EXAMPLE])
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err
    suggested = err.strip().splitlines()[-1].split()
    assert suggested[:3] == ["python", "-m", "magi_moe.bench"] and suggested[-2:] == ["--impl", EXAMPLE]
    args = parse_args(suggested[3:])  # the command it gives runs here
    assert [p.name for p in args.paths][-2:] == ["torch-einsum", "torch-einsum-layer"]


def _new_fp32_tensor(x, table, weights, config, *, out):
    """Wrong on purpose: right values, but in a new fp32 tensor; the caller's ``out`` is never
    written."""
    return expert_reference(x, table, weights, config, precision="fp32acc").float()


@dataclasses.dataclass(frozen=True)
class _RaisingSupports(Implementation):
    def supports(self, config, dtype=None):
        raise RuntimeError("supports exploded")


IGNORES_OUT = Implementation("ignores-out", _new_fp32_tensor, ("cpu",), "bf16-fp32acc",
                             description="test: returns a new fp32 tensor, out unwritten")
RAISING_SUPPORTS = _RaisingSupports("raising-supports", _narrow, ("cpu",), "bf16-fp32acc",
                                    description="test: supports() raises")


def test_a_forward_that_leaves_out_unwritten_is_wrong_and_not_timed(capsys, tmp_path):
    text, report = _run(capsys, "--impl", "tests.test_bench_outside:IGNORES_OUT", "--paths", "torch-bf16",
                        json_path=tmp_path / "b.json", status=1)
    assert _row(text, "ignores-out")[-1] == "WRONG"
    assert ("ignores-out: WRONG, not timed: forward returned a new float32 tensor of shape (32, 64) "
            "instead of out (bfloat16, (32, 64)); 2048 of out's 2048 elements left unwritten") in text
    result = report["results"][0]
    assert "ignores-out" not in result["timings"] and "torch-bf16" in result["timings"]
    # its layer (magi-moe's module, which casts to x's dtype) is right and timed
    assert result["parity"]["ignores-out-layer"]["status"] == "ok"
    assert text.strip().splitlines()[-1] == "not timed: ignores-out WRONG at H=1,S=32"


def test_a_raising_supports_is_reported_as_errored_not_a_traceback(capsys, tmp_path):
    text, report = _run(capsys, "--impl", "tests.test_bench_outside:RAISING_SUPPORTS",
                        "--paths", "torch-bf16", json_path=tmp_path / "b.json", status=1)
    for name in ("raising-supports", "raising-supports-layer"):
        assert _row(text, name)[-1] == "error"
        assert f"{name}: error, not timed: supports() raised RuntimeError: supports exploded" in text
    assert "torch-bf16" in report["results"][0]["timings"]
    assert text.strip().splitlines()[-1] == (
        "not timed: raising-supports error at H=1,S=32; raising-supports-layer error at H=1,S=32")
