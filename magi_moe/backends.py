"""Where code runs: the CPU reference backend, the Triton interpreter, and CUDA.

A backend is a device, whether Triton kernels run there, and every default the suite picks by
it (the audit's shapes and runs, the fuzz size budget, the variables a process needs): fields of
``Backend``, read by the sites instead of the name. Adding ROCm or MUSA is one more ``Backend``
entry here (and one tox environment).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, MutableMapping

import torch


def kernels_decorated() -> bool:
    """Whether magi-moe's Triton kernels are imported in this process: decoration has read the
    interpreter flag, so changing it now would not change how they run."""
    return "magi_moe.kernels" in sys.modules


def interpreter_enabled() -> bool:
    """True when Triton kernels run under the CPU interpreter (read at kernel decoration)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_INSTALLED: bool | None = None


def triton_installed() -> bool:
    """Whether Triton can be imported. Looked up once: an installation does not change within a
    process, and the layer asks on every call (a module global, not lru_cache, which dynamo
    warns about when it traces the layer)."""
    global _TRITON_INSTALLED
    if _TRITON_INSTALLED is None:
        _TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
    return _TRITON_INSTALLED


@dataclass(frozen=True)
class Backend:
    """One place code runs, and every fact the suite decides by it: a site asks the field, never
    the name, so a new backend is this one record (and one tox environment)."""
    name: str
    device: str  # the torch device type its tensors live on
    runs_triton: bool
    description: str
    _why_unavailable: Callable[[], str | None]
    # Plain PyTorch implementations run here: the interpreter runs Triton programs only, so a
    # plain implementation's row there would repeat its row on the same device's plain backend.
    runs_plain_pytorch: bool
    # Lower runs a given kernel faster. The order defaults are picked in (the interpreter last:
    # it runs programs one after another).
    speed_rank: int
    # NAME=VALUE variables a process needs before any Triton kernel is imported (decoration reads
    # them); a child started for another backend has them removed.
    process_env: tuple[str, ...] = ()
    # The help of the pytest marker named after this backend, which its rows carry so that
    # `-m "not cuda"` deselects them; None: its rows run anywhere and need no marker.
    marker: str | None = None
    # The backend whose Triton kernels an audit on this one also runs when usable (the CPU audit
    # runs them under the interpreter), and how the report then describes what it audits.
    audits_kernels_on: str | None = None
    kernels_audit_description: str = ""
    # The audit's defaults: shapes and tokens per problem (production widths where kernels are
    # compiled; the interpreter and host PyTorch pay per operation), and determinism runs (a race
    # shows in a few runs of a serial interpreter, a GPU's needs many).
    audit_presets: tuple[str, ...] = ("small",)
    audit_tokens: int = 128
    audit_determinism_runs: int = 3
    # Operations cost per call here: the determinism and layer sections use the tiny preset.
    small_audit_inputs: bool = True
    # torch CPU threads of the audit: its many small host ops run fastest single-threaded; None
    # leaves torch's default (the device does the work).
    audit_threads: int | None = 1
    # The fuzz strategies' shape budget (the ci profile's 1 overrides it): calls of thousands of
    # tokens cost little on a GPU, seconds on the CPU.
    fuzz_size_budget: float = 2.0
    # What is left to ask when tensors already sit on the device (it exists): None means the
    # whole unavailable_reason.
    _why_unavailable_on_its_tensors: Callable[[], str | None] | None = None

    def unavailable_reason(self) -> str | None:
        """None when usable in this process, else a one-line reason (used for pytest skips)."""
        return self._why_unavailable()

    @property
    def available(self) -> bool:
        return self.unavailable_reason() is None

    def skip_reason(self) -> str | None:
        """None when usable here, else the reason naming this backend (a skip or refusal text)."""
        why = self.unavailable_reason()
        return f"backend {self.name} unavailable: {why}" if why else None

    def skip_reason_on_its_tensors(self) -> str | None:
        """:meth:`skip_reason` for tensors already on this backend's device."""
        ask = self._why_unavailable_on_its_tensors or self._why_unavailable
        why = ask()
        return f"backend {self.name} unavailable: {why}" if why else None

    def env_prefix(self) -> str:
        """The variables a shell command line sets for this backend (``TRITON_INTERPRET=1 ``)."""
        return "".join(f"{v} " for v in self.process_env)

    def enable_here(self, env: MutableMapping[str, str] = os.environ) -> None:
        """Set this backend's variables in ``env``. This process's own environment is left as it
        is once magi-moe's kernels are imported: decoration has read the flag, and kernels
        decorated later the other way could not call the earlier ones ("Cannot call @triton.jit'd
        outside of the scope of a kernel"); the backend's availability then says why."""
        if env is os.environ and kernels_decorated():
            return
        for variable in self.process_env:
            name, _, value = variable.partition("=")
            env[name] = value

    def child_env(self, base: Mapping[str, str] = os.environ) -> dict[str, str]:
        """``base`` for a child that runs this backend: every backend's variables removed, then
        this one's set."""
        env = {k: v for k, v in base.items() if k not in _backend_variables()}
        self.enable_here(env)
        return env


def _cpu_reason() -> str | None:
    return None


def _interpret_reason() -> str | None:
    if not triton_installed():
        return "triton is not installed"
    if not interpreter_enabled():
        return "TRITON_INTERPRET=1 was not set before import (use tox -e cpu)"
    return None


def _cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not triton_installed():
        return "triton is not installed"
    if interpreter_enabled():
        return "TRITON_INTERPRET=1 is set: kernels would be interpreted, not compiled"
    return None


def _cuda_triton_reason() -> str | None:
    return None if triton_installed() else "triton is not installed"


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("cpu", "cpu", False, "plain PyTorch on the CPU (reference paths)", _cpu_reason,
                runs_plain_pytorch=True, speed_rank=1, audits_kernels_on="interpret",
                kernels_audit_description="the CPU: the torch paths, and the Triton kernels under "
                                          "the interpreter (TRITON_INTERPRET=1)"),
        Backend("interpret", "cpu", True, "Triton interpreter on the CPU (TRITON_INTERPRET=1)",
                _interpret_reason, runs_plain_pytorch=False, speed_rank=2,
                process_env=("TRITON_INTERPRET=1",),
                marker="runs Triton kernels under the CPU interpreter"),
        Backend("cuda", "cuda", True, "compiled Triton on an NVIDIA GPU", _cuda_reason,
                runs_plain_pytorch=True, speed_rank=0, marker="needs a CUDA GPU (skips cleanly without one)",
                audit_presets=("magi2-ep4-local", "magi2-full"), audit_tokens=4096,
                audit_determinism_runs=20, small_audit_inputs=False, audit_threads=None,
                fuzz_size_budget=32.0, _why_unavailable_on_its_tensors=_cuda_triton_reason),
    )
}


def _backend_variables() -> set[str]:
    """The names of every backend's process variables."""
    return {v.partition("=")[0] for b in BACKENDS.values() for v in b.process_env}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}") from None


def available_backends() -> list[Backend]:
    return [b for b in BACKENDS.values() if b.available]


def by_speed(*, kernels_first: bool = False) -> list[Backend]:
    """Every backend, fastest first; with ``kernels_first`` those running Triton lead (a
    default that should exercise the kernels)."""
    return sorted(BACKENDS.values(), key=lambda b: (kernels_first and not b.runs_triton, b.speed_rank))


def backends_on(device_type: str) -> list[Backend]:
    """The backends whose tensors live on ``device_type`` devices, fastest first."""
    return [b for b in by_speed() if b.device == device_type]


def kernels_backend_on(device_type: str) -> Backend | None:
    """The backend that runs Triton kernels on tensors on ``device_type`` devices (on a CPU, the
    interpreter), or None."""
    return next((b for b in backends_on(device_type) if b.runs_triton), None)


def plain_twin(backend: Backend) -> Backend | None:
    """The backend that runs plain PyTorch on ``backend``'s device: where a plain PyTorch
    implementation's row already runs (``backend`` itself when it runs plain PyTorch)."""
    return next((b for b in backends_on(backend.device) if b.runs_plain_pytorch), None)


def default_backend() -> Backend:
    """The fastest usable backend that runs Triton kernels, else the CPU reference: CUDA when
    usable, else the interpreter when enabled, else the CPU reference."""
    for backend in by_speed(kernels_first=True):
        if backend.available:
            return backend
    raise AssertionError("the cpu backend is always available")
