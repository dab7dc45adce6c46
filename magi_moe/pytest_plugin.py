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

Each implementation test names the contract clause it judges (``@pytest.mark.clause("accuracy")``,
:mod:`magi_moe.verdict`); the run ends with the verdict, one row per clause and implementation
on a backend (PASS, FAIL with a count and the command that reruns the first failure, NOT
DECLARED, UNSUPPORTED, NOT RUN), written as Markdown and JSON by ``--verdict-dir DIR``.

The verdict reads data, never a message: a skip's kind from its reason when that is a
:class:`~magi_moe.verdict.SkipReason` (``pytest.skip(V.not_declared("..."))``; a plain reason
is NOT RUN), a failure's root cause from its exception
(:class:`~magi_moe.verdict.CountedUnderAccuracy`, itself or one it was raised from).

A run in which an implementation named by ``--impl`` ran no test, or in which every
implementation test was skipped, fails with exit status 5 and says why (the most common skip
reasons), unless ``--allow-vacuous`` is given. A ``--verdict-dir`` that cannot be written at
the end is exit status 4 (a usage error, as one refused at the start), with one line saying why.
"""
from __future__ import annotations

import json
import shlex
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from .backends import BACKENDS, Backend
from .implementation import Implementation, UnsupportedShape
from .registry import get_implementation, implementations
from . import verdict as V

VACUOUS_EXIT = pytest.ExitCode.NO_TESTS_COLLECTED  # 5: "nothing was tested"
_IMPL_PROPERTY = "magi_moe_impl"
_CLAUSE_PROPERTY = "magi_moe_clause"
_SUBJECT_PROPERTY = "magi_moe_subject"
_REPRO_PROPERTY = "magi_moe_repro"
_SKIP_KIND_PROPERTY = "magi_moe_skip_kind"
_CAUSE_PROPERTY = "magi_moe_cause"
VERDICT_NOT_WRITTEN_EXIT = pytest.ExitCode.USAGE_ERROR  # 4: --verdict-dir unusable, as at the start


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
    group.addoption("--verdict-dir", default=None, metavar="DIR",
                    help="write the per-clause verdict as DIR/verdict.md and DIR/verdict.json")


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
    config.addinivalue_line("markers", "clause(name): the contract clause this implementation test "
                                       "judges (magi_moe.verdict), reported in the verdict table")
    config.addinivalue_line("markers", "dtypes(*dtypes): with impl_dtype, run only the declared "
                                       "dtypes among these")
    config.addinivalue_line("markers", "backends(*names): run the implementation matrix on these "
                                       "backends only")
    for backend in BACKENDS.values():
        if backend.marker:
            config.addinivalue_line("markers", f"{backend.name}: {backend.marker}")
    # The suite's own markers, for the installed tests (a checkout's pyproject.toml has them too).
    config.addinivalue_line("markers", "slow: tens of seconds each; -m 'not slow' is the quick run")
    config.addinivalue_line("markers", "serial: needs the GPU's memory to itself (run without xdist)")
    config.addinivalue_line("markers", "benchmark: pytest-benchmark timing tests")
    _check_verdict_dir(config.getoption("--verdict-dir", default=None))
    config._magi_moe_tally = Tally(config)
    config.pluginmanager.register(config._magi_moe_tally, "magi_moe_tally")
    if config.getoption("--impl", None):
        # `--impl team_kernel:IMPL` from the team's directory: importable under a bare `pytest`
        # (which, unlike `python -m pytest`, leaves the current directory off sys.path) and in
        # pytest-xdist workers, as in `magi-moe check`
        from .cli import use_current_directory

        use_current_directory()
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
        if kernels_only and impl.is_oracle:
            continue
        impl_dtypes = None if dtypes is None else declared_dtypes(impl, dtypes)
        if impl_dtypes == []:
            continue
        for backend in selected_backends(config):
            if backend.name not in impl.backends or backends and backend.name not in backends:
                continue
            pair = ImplOnBackend(impl, backend)
            marks = [getattr(pytest.mark, backend.name)] if backend.marker else []
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
        outcome.force_exception(pytest.skip.Exception(V.unsupported(f"unsupported: {exc}"),
                                                      _use_item_location=True))


def clause_of(item) -> str:
    """The clause an implementation test judges: its ``clause`` marker (the closest, so a
    parameter's mark wins over the function's), else ``other``."""
    mark = item.get_closest_marker("clause")
    if mark is None or not mark.args:
        return "other"
    V.clause(mark.args[0])  # an unknown name fails loudly at the first report
    return mark.args[0]


def _impl_spec(config, impl: Implementation) -> str:
    """How this run named ``impl`` (a ``package.module:attr`` spec reloads in a fresh process)."""
    for spec in config.getoption("--impl"):
        try:
            if get_implementation(spec).name == impl.name:
                return spec
        except (ValueError, TypeError):
            continue
    return impl.name


def repro_command(item, pair: ImplOnBackend) -> str:
    """The command that reruns ``item`` alone, from the directory this run started in."""
    config = item.config
    target = f"{Path(item.path).resolve()}::{item.name}"
    parts = ["python", "-m", "pytest", target, "--impl", _impl_spec(config, pair.impl),
             "--backend", pair.backend.name, "-p", "no:cacheprovider"]
    profile = config.getoption("--hypothesis-profile", default=None)
    if profile:
        parts += ["--hypothesis-profile", profile]
    return pair.backend.env_prefix() + " ".join(shlex.quote(p) for p in parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    is_impl_test, pair = _impl_pair(item)
    if report.when in ("setup", "call") and is_impl_test:
        # user_properties travel with the report, also from xdist workers
        report.user_properties.append(
            (_IMPL_PROPERTY, pair.impl.name if isinstance(pair, ImplOnBackend) else ""))
        if isinstance(pair, ImplOnBackend):
            report.user_properties += [(_CLAUSE_PROPERTY, clause_of(item)),
                                       (_SUBJECT_PROPERTY, str(pair))]
            exc = call.excinfo.value if call.excinfo is not None else None
            if report.skipped:  # the kind its reason carries (pytest.skip keeps the object)
                kind = V.skip_kind(getattr(exc, "msg", None))
                report.user_properties.append((_SKIP_KIND_PROPERTY, kind))
            if report.failed:
                report.user_properties.append((_REPRO_PROPERTY, repro_command(item, pair)))
                cause = V.cause_of(exc)
                if cause:
                    report.user_properties.append((_CAUSE_PROPERTY, cause))


class Tally:
    """Per implementation: tests run (passed or failed) and skip reasons, from test reports."""

    def __init__(self, config):
        self.config = config
        self.ran: Counter[str] = Counter()
        self.skipped: dict[str, Counter[str]] = defaultdict(Counter)
        self.impl_tests = 0
        self.outcomes: list[V.Outcome] = []

    def pytest_runtest_logreport(self, report) -> None:
        """Each test report (in the xdist controller for its workers' reports too)."""
        props = dict(report.user_properties)
        name = props.get(_IMPL_PROPERTY)
        if name is None:
            return
        if report.skipped and report.when in ("setup", "call"):
            self.impl_tests += 1
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = reason.removeprefix("Skipped: ")
            self.skipped[name or "(none)"][reason] += 1
            self._outcome(report, props, V.Status.SKIP, reason)
        elif report.when == "call" or report.failed:  # an error in setup is a failure too
            self.impl_tests += 1
            self.ran[name] += 1
            self._outcome(report, props, V.Status.FAIL if report.failed else V.Status.PASS,
                          _failure_line(report) if report.failed else "")

    def _outcome(self, report, props: dict, status: V.Status, detail: str) -> None:
        if _SUBJECT_PROPERTY in props:
            self.outcomes.append(V.Outcome(
                props[_SUBJECT_PROPERTY], props[_CLAUSE_PROPERTY], status, report.nodeid, detail,
                props.get(_REPRO_PROPERTY, ""), kind=props.get(_SKIP_KIND_PROPERTY),
                cause=props.get(_CAUSE_PROPERTY)))

    def verdict(self) -> dict[str, list[V.ClauseVerdict]]:
        return V.verdict_rows(self.outcomes)

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
        elif not self.config.getoption("--backend"):
            out += self._untested_kernels()
        return out

    def _untested_kernels(self) -> list[str]:
        """A whole run (no --impl, no --backend) in which no Triton kernel ran: every row of the
        backends that run them was skipped as unavailable (interpreter off, no GPU)."""
        def backend(o): return o.subject.rpartition("@")[2]
        kernel_rows = [o for o in self.outcomes if getattr(BACKENDS.get(backend(o)), "runs_triton", False)]
        if not kernel_rows or any(o.status is not V.Status.SKIP for o in kernel_rows):
            return []
        reasons = Counter(o.detail for o in kernel_rows)
        top = "; ".join(f"{n} x {r}" for r, n in reasons.most_common(2))
        return [f"no Triton kernel was tested: all {len(kernel_rows)} kernel rows were skipped "
                f"({top}); set TRITON_INTERPRET=1 without a GPU, or select --backend cpu"]

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
    if tally is None or hasattr(config, "workerinput"):  # an xdist worker: the controller decides
        return
    if tally.outcomes:
        config._magi_moe_verdict = tally.verdict()
        try:
            config._magi_moe_verdict_written = _write_verdict(config, config._magi_moe_verdict)
        except OSError as exc:  # a verdict the job cannot read is no result: never exit 0
            config._magi_moe_verdict_error = (f"--verdict-dir: cannot write the verdict: {exc} "
                                              f"(exit status {int(VERDICT_NOT_WRITTEN_EXIT)})")
            session.exitstatus = VERDICT_NOT_WRITTEN_EXIT
            return
    if exitstatus != pytest.ExitCode.OK or config.getoption("--allow-vacuous"):
        return
    problems = tally.problems()
    if problems:
        config._magi_moe_vacuous = problems
        session.exitstatus = VACUOUS_EXIT


def _failure_line(report) -> str:
    """The failure's own message, one line: the exception, not the traceback."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1:]
    text = text if isinstance(text, str) else " ".join(text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "failed").strip()[:400]


def _check_verdict_dir(where: str | None) -> None:
    """Refuse, before any test runs, a --verdict-dir that could not be written at the end."""
    if not where:
        return
    path = Path(where)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise pytest.UsageError(f"--verdict-dir must be a directory or a path under one, "
                                        f"but {part} is a file")
            break


def _write_verdict(config, table) -> Path | None:
    where = config.getoption("--verdict-dir")
    if not where:
        return None
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdict.md").write_text(V.markdown(table) + "\n")
    (out / "verdict.json").write_text(json.dumps(V.as_json(table), indent=1) + "\n")
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    table = getattr(config, "_magi_moe_verdict", None)
    if table is not None:
        terminalreporter.section("magi-moe verdict: one row per contract clause", sep="=", bold=True)
        for line in V.text_lines(table):
            terminalreporter.line(line, red=" FAIL " in line, green=line.endswith(": PASS"))
        error = getattr(config, "_magi_moe_verdict_error", None)
        written = getattr(config, "_magi_moe_verdict_written", None)
        if error:
            terminalreporter.line(error, red=True)
        elif written is not None:
            terminalreporter.line(f"verdict written to {written / 'verdict.md'} and "
                                  f"{written / 'verdict.json'}")
    problems = getattr(config, "_magi_moe_vacuous", None)
    if problems:
        terminalreporter.section("magi-moe: nothing was tested", sep="=", red=True, bold=True)
        for line in problems:
            terminalreporter.line(line, red=True)
        terminalreporter.line("(exit status 5; --allow-vacuous accepts such a run)")
