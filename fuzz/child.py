"""A child process for an implementation under test, under a memory cap and a time limit of its
own, and how it ended, told apart (CONTRACT section 7, failure classes).

A child that runs a case the parent cannot afford to run itself (a kernel that may read a wild
address, a huge-token case) can end in ways that mean different things to a kernel team:

* ``exited``: it ran to the end (any exit status); its own output says what it found.
* ``memory``: it needed more memory than it was given: the cap of :func:`run_capped`'s watchdog
  was reached, or it was killed with SIGKILL by someone else (on Linux the kernel's
  out-of-memory killer), or it reported an out-of-memory error itself (``torch.OutOfMemoryError``,
  ``MemoryError``). "needs more than N GiB at this case": a resource limit, never a finding.
* ``wild_read``: SIGSEGV or SIGBUS, or a CUDA illegal / misaligned address: the kernel touched
  memory it does not own (an int32 offset that wrapped, an unchecked index).
* ``timeout``: still running at the time limit; the watchdog killed it.
* ``crash``: any other signal (SIGABRT, SIGILL, SIGFPE, ...).

The cap is watched from the parent (the child's resident memory, its own children's included,
read from ``/proc`` every few milliseconds), not set with ``RLIMIT_AS``: the huge-token cases
rest on lazily allocated buffers of many GiB of address space whose pages are never touched,
which an address-space limit would refuse. Without ``/proc`` (not Linux) no cap is watched.
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHILD_MEMORY_ENV", "ChildEnd", "ChildRun", "classify_end", "default_memory_cap",
           "run_capped"]

GIB = 2**30
# The cap in GiB for every child run here, e.g. MAGI_MOE_CHILD_MEMORY_GIB=16.
CHILD_MEMORY_ENV = "MAGI_MOE_CHILD_MEMORY_GIB"
# Of the memory available when the child starts: room left for the parent and the machine.
DEFAULT_SHARE = 0.75
POLL_SECONDS = 0.02

END_CLASSES = ("exited", "memory", "wild_read", "timeout", "crash")
WILD_SIGNALS = (signal.SIGSEGV, signal.SIGBUS)
# What a CUDA wild access says (torch's RuntimeError text, the driver's error names).
WILD_TEXT = re.compile(r"illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|misaligned address"
                       r"|CUDA_ERROR_MISALIGNED_ADDRESS", re.I)
MEMORY_TEXT = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA_ERROR_OUT_OF_MEMORY"
                         r"|\bMemoryError\b|can't allocate memory|std::bad_alloc", re.I)


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_memory_cap() -> int | None:
    """The cap in bytes: ``$MAGI_MOE_CHILD_MEMORY_GIB`` if set, else three quarters of the memory
    available now (``MemAvailable``), so the machine keeps the rest; None without ``/proc``."""
    given = os.environ.get(CHILD_MEMORY_ENV)
    if given:
        try:
            gib = float(given)
        except ValueError:
            gib = -1.0
        if not (gib > 0 and math.isfinite(gib)):  # inf would overflow int() below
            raise ValueError(f"{CHILD_MEMORY_ENV} must be a finite number of GiB > 0, got {given!r}")
        return int(gib * GIB)
    available = _meminfo_bytes("MemAvailable")
    return None if available is None else int(available * DEFAULT_SHARE)


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it (0 once it is gone)."""
    total, pending, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while pending:
        p = pending.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pending.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue  # it ended between two reads
    return total


@dataclass(frozen=True)
class ChildEnd:
    """How a child ended: ``kind`` one of ``END_CLASSES``, ``text`` a line saying so."""

    kind: str
    text: str

    @property
    def is_finding(self) -> bool:
        """A wild read or another crash: the implementation's fault, whatever the machine."""
        return self.kind in ("wild_read", "crash")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def classify_end(returncode: int, output: str, *, watchdog: str | None = None,
                 memory_cap: int | None = None, peak_rss: int = 0,
                 timeout: float | None = None) -> ChildEnd:
    """How a child that ended with ``returncode`` (negative: the signal) and printed ``output``
    ended. ``watchdog``: ``"memory"`` or ``"timeout"`` when :func:`run_capped` killed it."""
    peak = f" (peak {_gib(peak_rss)} resident)" if peak_rss else ""
    if watchdog == "timeout":
        return ChildEnd("timeout", f"still running after {timeout:g} s: killed (a hang, or this "
                                   f"case is too slow here){peak}")
    if watchdog == "memory":
        return ChildEnd("memory", f"needs more than {_gib(memory_cap or 0)} of memory at this case: "
                                  f"the child reached its cap and was killed{peak}")
    if returncode < 0:
        number = -returncode
        if number in WILD_SIGNALS:
            return ChildEnd("wild_read", f"a wild read: the child died with {_signal_name(number)}")
        if number == signal.SIGKILL:
            need = (f"more than {_gib(peak_rss)} (the most seen before it died)" if peak_rss
                    else "more memory than the machine had")
            return ChildEnd("memory", f"needs {need} at this case: the child was killed with "
                                      "SIGKILL, not by its watchdog (most likely the system's "
                                      "out-of-memory killer)")
        return ChildEnd("crash", f"the child died with {_signal_name(number)}")
    if returncode != 0:
        if WILD_TEXT.search(output):
            line = WILD_TEXT.search(output).group(0)
            return ChildEnd("wild_read", f"a wild read: the child's CUDA context reported "
                                         f"'{line}' (exit {returncode})")
        if MEMORY_TEXT.search(output):
            line = MEMORY_TEXT.search(output).group(0)
            return ChildEnd("memory", f"needs more memory than the device had at this case: the "
                                      f"child reported '{line}' (exit {returncode}){peak}")
    return ChildEnd("exited", f"exited with {returncode}")


@dataclass(frozen=True)
class ChildRun:
    """A finished child: its exit status, its output, how it ended, its peak resident memory."""

    returncode: int
    stdout: str
    stderr: str
    end: ChildEnd
    peak_rss: int
    memory_cap: int | None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_capped(cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
               timeout: float = 600, memory_cap: int | None = None) -> ChildRun:
    """Run ``cmd`` to its end, killed (with everything it started) at ``timeout`` seconds or when
    its resident memory passes ``memory_cap`` bytes (default :func:`default_memory_cap`)."""
    if memory_cap is None:
        memory_cap = default_memory_cap()
    if memory_cap is not None and memory_cap <= 0:
        raise ValueError(f"memory_cap must be a number of bytes > 0, got {memory_cap!r}")
    watch = memory_cap is not None and os.path.isdir("/proc/self/task")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # files, not pipes: nothing has to read while the watchdog polls
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, text=True,
                                start_new_session=True)  # its own group: killed as a whole
        deadline, peak, watchdog = time.monotonic() + timeout, 0, None
        try:
            while proc.poll() is None:
                if watch:
                    peak = max(peak, _tree_rss(proc.pid))
                    if peak > memory_cap:
                        watchdog = "memory"
                if time.monotonic() > deadline:
                    watchdog = "timeout"
                if watchdog:
                    _kill_group(proc)
                    proc.wait()
                    break
                time.sleep(POLL_SECONDS)
        finally:
            if proc.poll() is None:  # the parent was interrupted: take the child with it
                _kill_group(proc)
                proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    end = classify_end(proc.returncode, (stdout + stderr)[-20000:], watchdog=watchdog,
                       memory_cap=memory_cap if watch else None, peak_rss=peak, timeout=timeout)
    return ChildRun(proc.returncode, stdout, stderr, end, peak, memory_cap if watch else None)
