"""Failure records, one-line reproduction commands, and the flight recorder.

A *record* is a JSON-ready dict naming everything a check needs to run again exactly::

    {"property": "differential", "impl": "native", "backend": "interpret",
     "case": {...}, "params": {...}}          # or "router": "pkg.mod:fn" instead of impl

``python -m magi_moe.fuzz replay '<record json>'`` (or a path to a saved record) replays it
(in a checkout ``python -m fuzz replay`` is the same command).

The flight recorder is how a campaign survives a case that kills its process (a segfault under
the interpreter, an illegal memory access on a GPU, a hang): before each case the worker writes the
record to ``<dir>/inflight-<pid>.json`` and removes it afterwards, so a record still there once
the worker is gone names the case that killed it. The first case of a test item that fails is
also noted (``found-<pid>.json``) until the item's failure is reported: a campaign stopped while
Hypothesis was still shrinking it, or a worker that died meanwhile, still yields the record (a
found failure is never lost to a stop). A CUDA error poisons the process's context, so
in a campaign the worker marks the record as a device fault and exits at once; pytest-xdist then
starts a fresh worker and the campaign goes on.

A CUDA error is asynchronous: a case that corrupts the context can return cleanly and let the
*next* case raise. With a device-health probe set (:func:`set_health_probe`; a GPU campaign sets
:func:`cuda_health_probe`, a tiny known kernel and a synchronize), the probe runs after every
case, and a probe that fails makes that case, the one that just ran, the device fault.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import sys
import time
import unittest
from pathlib import Path
from typing import Callable

from hypothesis.errors import HypothesisException

from .cases import dumps

__all__ = [
    "DEVICE_FAULT_EXIT", "FUZZ_COMMAND", "REPLAY_UNAVAILABLE", "DeviceFault", "PropertyViolation", "configure_flight_recorder",
    "cases_started", "count_case", "clear_found", "found_path", "in_flight", "is_device_fault", "repro_command",
    "cuda_health_probe", "save_failure", "save_record", "set_current_item", "set_health_probe",
]

DEVICE_FAULT_EXIT = 75  # worker exit status after a device fault (EX_TEMPFAIL)
REPLAY_UNAVAILABLE = 3  # ``python -m fuzz replay``: the record cannot run here (impl or backend missing)
_DEVICE_FAULT_MARKERS = ("illegal memory access", "device-side assert", "cuda error",
                         "unspecified launch failure", "misaligned address", "acceleratorerror")

_flight_dir: Path | None = None
_exit_on_device_fault = False
_cases_started = 0
_current_nodeid: str | None = None  # the test item running, named in flight records
_health_probe: Callable[[], None] | None = None  # run after every case (a GPU campaign's)


def set_health_probe(probe: Callable[[], None] | None) -> None:
    """Run ``probe`` after every case (None: no probe). It raises when the device is unhealthy;
    the case that just ran is then reported as the device fault."""
    global _health_probe
    if probe is not None and not callable(probe):
        raise TypeError(f"probe must be callable or None, got {type(probe).__name__}")
    _health_probe = probe


def cuda_health_probe() -> None:
    """A tiny kernel with a known answer and a synchronize: raises if the CUDA context is broken
    (a pending asynchronous error surfaces here) or computes wrong."""
    import torch

    got = float(torch.arange(8, device="cuda", dtype=torch.float32).mul(2).sum().item())
    torch.cuda.synchronize()
    if got != 56.0:
        raise RuntimeError(f"CUDA error: the health probe's known kernel gave {got}, expected 56.0")


def set_current_item(nodeid: str | None) -> None:
    """Name the test item whose cases run next (a campaign worker's plugin sets it), so a
    record left by a dead worker is attributed to its test."""
    global _current_nodeid
    _current_nodeid = nodeid


def count_case() -> None:
    """Count a case that runs outside :func:`in_flight` (a state machine's run)."""
    global _cases_started
    _cases_started += 1


def cases_started() -> int:
    """Cases this process has started (the campaign's progress counter)."""
    return _cases_started


# How a printed reproduction starts: the name that imports both in a checkout and from an
# installed wheel (where the package is magi_moe.fuzz; a top-level "fuzz" is not installed).
FUZZ_COMMAND = "python -m magi_moe.fuzz"


def repro_command(record: dict) -> str:
    """The one-line shell command that replays ``record`` exactly."""
    return f"{FUZZ_COMMAND} replay {shlex.quote(dumps(record))}"


def _who(record: dict) -> str:
    if record.get("router"):
        return f"router {record['router']}"
    return f"{record.get('impl')}@{record.get('backend')}"


class PropertyViolation(AssertionError):
    """A property failed on one case. ``record`` replays it; ``metrics`` holds the numbers."""

    def __init__(self, message: str, record: dict, metrics: dict | None = None):
        self.record = record
        self.metrics = metrics or {}
        self.reason = message
        super().__init__(f"{record.get('property')} violated by {_who(record)}: {message}\n"
                         f"  reproduce: {repro_command(record)}")


class DeviceFault(RuntimeError):
    """The device reported a fault (illegal address, device assert): its context is unusable."""

    def __init__(self, message: str, record: dict):
        self.record = record
        super().__init__(f"device fault in {record.get('property')} on {_who(record)}: {message}\n"
                         f"  reproduce: {repro_command(record)}")


def is_device_fault(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(marker in text for marker in _DEVICE_FAULT_MARKERS)


def configure_flight_recorder(directory: str | os.PathLike | None, *, exit_on_device_fault: bool = False) -> None:
    """Turn the flight recorder on (a directory) or off (None). Campaign workers set
    ``exit_on_device_fault`` so a poisoned CUDA context is never reused."""
    global _flight_dir, _exit_on_device_fault
    _flight_dir = Path(directory) if directory is not None else None
    if _flight_dir is not None:
        _flight_dir.mkdir(parents=True, exist_ok=True)
    _exit_on_device_fault = exit_on_device_fault


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a reader never sees half a record


def save_record(directory: str | os.PathLike, record: dict, *, kind: str, message: str,
                extra: dict | None = None) -> Path:
    """Save a failure record as ``<directory>/<property>-<hash>.json`` and return the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(dumps(record).encode()).hexdigest()[:10]
    path = directory / f"{record.get('property', 'case')}-{digest}.json"
    payload = {"kind": kind, "message": message, "record": record,
               "repro": repro_command(record), **(extra or {})}
    _write_json(path, payload)
    return path


def save_failure(directory: str | os.PathLike, nodeid: str, *, message: str, repro: str,
                 extra: dict | None = None) -> Path:
    """Save a failure that has no case record (e.g. a state machine's): it replays by node id."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(nodeid.encode()).hexdigest()[:10]
    path = directory / f"node-{digest}.json"
    _write_json(path, {"kind": "failure", "message": message, "nodeid": nodeid, "repro": repro,
                       **(extra or {})})
    return path


def flight_path() -> Path | None:
    return None if _flight_dir is None else _flight_dir / f"inflight-{os.getpid()}.json"


def found_path() -> Path | None:
    return None if _flight_dir is None else _flight_dir / f"found-{os.getpid()}.json"


def clear_found() -> None:
    """The item's failure was reported (or a new item starts): nothing is pending."""
    path = found_path()
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _note_found(record: dict, kind: str, message: str) -> None:
    """Note the first failing case of the running item (later ones are its shrinks)."""
    path = found_path()
    if path is None or path.exists():
        return
    _write_json(path, {"record": record, "kind": kind, "message": message, "pid": os.getpid(),
                       "found": time.time(), "cases": _cases_started, "repro": repro_command(record),
                       "nodeid": _current_nodeid})


def _device_fault(record: dict, path: Path | None, message: str) -> DeviceFault:
    """The device fault of ``record``'s case: in a campaign worker, the flight record says so and
    the worker exits at once (its context is poisoned); else the exception to raise."""
    _note_found(record, "device-fault", message)
    if path is not None and _exit_on_device_fault:
        _write_json(path, {"record": record, "pid": os.getpid(), "started": time.time(),
                           "status": "device-fault", "message": message,
                           "repro": repro_command(record), "nodeid": _current_nodeid})
        sys.stderr.write(f"fuzz: device fault, worker exits: {message}\n")
        sys.stderr.flush()
        os._exit(DEVICE_FAULT_EXIT)
    return DeviceFault(message, record)


def _check_health(record: dict, path: Path | None) -> None:
    """Run the health probe after ``record``'s case; a failing probe is that case's device fault."""
    if _health_probe is None:
        return
    try:
        _health_probe()
    except Exception as exc:
        raise _device_fault(record, path, f"device unhealthy after this case (health probe: "
                                          f"{type(exc).__name__}: {exc})") from exc


@contextlib.contextmanager
def in_flight(record: dict):
    """Run one case under ``record``: any exception that is not a property violation or a
    Hypothesis control exception becomes a :class:`PropertyViolation` carrying the record, so
    every failure prints its reproduction; a device fault becomes :class:`DeviceFault` (or, in a
    campaign worker, a left-behind record and an immediate exit)."""
    global _cases_started
    _cases_started += 1
    path = flight_path()
    if path is not None:
        _write_json(path, {"record": record, "pid": os.getpid(), "started": time.time(),
                           "status": "running", "repro": repro_command(record), "nodeid": _current_nodeid})
    try:
        yield
    except PropertyViolation as exc:
        _check_health(record, path)  # a broken device outranks the wrong values it gave
        _note_found(exc.record, "violation", exc.reason)
        raise
    except (HypothesisException, unittest.SkipTest):  # a skip (LayerWrongOnItsOwn) is no violation
        _check_health(record, path)
        raise
    except Exception as exc:
        if is_device_fault(exc):
            raise _device_fault(record, path, f"{type(exc).__name__}: {exc}") from exc
        _check_health(record, path)
        _note_found(record, "violation", f"raised {type(exc).__name__}: {exc}")
        raise PropertyViolation(f"raised {type(exc).__name__}: {exc}", record) from exc
    else:
        _check_health(record, path)
    finally:  # the case finished (passed or failed) and the process lives: nothing in flight
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
