"""The campaign runner end to end (python -m fuzz): a case that kills its worker is recorded with
its signal and the campaign goes on; a property violation is saved with a one-line reproduction
that replays it exactly; summary.json and junit.xml say so; the example database keeps it."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from magi_moe.fuzz.huge import REPO_ROOT, child_env

pytest.importorskip("xdist", reason="the campaign runner scales out with pytest-xdist")


@pytest.mark.slow  # about 20 s: one derandomised round per target, in a child process
def test_campaign_records_crashes_and_violations_and_goes_on(tmp_path):
    out, db = tmp_path / "out", tmp_path / "db"
    cmd = [sys.executable, "-m", "fuzz", "--backend", "cpu",
           "--impl", "magi_moe.tests.fuzz_broken:segfault_from_three_tokens",  # crashes first ...
           "--impl", "magi_moe.tests.fuzz_broken:empty_expert_garbage",        # ... then this still runs
           # the ci profile: one derandomised round per target, whatever the machine's speed (a
           # time-filled campaign under load gave the second target one example, which missed)
           "--properties", "empty_experts", "--profile", "ci", "--budget-seconds", "300",
           "--workers", "1", "--no-shrink", "--seed", "3", "--out", str(out), "--db", str(db)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env("cpu"), capture_output=True, text=True,
                          timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    assert "[fuzz]" in proc.stdout  # progress and results are printed

    summary = json.loads((out / "summary.json").read_text())
    by_kind = {f["kind"]: f for f in summary["failures"]}
    assert set(by_kind) == {"crash", "violation"}, summary["failures"]
    assert "SIGSEGV" in by_kind["crash"]["message"]
    assert "magi_moe.tests.fuzz_broken:segfault_from_three_tokens" in by_kind["crash"]["repro"]
    violation = by_kind["violation"]
    assert violation["property"] == "empty_experts"
    assert violation["repro"].startswith("python -m magi_moe.fuzz replay ")

    cases = ET.parse(out / "junit.xml").getroot().iter("testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    assert len(failed) == 2, failed
    assert any(p.iterdir() for p in db.iterdir()), "the example database kept nothing"

    command = shlex.split(violation["repro"])
    assert command[:4] == ["python", "-m", "magi_moe.fuzz", "replay"]
    # as printed, from outside the checkout (an installed wheel has no top-level fuzz package)
    replay = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=child_env("cpu"),
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1 and "FAIL: empty_experts violated" in replay.stdout, replay.stdout + replay.stderr


def test_fallback_junit_when_pytest_was_stopped(tmp_path):
    """A campaign stopped at its hard limit still leaves a JUnit file CI can read: one testcase
    per test that ran, a failure element per failure record (with its reproduction)."""
    from magi_moe.fuzz.campaign import write_fallback_junit

    (tmp_path / "stats").mkdir()
    (tmp_path / "failures").mkdir()
    ok, bad = "tests/test_fuzz_properties.py::test_property[zero_tokens-fused@cuda]", \
        "tests/test_fuzz_properties.py::test_property[linearity-fused@cuda]"
    for i, nodeid in enumerate((ok, bad)):
        (tmp_path / "stats" / f"{i}.json").write_text(json.dumps(
            {"nodeid": nodeid, "property": "p", "rounds": 3, "cases": 40, "seconds": 12.5}))
    (tmp_path / "failures" / "linearity-1.json").write_text(json.dumps(
        {"kind": "violation", "nodeid": bad, "message": "doubling did not double",
         "repro": "python -m magi_moe.fuzz replay '{}'", "record": {"property": "linearity"}}))
    root = ET.parse(write_fallback_junit(tmp_path)).getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {"test_property[zero_tokens-fused@cuda]", "test_property[linearity-fused@cuda]"}
    assert cases["test_property[zero_tokens-fused@cuda]"].find("failure") is None
    failure = cases["test_property[linearity-fused@cuda]"].find("failure")
    assert failure is not None and "python -m magi_moe.fuzz replay" in failure.text
    assert cases["test_property[linearity-fused@cuda]"].get("classname") == "tests.test_fuzz_properties"


# -- accounting: every failure record counts ------------------------------------------------------
def _args(**kw):
    import argparse
    base = dict(impl=[], profile="nightly", workers=1, db="/tmp/db", replay_only=False, budget_seconds=10.0)
    return argparse.Namespace(**{**base, **kw})


def _pytest_junit(path, cases):
    suite = ET.Element("testsuite", name="pytest", tests=str(len(cases)), failures="0", skipped="0")
    for nodeid, outcome in cases:
        file, _, name = nodeid.partition("::")
        case = ET.SubElement(suite, "testcase", classname=file.removesuffix(".py").replace("/", "."),
                             name=name, time="1.0")
        if outcome == "skipped":
            ET.SubElement(case, "skipped", message="budget spent")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path)


def test_every_failure_record_counts_in_summary_and_junit(tmp_path):
    """A failure record whose test pytest reported as passed or skipped, or never reported (a
    worker crash, a failure found mid-shrink when the run was stopped), still fails the test in
    junit.xml and counts in summary.json."""
    from magi_moe.fuzz.campaign import _summary, reconcile_junit
    from magi_moe.fuzz.record import save_record

    passed = "tests/test_fuzz_properties.py::test_property[differential-native@interpret]"
    skipped = "tests/test_fuzz_properties.py::test_property[linearity-native@interpret]"
    clean = "tests/test_fuzz_properties.py::test_property[zero_tokens-native@interpret]"
    _pytest_junit(tmp_path / "junit.xml", [(passed, "passed"), (skipped, "skipped"), (clean, "passed")])
    record = {"property": "differential", "impl": "native", "backend": "interpret", "case": {}, "params": {}}
    save_record(tmp_path / "failures", record, kind="violation", message="off the bound", extra={"nodeid": passed})
    save_record(tmp_path / "failures", {**record, "property": "linearity"}, kind="violation",
                message="found, then stopped", extra={"nodeid": skipped})
    save_record(tmp_path / "failures", {**record, "property": "empty_experts"}, kind="crash",
                message="worker died")  # no node id: a stand-in test
    reconcile_junit(tmp_path)
    summary = _summary(_args(), backend="interpret", seed=1, start=0.0, returncode=0, out=tmp_path,
                       order={}, replayed={})
    outcome = {t["test"]: t["outcome"] for t in summary["tests"]}
    assert outcome[passed] == outcome[skipped] == "failed" and outcome[clean] == "passed"
    assert summary["totals"]["failures"] == 3 and summary["totals"]["failed"] == 3, summary["totals"]
    root = ET.parse(tmp_path / "junit.xml").getroot()
    failing = [c for c in root.iter("testcase") if c.find("failure") is not None]
    assert len(failing) == 3 and all("reproduce: python -m magi_moe.fuzz replay" in c.find("failure").text for c in failing)
    assert root.find("testsuite").get("failures") == "3"


def test_a_failure_found_before_a_stop_is_recorded(tmp_path):
    """The first failing case of an item is noted when it fails; if the worker is stopped (or
    dies) while Hypothesis shrinks it, the runner still turns the note into a failure record."""
    from magi_moe.fuzz import record as rec
    from magi_moe.fuzz.campaign import _collect_crashes

    rec.configure_flight_recorder(tmp_path / "inflight")
    try:
        case = {"property": "linearity", "impl": "native", "backend": "cpu", "case": {}, "params": {}}
        for _ in range(2):  # the second failure is a shrink step of the first: one note
            with pytest.raises(rec.PropertyViolation):
                with rec.in_flight({**case, "params": {"n": _}}):
                    raise rec.PropertyViolation("not doubled", {**case, "params": {"n": _}})
        note = json.loads(rec.found_path().read_text())
        assert note["record"]["params"] == {"n": 0} and note["kind"] == "violation"
    finally:
        rec.configure_flight_recorder(None)
    written = _collect_crashes(tmp_path, "cpu", confirm=False, timeout=1.0, stopped=True)
    assert len(written) == 1
    data = json.loads(written[0].read_text())
    assert data["kind"] == "violation" and "stopped at the hard limit" in data["message"]
    assert data["repro"].startswith("python -m magi_moe.fuzz replay ")
    assert not list((tmp_path / "inflight").glob("found-*"))


def test_stale_outputs_never_stand_in_for_this_run(tmp_path):
    from magi_moe.fuzz.campaign import _clean_outputs

    for name in ("junit.xml", "summary.json", "failures/old.json", "stats/old.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    _clean_outputs(tmp_path)
    assert not (tmp_path / "junit.xml").exists() and not (tmp_path / "summary.json").exists()
    assert not any((tmp_path / "failures").iterdir()) and not any((tmp_path / "stats").iterdir())


# -- fair scheduling -------------------------------------------------------------------------------
class _Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_order_puts_known_failures_first_then_rotates():
    from magi_moe.fuzz.campaign_plugin import order_items

    items = [_Item(f"t{i}") for i in range(5)]
    order = {"first": ["t3", "gone"], "rotation": 7}  # 7 mod 4 others = 3
    assert [i.nodeid for i in order_items(items, order)] == ["t3", "t4", "t0", "t1", "t2"]
    assert [i.nodeid for i in order_items(items, {})] == ["t0", "t1", "t2", "t3", "t4"]


def test_targets_without_time_lead_the_next_campaign(tmp_path):
    from magi_moe.fuzz.campaign import _next_rotation

    (tmp_path / "targets.json").write_text(json.dumps({"collected": ["t0", "t1", "t2", "t3"]}))
    rows = [{"target": t, "rounds": r} for t, r in (("t2", 1), ("t3", 1), ("t0", 0), ("t1", 0))]
    assert _next_rotation({"rotation": 2}, tmp_path, rows) == 0  # t0 got none: it starts next time
    rows = [{"target": t, "rounds": 1} for t in ("t2", "t3", "t0", "t1")]
    assert _next_rotation({"rotation": 2}, tmp_path, rows) == 3  # all served: one further


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
def test_every_target_gets_time_on_a_tiny_budget_and_the_order_rotates(tmp_path):
    """Six targets, a one-second budget: each still runs a round (rounds start at one example),
    the summary lists cases and seconds per target, and the next campaign starts one further."""
    props = "differential,token_permutation,head_locality,linearity,empty_experts,zero_tokens"
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"out{seed}"
        proc = subprocess.run([sys.executable, "-m", "fuzz", "--backend", "cpu", "--impl", "reference",
                               "--properties", props, "--budget-seconds", "1", "--workers", "0",
                               # the hard stop (budget + grace) must not depend on how loaded
                               # the CI machine is: this test is about the scheduling
                               "--grace-seconds", "300",
                               "--seed", str(seed), "--db", str(tmp_path / "db"), "--out", str(out)],
                              cwd=REPO_ROOT, env=child_env("cpu"), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["totals"]["targets"] == 6 and summary["targets_without_time"] == []
        assert all(row["rounds"] >= 1 and row["cases"] >= 1 and row["seconds"] > 0 for row in summary["targets"])
        assert "6 of 6 targets got time" in proc.stdout, proc.stdout[-3000:]
        runs.append([row["target"] for row in summary["targets"]])
    assert runs[1] == runs[0][1:] + runs[0][:1], runs


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
def test_a_campaign_that_fuzzed_no_kernel_fails(tmp_path):
    """On the cpu backend without --impl only the oracle and the baseline run: the campaign says
    so and exits 2 instead of reporting a pass (--allow-no-kernels accepts it)."""
    base = [sys.executable, "-m", "fuzz", "--backend", "cpu", "--properties", "zero_tokens",
            "--budget-seconds", "1", "--workers", "0", "--seed", "3", "--db", str(tmp_path / "db")]
    proc = subprocess.run(base + ["--out", str(tmp_path / "a")], cwd=REPO_ROOT, env=child_env("cpu"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "no implementation under test ran a case" in proc.stdout
    allowed = subprocess.run(base + ["--out", str(tmp_path / "b"), "--allow-no-kernels"], cwd=REPO_ROOT,
                             env=child_env("cpu"), capture_output=True, text=True, timeout=600)
    assert allowed.returncode == 0, allowed.stdout[-3000:]


# -- the backend, the targets, the database, the verdict (in process: quick) -------------------------
CPU_ONLY = "magi_moe.tests.outside_broken:CONTENT_CHECKED_LAYER"  # plain torch, declares cpu only


@pytest.fixture
def no_gpu(monkeypatch):
    from magi_moe.fuzz import campaign

    monkeypatch.setattr(campaign, "_cuda_count", lambda: 0)


def test_the_backend_is_one_the_implementation_declares_and_can_use_here(no_gpu, monkeypatch):
    """An implementation that declares only cpu was once fuzzed on interpret (none of its
    targets ran) and the campaign exited 0."""
    from magi_moe import backends
    from magi_moe.fuzz.campaign import choose_backend

    assert choose_backend(None, [CPU_ONLY]) == ("cpu", None)
    backend, why = choose_backend("interpret", [CPU_ONLY])
    assert backend is None and why == ("--backend interpret: outside-content-checked-cache does not "
                                       "declare it (it declares cpu)")
    backend, why = choose_backend("cuda", [])
    assert backend is None and why == "--backend cuda is not usable here: no CUDA GPU here"
    monkeypatch.setattr(backends, "triton_installed", lambda: False)  # the [test] extra alone
    assert choose_backend(None, []) == ("cpu", None)
    backend, why = choose_backend(None, ["fused"])
    assert backend is None and "no backend every implementation declares is usable here" in why
    assert "fused declares interpret, cuda" in why


def test_targets_are_found_by_their_mark_not_by_a_list(tmp_path):
    """A new state machine is a marked test in a test_fuzz_*.py file: the campaign runs it and
    --properties accepts its name; a file without a mark is not collected."""
    from magi_moe.fuzz.campaign import DEFAULT_TESTS, STATE_MACHINES, campaign_test_files, machine_names

    assert {"tests/test_fuzz_properties.py", "tests/test_fuzz_stateful.py"} <= {
        f.replace("\\", "/").split("magi_moe/")[-1] for f in DEFAULT_TESTS}
    assert "weight_swaps" in STATE_MACHINES
    assert "serving_stream" in STATE_MACHINES  # the serving-stream machine (fuzz/serving.py)
    (tmp_path / "test_fuzz_newmachine.py").write_text(
        "@fuzzers.campaign_target\n@pytest.mark.clause('history')\ndef test_serving_stream(impl_backend):\n    pass\n")
    (tmp_path / "test_fuzz_unmarked.py").write_text("def test_x():\n    'campaign_target'\n")
    (tmp_path / "test_fuzz_rows.py").write_text(
        "@fuzzers.campaign_target(by_param='prop')\n@given(data=st.data())\ndef test_property(prop, data):\n    pass\n")
    files = [Path(f).name for f in campaign_test_files(tmp_path)]
    assert files == ["test_fuzz_newmachine.py", "test_fuzz_rows.py"]
    assert machine_names(tmp_path) == ("serving_stream",)


def test_each_implementation_set_has_its_own_directory_database(tmp_path):
    """Two implementations' campaigns in one directory once shared .hypothesis/fuzz-db."""
    import argparse

    from magi_moe.fuzz.campaign import database_for

    def db(impls, shared=False, spec=str(tmp_path / "db")):
        return database_for(argparse.Namespace(db=spec, impl=impls, shared_db=shared))

    assert db(["team:GOOD"]) != db(["team:BUGGY"])
    assert db(["team:GOOD"]) == str(tmp_path / "db" / "team_GOOD")
    assert db([]) == str(tmp_path / "db" / "all-declared")
    assert db(["a", "b"]) == db(["b", "a"])
    assert db(["team:GOOD"], shared=True) == str(tmp_path / "db")
    # Redis: one namespace per implementation set (key prefix and local half), as the directory
    assert db(["team:GOOD"], spec="redis://host:6379/0") == "redis://host:6379/0#team_GOOD"
    assert db(["team:GOOD"], spec="redis://host:6379/0") != db(["team:BUGGY"], spec="redis://host:6379/0")
    assert db(["x"], spec="redis://host:6379/0", shared=True) == "redis://host:6379/0"
    assert db(["x"], spec="redis://host:6379/0#nightly") == "redis://host:6379/0#nightly"  # named: as given


def _campaign_summary():
    repro = "python -m magi_moe.fuzz replay '{}'"
    return {"backend": "cpu", "targets": [
        {"target": "t::diff", "outcome": "failed", "cases": 3, "rounds": 1, "impl": "team-good"},
        {"target": "t::perm", "outcome": "passed", "cases": 9, "rounds": 2, "impl": "team-good"},
        {"target": "t::det", "outcome": "skipped", "cases": 0, "rounds": 0,
         "reason": "team-good does not declare deterministic", "skip_kind": "NOT DECLARED"},
        {"target": "t::zero", "outcome": "passed", "cases": 0, "rounds": 0, "impl": "team-good"},
        {"target": "t::swaps", "outcome": "passed", "cases": 4, "rounds": 1, "impl": "team-good"},
    ], "failures": [
        {"kind": "violation", "property": "differential", "nodeid": "t::diff", "message": "off by 1%",
         "repro": repro, "impl": "team:GOOD", "backend": "cpu"},
        {"kind": "crash", "property": "linearity", "nodeid": "fuzz/linearity::team:GOOD@cpu",
         "message": "SIGSEGV", "repro": repro, "impl": "team:GOOD", "backend": "cpu"},
    ]}


def test_the_verdict_of_a_campaign_has_one_row_per_clause():
    from magi_moe.fuzz.campaign_verdict import campaign_outcomes
    from magi_moe.verdict import FAIL, NOT_DECLARED, NOT_RUN, PASS, verdict_rows

    stats = {"t::diff": {"clause": "accuracy", "subject": "team-good@cpu"},
             "t::perm": {"clause": "locality", "subject": "team-good@cpu"},
             "t::det": {"clause": "determinism", "subject": "team-good@cpu"},
             "t::zero": {"clause": "edge-shapes", "subject": "team-good@cpu"},
             "t::swaps": {"clause": "weight-swaps", "subject": "team-good@cpu"}}
    table = verdict_rows(campaign_outcomes(_campaign_summary(), stats))
    rows = {r.clause.name: r for r in table["team-good@cpu"]}
    assert rows["accuracy"].status == FAIL and rows["accuracy"].repro.startswith("python -m magi_moe.fuzz replay")
    assert "off by 1%" in rows["accuracy"].detail
    assert rows["locality"].status == PASS and rows["weight-swaps"].status == PASS
    assert rows["determinism"].status == NOT_DECLARED
    assert rows["edge-shapes"].status == NOT_RUN and "no time" in rows["edge-shapes"].detail
    crash = {r.clause.name: r for r in table["team:GOOD@cpu"]}  # a record of no target: its property's clause
    assert crash["locality"].status == FAIL and "SIGSEGV" in crash["locality"].detail


def test_a_campaign_without_a_case_for_an_asked_implementation_fails():
    """The campaign that fuzzed only magi-moe's router and none of the asked-for implementation."""
    from magi_moe.fuzz.campaign import _impls_without_cases, _nothing_tested

    summary = {"targets": [{"target": "tie", "impl": None, "cases": 40, "outcome": "passed"},
                           {"target": "d", "impl": "outside-content-checked-cache", "cases": 0,
                            "outcome": "skipped"}]}
    assert _impls_without_cases([CPU_ONLY], summary) == [CPU_ONLY]
    line = _nothing_tested(summary, [CPU_ONLY], "cpu")
    assert line == (f"no case ran for {CPU_ONLY} on cpu: every target was skipped here (the verdict's "
                    f"rows say why); nothing was tested")
    summary["targets"][1].update(cases=5, outcome="passed")
    assert _impls_without_cases([CPU_ONLY], summary) == []


def test_a_shrink_stops_when_the_targets_share_is_spent():
    """A failure found late in a target's share was shrunk for minutes past the budget; the
    plugin now bounds the shrink, and the failure is still reported (shrunk as far as it got)."""
    import time

    from hypothesis import Phase, given, settings, strategies as st
    from hypothesis.internal.conjecture import engine

    from magi_moe.fuzz.hypothesis_internals import set_shrink_deadline

    default = engine.MAX_SHRINKING_SECONDS

    @settings(database=None, max_examples=5, derandomize=True, deadline=None, phases=tuple(Phase))
    @given(st.lists(st.integers(0, 2**40), min_size=200, max_size=200))
    def slow_to_shrink(xs):
        calls.append(xs)
        time.sleep(0.06)  # a slow case: a full shrink takes 112 calls, over 9 s
        assert sum(xs) < 0

    # Counted in calls, not seconds: a loaded machine (8 test workers beside GPU tests) stretched
    # the bounded run's wall time past a fixed limit, but it only fits fewer calls before the
    # deadline. At most 1.5 s / 0.06 s = 25 calls fit before it, plus the last pass's, the final
    # replay and the explain phase's (13 in all on an idle machine).
    calls = []
    try:
        assert set_shrink_deadline(time.time() + 1.5, least=0.5)  # the deadline counts from now,
        with pytest.raises(AssertionError):                     # not from when the shrink starts
            slow_to_shrink()
        assert len(calls) < 40, len(calls)  # unbounded: 112
    finally:
        engine.MAX_SHRINKING_SECONDS = default


# -- end to end, as an outside team runs it (slow tier) ------------------------------------------------
def _fuzz(args, *, cwd, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "magi_moe.fuzz", *args], cwd=cwd, env=env or child_env("cpu"),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # about 60 s: two campaigns of 15 s and a replay
def test_an_outside_team_fuzzes_its_cpu_implementation_and_reads_the_verdict(tmp_path):
    """No --backend: a cpu-only implementation is fuzzed on cpu (it once got interpret, none of
    its targets ran, and the campaign exited 0); the run ends with the per-clause verdict; a
    wrong kernel fails with a replay line that reproduces the failure from where it was run."""
    (tmp_path / "team.py").write_text((Path(__file__).parent / "outside_team_kernel.py").read_text())
    props = ["--properties", "differential,empty_experts,zero_tokens,deterministic"]  # a quick share
    good = _fuzz(["--impl", "team:GOOD", "--budget-seconds", "15", "--workers", "0", *props], cwd=tmp_path)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-2000:]
    assert "[fuzz] backend cpu, impl ['team:GOOD']" in good.stdout
    assert "verdict (one row per contract clause)" in good.stdout and "team-good@cpu: PASS" in good.stdout
    verdict = json.loads((tmp_path / "fuzz-out" / "verdict.json").read_text())
    team = next(s for s in verdict["subjects"] if s["subject"] == "team-good@cpu")
    statuses = {c["clause"]: c["status"] for c in team["clauses"]}
    assert statuses["accuracy"] == "PASS" and statuses["determinism"] == "NOT DECLARED", statuses
    assert (tmp_path / "fuzz-out" / "verdict.md").read_text().startswith("# magi-moe fuzz verdict (cpu)")

    bad = _fuzz(["--impl", "team:BUGGY", "--budget-seconds", "15", "--workers", "0", "--out", "bad", *props],
                cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    assert "team-buggy@cpu: FAIL" in bad.stdout
    assert (tmp_path / ".hypothesis" / "fuzz-db" / "team_BUGGY").is_dir()  # not team:GOOD's database
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    found = next(f for f in summary["failures"] if f["kind"] == "violation")
    command = shlex.split(found["repro"])
    assert command[:4] == ["python", "-m", "magi_moe.fuzz", "replay"], command[:4]
    replay = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=child_env("cpu"),
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1, replay.stdout[-2000:] + replay.stderr[-2000:]
    assert f"FAIL: {found['property']} violated by team:BUGGY@cpu" in replay.stdout, replay.stdout[-2000:]


@pytest.mark.slow  # about 15 s
def test_the_weight_swap_machine_runs_from_the_test_extra_without_triton(tmp_path):
    """With the [test] extra alone (no triton) the weight-swap machine was skipped at collection,
    so a campaign over a layer with a weight cache never ran it and exited 0."""
    hide = tmp_path / "no-triton"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["triton"] = None  # as if not installed\n')
    env = child_env("cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(hide), env["PYTHONPATH"]])
    proc = _fuzz(["--impl", CPU_ONLY, "--properties", "weight_swaps", "--budget-seconds", "8", "--workers", "0",
                  "--out", str(tmp_path / "out"), "--db", str(tmp_path / "db")], cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = [r for r in summary["targets"] if "test_weight_swaps" in r["target"]]
    assert len(rows) == 1 and rows[0]["cases"] > 0 and rows[0]["outcome"] == "passed", summary["targets"]
    assert "weight-swaps  PASS" in proc.stdout


@pytest.mark.slow  # about 35 s
def test_a_campaign_that_finds_a_failure_keeps_its_budget_and_every_target_gets_time(tmp_path):
    """A failing target once shrank past the hard limit (reported unshrunk after 125 s of a 90 s
    budget) and the targets after it got no case."""
    budget, grace = 20, 5
    proc = _fuzz(["--impl", "magi_moe.tests.fuzz_broken:empty_expert_garbage",
                  "--properties", "empty_experts,differential,zero_tokens", "--budget-seconds", str(budget),
                  "--grace-seconds", str(grace), "--workers", "0", "--seed", "5",
                  "--out", str(tmp_path / "out"), "--db", str(tmp_path / "db")], cwd=REPO_ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert any(f["property"] == "empty_experts" for f in summary["failures"]), summary["failures"]
    assert summary["wall_seconds"] <= budget + grace, summary["wall_seconds"]
    assert summary["targets_without_time"] == [] and all(r["cases"] > 0 for r in summary["targets"])


def test_a_skip_before_a_stop_still_reads_as_a_skip(tmp_path):
    """pytest stopped at the hard limit writes no junit.xml: the targets it had skipped (an
    undeclared capability) were once listed as "not run" and the verdict said they got no time."""
    import argparse

    from magi_moe.fuzz.campaign import _summary, write_fallback_junit
    from magi_moe.fuzz.campaign_verdict import campaign_outcomes
    from magi_moe.verdict import NOT_DECLARED, verdict_rows

    node = "tests/test_fuzz_properties.py::test_property[deterministic-team-good@cpu]"
    for sub in ("failures", "stats", "skips"):
        (tmp_path / sub).mkdir()
    (tmp_path / "targets.json").write_text(json.dumps({"targets": [node], "collected": [node], "rows": {
        node: {"property": "deterministic", "impl": "team-good", "clause": "determinism",
               "subject": "team-good@cpu"}}}))
    (tmp_path / "skips" / "d.json").write_text(json.dumps(
        {"nodeid": node, "reason": "team-good does not declare deterministic", "kind": NOT_DECLARED}))
    write_fallback_junit(tmp_path)
    args = argparse.Namespace(impl=["team:GOOD"], profile="nightly", workers=0, db=str(tmp_path / "db"),
                              replay_only=False, budget_seconds=10.0)
    summary = _summary(args, backend="cpu", seed=1, start=0.0, returncode=-15, out=tmp_path,
                       order={}, replayed={})
    row = summary["targets"][0]
    assert row["outcome"] == "skipped" and row["impl"] == "team-good" and summary["targets_without_time"] == []
    rows = verdict_rows(campaign_outcomes(summary, json.loads((tmp_path / "targets.json").read_text())["rows"]))
    assert [(r.clause.name, r.status) for r in rows["team-good@cpu"]] == [("determinism", NOT_DECLARED)]
    # the summary row names its clause and subject, so a merge of summaries alone folds the same verdict
    assert (row["clause"], row["subject"]) == ("determinism", "team-good@cpu")
    assert [(r.clause.name, r.status) for r in verdict_rows(campaign_outcomes(summary, {}))["team-good@cpu"]] \
        == [("determinism", NOT_DECLARED)]


def test_a_target_stopped_in_its_first_round_is_not_reported_as_getting_no_time(tmp_path):
    """A serving stream started 76 s into a 90 s campaign and stopped at the hard limit 44 s later
    once read "got no time within the budget": its time was spent, in a round that never ended."""
    import argparse

    from magi_moe.fuzz.campaign import _summary, write_fallback_junit
    from magi_moe.fuzz.campaign_verdict import campaign_outcomes
    from magi_moe.verdict import NOT_RUN, verdict_rows

    stopped = "tests/test_fuzz_stateful.py::test_serving_stream[team-stale@cpu]"
    never = "tests/test_fuzz_stateful.py::test_weight_swaps[team-stale@cpu]"
    for sub in ("failures", "stats", "skips"):
        (tmp_path / sub).mkdir()
    rows = {n: {"property": None, "impl": "team-stale", "clause": c, "subject": "team-stale@cpu"}
            for n, c in ((stopped, "history"), (never, "weight-swaps"))}
    (tmp_path / "targets.json").write_text(json.dumps({"targets": [stopped, never], "rows": rows}))
    (tmp_path / "stats" / "s.json").write_text(json.dumps(  # as the plugin writes it when a target starts
        {"nodeid": stopped, **rows[stopped], "rounds": 0, "cases": 0, "seconds": 0.0, "started": 76.5}))
    write_fallback_junit(tmp_path)
    args = argparse.Namespace(impl=["team:STALE"], profile="nightly", workers=1, db=str(tmp_path / "db"),
                              replay_only=False, budget_seconds=90.0)
    summary = _summary(args, backend="cpu", seed=1, start=0.0, returncode=-15, out=tmp_path, order={}, replayed={})
    table = {r.clause.name: r for r in verdict_rows(campaign_outcomes(summary, {}))["team-stale@cpu"]}
    assert table["history"].status == NOT_RUN and "stopped at the hard limit in its first round" in \
        table["history"].detail and "started 76 s into" in table["history"].detail, table["history"].detail
    assert table["weight-swaps"].status == NOT_RUN and "got no time" in table["weight-swaps"].detail
