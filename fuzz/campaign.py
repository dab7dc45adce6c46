"""The campaign runner behind ``python -m fuzz``: pytest-xdist workers running the fuzz tests
against one shared Hypothesis example database, for a time budget.

It adds no scheduler of its own. It starts ``pytest -n WORKERS -p fuzz.campaign_plugin`` on the
fuzz test files in a child process group, with ``TRITON_INTERPRET`` set or cleared for the
backend; the plugin (:mod:`fuzz.campaign_plugin`) time-boxes each test and records failures.
pytest-xdist isolates the cases: a worker killed by a segfault, an illegal memory access or the
hang watchdog is reported as crashed and replaced (``--max-worker-restart``), and the campaign
goes on. Afterwards the runner

* turns flight-recorder files left by dead workers into crash / device-fault / timeout
  records, and replays each once in a child process to name the signal;
* writes ``summary.json`` (budget, totals, per-test outcome, cases and rounds, every failure
  with its one-line reproduction) next to pytest's ``junit.xml``;
* prints every reproduction command and exits 1 if anything failed, 2 if no case ran at all.

Running it again with the same ``--db`` resumes: Hypothesis replays every failing and
interesting example it saved before generating new ones.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .huge import REPO_ROOT, child_env
from .profiles import FUZZ_DATABASE

__all__ = ["DEFAULT_TESTS", "build_pytest_command", "campaign_main", "rerun_main"]

DEFAULT_TESTS = ("tests/test_fuzz_properties.py", "tests/test_fuzz_huge.py", "tests/test_fuzz_stateful.py")
PROFILES = ("nightly", "dev", "ci")
OTHER_COMMANDS = """other commands (each takes --help):
  python -m fuzz replay RECORD|FILE                  replay one recorded case exactly; exit 1 if it still fails
  python -m fuzz rerun NODEID --db DIR --backend B   replay a failing test node from a campaign's database
  python -m fuzz list                                the properties a campaign can run (--properties)"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=OTHER_COMMANDS)
    p.add_argument("--backend", default=None, help="cpu, interpret or cuda (default: the best available)")
    p.add_argument("--impl", action="append", default=[],
                   help="implementation under test (name or package.module:attr); repeatable; default: all")
    p.add_argument("--budget-seconds", type=float, default=600.0, help="time budget (default 600)")
    p.add_argument("--seed", type=int, default=None, help="campaign seed (default: random, printed)")
    p.add_argument("--db", default=FUZZ_DATABASE,
                   help="shared example database directory (default: $FUZZ_DB, else .hypothesis/fuzz-db; "
                        "the nightly profile's too)")
    p.add_argument("--out", default="fuzz-out", help="output directory (summary.json, junit.xml, failures/)")
    p.add_argument("--profile", default="nightly", choices=PROFILES, help="settings the campaign derives from")
    p.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (one per core or GPU)")
    p.add_argument("--properties", action="append", default=[],
                   help="comma-separated properties (default: all; see python -m fuzz list)")
    p.add_argument("--round-examples", type=int, default=25, help="examples per round of one test")
    p.add_argument("--case-timeout", type=float, default=600.0, help="seconds after which a case is a hang")
    p.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="fuzz test files")
    p.add_argument("--grace-seconds", type=float, default=30.0,
                   help="time past the budget before pytest is stopped (default 30)")
    p.add_argument("--no-confirm", action="store_true", help="do not replay crashes to name the signal")
    p.add_argument("--no-shrink", action="store_true", help="report first failing examples unshrunk (faster)")
    p.add_argument("--size-budget", type=float, default=None,
                   help="shape budget of the strategies (default: 2 on the CPU, 32 on a GPU; ci: 1)")
    return p


def _backend(name: str | None) -> str:
    from magi_moe.backends import BACKENDS
    if name is None:
        return "cuda" if _cuda_count() > 0 else "interpret"
    if name not in BACKENDS:
        raise SystemExit(f"--backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return name


def _cuda_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def build_pytest_command(args, *, backend: str, out: Path, start: float, seed: int,
                         gpus: int, single_round: bool = False, nodeids=()) -> list[str]:
    props = ",".join(p.strip() for group in args.properties for p in group.split(",") if p.strip())
    cmd = [sys.executable, "-m", "pytest", *(nodeids or args.tests),
           "-p", "fuzz.campaign_plugin", "-p", "no:cacheprovider", "-q", "-rfE",
           "-W", "ignore::RuntimeWarning", "--backend", backend,
           "--fuzz-out", str(out), "--fuzz-db", str(args.db), "--fuzz-start", repr(start),
           "--fuzz-budget", repr(float(args.budget_seconds)), "--fuzz-seed", str(seed),
           "--fuzz-properties", props, "--fuzz-profile", args.profile,
           "--fuzz-round-examples", str(args.round_examples),
           "--fuzz-case-timeout", repr(float(args.case_timeout)), "--fuzz-gpus", str(gpus),
           "--fuzz-device", "cuda" if backend == "cuda" else "cpu",
           "--junitxml", str(out / "junit.xml"), "-o", "junit_family=xunit2"]
    if args.workers > 0:
        cmd += ["-n", str(args.workers), "--max-worker-restart", str(max(8, 4 * args.workers))]
    if single_round:
        cmd.append("--fuzz-single-round")
    if getattr(args, "no_shrink", False):
        cmd.append("--fuzz-no-shrink")
    default_size = 1.0 if args.profile == "ci" else 32.0 if backend == "cuda" else 2.0
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
    while proc.poll() is None:
        time.sleep(0.5)
        if time.time() >= next_report:
            print(_progress(out, start, budget), flush=True)
            next_report = time.time() + 15
        if time.time() > hard_limit:
            print(f"[fuzz] past the hard limit ({hard_limit - start:.0f} s): stopping pytest", flush=True)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    pump.join(timeout=5)
    return proc.returncode


def _confirm_signal(record: dict, backend: str, timeout: float) -> str:
    """Replay a crashed case in a child process and say how that child ended."""
    from .cases import dumps
    cmd = [sys.executable, "-m", "fuzz", "replay", dumps(record)]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(backend), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"replay still running after {timeout:.0f} s (hang)"
    if proc.returncode < 0:
        return f"replay killed by {signal.Signals(-proc.returncode).name}"
    return f"replay exited {proc.returncode}: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}"


def _collect_crashes(out: Path, backend: str, confirm: bool, timeout: float,
                     stopped: bool = False) -> None:
    """Flight-recorder files left behind by dead workers become failure records (``stopped``:
    the runner stopped pytest at its hard limit, so a case still running was interrupted)."""
    from .record import save_record
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
        extra = {"worker_pid": data.get("pid")}
        if confirm and kind in ("crash", "device-fault"):
            extra["confirmed"] = _confirm_signal(data["record"], backend, timeout)
            message += f"; {extra['confirmed']}"
        save_record(out / "failures", data["record"], kind=kind, message=message, extra=extra)
        path.unlink()


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
        tests.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0) or 0)})
    return tests


def _summary(args, *, backend: str, seed: int, start: float, returncode: int, out: Path) -> dict:
    failures = []
    for path in sorted((out / "failures").glob("*.json")):
        data = json.loads(path.read_text())
        failures.append({"kind": data.get("kind"), "property": data.get("record", {}).get("property"),
                         "nodeid": data.get("nodeid"), "message": data.get("message"),
                         "repro": data.get("repro"), "file": str(path)})
    stats = []
    for path in sorted((out / "stats").glob("*.json")):
        with open(path) as f:
            stats.append(json.load(f))
    tests = _junit_tests(out / "junit.xml")
    return {
        "backend": backend, "impls": args.impl or ["(all declared)"], "seed": seed,
        "profile": args.profile, "workers": args.workers, "database": str(args.db),
        "budget_seconds": args.budget_seconds, "wall_seconds": round(time.time() - start, 1),
        "pytest_returncode": returncode,
        "totals": {"tests": len(tests), "passed": sum(t["outcome"] == "passed" for t in tests),
                   "failed": sum(t["outcome"] in ("failed", "error") for t in tests),
                   "skipped": sum(t["outcome"] == "skipped" for t in tests),
                   "cases": sum(s.get("cases", 0) for s in stats),
                   "rounds": sum(s.get("rounds", 0) for s in stats), "failures": len(failures)},
        "items": stats, "tests": tests, "failures": failures,
    }


def campaign_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.budget_seconds <= 0 or args.workers < 0 or args.round_examples < 1 or args.grace_seconds < 0:
        raise SystemExit("--budget-seconds must be > 0, --workers >= 0, --round-examples >= 1, "
                         "--grace-seconds >= 0")
    backend = _backend(args.backend)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    out = Path(args.out).resolve()
    args.db = str(Path(args.db).resolve())
    for sub in ("failures", "stats", "inflight"):
        (out / sub).mkdir(parents=True, exist_ok=True)
        for old in (out / sub).glob("*"):
            old.unlink()  # this campaign's results only; the database keeps the history
    gpus = _cuda_count() if backend == "cuda" and args.workers > 1 else 0
    start = time.time()
    cmd = build_pytest_command(args, backend=backend, out=out, start=start, seed=seed, gpus=gpus)
    print(f"[fuzz] backend {backend}, impl {args.impl or 'all'}, seed {seed}, budget {args.budget_seconds:.0f} s, "
          f"workers {args.workers}, database {args.db}, out {out}", flush=True)
    # A round or a shrink may run past the budget; past the grace period pytest is stopped (its
    # workers' in-flight cases are recorded as interrupted) and the summary is still written.
    hard_limit = start + args.budget_seconds + args.grace_seconds
    code = _run_pytest(cmd, env=child_env(backend), out=out, start=start, budget=args.budget_seconds,
                       hard_limit=hard_limit)
    stopped = time.time() > hard_limit
    _collect_crashes(out, backend, not args.no_confirm and not stopped,
                     timeout=max(30.0, min(args.case_timeout, hard_limit - time.time())), stopped=stopped)
    if not (out / "junit.xml").exists():  # pytest stopped before writing it: CI still gets one
        write_fallback_junit(out)
    summary = _summary(args, backend=backend, seed=seed, start=start, returncode=code, out=out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(_progress(out, start, args.budget_seconds))
    t = summary["totals"]
    print(f"[fuzz] {t['tests']} tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped; "
          f"{t['cases']} cases in {t['rounds']} rounds; {t['failures']} failure records")
    for f in summary["failures"]:
        print(f"[fuzz] {f['kind']}: {f['property'] or f['nodeid']}: {f['message']}\n  reproduce: {f['repro']}")
    print(f"[fuzz] wrote {out / 'summary.json'} and {out / 'junit.xml'}")
    if stopped:
        print("[fuzz] note: pytest was stopped at the hard limit; junit.xml was written by the runner "
              "from the per-test statistics and failure records")
    if t["cases"] == 0 and not summary["failures"]:
        print("[fuzz] error: no case ran (budget too small for this machine, or nothing selected)")
        return 2
    summary_code = 1 if summary["failures"] else 0
    return summary_code if stopped else (1 if summary["failures"] or code not in (0, 5) else 0)


def rerun_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fuzz rerun",
                                description="Replay a failing fuzz test from a campaign's example database.")
    p.add_argument("nodeid", help="the failing test node, as the campaign printed it")
    p.add_argument("--db", required=True, help="the campaign's example database directory")
    p.add_argument("--backend", required=True, help="cpu, interpret or cuda, as in the campaign")
    p.add_argument("--impl", action="append", default=[],
                   help="implementation under test, as in the campaign; repeatable")
    p.add_argument("--out", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    import tempfile
    out = Path(args.out or tempfile.mkdtemp(prefix="fuzz-rerun-"))
    ns = _parser().parse_args(["--backend", args.backend, "--db", args.db, "--workers", "0",
                               *[a for impl in args.impl for a in ("--impl", impl)]])
    ns.db = str(Path(ns.db).resolve())
    cmd = build_pytest_command(ns, backend=args.backend, out=out, start=time.time(), seed=0, gpus=0,
                               single_round=True, nodeids=[args.nodeid])
    return subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(args.backend)).returncode
