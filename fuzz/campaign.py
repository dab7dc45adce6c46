"""The campaign runner behind ``python -m fuzz``: pytest-xdist workers running the fuzz tests
against one shared Hypothesis example database, for a time budget.

It adds no scheduler of its own: pytest-xdist runs the workers (and replaces a dead one), the
Hypothesis database (:mod:`fuzz.database`: a directory, or Redis shared by every machine)
carries what each worker found to all the others. The runner starts
``pytest -n WORKERS -p fuzz.campaign_plugin`` on the fuzz test files in a child process group,
with ``TRITON_INTERPRET`` set or cleared for the backend; the plugin
(:mod:`fuzz.campaign_plugin`) gives every target its share of the budget and records failures.
Around that run the runner

* first replays every failure record the database holds for this backend (each in a child
  process: a crash stays a crash), before any new case; one that passes now is forgotten;
* orders the targets: those with known failures first, the rest rotated from where the last
  campaign left off (a target that got no time leads the next campaign);
* afterwards turns flight-recorder files left by dead workers into crash / device-fault /
  timeout records (replaying each once to name the signal), and a failure found while the run
  was stopped mid-shrink into a violation record; saves each into the database;
* writes ``summary.json`` (budget, totals, cases and seconds per target, the targets that got
  no time, every failure with its one-line reproduction) and ``junit.xml`` (pytest's, with a
  failure added for any record pytest did not report); every failure record counts;
* ends with the per-clause verdict (:mod:`magi_moe.verdict`: the console, ``verdict.md`` and
  ``verdict.json``), each row's clause from the target's Property record (or the machine's mark);
* prints every reproduction command and exits 1 if anything failed, 2 if no case ran at all or
  no asked-for implementation got a case.

The backend, when not given, is one that every asked-for implementation declares and that is
usable here (a GPU, then plain PyTorch on the CPU, then the Triton interpreter); a ``--backend``
an implementation does not declare, or one not usable here, is refused in one line. The targets
are found, not listed: every ``tests/test_fuzz_*.py`` with a test marked
:func:`fuzz.fuzzers.campaign_target` (the property records' test, each state machine). A
directory ``--db`` holds one example database per implementation set (``<db>/<impls>``), a Redis
``--db`` one namespace per set (``redis://...#<impls>``: key prefix and local directory), unless
``--shared-db``.

``--replay-only`` is the per-commit run: the database is opened read-only, every saved example
and every failure record is replayed (records on this backend, whatever backend found them),
and nothing new is generated or written.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from magi_moe.arguments import OneLineParser, finite_non_negative, finite_positive, refuse
from magi_moe.backends import BACKENDS, by_speed, get_backend
from magi_moe.cli import refuse_bad_impl

from . import database as fuzz_db
from .cli import program_name
from .fuzzers import PROPERTIES
from .huge import REPO_ROOT, child_env
from .record import REPLAY_UNAVAILABLE
from .profiles import FUZZ_DATABASE

__all__ = ["DEFAULT_TESTS", "build_pytest_command", "campaign_main", "rerun_main"]

# The fuzz tests beside this package (the checkout's tests/, or magi_moe/tests/ when installed),
# relative to REPO_ROOT, where the campaign's pytest runs.
_TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
# A campaign target is a test decorated with fuzzers.campaign_target; the property records' test
# passes by_param=, every other marked test (a state machine) is a target named after itself.
_TARGET_MARK = re.compile(r"^@(?:fuzzers\.)?campaign_target\b(?P<args>\(.*\))?", re.M)
_TARGET_DEF = re.compile(r"^@(?:fuzzers\.)?campaign_target\s*\n(?:@.*\n)*def test_(?P<name>\w+)", re.M)


def campaign_test_files(tests_dir: Path = _TESTS_DIR) -> tuple[str, ...]:
    """Every ``test_fuzz_*.py`` beside this package that marks a campaign target (relative to
    REPO_ROOT): a new machine's test file is picked up by its mark, not by a list here."""
    return tuple(os.path.relpath(path, REPO_ROOT) for path in sorted(tests_dir.glob("test_fuzz_*.py"))
                 if _TARGET_MARK.search(path.read_text()))


def machine_names(tests_dir: Path = _TESTS_DIR) -> tuple[str, ...]:
    """The ``--properties`` names that are marked tests, not Property records (state machines)."""
    names = []
    for file in campaign_test_files(tests_dir):
        names += [m["name"] for m in _TARGET_DEF.finditer((REPO_ROOT / file).resolve().read_text())]
    return tuple(n for n in dict.fromkeys(names) if n not in PROPERTIES)


def machine_records(tests_dir: Path = _TESTS_DIR) -> list[dict]:
    """Each state machine's ``name``, ``clause`` and ``needs`` (its marks) and ``summary`` (its
    docstring's first sentence), read from its test's source (nothing is imported)."""
    import ast

    def mark(decorator, name):
        call = decorator if isinstance(decorator, ast.Call) else None
        if call is not None and ast.unparse(call.func) == f"pytest.mark.{name}":
            return [a.value for a in call.args if isinstance(a, ast.Constant)]
        return None

    records = []
    for file in campaign_test_files(tests_dir):
        for node in ast.parse((REPO_ROOT / file).resolve().read_text()).body:
            if not isinstance(node, ast.FunctionDef) or node.name.removeprefix("test_") not in machine_names(tests_dir):
                continue
            marks = {n: sum((mark(d, n) or [] for d in node.decorator_list), []) for n in ("clause", "needs")}
            doc = " ".join((ast.get_docstring(node) or "").split())
            records.append({"name": node.name.removeprefix("test_"), "clause": ", ".join(marks["clause"]),
                            "needs": marks["needs"], "summary": doc.split(". ")[0].rstrip(".")})
    return records


DEFAULT_TESTS = campaign_test_files()
STATE_MACHINES = machine_names()  # --properties names that are not fuzz.fuzzers.PROPERTIES
PROFILES = ("nightly", "dev", "ci")
OTHER_COMMANDS = """other commands (each takes --help):
  python -m fuzz replay RECORD|FILE                  replay one recorded case exactly; exit 1 if it still fails
  python -m fuzz rerun NODEID --db DIR --backend B   replay a failing test node from a campaign's database
  python -m fuzz list                                what a campaign can run (--properties): properties, state machines
  python -m fuzz merge OUT... --out DIR              one summary.json from the campaigns of N machines"""


def _parser() -> argparse.ArgumentParser:
    prog = program_name()
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog=OTHER_COMMANDS.replace("python -m fuzz", prog))
    p.add_argument("--backend", default=None, choices=tuple(BACKENDS),
                   help="cpu, interpret or cuda (default: one every --impl declares and usable "
                        "here: cuda on a GPU, else cpu, else interpret)")
    p.add_argument("--impl", action="append", default=[],
                   help="implementation under test (name or package.module:attr); repeatable; default: all")
    p.add_argument("--budget-seconds", type=finite_positive, default=600.0, help="time budget (default 600)")
    p.add_argument("--allow-no-kernels", action="store_true",
                   help="exit 0 even when only the oracle and the baseline ran (no kernel fuzzed)")
    p.add_argument("--seed", type=int, default=None, help="campaign seed (default: random, printed)")
    p.add_argument("--db", default=FUZZ_DATABASE,
                   help="example database (default: $FUZZ_DB, else .hypothesis/fuzz-db): a directory (one machine) or redis://host:port/N (shared by "
                        "every machine; paired with --db-local); one database per implementation set "
                        "(a directory: <db>/<impls>; Redis: the namespace redis://...#<impls>) unless --shared-db")
    p.add_argument("--shared-db", action="store_true",
                   help="use --db as it is (a directory, or Redis without a namespace), shared by every "
                        "implementation's campaigns")
    p.add_argument("--db-local", default=None,
                   help=f"local directory paired with a Redis --db (default {fuzz_db.DEFAULT_LOCAL_DIR})")
    p.add_argument("--replay-only", action="store_true",
                   help="per-commit run: replay the database read-only (saved examples and failure "
                        "records, on this backend), generate nothing")
    p.add_argument("--out", default="fuzz-out", help="output directory (summary.json, junit.xml, failures/)")
    p.add_argument("--profile", default="nightly", choices=PROFILES, help="settings the campaign derives from")
    p.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (one per core or GPU)")
    p.add_argument("--properties", action="append", default=[],
                   help=f"comma-separated properties (default: all): {', '.join(PROPERTIES)} (python -m fuzz "
                        f"list describes them), and the state machines: {', '.join(STATE_MACHINES)}")
    p.add_argument("--round-examples", type=int, default=25, help="examples per round of one test")
    p.add_argument("--first-round-examples", type=int, default=1,
                   help="examples of every target's first round, whatever the budget and the "
                        "machine's speed (default 1; rounds then double up to --round-examples)")
    p.add_argument("--case-timeout", type=finite_positive, default=600.0,
                   help="seconds after which a case is a hang")
    p.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="fuzz test files")
    p.add_argument("--grace-seconds", type=finite_non_negative, default=30.0,
                   help="time past the budget before pytest is stopped (default 30)")
    p.add_argument("--no-confirm", action="store_true", help="do not replay crashes to name the signal")
    p.add_argument("--no-shrink", action="store_true", help="report first failing examples unshrunk (faster)")
    p.add_argument("--size-budget", type=finite_positive, default=None,
                   help="shape budget of the strategies (default: 2 on the CPU, 32 on a GPU; ci: 1)")
    return p


def _unusable(backend: str, impls: list) -> str | None:
    """Why ``backend`` cannot run here (one phrase), or None."""
    from magi_moe.backends import triton_installed

    chosen = get_backend(backend)
    if chosen.device == "cuda" and _cuda_count() == 0:  # nvidia-smi: the runner starts no CUDA
        return "no CUDA GPU here"
    plain_only = chosen.runs_plain_pytorch and impls and all(i.plain_pytorch for i in impls)
    if chosen.runs_triton and not plain_only and not triton_installed():
        return "triton is not installed (the [triton] extra)"
    return None


def choose_backend(requested: str | None, impl_names: list[str]) -> tuple[str | None, str | None]:
    """``(backend, None)``, or ``(None, why)`` in one line: the asked-for backend when every
    --impl declares it and it is usable here, else the fastest that is (cuda, cpu, interpret;
    with no --impl those running kernels first: cuda, interpret, cpu)."""
    from magi_moe.registry import get_implementation

    impls = [get_implementation(name) for name in impl_names]
    if requested is not None:
        for impl in impls:
            if requested not in impl.backends:
                return None, (f"--backend {requested}: {impl.name} does not declare it (it declares "
                              f"{', '.join(impl.backends)})")
        why = _unusable(requested, impls)
        return (None, f"--backend {requested} is not usable here: {why}") if why else (requested, None)
    for backend in (b.name for b in by_speed(kernels_first=not impls)):
        if all(backend in impl.backends for impl in impls) and _unusable(backend, impls) is None:
            return backend, None
    declared = "; ".join(f"{impl.name} declares {', '.join(impl.backends)}" for impl in impls)
    return None, (f"--impl: no backend every implementation declares is usable here ({declared}; "
                  f"cuda needs a GPU, interpret the [triton] extra)")


def database_for(args) -> str:
    """The database of this campaign's implementations: ``<db>/<impls>`` for a directory, the
    namespace ``redis://...#<impls>`` for Redis (:func:`fuzz.database.namespaced`), so that the
    records and examples of one implementation never open another's campaign. --shared-db, or a
    URL that names its namespace already: as given."""
    if args.shared_db or Path(args.db).is_file():  # a file: refused as given
        return args.db
    names = sorted(args.impl) or ["all-declared"]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", "+".join(names))[:120]
    if fuzz_db.is_url(args.db):
        return args.db if "#" in args.db else fuzz_db.namespaced(args.db, name)
    return str(Path(args.db) / name)


def refused_arguments(args) -> str | None:
    """What is wrong with the campaign's arguments (one line), or None; checked before the
    database is opened or any pytest starts."""
    if args.workers < 0:
        return f"--workers must be >= 0, got {args.workers}"
    if args.round_examples < 1:
        return f"--round-examples must be >= 1, got {args.round_examples}"
    if not 1 <= args.first_round_examples <= args.round_examples:
        return (f"--first-round-examples must be between 1 and --round-examples "
                f"({args.round_examples}), got {args.first_round_examples}")
    known = (*PROPERTIES, *STATE_MACHINES)
    for name in (p.strip() for group in args.properties for p in group.split(",")):
        if name and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"--properties must name properties among {', '.join(known)}, got {name!r}{hint}"
    for name in args.impl:
        why = refuse_bad_impl(name)
        if why:
            return why
    from .child import default_memory_cap

    try:  # read by every child: refused here, before any case could blame an implementation
        default_memory_cap()
    except ValueError as exc:
        return str(exc)
    return None


def _cuda_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def build_pytest_command(args, *, backend: str, out: Path, start: float, seed: int,
                         gpus: int, single_round: bool = False, nodeids=()) -> list[str]:
    props = ",".join(p.strip() for group in args.properties for p in group.split(",") if p.strip())
    # --rootdir: node ids relative to REPO_ROOT, the child's cwd, in a checkout and installed alike,
    # so that a printed rerun line names a file the rerun finds
    cmd = [sys.executable, "-m", "pytest", *(nodeids or args.tests), "--rootdir", str(REPO_ROOT),
           "-p", "magi_moe.fuzz.campaign_plugin", "-p", "no:cacheprovider", "-q", "-rfE",
           "-W", "ignore::RuntimeWarning", "--backend", backend,
           "--fuzz-out", str(out), "--fuzz-db", str(args.db), "--fuzz-start", repr(start),
           "--fuzz-budget", repr(float(args.budget_seconds)), "--fuzz-seed", str(seed),
           "--fuzz-properties", props, "--fuzz-profile", args.profile,
           "--fuzz-round-examples", str(args.round_examples),
           "--fuzz-first-round-examples", str(getattr(args, "first_round_examples", 1)),
           "--fuzz-case-timeout", repr(float(args.case_timeout)), "--fuzz-gpus", str(gpus),
           "--fuzz-device", get_backend(backend).device,
           "--junitxml", str(out / "junit.xml"), "-o", "junit_family=xunit2"]
    if args.workers > 0:
        cmd += ["-n", str(args.workers), "--max-worker-restart", str(max(8, 4 * args.workers))]
    if single_round:
        cmd.append("--fuzz-single-round")
    else:  # the campaign's own child, in a session of its own: it ends when the runner does
        cmd += ["--fuzz-runner-pid", str(os.getpid())]
    if getattr(args, "db_local", None):
        cmd += ["--fuzz-db-local", str(args.db_local)]
    if getattr(args, "replay_only", False):
        cmd.append("--fuzz-replay-only")
    if (out / "order.json").exists():
        cmd += ["--fuzz-order", str(out / "order.json")]
    if getattr(args, "no_shrink", False):
        cmd.append("--fuzz-no-shrink")
    default_size = 1.0 if args.profile == "ci" else get_backend(backend).fuzz_size_budget
    size = getattr(args, "size_budget", None) or default_size
    cmd += ["--fuzz-size-budget", repr(float(size))]
    for impl in args.impl:
        cmd += ["--impl", impl]
    return cmd


def _progress(out: Path, start: float, budget: float) -> str:
    cases = rounds = 0
    for path in (out / "stats").glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        cases += data.get("cases", 0)
        rounds += data.get("rounds", 0)
    failures = len(list((out / "failures").glob("*.json")))
    inflight = len(list((out / "inflight").glob("inflight-*.json")))
    return (f"[fuzz] {time.time() - start:6.0f}/{budget:.0f} s  cases {cases}  rounds {rounds}  "
            f"failures {failures}  running {inflight}")


def _pump(stream, log_path: Path, echo: bool) -> None:
    with open(log_path, "a") as log:
        for line in iter(stream.readline, ""):
            log.write(line)
            log.flush()
            if echo and (line.startswith(("FAILED", "ERROR", "[gw")) or "crashed" in line
                         or line.startswith(("=", "Falsifying"))):
                sys.stdout.write("  | " + line)
                sys.stdout.flush()


def _run_pytest(cmd: list[str], *, env: dict, out: Path, start: float, budget: float,
                hard_limit: float) -> int:
    log = out / "pytest.log"
    log.write_text("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, log, True), daemon=True)
    pump.start()
    next_report = time.time() + 10
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:  # SIGTERM becomes SystemExit, so the child group is stopped below
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        _wait_for_pytest(proc, out, start, budget, hard_limit, next_report)
    except BaseException:  # Ctrl-C or SIGTERM: the child is in its own session, stop it too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    proc.wait()
    pump.join(timeout=5)
    return proc.returncode


def _wait_for_pytest(proc, out: Path, start: float, budget: float, hard_limit: float,
                     next_report: float) -> None:
    while proc.poll() is None:
        time.sleep(0.5)
        if time.time() >= next_report:
            print(_progress(out, start, budget), flush=True)
            next_report = time.time() + 15
        if time.time() > hard_limit:
            print(f"[fuzz] past the hard limit ({hard_limit - start:.0f} s): stopping pytest", flush=True)
            os.killpg(proc.pid, signal.SIGTERM)
            try:  # briefly: the budget and its grace are spent
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            break


def _replay_child(record: dict, backend: str, timeout: float) -> tuple[str, str]:
    """Replay ``record`` in a child process under a memory cap of its own (:mod:`.child`).
    Returns (outcome, text): outcome is ``pass``, ``fail``, ``crash`` (killed by a signal),
    ``timeout`` or ``unavailable`` (also: it needs more memory than it may have here)."""
    from .cases import dumps
    from .child import run_capped
    cmd = [sys.executable, "-m", "magi_moe.fuzz", "replay", dumps(record)]
    proc = run_capped(cmd, cwd=REPO_ROOT, env=child_env(backend), timeout=timeout)
    if proc.end.kind == "timeout":
        return "timeout", f"replay still running after {timeout:.0f} s (hang)"
    if proc.end.kind == "memory":
        return "unavailable", f"replay {proc.end.text}"
    if proc.returncode < 0:
        return "crash", f"replay killed by {signal.Signals(-proc.returncode).name} ({proc.end.kind})"
    lines = (proc.stdout + proc.stderr).strip().splitlines() or [""]
    verdict = [line for line in lines if line.startswith(("PASS:", "FAIL:", "UNAVAILABLE:"))]
    outcome = {0: "pass", 1: "fail", REPLAY_UNAVAILABLE: "unavailable"}.get(proc.returncode, "fail")
    return outcome, verdict[0] if verdict else f"replay exited {proc.returncode}: {lines[-1]}"


def _confirm_signal(record: dict, backend: str, timeout: float) -> str:
    """Replay a crashed case in a child process and say how that child ended."""
    outcome, text = _replay_child(record, backend, timeout)
    return text if outcome in ("crash", "timeout") else f"replay {outcome}: {text}"


def _collect_crashes(out: Path, backend: str, confirm: bool, timeout: float,
                     stopped: bool = False) -> list[Path]:
    """Flight-recorder files left behind by dead workers become failure records (``stopped``:
    the runner stopped pytest at its hard limit, so a case still running was interrupted).
    A ``found-*`` note left behind (the worker found a failure, then was stopped or died
    before reporting it, e.g. while shrinking) becomes a violation record: a found failure is
    never lost. Returns the records written."""
    from .record import save_record
    written = []
    for path in sorted((out / "inflight").glob("inflight-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        status = data.get("status", "running")
        if stopped and status == "running":
            print(f"[fuzz] interrupted at the hard limit: {data.get('repro')}")
            path.unlink()
            continue
        kind = {"running": "crash", "device-fault": "device-fault", "timeout": "timeout"}.get(status, status)
        message = data.get("message") or f"worker pid {data.get('pid')} died while running this case"
        extra = {"worker_pid": data.get("pid"), **({"nodeid": data["nodeid"]} if data.get("nodeid") else {})}
        if confirm and kind in ("crash", "device-fault"):
            extra["confirmed"] = _confirm_signal(data["record"], backend, timeout)
            message += f"; {extra['confirmed']}"
        written.append(save_record(out / "failures", data["record"], kind=kind, message=message, extra=extra))
        path.unlink()
    recorded = [_read_json(p, {}).get("record") for p in (out / "failures").glob("*.json")]
    for path in sorted((out / "inflight").glob("found-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("record") in recorded:  # e.g. the device fault its worker exited on
            path.unlink()
            continue
        how = "stopped at the hard limit" if stopped else "its worker ended"
        message = f"{data.get('message')} (found, then the run was {how} before it was reported: unshrunk)"
        extra = {"worker_pid": data.get("pid"), **({"nodeid": data["nodeid"]} if data.get("nodeid") else {})}
        written.append(save_record(out / "failures", data["record"], kind=data.get("kind", "violation"),
                                   message=message, extra=extra))
        path.unlink()
    return written


def _finding_matches(finding: dict, *, backend: str, impls: list[str], props: set[str],
                     any_backend: bool) -> bool:
    """Whether a failure record of the database belongs to this campaign's selection."""
    record = finding.get("record")
    if not record:
        return False
    if props and record.get("property") not in props:
        return False
    if impls and record.get("impl") is not None and record["impl"] not in impls:
        return False
    return any_backend or record.get("backend") == backend


def _replay_findings(findings: list[dict], *, backend: str, out: Path, timeout: float,
                     swap_backend: bool, until: float | None = None) -> dict:
    """Replay the database's failure records before anything else, each in a child process (a
    crash stays a crash). ``swap_backend``: run each on this backend whatever backend found it
    (the per-commit run). Still failing: a failure record here. ``until``: no replay starts after
    it, and none runs past it (the budget; those left are kept for the next campaign). Returns
    what happened to each."""
    from .record import save_record
    done = {"failing": [], "fixed": [], "unavailable": [], "no_time": []}
    for finding in findings:
        record = dict(finding["record"])
        if swap_backend:
            record["backend"] = backend
        left = timeout if until is None else min(timeout, until - time.time())
        if left < 1.0:
            done["no_time"].append(finding)
            continue
        outcome, text = _replay_child(record, backend, left)
        who = f"{record.get('property')} on {record.get('impl') or record.get('router')}@{record.get('backend')}"
        print(f"[fuzz] replayed from the database: {who}: {outcome} ({text})", flush=True)
        if outcome == "pass":
            done["fixed"].append(finding)
        elif outcome == "unavailable":
            done["unavailable"].append({"record": record, "reason": text})
        else:
            kind = {"crash": "crash", "timeout": "timeout"}.get(outcome, finding.get("kind") or "violation")
            if kind == "failure":
                kind = "violation"
            extra = {"source": "database"}
            if finding.get("nodeid"):
                extra["nodeid"] = finding["nodeid"]
            save_record(out / "failures", record, kind=kind, message=f"replayed from the database: {text}",
                        extra=extra)
            done["failing"].append(finding)
    return done


def write_fallback_junit(out: Path) -> Path:
    """A JUnit file built from the campaign's own records, for when pytest was stopped before
    writing one: one testcase per test that ran a round (``stats/``) and a ``failure`` element
    per failure record. (Cases in flight at the stop are printed, not failed.)"""
    failures: dict[str, list[str]] = {}
    for path in sorted((out / "failures").glob("*.json")):
        data = json.loads(path.read_text())
        nodeid = data.get("nodeid") or record_nodeid(data.get("record", {}))
        failures.setdefault(nodeid, []).append(f"{data.get('kind')}: {data.get('message')}\n"
                                               f"reproduce: {data.get('repro')}")
    items = {}
    for path in sorted((out / "stats").glob("*.json")):
        data = json.loads(path.read_text())
        items[data["nodeid"]] = data
    for nodeid in failures:
        items.setdefault(nodeid, {"nodeid": nodeid, "seconds": 0})
    suite = ET.Element("testsuite", name="fuzz", tests=str(len(items)),
                       failures=str(sum(n in failures for n in items)), errors="0", skipped="0")
    for nodeid, data in sorted(items.items()):
        path, _, name = nodeid.partition("::")
        case = ET.SubElement(suite, "testcase", classname=path.removesuffix(".py").replace("/", "."),
                             name=name, time=str(data.get("seconds", 0)))
        for message in failures.get(nodeid, []):
            node = ET.SubElement(case, "failure", message=message.splitlines()[0][:200])
            node.text = message
    target = out / "junit.xml"
    root = ET.Element("testsuites", name="fuzz")
    root.append(suite)
    ET.ElementTree(root).write(target, encoding="utf-8", xml_declaration=True)
    return target


def record_nodeid(record: dict) -> str:
    """A stand-in test id for a failure record saved without one (a crashed worker's case)."""
    return f"fuzz/{record.get('property', 'unknown')}::{record.get('impl', '?')}@{record.get('backend', '?')}"


def _junit_tests(path: Path) -> list[dict]:
    if not path.exists():
        return []
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                break
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        entry = {"test": name, "outcome": outcome, "seconds": float(case.get("time", 0) or 0)}
        if outcome == "skipped":
            entry["reason"] = (case.find("skipped").get("message") or "")[:200]
        tests.append(entry)
    return tests


def reconcile_junit(out: Path) -> None:
    """Make ``junit.xml`` carry every failure record: a record whose test pytest reported as
    passed (or never reported: a crash, a failure replayed from the database) gets a
    ``failure`` element, so no found failure is ever shown to CI as a pass."""
    path = out / "junit.xml"
    tree = ET.parse(path)
    root = tree.getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    cases = {}
    for case in root.iter("testcase"):
        nodeid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cases[nodeid] = case
    changed = False
    for record_path in sorted((out / "failures").glob("*.json")):
        data = json.loads(record_path.read_text())
        nodeid = data.get("nodeid") or record_nodeid(data.get("record", {}))
        case = cases.get(nodeid)
        if case is None:
            file, _, name = nodeid.partition("::")
            case = ET.SubElement(suite, "testcase", classname=file.removesuffix(".py").replace("/", "."),
                                 name=name, time="0")
            cases[nodeid] = case
        if case.find("failure") is not None or case.find("error") is not None:
            continue
        skipped = case.find("skipped")
        if skipped is not None:
            case.remove(skipped)
        text = f"{data.get('kind')}: {data.get('message')}\nreproduce: {data.get('repro')}"
        node = ET.SubElement(case, "failure", message=text.splitlines()[0][:200])
        node.text = text
        changed = True
    if changed:
        for s in root.iter("testsuite"):
            s.set("failures", str(sum(c.find("failure") is not None for c in s.iter("testcase"))))
            s.set("tests", str(sum(1 for _ in s.iter("testcase"))))
            s.set("skipped", str(sum(c.find("skipped") is not None for c in s.iter("testcase"))))
        tree.write(path, encoding="utf-8", xml_declaration=True)


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _summary(args, *, backend: str, seed: int, start: float, returncode: int, out: Path,
             order: dict, replayed: dict) -> dict:
    failures = []
    for path in sorted((out / "failures").glob("*.json")):
        data = json.loads(path.read_text())
        record = data.get("record", {})
        failures.append({"kind": data.get("kind"), "property": record.get("property"),
                         **{k: record[k] for k in ("impl", "router", "backend") if record.get(k)},
                         **({"cause": data["cause"]} if data.get("cause") else {}),
                         "nodeid": data.get("nodeid") or record_nodeid(data.get("record", {})),
                         "message": data.get("message"), "repro": data.get("repro"),
                         "source": data.get("source", "campaign"), "file": str(path)})
    stats = {}
    for path in sorted((out / "stats").glob("*.json")):
        data = _read_json(path, None)
        if data:
            stats[data["nodeid"]] = data
    skips = {d["nodeid"]: d for d in (_read_json(p, None) for p in sorted((out / "skips").glob("*.json"))) if d}
    listed = _read_json(out / "targets.json", {})
    targets = listed.get("targets", list(stats))
    for nodeid, info in listed.get("rows", {}).items():  # a target that never ran has no stats
        stats[nodeid] = {**info, **stats.get(nodeid, {})}
    tests = _junit_tests(out / "junit.xml")
    outcome = {t["test"]: t for t in tests}
    per_target = []
    for nodeid in targets:
        s = stats.get(nodeid, {})
        test = outcome.get(nodeid, {})
        if not test and nodeid in skips:  # skipped, then pytest was stopped before junit.xml
            test = {"outcome": "skipped", "reason": skips[nodeid]["reason"]}
        per_target.append({"target": nodeid, "property": s.get("property"), "impl": s.get("impl"),
                           "clause": s.get("clause"), "subject": s.get("subject"),  # the verdict's row
                           "outcome": test.get("outcome", "not run"), "rounds": s.get("rounds", 0),
                           "cases": s.get("cases", 0), "seconds": s.get("seconds", 0.0), "worker": s.get("worker"),
                           "started": s.get("started"),  # seconds into the campaign; None: never started
                           "first_failure_case": s.get("first_failure_case"),
                           **({"reason": test["reason"]} if test.get("reason") else {}),
                           **({"skip_kind": skips[nodeid]["kind"]} if nodeid in skips else {})})
    failed_tests = sum(t["outcome"] in ("failed", "error") for t in tests)
    # A target the test itself skips (not applicable here: an implementation without the
    # capability) is not starved; one that ran no round for any other reason is.
    starved = [t["target"] for t in per_target if t["rounds"] == 0 and t["outcome"] != "skipped"]
    not_applicable = [t["target"] for t in per_target if t["outcome"] == "skipped"]
    return {
        "backend": backend, "impls": args.impl or ["(all declared)"], "seed": seed,
        "profile": args.profile, "workers": args.workers, "database": fuzz_db.describe(args.db),
        "mode": "replay-only" if args.replay_only else "campaign",
        "budget_seconds": args.budget_seconds, "wall_seconds": round(time.time() - start, 1),
        "pytest_returncode": returncode,
        "order": {"first": order.get("first", []), "rotation": order.get("rotation", 0)},
        "totals": {"tests": len(tests), "passed": sum(t["outcome"] == "passed" for t in tests),
                   "failed": failed_tests, "skipped": sum(t["outcome"] == "skipped" for t in tests),
                   "cases": sum(t["cases"] for t in per_target),
                   "rounds": sum(t["rounds"] for t in per_target), "failures": len(failures),
                   "targets": len(per_target), "targets_not_applicable": len(not_applicable),
                   "targets_without_time": len(starved)},
        # every target's share: a target that ran no round is listed by name
        "targets": per_target,
        "targets_without_time": starved,
        "targets_not_applicable": not_applicable,
        "replayed_from_database": {k: len(v) for k, v in replayed.items()},
        "not_replayable_here": replayed.get("unavailable", []),
        "tests": tests, "failures": failures,
    }


def _next_rotation(order: dict, out: Path, per_target: list[dict]) -> int:
    """Where the next campaign starts among the targets without known failures: at the first
    one that got no time in this campaign, else one further than this campaign started."""
    collected = _read_json(out / "targets.json", {}).get("collected", [])
    first = set(order.get("first", []))
    rest = [n for n in collected if n not in first]
    if not rest:
        return 0
    starved = [t["target"] for t in per_target
               if t["rounds"] == 0 and t.get("outcome") != "skipped" and t["target"] in rest]
    if starved:
        return rest.index(starved[0])
    return (int(order.get("rotation", 0)) + 1) % len(rest)


def _clean_outputs(out: Path) -> None:
    """This run's results only (the database keeps the history): a stale junit.xml or summary
    from an earlier run must never stand in for this one's."""
    for sub in ("failures", "stats", "inflight", "skips"):
        (out / sub).mkdir(parents=True, exist_ok=True)
        for old in (out / sub).glob("*"):
            old.unlink()
    for name in ("junit.xml", "summary.json", "targets.json", "order.json", "pytest.log",
                 "verdict.md", "verdict.json"):
        (out / name).unlink(missing_ok=True)


def campaign_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    why = refused_arguments(args)
    if why:
        return refuse(program_name(), why)
    backend, why = choose_backend(args.backend, args.impl)
    if why:
        return refuse(program_name(), why)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    out = Path(args.out).resolve()
    args.db = database_for(args)
    if not fuzz_db.is_url(args.db):
        args.db = str(Path(args.db).resolve())
    elif args.db_local:
        args.db_local = str(Path(args.db_local).resolve())
    else:
        args.db_local = str((Path.cwd() / fuzz_db.DEFAULT_LOCAL_DIR).resolve())
    try:  # a wrong URL or a missing server fails here, before any worker starts
        db = fuzz_db.open_database(args.db, local_dir=args.db_local, read_only=args.replay_only)
        corrupt: list[bytes] = []
        findings = fuzz_db.load_findings(db, corrupt)
        rotation = 0 if args.replay_only else fuzz_db.read_rotation(db)
    except fuzz_db.DatabaseError as exc:
        print(f"[fuzz] error: {exc}", file=sys.stderr)
        return 2
    if corrupt:
        print(f"[fuzz] warning: passed over {len(corrupt)} unreadable failure record(s) in the database "
              f"(first: {corrupt[0][:80]!r})", file=sys.stderr, flush=True)
    _clean_outputs(out)
    props = {p.strip() for group in args.properties for p in group.split(",") if p.strip()}
    mine = [f for f in findings if _finding_matches(f, backend=backend, impls=args.impl, props=props,
                                                    any_backend=args.replay_only)]
    order = {"first": [f["nodeid"] for f in findings if f.get("nodeid")], "rotation": rotation}
    (out / "order.json").write_text(json.dumps(order, indent=1))
    gpus = _cuda_count() if get_backend(backend).device == "cuda" and args.workers > 1 else 0
    start = time.time()
    print(f"[fuzz] backend {backend}, impl {args.impl or 'all'}, seed {seed}, budget {args.budget_seconds:.0f} s, "
          f"workers {args.workers}, database {fuzz_db.describe(args.db)}"
          f"{' (read-only)' if args.replay_only else ''}, out {out}; {len(findings)} failure records in the "
          f"database, {len(mine)} for this run; rotation {rotation}", flush=True)
    replay_timeout = max(30.0, min(args.case_timeout, 300.0))
    replayed = _replay_findings(mine, backend=backend, out=out, timeout=replay_timeout,
                                swap_backend=args.replay_only,
                                until=None if args.replay_only else start + args.budget_seconds)
    if not args.replay_only:
        for finding in replayed["fixed"]:
            fuzz_db.delete_finding(db, finding)
    cmd = build_pytest_command(args, backend=backend, out=out, start=time.time() if args.replay_only else start,
                               seed=seed, gpus=gpus)
    # A round or a shrink may run past the budget; past the grace period pytest is stopped (its
    # workers' in-flight cases are recorded as interrupted, their found failures as records)
    # and the summary is still written.
    hard_limit = start + args.budget_seconds + args.grace_seconds
    if args.replay_only:
        hard_limit = time.time() + max(args.budget_seconds, args.case_timeout) + args.grace_seconds
    code = _run_pytest(cmd, env=child_env(backend), out=out, start=start, budget=args.budget_seconds,
                       hard_limit=hard_limit)
    stopped = time.time() > hard_limit
    # confirming a crash's signal replays it: only within the grace that is left
    confirm_time = min(args.case_timeout, hard_limit - time.time())
    written = _collect_crashes(out, backend, not args.no_confirm and not stopped and confirm_time >= 5.0,
                               timeout=max(5.0, confirm_time), stopped=stopped)
    if not args.replay_only:
        for path in written:  # the next campaign, on any machine, replays these first
            fuzz_db.save_finding(db, json.loads(path.read_text()))
    if not (out / "junit.xml").exists():  # pytest stopped before writing it: CI still gets one
        write_fallback_junit(out)
    reconcile_junit(out)
    summary = _summary(args, backend=backend, seed=seed, start=start, returncode=code, out=out,
                       order=order, replayed=replayed)
    if not args.replay_only:
        fuzz_db.write_rotation(db, _next_rotation(order, out, summary["targets"]))
        _forget_fixed_nodes(db, findings, summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(_progress(out, start, args.budget_seconds))
    t = summary["totals"]
    if args.replay_only:  # Hypothesis skips a test with nothing saved: that is no starvation
        share = (f"{sum(row['cases'] > 0 for row in summary['targets'])} of {t['targets']} targets had "
                 f"saved examples to replay")
    else:
        share = (f"{t['targets'] - t['targets_without_time'] - t['targets_not_applicable']} of "
                 f"{t['targets'] - t['targets_not_applicable']} targets got time "
                 f"({t['targets_not_applicable']} not applicable here)")
    print(f"[fuzz] {t['tests']} tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped; "
          f"{t['cases']} cases in {t['rounds']} rounds; {t['failures']} failure records; {share}")
    for row in summary["targets"]:
        note = f"  ({row['outcome']}: {row.get('reason', '')})" if row["outcome"] == "skipped" else ""
        print(f"[fuzz]   {row['cases']:6d} cases {row['seconds']:8.1f} s  {row['rounds']:3d} rounds  "
              f"{row['target']}{note}")
    if summary["targets_without_time"] and not args.replay_only:
        print(f"[fuzz] no time (they lead the next campaign): {', '.join(summary['targets_without_time'])}")
    for f in summary["failures"]:
        print(f"[fuzz] {f['kind']}: {f['property'] or f['nodeid']}: {f['message']}\n  reproduce: {f['repro']}")
    print(f"[fuzz] wrote {out / 'summary.json'} and {out / 'junit.xml'}")
    if stopped:
        print("[fuzz] note: pytest was stopped at the hard limit; junit.xml and the summary count the "
              "failures found up to then")
    _write_verdict(out, summary, title=f"magi-moe fuzz verdict ({backend})")
    if summary["failures"] or t["failed"]:
        return 1
    idle = [] if args.replay_only else _impls_without_cases(args.impl, summary)
    if not args.replay_only and (t["cases"] == 0 or idle):
        print(f"[fuzz] error: {_nothing_tested(summary, idle, backend)}")
        return 2
    if not args.replay_only and not args.impl and not args.allow_no_kernels and not _kernels_fuzzed(summary):
        print("[fuzz] error: no implementation under test ran a case, only the float64 oracle and the "
              "PyTorch baseline (the Triton kernels need --backend interpret, which sets "
              "TRITON_INTERPRET=1, or a GPU); --allow-no-kernels accepts such a campaign")
        return 2
    if args.replay_only:
        print(f"[fuzz] replayed the database: {t['cases']} saved cases, "
              f"{summary['replayed_from_database']['fixed']} failure records that pass now")
        return 0 if code in (0, 5) or stopped else 1
    return 0 if stopped or code in (0, 5) else 1


def _write_verdict(out: Path, summary: dict, *, title: str) -> None:
    """The per-clause verdict of the campaign, printed and written as verdict.md / verdict.json."""
    from .campaign_verdict import campaign_outcomes, write_verdict

    stats = dict(_read_json(out / "targets.json", {}).get("rows", {}))
    for path in (out / "stats").glob("*.json"):
        data = _read_json(path, None)
        if data:
            stats[data["nodeid"]] = data
    outcomes = campaign_outcomes(summary, stats)
    lines = write_verdict(out, outcomes, title=title)
    print("[fuzz] verdict (one row per contract clause):")
    for line in lines:
        print(f"  {line}")
    print(f"[fuzz] wrote {out / 'verdict.md'} and {out / 'verdict.json'}")


def _impls_without_cases(asked: list[str], summary: dict) -> list[str]:
    """The asked-for implementations (--impl) none of whose targets ran a case."""
    from magi_moe.registry import get_implementation

    ran = {row.get("impl") for row in summary["targets"] if row["cases"] > 0}
    return [name for name in asked if get_implementation(name).name not in ran]


def _nothing_tested(summary: dict, idle: list[str], backend: str) -> str:
    """The one line saying that nothing (of an asked-for implementation) was tested, and why."""
    from magi_moe.registry import get_implementation

    names = {get_implementation(n).name for n in idle}
    rows = [r for r in summary["targets"] if not idle or r.get("impl") in names]
    if rows and all(r["outcome"] == "skipped" for r in rows):
        why = "every target was skipped here (the verdict's rows say why)"
    elif not rows:
        why = "no target was selected (--properties, --impl)"
    else:
        why = "its targets got no time (budget too small for this machine)"
    who = f"for {', '.join(idle)} " if idle else ""
    return f"no case ran {who}on {backend}: {why}; nothing was tested"


def _kernels_fuzzed(summary: dict) -> bool:
    """Did a target of an implementation under test (not the oracle or the baseline) run a case?
    Router targets (the tie rule) name no implementation and do not count."""
    from magi_moe.impls import BASELINE, REFERENCE

    return any(row["cases"] > 0 and row.get("impl") not in (None, REFERENCE.name, BASELINE.name)
               for row in summary["targets"])


def _forget_fixed_nodes(db, findings: list[dict], summary: dict) -> None:
    """A node-only finding (the state machine's) whose test passed in this campaign is fixed."""
    outcome = {t["test"]: t["outcome"] for t in summary["tests"]}
    failing = {f["nodeid"] for f in summary["failures"]}
    for finding in findings:
        nodeid = finding.get("nodeid")
        if not finding.get("record") and nodeid and outcome.get(nodeid) == "passed" and nodeid not in failing:
            fuzz_db.delete_finding(db, finding)


def resolve_nodeid(nodeid: str) -> str | None:
    """``nodeid`` as the rerun's pytest (run in REPO_ROOT) finds it: as printed, or with its file
    looked up by name among the fuzz tests (a node id printed by a campaign in a checkout,
    rerun from an installed wheel, or the other way round); None when no such file exists."""
    file, sep, rest = nodeid.partition("::")
    if (REPO_ROOT / file).is_file():
        return nodeid
    here = _TESTS_DIR / Path(file).name
    if Path(file).suffix == ".py" and here.is_file():
        return str(here.relative_to(REPO_ROOT)) + sep + rest
    return None


def rerun_main(argv: list[str]) -> int:
    p = OneLineParser(prog=f"{program_name()} rerun",
                      description="Replay a failing fuzz test from a campaign's example database.")
    p.add_argument("nodeid", help="the failing test node, as the campaign printed it")
    p.add_argument("--db", required=True, help="the campaign's example database directory")
    p.add_argument("--backend", required=True, choices=tuple(BACKENDS),
                   help="cpu, interpret or cuda, as in the campaign")
    p.add_argument("--impl", action="append", default=[],
                   help="implementation under test, as in the campaign; repeatable")
    p.add_argument("--profile", default="nightly", choices=PROFILES,
                   help="settings, as in the campaign (default nightly)")
    p.add_argument("--no-shrink", action="store_true",
                   help="report the first failing example unshrunk, as a --no-shrink campaign did")
    p.add_argument("--out", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    nodeid = resolve_nodeid(args.nodeid)
    if nodeid is None:
        return refuse(p.prog, f"NODEID must name a test of the fuzz suite ({_TESTS_DIR}), "
                              f"got {args.nodeid!r}")
    for impl in args.impl:
        why = refuse_bad_impl(impl)
        if why:
            return refuse(p.prog, why)
    import tempfile
    out = Path(args.out or tempfile.mkdtemp(prefix="fuzz-rerun-"))
    shrink = ["--no-shrink"] if args.no_shrink else []
    ns = _parser().parse_args(["--backend", args.backend, "--db", args.db, "--workers", "0",
                               "--profile", args.profile, *shrink,
                               *[a for impl in args.impl for a in ("--impl", impl)]])
    if not fuzz_db.is_url(ns.db):
        ns.db = str(Path(ns.db).resolve())
    cmd = build_pytest_command(ns, backend=args.backend, out=out, start=time.time(), seed=0, gpus=0,
                               single_round=True, nodeids=[nodeid])
    return subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(args.backend)).returncode
