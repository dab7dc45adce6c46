"""``python -m fuzz merge``: the summaries of N machines sharing one database become one."""
from __future__ import annotations

import json

from magi_moe.fuzz.cli import main


def _summary(path, *, targets, failures=(), failed=0, seed=1):
    path.mkdir(parents=True)
    rows = [{"target": t, "outcome": o, "cases": c, "rounds": r, "seconds": 1.0} for t, o, c, r in targets]
    totals = {"tests": len(rows), "passed": sum(o == "passed" for _, o, _, _ in targets), "failed": failed,
              "skipped": 0, "cases": sum(c for _, _, c, _ in targets), "rounds": sum(r for _, _, _, r in targets)}
    (path / "summary.json").write_text(json.dumps({"backend": "cpu", "seed": seed, "totals": totals,
                                                   "targets": rows, "failures": list(failures)}))
    return path


def test_merge_adds_targets_and_lists_each_failure_once(tmp_path, capsys):
    failure = {"kind": "violation", "property": "linearity", "message": "off", "repro": "python -m magi_moe.fuzz replay '{}'"}
    a = _summary(tmp_path / "a", targets=[("t1", "passed", 10, 2), ("t2", "passed", 0, 0)])
    b = _summary(tmp_path / "b", targets=[("t1", "failed", 5, 1), ("t3", "passed", 7, 1)],
                 failures=[failure, failure], failed=1, seed=2)
    assert main(["merge", str(a), str(b / "summary.json"), "--out", str(tmp_path / "m")]) == 1
    merged = json.loads((tmp_path / "m" / "summary.json").read_text())
    rows = {r["target"]: r for r in merged["targets"]}
    assert rows["t1"]["cases"] == 15 and rows["t1"]["rounds"] == 3 and rows["t1"]["outcome"] == "failed"
    assert merged["targets_without_time"] == ["t2"]
    assert merged["totals"]["cases"] == 22 and merged["totals"]["failures"] == 1
    assert merged["machines"] == 2 and merged["seeds"] == [1, 2]
    assert "reproduce: python -m magi_moe.fuzz replay" in capsys.readouterr().out


def test_merge_passes_when_no_machine_failed(tmp_path):
    a = _summary(tmp_path / "a", targets=[("t1", "passed", 3, 1)])
    assert main(["merge", str(a), "--out", str(tmp_path / "m")]) == 0


def test_merge_refuses_what_is_not_a_summary(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["merge", str(tmp_path / "x"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "OUT must be a campaign's --out directory" in err


def test_merge_refuses_one_campaign_given_twice(tmp_path, capsys):
    """``merge a a`` (or a copy of a) once counted one campaign as two machines and exited 0."""
    a = _summary(tmp_path / "a", targets=[("t1", "passed", 3, 1)])
    copy = tmp_path / "copy.json"
    copy.write_text((a / "summary.json").read_text())
    for twice in ([str(a), str(a)], [str(a), str(a / "summary.json")], [str(a), str(copy)]):
        assert main(["merge", *twice, "--out", str(tmp_path / "m")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is the same campaign as" in err, err
    assert not (tmp_path / "m").exists()


def test_merge_refuses_a_summary_whose_targets_are_not_rows(tmp_path, capsys):
    a = _summary(tmp_path / "a", targets=[("t1", "passed", 3, 1)])
    data = json.loads((a / "summary.json").read_text())
    data["targets"] = {"t1": data["targets"][0]}
    (a / "summary.json").write_text(json.dumps(data))
    assert main(["merge", str(a), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'targets' must be a list of objects, got dict" in err, err


def test_merge_refuses_an_out_under_a_file_before_reading_any_input(tmp_path, capsys):
    (tmp_path / "plain").write_text("x")
    missing = tmp_path / "never-written"  # unread: the --out check comes first
    assert main(["merge", str(missing), "--out", str(tmp_path / "plain" / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out must be a directory" in err and "is a file" in err, err


def test_merge_writes_the_merged_campaigns_verdict(tmp_path, capsys):
    """The merge once wrote summary.json only: no verdict, unlike each machine's campaign."""
    failure = {"kind": "violation", "property": "differential", "nodeid": "t::diff", "message": "off by 1%",
               "repro": "python -m magi_moe.fuzz replay '{}'", "impl": "team-good", "backend": "cpu"}
    a = _summary(tmp_path / "a", targets=[("t::diff", "passed", 4, 1), ("t::swaps", "passed", 0, 0)])
    b = _summary(tmp_path / "b", targets=[("t::diff", "failed", 2, 1), ("t::swaps", "passed", 3, 1)],
                 failures=[failure], failed=1, seed=2)
    for path, rows in ((a, None), (b, None)):  # each machine's rows name their clause and subject
        data = json.loads((path / "summary.json").read_text())
        for row in data["targets"]:
            row.update(clause="accuracy" if row["target"] == "t::diff" else "weight-swaps",
                       subject="team-good@cpu", impl="team-good")
        (path / "summary.json").write_text(json.dumps(data))
    assert main(["merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 1
    verdict = json.loads((tmp_path / "m" / "verdict.json").read_text())
    [subject] = verdict["subjects"]
    rows = {c["clause"]: c for c in subject["clauses"]}
    assert subject["subject"] == "team-good@cpu" and subject["verdict"] == "FAIL"
    assert rows["accuracy"]["status"] == "FAIL" and "off by 1%" in rows["accuracy"]["detail"]
    assert rows["accuracy"]["repro"].startswith("python -m magi_moe.fuzz replay")
    assert rows["weight-swaps"]["status"] == "PASS"  # no cases on a, three on b: it ran
    assert "accuracy" in (tmp_path / "m" / "verdict.md").read_text()
    out = capsys.readouterr().out
    assert "verdict (one row per contract clause)" in out and "team-good@cpu: FAIL" in out
