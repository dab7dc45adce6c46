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

from fuzz.huge import REPO_ROOT, child_env

pytest.importorskip("xdist", reason="the campaign runner scales out with pytest-xdist")


@pytest.mark.slow  # 14-37 s here: a campaign with a 20 s budget, in a child process
def test_campaign_records_crashes_and_violations_and_goes_on(tmp_path):
    out, db = tmp_path / "out", tmp_path / "db"
    cmd = [sys.executable, "-m", "fuzz", "--backend", "cpu",
           "--impl", "tests.fuzz_broken:segfault_from_three_tokens",  # crashes first ...
           "--impl", "tests.fuzz_broken:empty_expert_garbage",        # ... then this still runs
           "--properties", "empty_experts", "--budget-seconds", "20", "--workers", "1",
           "--round-examples", "5", "--no-shrink", "--seed", "3", "--out", str(out), "--db", str(db)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env("cpu"), capture_output=True, text=True,
                          timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    assert "[fuzz]" in proc.stdout  # progress and results are printed

    summary = json.loads((out / "summary.json").read_text())
    by_kind = {f["kind"]: f for f in summary["failures"]}
    assert set(by_kind) == {"crash", "violation"}, summary["failures"]
    assert "SIGSEGV" in by_kind["crash"]["message"]
    assert "tests.fuzz_broken:segfault_from_three_tokens" in by_kind["crash"]["repro"]
    violation = by_kind["violation"]
    assert violation["property"] == "empty_experts"
    assert violation["repro"].startswith("python -m fuzz replay ")

    cases = ET.parse(out / "junit.xml").getroot().iter("testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    assert len(failed) == 2, failed
    assert any(p.iterdir() for p in db.iterdir()), "the example database kept nothing"

    command = shlex.split(violation["repro"])
    assert command[:4] == ["python", "-m", "fuzz", "replay"]
    replay = subprocess.run([sys.executable, *command[1:]], cwd=REPO_ROOT, env=child_env("cpu"),
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1 and "FAIL: empty_experts violated" in replay.stdout, replay.stdout + replay.stderr


def test_fallback_junit_when_pytest_was_stopped(tmp_path):
    """A campaign stopped at its hard limit still leaves a JUnit file CI can read: one testcase
    per test that ran, a failure element per failure record (with its reproduction)."""
    from fuzz.campaign import write_fallback_junit

    (tmp_path / "stats").mkdir()
    (tmp_path / "failures").mkdir()
    ok, bad = "tests/test_fuzz_properties.py::test_zero_tokens[fused@cuda]", \
        "tests/test_fuzz_properties.py::test_linearity[fused@cuda]"
    for i, nodeid in enumerate((ok, bad)):
        (tmp_path / "stats" / f"{i}.json").write_text(json.dumps(
            {"nodeid": nodeid, "property": "p", "rounds": 3, "cases": 40, "seconds": 12.5}))
    (tmp_path / "failures" / "linearity-1.json").write_text(json.dumps(
        {"kind": "violation", "nodeid": bad, "message": "doubling did not double",
         "repro": "python -m fuzz replay '{}'", "record": {"property": "linearity"}}))
    root = ET.parse(write_fallback_junit(tmp_path)).getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {"test_zero_tokens[fused@cuda]", "test_linearity[fused@cuda]"}
    assert cases["test_zero_tokens[fused@cuda]"].find("failure") is None
    failure = cases["test_linearity[fused@cuda]"].find("failure")
    assert failure is not None and "python -m fuzz replay" in failure.text
    assert cases["test_linearity[fused@cuda]"].get("classname") == "tests.test_fuzz_properties"
