"""magi-moe's pytest plugin: the implementation under test as a test parameter, and no green
run that tested nothing.

Installed as a ``pytest11`` entry point (so ``pytest --pyargs magi_moe.tests --impl mypkg:IMPL``
works from any directory) and loaded by the checkout's ``tests/conftest.py``. It stays inert
in test suites that do not use it: only tests asking for ``impl_backend`` are parametrized and
counted.

``--impl NAME`` (repeatable; a registered name, ``package.module:attr`` or an entry point) and
``--backend NAME`` (repeatable) narrow the matrix; by default every registered implementation
runs on every backend it declares, and a pair whose backend is missing here is skipped with the
reason. Tests ask for ``impl_backend`` (an :class:`ImplOnBackend`) and get one test per pair,
named ``[native@interpret]`` so ``-k`` selects them; ``@pytest.mark.needs("deterministic")``
narrows to implementations declaring capabilities, ``@pytest.mark.kernels_only`` drops the
float64 oracle, ``@pytest.mark.backends("cuda")`` keeps only those backends' rows.

A test that also asks for ``impl_dtype`` runs once per dtype the implementation declares
(``Implementation.dtypes``), named ``[fused@interpret-bfloat16]``; ``@pytest.mark.dtypes(...)``
narrows to those dtypes, and an implementation declaring none of them gets no row (nothing to
skip). Outside the matrix, :func:`impl_dtype_params` gives the same declared pairs for a fixed
list of implementations (``[fused-float16]``).

A run in which an implementation named by ``--impl`` ran no test, or in which every
implementation test was skipped, fails with exit status 5 and says why (the most common skip
reasons), unless ``--allow-vacuous`` is given.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import torch

from .backends import BACKENDS, Backend
from .implementation import Implementation, UnsupportedShape
from .registry import get_implementation, implementations

VACUOUS_EXIT = pytest.ExitCode.NO_TESTS_COLLECTED  # 5: "nothing was tested"
_IMPL_PROPERTY = "magi_moe_impl"


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
                    help="implementation under test: a registered name, package.module:attr, or an "
                         "installed entry point of group magi_moe.implementations; repeatable")
    group.addoption("--backend", action="append", default=[],
                    help=f"backend to test, one of {sorted(BACKENDS)}; repeatable (default: all)")
    group.addoption("--allow-vacuous", action="store_true",
                    help="exit 0 even when an implementation asked for ran no test")
    group.addoption("--conformance", action="store_true",
                    help="run only the tests parametrized by the implementation under test "
                         "(what `magi-moe check` runs against an outside implementation)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--conformance"):
        return
    keep, drop = [], []
    for item in items:
        (keep if _impl_pair(item)[0] else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*capabilities): run only implementations declaring them")
    config.addinivalue_line("markers", "kernels_only: skip the float64 oracle itself")
    config.addinivalue_line("markers", "dtypes(*dtypes): with impl_dtype, run only the declared "
                                       "dtypes among these")
    config.addinivalue_line("markers", "backends(*names): run the implementation matrix on these "
                                       "backends only")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skips cleanly without one)")
    config.addinivalue_line("markers", "interpret: runs Triton kernels under the CPU interpreter")
    # The suite's own markers, for the installed tests (a checkout's pyproject.toml has them too).
    config.addinivalue_line("markers", "slow: tens of seconds each; -m 'not slow' is the quick run")
    config.addinivalue_line("markers", "serial: needs the GPU's memory to itself (run without xdist)")
    config.addinivalue_line("markers", "benchmark: pytest-benchmark timing tests")
    config._magi_moe_tally = Tally(config)
    config.pluginmanager.register(config._magi_moe_tally, "magi_moe_tally")
    if config.getoption("--impl", None):
        selected_impls(config)  # a bad --impl: one usage error now, not one per test module


def selected_impls(config) -> list[Implementation]:
    names = config.getoption("--impl")
    try:
        return [get_implementation(n) for n in names] if names else implementations()
    except (ValueError, TypeError) as exc:
        raise pytest.UsageError(f"--impl: {exc}") from None


def selected_backends(config) -> list[Backend]:
    names = config.getoption("--backend") or list(BACKENDS)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"--backend must be one of {sorted(BACKENDS)}, got {unknown}")
    return [BACKENDS[n] for n in names]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def declared_dtypes(impl: Implementation, only: tuple[torch.dtype, ...] = ()) -> list[torch.dtype]:
    """The dtypes ``impl`` declares, in its order, narrowed to ``only`` when given."""
    return [d for d in impl.dtypes if not only or d in only]


def impl_dtype_params(impls, *, dtypes: tuple[torch.dtype, ...] = ()) -> list:
    """``pytest.param(impl, dtype, id="fused-bfloat16")`` for every dtype each implementation
    declares (narrowed to ``dtypes`` when given): only declared pairs, so none is skipped.
    For ``@pytest.mark.parametrize("impl, dtype", impl_dtype_params([FUSED]))``."""
    return [pytest.param(impl, dtype, id=f"{impl.name}-{dtype_name(dtype)}")
            for impl in impls for dtype in declared_dtypes(impl, dtypes)]


def impl_backend_params(config, *, needs: tuple[str, ...] = (), kernels_only: bool = False,
                        dtypes: tuple[torch.dtype, ...] | None = None,
                        backends: tuple[str, ...] = ()):
    """Every selected (implementation, backend) pair as a ``pytest.param``; a pair that cannot
    run here is marked skip with the reason. ``backends`` (names) keeps only those backends.

    With ``dtypes`` (a tuple, empty for "all"): ``(pair, dtype)`` params for each dtype the
    implementation declares among them (``[fused@interpret-bfloat16]``); an implementation that
    declares none gets no param, and a pair that cannot run here gets one skipped param (dtype
    None) instead of one per dtype."""
    params = []
    for impl in selected_impls(config):
        if kernels_only and impl.precision == "float64":
            continue
        impl_dtypes = None if dtypes is None else declared_dtypes(impl, dtypes)
        if impl_dtypes == []:
            continue
        for backend in selected_backends(config):
            if backend.name not in impl.backends or backends and backend.name not in backends:
                continue
            pair = ImplOnBackend(impl, backend)
            marks = [getattr(pytest.mark, backend.name)] if backend.name in ("cuda", "interpret") else []
            reason = impl.skip_reason(backend, needs=needs)
            if reason:
                marks.append(pytest.mark.skip(reason=reason))
            if impl_dtypes is None:
                params.append(pytest.param(pair, id=str(pair), marks=marks))
            elif reason:
                params.append(pytest.param(pair, None, id=str(pair), marks=marks))
            else:
                params.extend(pytest.param(pair, d, id=f"{pair}-{dtype_name(d)}", marks=marks)
                              for d in impl_dtypes)
    return params


def _impl_pair(item) -> tuple[bool, ImplOnBackend | None]:
    """Whether ``item`` tests an implementation, and its pair: a test parametrized by
    ``impl_backend`` (``None`` when no pair was selected), or one with another parameter holding
    an :class:`ImplOnBackend` (the fuzz properties' rows build their own pairs)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "impl_backend" in params:
        return True, params["impl_backend"]
    pair = next((v for v in params.values() if isinstance(v, ImplOnBackend)), None)
    return pair is not None, pair


def pytest_generate_tests(metafunc):
    if "impl_backend" not in metafunc.fixturenames:
        return
    definition = metafunc.definition
    needs_mark = definition.get_closest_marker("needs")
    dtypes_mark = definition.get_closest_marker("dtypes")
    backends_mark = definition.get_closest_marker("backends")
    unknown = [b for b in (backends_mark.args if backends_mark else ()) if b not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"{definition.nodeid}: @pytest.mark.backends takes names among "
                                f"{sorted(BACKENDS)}, got {unknown}")
    with_dtype = "impl_dtype" in metafunc.fixturenames
    if dtypes_mark is not None and not with_dtype:
        raise pytest.UsageError(f"{definition.nodeid}: @pytest.mark.dtypes needs the impl_dtype argument")
    params = impl_backend_params(
        metafunc.config, needs=tuple(needs_mark.args) if needs_mark else (),
        kernels_only=definition.get_closest_marker("kernels_only") is not None,
        dtypes=(tuple(dtypes_mark.args) if dtypes_mark else ()) if with_dtype else None,
        backends=tuple(backends_mark.args) if backends_mark else ())
    if with_dtype:
        wanted = ", ".join(map(dtype_name, dtypes_mark.args)) if dtypes_mark else "any dtype"
        metafunc.parametrize(("impl_backend", "impl_dtype"), params or [pytest.param(
            None, None, marks=pytest.mark.skip(
                reason=f"no selected implementation declares {wanted}"))])
        return
    metafunc.parametrize("impl_backend", params or [pytest.param(None, marks=pytest.mark.skip(
        reason="no implementation/backend pair selected"))])


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A fixed case outside the implementation's declared shapes is skipped with the reason
    (``UnsupportedShape`` from the harness), never reported as a failure."""
    outcome = yield
    exc = outcome.exception if hasattr(outcome, "exception") else (
        outcome.excinfo[1] if outcome.excinfo else None)
    if isinstance(exc, UnsupportedShape):
        outcome.force_exception(pytest.skip.Exception(f"unsupported: {exc}", _use_item_location=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    is_impl_test, pair = _impl_pair(item)
    if report.when in ("setup", "call") and is_impl_test:
        # user_properties travel with the report, also from xdist workers
        report.user_properties.append(
            (_IMPL_PROPERTY, pair.impl.name if isinstance(pair, ImplOnBackend) else ""))


class Tally:
    """Per implementation: tests run (passed or failed) and skip reasons, from test reports."""

    def __init__(self, config):
        self.config = config
        self.ran: Counter[str] = Counter()
        self.skipped: dict[str, Counter[str]] = defaultdict(Counter)
        self.impl_tests = 0

    def pytest_runtest_logreport(self, report) -> None:
        """Each test report (in the xdist controller for its workers' reports too)."""
        name = next((v for k, v in report.user_properties if k == _IMPL_PROPERTY), None)
        if name is None:
            return
        if report.skipped and report.when in ("setup", "call"):
            self.impl_tests += 1
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped[name or "(none)"][reason.removeprefix("Skipped: ")] += 1
        elif report.when == "call":
            self.impl_tests += 1
            self.ran[name] += 1

    def problems(self) -> list[str]:
        """Why this run tested nothing it was asked to, or an empty list."""
        asked = self.config.getoption("--impl")
        out = []
        if asked:
            for spec in asked:
                impl = get_implementation(spec)
                if not self.ran[impl.name]:
                    out.append(self._explain(f"--impl {spec} ran no test", impl.name))
        elif self.impl_tests and not sum(self.ran.values()):
            out.append(self._explain("every implementation test was skipped", None))
        return out

    def _explain(self, head: str, name: str | None) -> str:
        reasons = Counter()
        for impl, counter in self.skipped.items():
            if name is None or impl == name:
                reasons.update(counter)
        if not reasons:
            return f"{head}: none was selected (check -k, -m and --backend)"
        top = "; ".join(f"{n} x {r}" for r, n in reasons.most_common(3))
        return f"{head}: {sum(reasons.values())} skipped ({top})"


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    tally = getattr(config, "_magi_moe_tally", None)
    if tally is None or exitstatus != pytest.ExitCode.OK or config.getoption("--allow-vacuous"):
        return
    if hasattr(config, "workerinput"):  # an xdist worker: the controller decides
        return
    problems = tally.problems()
    if problems:
        config._magi_moe_vacuous = problems
        session.exitstatus = VACUOUS_EXIT


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    problems = getattr(config, "_magi_moe_vacuous", None)
    if problems:
        terminalreporter.section("magi-moe: nothing was tested", sep="=", red=True, bold=True)
        for line in problems:
            terminalreporter.line(line, red=True)
        terminalreporter.line("(exit status 5; --allow-vacuous accepts such a run)")
