"""Used memory for every harness call (magi_moe/dirty_memory.py, CONTRACT section 10): how far it
reaches on the CPU and on CUDA, the switch that turns it off, and the planted bug it exists for
(tests/dirty_memory_broken.py): an expert with no tokens read from an uninitialised arena."""
from __future__ import annotations

import pytest
import torch

from magi_moe import dirty_memory as dm
from magi_moe.judge import judge
from magi_moe.backends import BACKENDS
from magi_moe.config import preset
from magi_moe.impls import FUSED, REFERENCE, TORCH_BF16
from magi_moe.problems import random_problem, run_poisoned
from magi_moe.tests.dirty_memory_broken import UNZEROED_EMPTY_EXPERT

SIZES = [4, 64, 1000, 65536, 1 << 20, 3 << 20, 8 << 20, 64 << 20]  # bytes: malloc's cache to mmap


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    if request.param == "cpu":
        if dm._c10_fill_switches() is None:
            pytest.skip(f"dirty memory reaches {dm.reach('cpu')}")
        return torch.device("cpu")
    why = BACKENDS["cuda"].unavailable_reason()
    if why:
        pytest.skip(f"backend cuda unavailable: {why}")
    return torch.device("cuda")


@pytest.fixture
def dirty_on(monkeypatch):
    monkeypatch.delenv(dm.OFF_ENV, raising=False)


def _is_poison(got: torch.Tensor) -> torch.Tensor:
    """Per byte of a uint8 tensor: the fill the device's dirty memory writes there."""
    if got.device.type == "cuda":
        return got == dm.CUDA_FILL
    pattern = torch.tensor([dm.CPU_FILL], dtype=torch.int32).view(torch.uint8)
    return got == pattern.repeat(got.numel() // 4 + 1)[: got.numel()]


def _used_then_empty(device: torch.device, nbytes: int, **handed) -> torch.Tensor:
    """The bytes ``torch.empty`` hands out right after a block of that size held ones."""
    torch.full((nbytes,), 1, dtype=torch.uint8, device=device)  # made and freed: a used block
    with dm.handed_memory(device, reserve_bytes=128 << 20, **handed):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


@pytest.mark.parametrize("nbytes", SIZES)
def test_every_block_handed_out_is_poison(device, dirty_on, nbytes):
    """Small and large blocks, reused and freshly mapped (64 MiB: above glibc's largest mmap
    threshold, zeroed pages without the switch): every byte is the fill byte."""
    got = _used_then_empty(device, nbytes)
    assert bool(_is_poison(got).all()), f"{int((~_is_poison(got)).sum())} bytes not poisoned"


@pytest.mark.parametrize("nbytes", [4, 64, 1000])
def test_small_blocks_glibc_keeps_in_its_caches_are_poison_too(dirty_on, nbytes):
    """glibc hands small blocks back from its thread cache, and exact fits from its unsorted bin,
    without its perturb fill; many of them in a row, each freed holding ones, all come back as
    poison (the allocator fills what it is given, wherever glibc found it)."""
    held = [torch.full((nbytes,), 1, dtype=torch.uint8) for _ in range(64)]
    del held[::2]  # freed in between live blocks: cached and binned, not merged away
    with dm.handed_memory("cpu"):
        got = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(64)]
    assert all(bool(_is_poison(g).all()) for g in got)


def test_the_switches_are_restored_and_never_both_on(dirty_on):
    """c10 aborts the process when it finds both fill switches on: nesting a zeroed call inside
    a dirty one (and back) keeps one on at a time and restores the one before."""
    switches = dm._c10_fill_switches()
    if switches is None:
        pytest.skip(f"dirty memory reaches {dm.reach('cpu')}")
    with dm.handed_memory("cpu"):
        with dm.handed_memory("cpu", zeroed=True):
            assert (switches["junk"].value, switches["zero"].value) == (False, True)
            assert bool((torch.empty(100, dtype=torch.uint8) == 0).all())
        assert (switches["junk"].value, switches["zero"].value) == (True, False)
    assert (switches["junk"].value, switches["zero"].value) == (False, False)


def test_a_block_never_used_is_poison_too(device, dirty_on):
    """A request larger than any free block: carved from the reserve (CUDA) or mapped (CPU)."""
    with dm.handed_memory(device, reserve_bytes=200 << 20):
        got = torch.empty(150 << 20, dtype=torch.uint8, device=device)
    assert bool(_is_poison(got).all())


def test_fresh_memory_is_zero_without_it(monkeypatch):
    """What the switch is for, measured on the CPU: a 64 MiB block is freshly mapped and reads
    as zeros, so an unwritten element there hides."""
    monkeypatch.setenv(dm.OFF_ENV, "1")
    got = _used_then_empty(torch.device("cpu"), 64 << 20)
    assert bool((got == 0).all())
    assert dm.reach("cpu").startswith("off")


@pytest.mark.parametrize("nbytes", [1000, 64 << 20])
def test_zeroed_emulates_fresh_memory(device, nbytes):
    assert bool((_used_then_empty(device, nbytes, zeroed=True) == 0).all())


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_bad_reserve_is_refused_naming_the_argument(value):
    with pytest.raises(ValueError, match="reserve_bytes must be an int >= 0"):
        with dm.handed_memory("cpu", reserve_bytes=value):
            pass


# ---------------------------------------------------------------------------------------------
# the planted bug: right on fresh memory, caught on used memory
# ---------------------------------------------------------------------------------------------
def _problem_with_an_empty_expert(device: torch.device):
    problem = random_problem(preset("tiny"), 5, seed=41, device=device)
    assert bool((problem.table.counts() == 0).any()), "the control needs an expert with no tokens"
    return problem


def test_unzeroed_expert_passes_on_fresh_memory(device, monkeypatch):
    """Dirty memory off, and the memory the call gets zeroed as fresh memory is: right."""
    problem = _problem_with_an_empty_expert(device)
    monkeypatch.setenv(dm.OFF_ENV, "1")
    with dm.handed_memory(device, zeroed=True, reserve_bytes=128 << 20):
        out = run_poisoned(UNZEROED_EMPTY_EXPERT, problem)
    v = judge(out, problem, UNZEROED_EMPTY_EXPERT)
    assert v.ok, v.text


def test_unzeroed_expert_is_caught_on_used_memory(device, dirty_on):
    problem = _problem_with_an_empty_expert(device)
    v = judge(run_poisoned(UNZEROED_EMPTY_EXPERT, problem), problem, UNZEROED_EMPTY_EXPERT)
    assert not v.ok


@pytest.mark.parametrize("impl", [REFERENCE, TORCH_BF16, FUSED], ids=lambda i: i.name)
def test_correct_implementations_pass_on_used_memory(device, dirty_on, impl):
    if device.type == "cpu" and impl is FUSED:
        pytest.skip("the fused kernels' interpreter rows are test_implementations.py's")
    problem = _problem_with_an_empty_expert(device)
    v = judge(run_poisoned(impl, problem), problem, impl)
    assert v.ok, v.text
