"""The implementation under test timed under pytest-benchmark, so that a team keeps its kernel's
history across its commits:

    pytest --impl mypkg.kernels:IMPL tests/benchmarks -k impl --benchmark-autosave
    pytest --impl mypkg.kernels:IMPL tests/benchmarks -k impl --benchmark-compare

(installed: ``pytest --pyargs magi_moe.tests.benchmarks --impl ...``). The cases are
``python -m magi_moe.bench``'s: the four of docs/ANCHORS.md on the ``cuda`` backend, one tiny case
on ``cpu`` and ``interpret`` (wall clock: trying the loop, not a GPU figure). Each at kernel level
(``forward`` on precomputed routes, after ``prepare_weights``) and layer level (the
implementation's own layer, routing included), each checked by the judge before it is timed: a
wrong implementation fails with the judge's text and is not timed; a case outside its declared
shapes is skipped as unsupported. Without ``--impl`` every registered implementation but the
float64 oracle is timed.

GPU timings are :mod:`magi_moe.bench.timing`'s: the L2 flushed before every round and CUDA events
around the call, whose median goes into ``extra_info`` beside the floors and the error.
"""
from __future__ import annotations

import pytest
import torch

from magi_moe.bench.cases import ANCHOR_CASES, BenchCase, draw_problem, floors
from magi_moe.bench.paths import check_path, paths_of
from magi_moe.bench.timing import timer_label
from magi_moe.implementation import UnsupportedShape
from magi_moe.tests.benchmarks.cuda_events import device_median_ms

pytestmark = [pytest.mark.benchmark, pytest.mark.kernels_only, pytest.mark.clause("speed")]

FLUSH_MIB = 512
# The CPU case: small enough for the Triton interpreter, inside the narrow example's rule
TINY_CASE = BenchCase(heads=1, tokens=32, experts=8, top_k=2, head_dim=64, inter=128)
LEVELS = ("kernel", "layer")


@pytest.fixture(scope="module")
def problems():
    cache: dict = {}

    def get(case: BenchCase, device: str):
        key = (case, device)
        if key not in cache:
            cache.clear()  # one production problem resident at a time (H=12: ~8 GB)
            cache[key] = draw_problem(case, torch.device(device))
        return cache[key]
    return get


def _checked_path(impl_backend, case: BenchCase, level: str, problems):
    """The path's callable on the case's problem, after the judge passed it; its check entry."""
    impl, device = impl_backend.impl, impl_backend.device
    path = paths_of(impl)[LEVELS.index(level)]
    problem = problems(case, device)
    why = path.unsupported(problem)
    if why:
        raise UnsupportedShape(why)
    fn = path.build(problem)
    check = check_path(path, problem, fn)
    if check["status"] != "ok":
        pytest.fail(f"{path.name} is WRONG on {case.label}, not timed: {check['why']}", pytrace=False)
    return problem, fn, check


def _record(benchmark, impl_backend, case, level, problem, check, device) -> None:
    """Before timing: the group (one case and level, every implementation side by side) and
    what identifies the figure."""
    fl = floors(problem)
    benchmark.group = f"{case.label} {level}"
    benchmark.extra_info.update(
        implementation=impl_backend.impl.name, backend=impl_backend.backend.name, level=level,
        rel_l2=check["rel_l2"], max_abs=check["max_abs"], timer=timer_label(device, FLUSH_MIB),
        memory_floor_ms=fl["memory_floor_ms"], compute_floor_ms=fl["compute_floor_ms"])


@pytest.mark.backends("cuda")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("heads,tokens", ANCHOR_CASES, ids=lambda v: str(v))
def test_impl_anchor_case(benchmark, impl_backend, problems, heads, tokens, level):
    case = BenchCase(heads, tokens)
    problem, fn, check = _checked_path(impl_backend, case, level, problems)
    device = torch.device(impl_backend.device)
    _record(benchmark, impl_backend, case, level, problem, check, device)
    benchmark.extra_info["device_median_ms"] = device_median_ms(
        benchmark, fn, device, FLUSH_MIB * 2**20, rounds=30, warmup=5)


@pytest.mark.backends("cpu", "interpret")
@pytest.mark.parametrize("level", LEVELS)
def test_impl_tiny_case(benchmark, impl_backend, problems, level):
    problem, fn, check = _checked_path(impl_backend, TINY_CASE, level, problems)
    _record(benchmark, impl_backend, TINY_CASE, level, problem, check, torch.device("cpu"))
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=1)
