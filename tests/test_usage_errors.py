"""What an outside team meets first: every refused argument of ``magi-moe``, ``python -m audit``
and ``python -m fuzz`` is one line on stderr naming the argument and what was expected, with
exit status 2, before any work starts; a finished audit is never lost (a section that raises,
matplotlib missing); declaration mistakes say what to write instead. In-process where the
command allows it (fast), in a child process where the console's own output is the point."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magi_moe import cli, plugins, registry
from magi_moe.implementation import Implementation

SPEC = "magi_moe.tests.outside_impl_example:IMPL"
FORWARD_SPEC = "magi_moe.tests.outside_impl_example:einsum_forward"


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value.startswith("magi_moe.pytest_plugin") for ep in entry_points(group="pytest11"))


# A child pytest outside the checkout gets --impl from the installed pytest11 plugin only (a
# machine that runs the checkout through PYTHONPATH, like the GPU machine, has none).
needs_installed_plugin = pytest.mark.skipif(
    not _plugin_installed(), reason="magi_moe is not installed (pip install -e .): a child pytest "
                                    "outside the checkout loads its plugin from the installed entry point")


@pytest.fixture(autouse=True)
def _restore_process_state(monkeypatch):
    """Registry, sys.path and PYTHONPATH as they were: the commands change all three."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(plugins, "_loaded", dict(plugins._loaded))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def refused(capsys, run) -> str:
    """Run a command that must refuse its arguments; returns its one stderr line."""
    try:
        code = run()
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    assert code == 2
    captured = capsys.readouterr()
    assert not captured.out.strip(), captured.out
    return one_line(captured.err)


# -- magi-moe ------------------------------------------------------------------------------------

def test_an_unknown_command_is_named(capsys):
    line = refused(capsys, lambda: cli.main(["nope"]))
    assert "'nope'" in line and "audit, check, fuzz, example" in line


@pytest.mark.parametrize("impl, says", [
    ("nope_module:X", "importing 'nope_module' failed"),
    ("no-such-impl", "got 'no-such-impl'"),
    (FORWARD_SPEC, "needs arguments (x, table, weights, config, out)"),
])
def test_check_refuses_a_bad_impl_before_pytest(capsys, impl, says):
    line = refused(capsys, lambda: cli.main(["check", impl, "--backend", "cpu"]))
    assert line.startswith("magi-moe check: --impl:") and says in line


def test_check_reads_backend_after_the_impl(capsys):
    line = refused(capsys, lambda: cli.main(["check", SPEC, "--backend", "gpu"]))
    assert "--backend must be one of" in line and "'gpu'" in line


def test_console_prints_one_line_for_a_bad_impl(tmp_path):
    """The whole console script, as the team runs it: one line, exit 2, nothing else."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "magi_moe.cli", "check", "team_kernel:IMPL"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "importing 'team_kernel' failed" in one_line(proc.stderr)


@needs_installed_plugin
def test_pytest_says_a_bad_impl_once(tmp_path):
    """Not once per test module (ten copies of pluggy's stack): one usage error."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "magi_moe.tests", "--impl", "nope_module:X",
                           "-p", "no:cacheprovider", "-q"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-2000:]  # pytest's usage-error status
    # pytest's own framing differs between releases (some print a usage line first): the error
    # itself is said once, with no traceback
    lines = [line for line in text.splitlines() if line.strip()]
    assert text.count("importing 'nope_module' failed") == 1 and "Traceback" not in text, text
    assert len(lines) <= 2 and "importing 'nope_module' failed" in lines[-1], text


# -- audit ---------------------------------------------------------------------------------------

def audit_main(argv):
    from magi_moe.audit.cli import main

    return main(argv)


@pytest.mark.parametrize("argv, says", [
    (["--impl", "nope"], "--impl: implementation must be one of"),
    (["--impl", FORWARD_SPEC], "needs arguments"),
    (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--preset", "nah"], "--preset must be one of"),
])
def test_audit_refuses_bad_arguments(capsys, argv, says):
    assert says in refused(capsys, lambda: audit_main(argv))


@pytest.mark.parametrize("under", ["a-file", "a-file/report"])
def test_audit_out_under_a_regular_file_is_refused_before_the_run(capsys, tmp_path, under):
    (tmp_path / "a-file").write_text("not a directory")
    line = refused(capsys, lambda: audit_main(["--out", str(tmp_path / under)]))
    assert "--out must be a directory" in line


@dataclasses.dataclass(frozen=True)
class RaisingSupports(Implementation):
    """An outside declaration whose own supports() raises."""

    def supports(self, config, dtype=None):
        raise RuntimeError("supports exploded")


def quick_audit(tmp_path, impl, capsys) -> tuple[int, dict, str]:
    from magi_moe.audit.report import Audit, AuditOptions

    options = AuditOptions(backend="cpu", impls=[impl], tokens=16, probes=("random",),
                           out=tmp_path / "report", controls=False, mp_validation=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = Audit(options).run()
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    return code, report, capsys.readouterr().out


def test_a_raising_supports_is_a_failure_row_and_the_report_is_written(tmp_path, capsys):
    from magi_moe.tests.outside_impl_example import IMPL

    fields = {f.name: getattr(IMPL, f.name) for f in dataclasses.fields(IMPL)}
    impl = RaisingSupports(**{**fields, "name": "raising-supports"})
    code, report, _ = quick_audit(tmp_path, impl, capsys)
    assert code == 1
    stopped = [r for r in report["rows"] if r["subject"] == "section stopped"]
    assert stopped and all("supports exploded" in r["result"] for r in stopped)
    assert (tmp_path / "report" / "report.md").read_text().startswith("# magi-moe audit: FAILED")


def test_without_matplotlib_the_report_is_written_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    code, report, out = quick_audit(tmp_path, SPEC, capsys)
    assert code == 0, out
    assert "matplotlib is not installed" in report["meta"]["plots"]
    assert "plots not written: matplotlib is not installed" in out
    assert not list((tmp_path / "report").glob("*.png"))


def test_the_header_says_the_cpu_backend_audits_the_kernels_under_the_interpreter():
    from magi_moe.audit import report
    from magi_moe.backends import BACKENDS

    text = report.backend_description(BACKENDS["cpu"])
    if BACKENDS["interpret"].available:
        assert "Triton kernels under the interpreter" in text
    else:
        assert text == BACKENDS["cpu"].description


# -- fuzz ----------------------------------------------------------------------------------------

def fuzz_main(argv):
    from magi_moe.fuzz.cli import main

    return main(argv)


@pytest.mark.parametrize("argv, says", [
    (["--budget-seconds", "nan"], "argument --budget-seconds: expected a finite number > 0, got 'nan'"),
    (["--budget-seconds", "-1"], "expected a finite number > 0, got '-1'"),
    (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    (["--impl", "nonexistent"], "--impl: implementation must be one of"),
    (["--properties", "diferential"], "got 'diferential' (did you mean 'differential'?)"),
    (["--workers", "-1"], "--workers must be >= 0, got -1"),
    (["replay", "{not json"], "RECORD must be a record's JSON or a failure file"),
    (["rerun", "nope.py::x", "--db", "db", "--backend", "cpu"], "NODEID must name a test of the fuzz suite"),
    (["rerun", "test_fuzz_stateful.py::x", "--db", "db", "--backend", "gpu"], "invalid choice: 'gpu'"),
])
def test_fuzz_refuses_bad_arguments_before_any_work(capsys, tmp_path, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, lambda: fuzz_main(argv + (["--out", "out"] if argv[0].startswith("--") else [])))
    assert says in line
    assert not (tmp_path / "out").exists(), "work started before the arguments were checked"


@pytest.mark.parametrize("printed", [
    "tests/test_fuzz_stateful.py::test_weight_swaps[fused@cpu]",           # by a checkout
    "magi_moe/tests/test_fuzz_stateful.py::test_weight_swaps[fused@cpu]",  # by a wheel
    "test_fuzz_stateful.py::test_weight_swaps[fused@cpu]",
])
def test_rerun_finds_a_printed_node_in_a_checkout_or_a_wheel(printed):
    from magi_moe.fuzz.campaign import REPO_ROOT, resolve_nodeid

    found = resolve_nodeid(printed)
    assert found is not None and found.endswith("::test_weight_swaps[fused@cpu]")
    assert (REPO_ROOT / found.partition("::")[0]).is_file()


def test_repro_lines_name_the_installed_package():
    from magi_moe.fuzz.record import repro_command

    assert repro_command({"property": "linearity"}).startswith("python -m magi_moe.fuzz replay ")


def test_unreadable_database_records_are_passed_over(tmp_path):
    from magi_moe.fuzz import database as fuzz_db

    db = fuzz_db.open_database(str(tmp_path / "db"))
    good = {"kind": "violation", "record": {"property": "linearity", "backend": "cpu"}}
    fuzz_db.save_finding(db, good)
    for raw in (b"{truncated", b"[1, 2]", b'"a string"', b'{"record": "not a dict"}', b'{"nodeid": 3}'):
        db.save(fuzz_db.FINDINGS_KEY, raw)
    corrupt: list[bytes] = []
    findings = fuzz_db.load_findings(db, corrupt)
    assert [f["record"] for f in findings] == [good["record"]]
    assert len(corrupt) == 5


# -- declarations --------------------------------------------------------------------------------

def _declare(**changes):
    fields = dict(name="declared", forward=lambda *a, **k: None, backends=("cpu",), precision="bf16-plain")
    return Implementation(**{**fields, **changes})


@pytest.mark.parametrize("changes, says", [
    ({"dtypes": torch.bfloat16}, r"got the single dtype torch.bfloat16 \(write dtypes=\(torch.bfloat16,\)\)"),
    ({"backends": "cpu"}, r"got the string 'cpu' \(write backends=\('cpu',\)\)"),
    ({"dtypes": "bf16"}, "dtypes must be a tuple of floating torch dtypes, got str 'bf16'"),
])
def test_declaration_mistakes_say_what_to_write(changes, says):
    with pytest.raises(ValueError, match=says):
        _declare(**changes)


def test_a_forward_function_named_as_impl_is_called_what_it_is():
    with pytest.raises(ValueError, match=r"needs arguments \(x, table, weights, config, out\).*"
                                         r"Implementation\(forward=\.\.\.\)"):
        registry.get_implementation(FORWARD_SPEC)


def test_a_layer_factory_returning_a_non_module_is_refused():
    from magi_moe.config import preset

    impl = _declare(layer_factory=lambda config, state_dict, device: "not a module")
    with pytest.raises(TypeError, match="layer_factory must return a torch.nn.Module, got str"):
        impl.layer(preset("tiny"), {})


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"--fuzz-out {text}" in cmdline:  # the campaign's pytest and its workers only
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_the_campaign_pytest_ends_when_its_runner_is_killed(tmp_path):
    """SIGKILL to the runner (nothing it can catch): its pytest child, in a session of its own,
    notices and ends its whole group instead of fuzzing on unwatched."""
    import signal
    import time

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runner = subprocess.Popen([sys.executable, "-m", "magi_moe.fuzz", "--backend", "cpu", "--impl", SPEC,
                               "--properties", "differential", "--budget-seconds", "120", "--workers", "0",
                               "--out", str(out), "--db", str(tmp_path / "db")],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not _processes_mentioning(str(out)) and time.time() < deadline:
            time.sleep(0.5)
        assert _processes_mentioning(str(out)), "the campaign's pytest never started"
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        deadline = time.time() + 15
        while _processes_mentioning(str(out)) and time.time() < deadline:
            time.sleep(0.5)
        assert not _processes_mentioning(str(out)), "pytest kept running after its runner was killed"
    finally:
        if runner.poll() is None:
            runner.kill()


@needs_installed_plugin
def test_a_bare_pytest_loads_the_teams_module_from_its_directory(tmp_path):
    """`pytest --pyargs magi_moe.tests.benchmarks --impl team:IMPL` from the team's directory:
    the console script, unlike `python -m pytest`, leaves the directory off sys.path (-P here)."""
    (tmp_path / "team_module.py").write_text(
        "import dataclasses\n"
        "from magi_moe.tests.outside_impl_example import IMPL as _EXAMPLE\n"
        "IMPL = dataclasses.replace(_EXAMPLE, name='team-from-cwd')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bench = Path(__file__).resolve().parent / "test_bench_pace.py"
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", str(bench), "--co", "-q",
                           "-p", "no:cacheprovider", "--allow-vacuous", "--impl", "team_module:IMPL"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


# -- a team module that raises at import -----------------------------------------------------------

# Not an ImportError: the module itself fails (no GPU on this machine, a typo in the file).
RAISING_MODULES = {
    "team_no_gpu": ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    "team_typo": ("def forward(:\n    pass\n", "SyntaxError: "),
}


@pytest.fixture
def raising_module(tmp_path, monkeypatch, request):
    """A team module in the current directory that raises when imported; yields (spec, says)."""
    name = request.param
    source, says = RAISING_MODULES[name]
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:IMPL", says


def _load_failure(line: str, spec: str, says: str) -> None:
    assert f"cannot load implementation {spec!r}" in line and says in line, line


@pytest.mark.parametrize("raising_module", sorted(RAISING_MODULES), indirect=True)
def test_a_module_raising_at_import_is_one_line_for_check(capsys, raising_module):
    spec, says = raising_module
    line = refused(capsys, lambda: cli.main(["check", spec, "--backend", "cpu"]))
    assert line.startswith("magi-moe check: --impl:")
    _load_failure(line, spec, says)


@pytest.mark.parametrize("raising_module", sorted(RAISING_MODULES), indirect=True)
def test_a_module_raising_at_import_is_one_line_for_audit(capsys, raising_module):
    spec, says = raising_module
    _load_failure(refused(capsys, lambda: cli.main(["audit", "--impl", spec])), spec, says)


@pytest.mark.parametrize("raising_module", sorted(RAISING_MODULES), indirect=True)
def test_a_module_raising_at_import_is_one_line_for_fuzz(capsys, raising_module, tmp_path):
    spec, says = raising_module
    line = refused(capsys, lambda: cli.main(["fuzz", "--impl", spec, "--out", "out"]))
    _load_failure(line, spec, says)
    assert not (tmp_path / "out").exists(), "work started before the arguments were checked"


@pytest.mark.parametrize("raising_module", sorted(RAISING_MODULES), indirect=True)
def test_a_module_raising_at_import_is_one_line_for_bench(capsys, raising_module):
    from magi_moe.bench.__main__ import main as bench_main

    spec, says = raising_module
    line = refused(capsys, lambda: bench_main(["--device", "cpu", "--impl", spec]))
    _load_failure(line, spec, says)


def test_a_factory_raising_is_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "team_factory.py").write_text(
        "def make():\n    raise RuntimeError('CUDA driver not found\\nsecond line')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused(capsys, lambda: cli.main(["check", "team_factory:make", "--backend", "cpu"]))
    assert "its factory raised RuntimeError: CUDA driver not found" in line


def test_the_console_prints_one_line_for_a_module_raising_at_import(tmp_path):
    """The whole console script: no traceback, exit 2."""
    (tmp_path / "team_kernel.py").write_text("raise RuntimeError('no GPU here')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "magi_moe.cli", "check", "team_kernel:IMPL"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "raised RuntimeError: no GPU here" in one_line(proc.stderr)
