"""The campaign runner end to end (python -m fuzz): a case that kills its worker is recorded with
its signal and the campaign goes on; a property violation is saved with a one-line reproduction
that replays it exactly; summary.json and junit.xml say so; the example database keeps it."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET

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
