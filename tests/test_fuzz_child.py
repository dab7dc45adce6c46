"""How a child process for an implementation ended, told apart (fuzz.child, CONTRACT section 7):
a child that runs out of memory "needs more than N GiB at this case" and is never an offset
finding; a wild read (SIGSEGV) is; a timeout and other signals are classes of their own. Real
child processes, each a second or two."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from magi_moe.fuzz.child import CHILD_MEMORY_ENV, GIB, classify_end, default_memory_cap, run_capped

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="the memory watchdog reads Linux /proc")

MIB = 2**20


def _python(code: str, **kwargs):
    return run_capped([sys.executable, "-c", textwrap.dedent(code)], **kwargs)


def test_a_child_past_its_memory_cap_is_memory_not_a_finding():
    """Cap 300 MiB, the child writes 1 GiB: killed at the cap, reported as needing more."""
    run = _python("""
        import time
        block = b"\\x01" * 2**30   # every page written
        time.sleep(30)
    """, memory_cap=300 * MIB, timeout=60)
    assert run.end.kind == "memory", run.end
    assert not run.end.is_finding
    assert "needs more than 0.3 GiB of memory at this case" in run.end.text
    assert run.peak_rss > 300 * MIB and run.returncode < 0


def test_memory_of_the_childs_own_children_counts():
    """The cap covers what the child starts (a compiler, a worker): the grandchild's 1 GiB is
    seen, and the whole group is killed."""
    run = _python(f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c",
                        "import time; b = bytes([1]) * 2**30; time.sleep(30)"])
    """, memory_cap=300 * MIB, timeout=60)
    assert run.end.kind == "memory", run.end


def test_lazily_allocated_address_space_is_not_memory():
    """Why the cap is watched and not set with RLIMIT_AS: 8 GiB of address space with a few
    pages touched runs under a 300 MiB cap (the huge-offset cases rest on this)."""
    run = _python("""
        import mmap
        space = mmap.mmap(-1, 8 * 2**30)
        for i in range(0, 8 * 2**30, 2**30):
            space[i] = 1
        print("ran")
    """, memory_cap=300 * MIB, timeout=60)
    assert run.end.kind == "exited" and run.returncode == 0, (run.end, run.stderr[-500:])
    assert run.stdout.strip() == "ran"


def test_a_segfault_is_a_wild_read():
    run = _python("import ctypes; ctypes.string_at(0)", memory_cap=300 * MIB, timeout=60)
    assert run.end.kind == "wild_read", run.end
    assert run.end.is_finding and "SIGSEGV" in run.end.text


def test_sigkill_from_outside_the_watchdog_is_memory():
    """What the system's out-of-memory killer does: SIGKILL, not sent by the watchdog."""
    run = _python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                  memory_cap=300 * MIB, timeout=60)
    assert run.end.kind == "memory", run.end
    assert "out-of-memory killer" in run.end.text and not run.end.is_finding


def test_a_child_past_its_time_limit_is_a_timeout():
    run = _python("import time; time.sleep(60)", memory_cap=300 * MIB, timeout=1)
    assert run.end.kind == "timeout", run.end
    assert "still running after 1 s" in run.end.text


def test_other_signals_and_ordinary_exits():
    aborted = _python("import os; os.abort()", memory_cap=300 * MIB, timeout=60)
    assert aborted.end.kind == "crash" and "SIGABRT" in aborted.end.text
    exited = _python("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
                     memory_cap=300 * MIB, timeout=60)
    assert (exited.end.kind, exited.returncode) == ("exited", 3)
    assert exited.stdout == "out\n" and exited.stderr == "err\n"


@pytest.mark.parametrize("text,kind", [
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "wild_read"),
    ("triton ... CUDA_ERROR_MISALIGNED_ADDRESS", "wild_read"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB", "memory"),
    ("RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
     "memory"),
    ("ValueError: head_dim must be a multiple of 64", "exited"),
])
def test_what_a_failed_child_printed(text, kind):
    """A CUDA wild access and an out-of-memory error end the child with an exception, not a
    signal: its last words decide."""
    assert classify_end(1, "Traceback ...\n" + text).kind == kind
    assert classify_end(0, text).kind == "exited"  # a child that went on is judged by its result


def test_the_default_cap_is_below_the_machine_and_configurable(monkeypatch):
    monkeypatch.delenv(CHILD_MEMORY_ENV, raising=False)
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < default_memory_cap() < total
    monkeypatch.setenv(CHILD_MEMORY_ENV, "1.5")
    assert default_memory_cap() == int(1.5 * GIB)
    monkeypatch.setenv(CHILD_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=f"{CHILD_MEMORY_ENV} must be a finite number of GiB > 0, got 'lots'"):
        default_memory_cap()


@pytest.mark.parametrize("given", ["inf", "nan", "-2", "0"])
def test_a_cap_that_is_no_finite_size_is_refused_in_one_line(given, monkeypatch):
    """inf once overflowed int() inside a case and was filed as a finding against the
    implementation; the variable is refused before any child starts."""
    monkeypatch.setenv(CHILD_MEMORY_ENV, given)
    with pytest.raises(ValueError, match=f"{CHILD_MEMORY_ENV} must be a finite number of GiB > 0"):
        default_memory_cap()


def test_a_forward_that_needs_more_memory_is_not_an_offset_finding(monkeypatch):
    """The case an outside team met: a correct plain-PyTorch forward (no launcher, so the whole
    4.3 GB output is real memory) under a 1 GiB cap is "needs more than 1.0 GiB at this case",
    returned as unsupported, not reported as an int32 offset overflow."""
    from magi_moe.config import preset
    from magi_moe.fuzz.cases import HugeCase, first_overflowing_token
    from magi_moe.fuzz.properties import check_huge_offsets, make_target

    monkeypatch.setenv(CHILD_MEMORY_ENV, "1")
    cfg = preset("tiny")
    t0 = first_overflowing_token(cfg)
    got = check_huge_offsets(make_target("torch-bf16", "cpu"), HugeCase(cfg, t0 + 4, (t0,), seed=1),
                             timeout=300)
    assert got.get("end") == "memory", got
    assert "torch-bf16 needs more than 1.0 GiB of memory at this case" in got["unsupported"]
