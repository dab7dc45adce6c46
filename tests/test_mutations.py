"""The suite must fail on broken kernels. Each mutant is the native kernel's source with one
deliberate bug; the accuracy judge (magi_moe.judge) that passes the real kernel must reject it."""
import importlib.util
import pathlib
import re
import sys

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")

import magi_moe.kernels.native as native
from magi_moe.backends import by_speed
from magi_moe.fuzz.child import run_capped
from magi_moe.config import preset
from magi_moe.problems import random_problem, run_poisoned
from magi_moe.registry import Implementation

from magi_moe.judge import judge

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (id, original text, mutated text): one bug each.
MUTANTS = [
    ("weight-applied-twice", "acc = acc * probs[:, None]", "acc = acc * probs[:, None] * probs[:, None]"),
    ("wrong-head-offset", "head = bank // num_experts", "head = bank * 0"),
    ("off-by-one-token-mask", "row_mask = rows < end", "row_mask = rows <= end"),
    ("clamp-dropped", "round_operand(swiglu7(g, u),",
     "round_operand(g * tl.sigmoid(1.702 * g) * (tl.minimum(tl.maximum(u, -7.0), 7.0) + 1.0),"),
    ("activation-truncated", "a = round_operand(swiglu7(g, u), w_down_ptr.dtype.element_ty, UPCAST)",
     # toward zero by bit masking, then exact in the operand dtype: valid on a GPU as well
     "a = round_operand((swiglu7(g, u).to(tl.uint32, bitcast=True) & 0xFFFF0000)"
     ".to(tl.float32, bitcast=True), w_down_ptr.dtype.element_ty, UPCAST)"),
    ("down-rows-shifted", "w_down_bank + n[:, None] * HEAD_DIM + d[None, :]",
     "w_down_bank + n[:, None] * HEAD_DIM + (d[None, :] + 1) % HEAD_DIM"),
]


def write_mutant(tmp_path: pathlib.Path, name: str, original: str, mutated: str) -> pathlib.Path:
    source = pathlib.Path(native.__file__).read_text()
    assert source.count(original) == 1, f"mutant {name}: pattern not found once in native.py"
    # A standalone module: its relative imports become absolute (siblings live in kernels/).
    source = re.sub(r"^from \.(\w)", r"from magi_moe.kernels.\1",
                    source.replace(original, mutated).replace("from ..", "from magi_moe."),
                    flags=re.M)
    path = tmp_path / f"native_mutant_{name.replace('-', '_')}.py"
    path.write_text(source)
    return path


def kernel_backend():
    for backend in by_speed():
        if backend.runs_triton and backend.available:
            return backend
    pytest.skip("no Triton backend here (set TRITON_INTERPRET=1 or use a GPU)")


MISSED, ALL_CAUGHT = 10, 11  # child exit codes; a crash (negative code) also counts as caught


def check_mutant(source_path: str, device: str) -> None:
    """Child-process body: run both kernel variants of the mutant through the accuracy judge,
    each of them whatever the other did, one line each. Exits MISSED if any variant passes it,
    ALL_CAUGHT if the check rejects both."""
    spec = importlib.util.spec_from_file_location(pathlib.Path(source_path).stem, source_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton's jit looks the module up for the kernel's globals
    spec.loader.exec_module(module)
    # Large weights put the gate pre-activations on both sides of the SwiGLU7 clamp at 7.
    problem = random_problem(preset("tiny"), 70, seed=31, device=device, x_std=4.0, weight_std=0.3)
    missed = False
    for deterministic in (False, True):
        def forward(x, table, weights, config, *, out):
            return module.native_forward(x, table, weights, config, deterministic=deterministic, out=out)

        mutant = Implementation("mutant", forward, ("interpret", "cuda"), "bf16-fp32acc")
        verdict = judge(run_poisoned(mutant, problem), problem, mutant)
        if not verdict.ok:
            print(f"deterministic={deterministic}: caught: {verdict.text[:300]}", flush=True)
        else:
            print(f"deterministic={deterministic}: MISSED", flush=True)
            missed = True
    sys.exit(MISSED if missed else ALL_CAUGHT)


def run_child(path: pathlib.Path, device: str):
    """The check in a child process under a memory cap of its own (fuzz.child): ``end`` tells a
    wild read from a child that ran out of memory, which proves nothing about the mutant."""
    code = (f"import sys; sys.path[:0] = {[str(ROOT), str(ROOT / 'tests')]!r}; "
            f"import test_mutations as t; t.check_mutant({str(path)!r}, {device!r})")
    return run_capped([sys.executable, "-c", code], timeout=300)


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
@pytest.mark.interpret
@pytest.mark.parametrize("name,original,mutated", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_broken_native_kernel_is_caught(tmp_path, name, original, mutated):
    """Run in a child process: a mutant may read wild memory and kill the interpreter (CONTRACT 8),
    which counts as caught -- the suite would fail -- but must not take this process down."""
    backend = kernel_backend()
    child = run_child(write_mutant(tmp_path, name, original, mutated), backend.device)
    print(f"{name}: exit {child.returncode}\n{child.stdout}")
    assert child.returncode not in (0, MISSED), f"mutant {name} passed:\n{child.stdout}{child.stderr[-1500:]}"
    if child.returncode != ALL_CAUGHT:
        assert child.end.is_finding, \
            f"mutant {name}: child failed oddly ({child.end.text}):\n{child.stderr[-1500:]}"


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
def test_the_unmutated_kernel_passes_the_same_check(tmp_path):
    """Guards the harness itself: with no mutation both variants (atomic and deterministic) must
    run and pass in the child."""
    backend = kernel_backend()
    child = run_child(write_mutant(tmp_path, "none", "acc = acc * probs[:, None]",
                                   "acc = acc * probs[:, None]"), backend.device)
    passed = [f"deterministic={d}: MISSED" for d in (False, True)]
    assert child.returncode == MISSED and all(line in child.stdout for line in passed), \
        f"{child.stdout}\n{child.stderr[-2000:]}"
