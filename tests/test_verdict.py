"""The verdict (magi_moe.verdict): one row per contract clause, folded from the cases that judged
it, and the conformance suite end to end: a correct, input-trusting implementation with a narrow
shape rule gets no failure and no case outside its rule; a buggy one gets a FAIL row naming the
clause, whose rerun command fails again on its own."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from magi_moe import verdict as V

ROOT = Path(__file__).resolve().parents[1]


def _o(clause, status, detail="", case="", repro="", subject="k@cpu"):
    return V.Outcome(subject, clause, status, case, detail, repro)


# -- folding -------------------------------------------------------------------------------------
def test_one_root_cause_is_one_row_with_a_count():
    rows = V.verdict_rows([_o("input-checks", "failed", "ValueError not raised", f"t{i}", f"rerun {i}")
                           for i in range(23)] + [_o("input-checks", "passed")])["k@cpu"]
    assert len(rows) == 1
    row = rows[0]
    assert (row.status, row.failed, row.passed, row.repro) == (V.FAIL, 23, 1, "rerun 0")
    assert row.failing_cases[:2] == ["t0", "t1"] and "other message" not in row.detail


def test_distinct_failure_messages_are_counted():
    row = V.verdict_rows([_o("accuracy", "failed", "a"), _o("accuracy", "failed", "b"),
                          _o("accuracy", "failed", "c")])["k@cpu"][0]
    assert row.detail == "a (and 2 other messages)"


INACCURATE = "PropertyViolation: empty_experts violated by k@cpu: inaccurate: k [bf16-fp32acc]: FAILED on bounds"


def test_an_edge_shape_that_is_only_inaccurate_counts_under_a_failing_accuracy():
    """A SwiGLU without its clamp fails accuracy, and also the empty-experts case's accuracy
    half: one root cause, one FAIL row."""
    rows = {r.clause.name: r for r in V.verdict_rows([
        _o("accuracy", "failed", "AssertionError: k [bf16-fp32acc]: FAILED on bounds", "a1"),
        _o("accuracy", "passed"),
        _o("edge-shapes", "failed", INACCURATE, "e1"), _o("edge-shapes", "passed"),
    ])["k@cpu"]}
    assert (rows["accuracy"].status, rows["accuracy"].failed) == (V.FAIL, 2)
    assert rows["accuracy"].failing_cases == ["a1", "e1"]
    edge = rows["edge-shapes"]
    assert (edge.status, edge.failed, edge.passed) == (V.PASS, 0, 1)
    assert "1 case(s) inaccurate, counted under accuracy" in edge.detail


def test_an_edge_clause_whose_every_case_was_inaccurate_is_not_run_not_passed():
    """Nothing of the edge clause is left to pass once its only case moves to accuracy: the row
    must not read PASS (nothing judged the edge) and must say where its case went."""
    rows = {r.clause.name: r for r in V.verdict_rows([
        _o("accuracy", "failed", "k: FAILED on bounds", "a1"),
        _o("edge-shapes", "failed", INACCURATE, "e1"),
    ])["k@cpu"]}
    assert (rows["accuracy"].status, rows["accuracy"].failed) == (V.FAIL, 2)
    edge = rows["edge-shapes"]
    assert (edge.status, edge.passed, edge.failed) == (V.NOT_RUN, 0, 0)
    assert edge.detail == "every case that ran was inaccurate, counted under accuracy"


@pytest.mark.parametrize("accuracy, edge_detail", [
    ("passed", INACCURATE),  # accuracy holds elsewhere: the edge shape's inaccuracy is its own
    ("failed", "k: FAILED on written: 12 elements not written"),  # unwritten: an edge bug
])
def test_an_edge_shape_failure_of_its_own_stays_an_edge_failure(accuracy, edge_detail):
    rows = {r.clause.name: r for r in V.verdict_rows([
        _o("accuracy", accuracy, "k: FAILED on bounds" if accuracy == "failed" else ""),
        _o("edge-shapes", "failed", edge_detail),
    ])["k@cpu"]}
    assert (rows["edge-shapes"].status, rows["edge-shapes"].failed) == (V.FAIL, 1)


@pytest.mark.parametrize("reason, status", [
    ("k does not declare deterministic", V.NOT_DECLARED),
    ("k does not declare input_checks", V.NOT_DECLARED),
    ("unsupported: k: head_dim must be a multiple of 64, got 32", V.UNSUPPORTED),
    ("k does not declare dtype torch.float16", V.UNSUPPORTED),
    ("backend cuda unavailable: no CUDA GPU", V.NOT_RUN),
    ("needs a second device", V.NOT_RUN),
])
def test_a_clause_nothing_ran_says_why(reason, status):
    row = V.verdict_rows([_o("determinism", "skipped", reason)])["k@cpu"][0]
    assert (row.status, row.detail) == (status, reason)


def test_not_declared_wins_over_other_skips():
    rows = V.verdict_rows([_o("determinism", "skipped", "backend cuda unavailable: no CUDA GPU"),
                           _o("determinism", "skipped", "k does not declare deterministic")])
    assert rows["k@cpu"][0].status == V.NOT_DECLARED


def test_rows_follow_the_contract_order_and_families_name_their_route():
    rows = V.verdict_rows([_o("weight-change/to_dtype", "passed"), _o("routing", "passed"),
                           _o("weight-change/copy_no_grad", "failed", "stale"), _o("accuracy", "passed")])
    assert [r.clause.name for r in rows["k@cpu"]] == [
        "accuracy", "routing", "weight-change/copy_no_grad", "weight-change/to_dtype"]
    assert "copy_no_grad" in rows["k@cpu"][2].clause.title
    assert V.overall(rows["k@cpu"]) == V.FAIL


def test_unknown_clauses_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="clause must be one of"):
        V.clause("acuracy")
    with pytest.raises(ValueError, match="family/route"):
        V.clause("weight-change/")


def test_markdown_and_json_carry_every_row():
    table = V.verdict_rows([_o("accuracy", "passed"), _o("determinism", "failed", "bits | differ",
                                                         repro="python -m pytest x")])
    md = V.markdown(table)
    assert "| determinism (CONTRACT 6) | **FAIL** | 1 failed | bits \\| differ | `python -m pytest x` |" in md
    data = V.as_json(table)
    assert data["subjects"][0]["verdict"] == V.FAIL
    assert [c["clause"] for c in data["subjects"][0]["clauses"]] == ["accuracy", "determinism"]


def test_a_layer_wrong_from_the_start_is_one_accuracy_row_even_where_accuracy_passed():
    wrong = ("AssertionError: team's layer FAILED on bounds before any weight change, so "
             "{} was not judged")
    rows = {r.clause.name: r for r in V.verdict_rows(
        [_o("weight-change/in_place", "failed", wrong.format("in_place"), "t1", "rerun 1"),
         _o("weight-change/to_dtype", "failed", wrong.format("to_dtype"), "t2", "rerun 2"),
         _o("cuda-graph/in_place", "failed", wrong.format("in_place"), "t3", "rerun 3")])["k@cpu"]}
    # no accuracy outcome at all (a run of the weight-change tests alone): the row is made
    accuracy = rows["accuracy"]
    assert (accuracy.status, accuracy.failed, accuracy.repro) == (V.FAIL, 3, "rerun 1")
    for route in ("weight-change/in_place", "weight-change/to_dtype", "cuda-graph/in_place"):
        assert rows[route].status == V.NOT_RUN, rows[route]
        assert rows[route].detail == "every case that ran was inaccurate, counted under accuracy"
    # a stale route beside a passing accuracy row stays its own failure
    rows = {r.clause.name: r for r in V.verdict_rows(
        [_o("accuracy", "passed"),
         _o("weight-change/in_place", "failed", "in_place/W_up: stale")])["k@cpu"]}
    assert rows["accuracy"].status == V.PASS and rows["weight-change/in_place"].status == V.FAIL


# -- end to end ----------------------------------------------------------------------------------
def _conformance(spec: str, tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "verdict"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--conformance", "--impl", spec, "--backend", "cpu",
         "-p", "no:cacheprovider", "-p", "no:xdist", "--hypothesis-profile", "ci", "-q",
         "--verdict-dir", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    data = json.loads((out / "verdict.json").read_text()) if (out / "verdict.json").exists() else {}
    return proc.returncode, data, proc.stdout[-4000:] + proc.stderr[-2000:]


def _rows(data: dict) -> dict[str, dict]:
    (subject,) = data["subjects"]
    return {c["clause"]: c for c in subject["clauses"]}


@pytest.mark.slow
def test_a_correct_trusting_narrow_implementation_gets_no_failure(tmp_path):
    """tests/outside_narrow_example.py raises on anything outside its rule and never validates
    its inputs: a check that calls it outside the rule, or holds it to input checks it never
    declared, fails here. Every conformance test must also name its clause."""
    rc, data, log = _conformance("tests.outside_narrow_example:IMPL", tmp_path, "-m", "not slow")
    assert rc == 0, log
    rows = _rows(data)
    assert not [c for c, r in rows.items() if r["status"] == V.FAIL], log
    assert "other" not in rows, f"conformance tests without a clause: {rows.get('other')}"
    assert rows["input-checks"]["status"] == V.NOT_DECLARED
    for needed in ("accuracy", "edge-shapes", "zero-rows", "locality", "determinism",
                   "inputs-unchanged", "weight-change/param_data_copy"):
        assert rows[needed]["status"] == V.PASS, (needed, rows[needed])


@pytest.mark.slow
def test_a_stale_cache_fails_its_route_row_and_the_rerun_fails_again(tmp_path):
    rc, data, log = _conformance("tests.outside_broken:VERSION_KEYED_LAYER", tmp_path,
                                 "-k", "test_layer_follows_the_weight_change")
    assert rc == 1, log
    rows = _rows(data)
    stale = rows["weight-change/param_data_copy"]
    assert stale["status"] == V.FAIL and stale["failed"] == 1, stale
    assert "stale" in stale["detail"]
    assert rows["weight-change/load_state_dict"]["status"] == V.PASS
    args = shlex.split(stale["repro"])
    assert args[:3] == ["python", "-m", "pytest"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    again = subprocess.run([sys.executable, *args[1:], "-p", "no:xdist"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 1 and "1 failed" in again.stdout, again.stdout[-3000:]


# -- the audit's rows ----------------------------------------------------------------------------
def test_audit_rows_become_clause_outcomes():
    from magi_moe.audit.clauses import audit_outcomes
    from magi_moe.audit.report import Row

    rows = [Row("selfcheck", "interpret: rounding", "pass", "ok"),
            Row("selfcheck", "interpret: truncation", "info", "observed"),
            Row("bounds", "fused-layer @ small/random", "pass", "ok", {"preset": "small", "probe": "random"}),
            Row("bounds", "fused @ small(Dh=64,I=128)/swamp", "FAIL", "too wrong",
                {"preset": "small(Dh=64,I=128)", "probe": "swamp"}),
            Row("determinism", "fused.layer()", "pass", "0/10 differ"),
            Row("determinism", "fused-layer", "info", "3/10 differ; not declared deterministic"),
            Row("cache", "fused: param_data_copy/W_gate", "FAIL", "stale: served stale weights"),
            Row("cache", "fused: to_device/all", "skip", "needs a layer on a CUDA device"),
            Row("cache", "fused", "info", "its layer offers no pack count"),
            Row("graphs", "fused-layer: in_place/W_gate", "info", "capture failed: host sync"),
            Row("discipline", "host sync / allocations / compile", "skip", "CUDA only"),
            Row("coverage", "fused", "pass", "audited")]
    got = audit_outcomes(rows, impls={"fused": "fused", "fused-layer": "pkg.mod:LAYER"},
                         backend="cpu", runs_on={"fused": "interpret"})
    table = V.verdict_rows(got)
    fused = {r.clause.name: r for r in table["fused@interpret"]}
    assert fused["accuracy"].status == V.FAIL
    assert fused["accuracy"].repro == "magi-moe audit --backend cpu --impl fused --preset small --probe swamp"
    assert fused["weight-change/param_data_copy"].status == V.FAIL
    assert fused["weight-change/to_device"].status == V.NOT_RUN
    assert fused["determinism"].status == V.PASS
    layer = {r.clause.name: r for r in table["fused-layer@cpu"]}
    assert layer["accuracy"].status == V.PASS
    assert layer["determinism"].status == V.NOT_DECLARED
    assert layer["cuda-graph/in_place"].detail.startswith("cannot be captured")
    assert [r.status for r in table["magi-moe"]] == [V.PASS]
