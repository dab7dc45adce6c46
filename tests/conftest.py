"""Implementations and backends as test parameters.

``--impl NAME`` (repeatable; a registered name or ``package.module:attr``) and ``--backend NAME``
(repeatable) narrow the matrix; by default every registered implementation runs on every backend
it declares, and a pair whose backend is missing here is skipped with the reason.

Tests ask for ``impl_backend`` (an ``ImplOnBackend``) and get one test per pair, named
``[native@interpret]`` so ``-k`` selects them.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from magi_moe.backends import BACKENDS, Backend
from magi_moe.registry import Implementation, get_implementation, implementations

try:  # Hypothesis profiles (ci / dev / nightly): --hypothesis-profile, else $HYPOTHESIS_PROFILE, else ci
    from fuzz.profiles import load_default_profile
except ImportError:  # the fuzz package is optional for the core suite
    load_default_profile = None


@dataclass(frozen=True)
class ImplOnBackend:
    impl: Implementation
    backend: Backend

    @property
    def device(self) -> str:
        return self.backend.device

    def __str__(self) -> str:
        return f"{self.impl.name}@{self.backend.name}"


def pytest_addoption(parser):
    group = parser.getgroup("magi-moe")
    group.addoption("--impl", action="append", default=[],
                    help="implementation under test (registered name or package.module:attr); repeatable")
    group.addoption("--backend", action="append", default=[],
                    help=f"backend to test, one of {sorted(BACKENDS)}; repeatable")


def selected_impls(config) -> list[Implementation]:
    names = config.getoption("--impl")
    return [get_implementation(n) for n in names] if names else implementations()


def selected_backends(config) -> list[Backend]:
    names = config.getoption("--backend") or list(BACKENDS)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"--backend must be one of {sorted(BACKENDS)}, got {unknown}")
    return [BACKENDS[n] for n in names]


def _pairs(config, *, triton_only: bool = False, needs: tuple[str, ...] = ()):
    params = []
    for impl in selected_impls(config):
        for backend in selected_backends(config):
            if backend.name not in impl.backends:
                continue
            if triton_only and not backend.runs_triton:
                continue
            pair = ImplOnBackend(impl, backend)
            marks = [getattr(pytest.mark, backend.name)] if backend.name in ("cuda", "interpret") else []
            reason = impl.skip_reason(backend, needs=needs)
            if reason:
                marks.append(pytest.mark.skip(reason=reason))
            params.append(pytest.param(pair, id=str(pair), marks=marks))
    return params


def pytest_generate_tests(metafunc):
    """``impl_backend``: every (implementation, backend) pair. A test may narrow it with
    ``@pytest.mark.needs("deterministic", ...)`` (capabilities) or ``@pytest.mark.kernels_only``."""
    if "impl_backend" not in metafunc.fixturenames:
        return
    needs_mark = metafunc.definition.get_closest_marker("needs")
    needs = tuple(needs_mark.args) if needs_mark else ()
    kernels_only = metafunc.definition.get_closest_marker("kernels_only") is not None
    params = _pairs(metafunc.config, needs=needs)
    if kernels_only:
        params = [p for p in params if p.values[0].impl.precision != "float64"]
    metafunc.parametrize("impl_backend", params or [pytest.param(None, marks=pytest.mark.skip(
        reason="no implementation/backend pair selected"))])


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*capabilities): run only implementations declaring them")
    config.addinivalue_line("markers", "kernels_only: skip the float64 oracle itself")
    if load_default_profile is not None:
        try:
            load_default_profile(config.getoption("--hypothesis-profile", default=None))
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None


@pytest.fixture(scope="session")
def reference_impl() -> Implementation:
    return get_implementation("reference")


@pytest.fixture(scope="session")
def baseline_impl() -> Implementation:
    return get_implementation("torch-bf16")


@pytest.fixture
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device("cuda")


@pytest.fixture(params=[pytest.param("interpret", marks=pytest.mark.interpret),
                        pytest.param("cuda", marks=pytest.mark.cuda)])
def triton_device(request) -> torch.device:
    """Each backend that runs Triton kernels; skipped with the reason where it is missing."""
    why = BACKENDS[request.param].unavailable_reason()
    if why:
        pytest.skip(f"backend {request.param} unavailable: {why}")
    return torch.device(BACKENDS[request.param].device)


@pytest.fixture
def single_thread():
    """Many small float64 ops: one torch thread avoids oversubscribing the 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
