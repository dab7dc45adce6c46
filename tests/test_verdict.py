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


P, F, S = V.Status.PASS, V.Status.FAIL, V.Status.SKIP


def _o(clause, status, detail="", case="", repro="", subject="k@cpu", cause=None):
    return V.Outcome(subject, clause, status, case, detail, repro, cause=cause)


# -- folding -------------------------------------------------------------------------------------
def test_one_root_cause_is_one_row_with_a_count():
    rows = V.verdict_rows([_o("input-checks", F, "ValueError not raised", f"t{i}", f"rerun {i}")
                           for i in range(23)] + [_o("input-checks", P)])["k@cpu"]
    assert len(rows) == 1
    row = rows[0]
    assert (row.status, row.failed, row.passed, row.repro) == (V.FAIL, 23, 1, "rerun 0")
    assert row.failing_cases[:2] == ["t0", "t1"] and "other message" not in row.detail


def test_distinct_failure_messages_are_counted():
    row = V.verdict_rows([_o("accuracy", F, "a"), _o("accuracy", F, "b"),
                          _o("accuracy", F, "c")])["k@cpu"][0]
    assert row.detail == "a (and 2 other messages)"


INACCURATE = "PropertyViolation: empty_experts violated by k@cpu: inaccurate: k [bf16-fp32acc]: FAILED on bounds"


def test_an_edge_shape_that_is_only_inaccurate_counts_under_a_failing_accuracy():
    """A SwiGLU without its clamp fails accuracy, and also the empty-experts case's accuracy
    half: one root cause, one FAIL row."""
    rows = {r.clause.name: r for r in V.verdict_rows([
        _o("accuracy", F, "AssertionError: k [bf16-fp32acc]: FAILED on bounds", "a1"),
        _o("accuracy", P),
        _o("edge-shapes", F, INACCURATE, "e1", cause=V.INACCURATE), _o("edge-shapes", P),
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
        _o("accuracy", F, "k: FAILED on bounds", "a1"),
        _o("edge-shapes", F, INACCURATE, "e1", cause=V.INACCURATE),
    ])["k@cpu"]}
    assert (rows["accuracy"].status, rows["accuracy"].failed) == (V.FAIL, 2)
    edge = rows["edge-shapes"]
    assert (edge.status, edge.passed, edge.failed) == (V.NOT_RUN, 0, 0)
    assert edge.detail == "every case that ran was inaccurate, counted under accuracy"


@pytest.mark.parametrize("accuracy, edge_detail, cause", [
    (P, INACCURATE, V.INACCURATE),  # accuracy holds elsewhere: the edge shape's inaccuracy is its own
    (F, "k: FAILED on written: 12 elements not written", None),  # unwritten: an edge bug
    (F, INACCURATE, None),  # the words of an inaccuracy, without its type: the edge's own failure
])
def test_an_edge_shape_failure_of_its_own_stays_an_edge_failure(accuracy, edge_detail, cause):
    rows = {r.clause.name: r for r in V.verdict_rows([
        _o("accuracy", accuracy, "k: FAILED on bounds" if accuracy is F else ""),
        _o("edge-shapes", F, edge_detail, cause=cause),
    ])["k@cpu"]}
    assert (rows["edge-shapes"].status, rows["edge-shapes"].failed) == (V.FAIL, 1)


@pytest.mark.parametrize("reason, status", [
    (V.not_declared("k does not declare deterministic"), V.NOT_DECLARED),
    (V.not_declared("k does not declare input_checks"), V.NOT_DECLARED),
    (V.unsupported("unsupported: k: head_dim must be a multiple of 64, got 32"), V.UNSUPPORTED),
    (V.unsupported("k does not declare dtype torch.float16"), V.UNSUPPORTED),
    (V.not_run("backend cuda unavailable: no CUDA GPU"), V.NOT_RUN),
    ("needs a second device", V.NOT_RUN),  # plain text: NOT RUN
])
def test_a_clause_nothing_ran_says_why(reason, status):
    row = V.verdict_rows([_o("determinism", S, reason)])["k@cpu"][0]
    assert (row.status, row.detail) == (status, reason)


@pytest.mark.parametrize("kind", V.SKIP_KINDS)
def test_a_reworded_skip_keeps_its_kind(kind):
    """The kind travels with the reason: any wording, the same row; and words alone decide
    nothing (a plain reason saying "does not declare" is NOT RUN)."""
    for words in ("k does not declare deterministic", "unsupported: outside the declared shapes",
                  "no GPU here", "la capacité n'est pas déclarée"):
        row = V.verdict_rows([_o("determinism", S, V.SkipReason(kind, words))])["k@cpu"][0]
        assert (row.status, row.detail) == (kind, words)
        plain = V.verdict_rows([_o("determinism", S, words)])["k@cpu"][0]
        assert plain.status == V.NOT_RUN


def test_a_skip_reason_is_its_text_and_keeps_its_kind_through_pickling():
    import pickle

    reason = V.not_declared("k does not declare deterministic")
    assert reason == "k does not declare deterministic" and isinstance(reason, str)
    again = pickle.loads(pickle.dumps(reason))
    assert (again, again.kind) == (reason, V.NOT_DECLARED)
    with pytest.raises(ValueError, match="kind must be one of"):
        V.SkipReason("DECLINED", "no")


def test_outcomes_take_one_status_vocabulary():
    assert V.Outcome("k@cpu", "accuracy", "pass").status is V.Status.PASS
    for bad in ("passed", "PASS", "skipped"):
        with pytest.raises(ValueError, match="status must be one of"):
            V.Outcome("k@cpu", "accuracy", bad)
    with pytest.raises(ValueError, match="status must be pass, FAIL or skip"):
        V.Outcome("k@cpu", "accuracy", V.Status.INFO)
    with pytest.raises(ValueError, match="cause must be one of"):
        V.Outcome("k@cpu", "accuracy", F, cause="FAILED on bounds")


def test_not_declared_wins_over_other_skips():
    rows = V.verdict_rows([_o("determinism", S, V.not_run("backend cuda unavailable: no CUDA GPU")),
                           _o("determinism", S, V.not_declared("k does not declare deterministic"))])
    assert rows["k@cpu"][0].status == V.NOT_DECLARED


def test_rows_follow_the_contract_order_and_families_name_their_route():
    rows = V.verdict_rows([_o("weight-change/to_dtype", P), _o("routing", P),
                           _o("weight-change/copy_no_grad", F, "stale"), _o("accuracy", P)])
    assert [r.clause.name for r in rows["k@cpu"]] == [
        "accuracy", "routing", "weight-change/copy_no_grad", "weight-change/to_dtype"]
    assert "copy_no_grad" in rows["k@cpu"][2].clause.title
    assert V.overall(rows["k@cpu"]) == V.FAIL


def test_a_clause_added_to_the_registry_alone_is_judged_everywhere(monkeypatch):
    """Adding a clause is one Clause record: the fold, its order, its family rows and the
    audit's rows take it with nothing else changed."""
    from magi_moe.audit.clauses import audit_outcomes
    from magi_moe.audit.rows import Row

    added = (V.Clause("brand-new", "a clause added today", "CONTRACT 9"),
             V.Clause("new-family", "one row per route", "CONTRACT 9", family=True))
    monkeypatch.setattr(V, "_FIXED", V._FIXED[:1] + added + V._FIXED[1:])
    assert "new-family" in V.families() and V.clause("new-family/r1").contract == "CONTRACT 9"
    rows = [Row("new", "k @ x", "pass", "ok", impl="k", clause="brand-new"),
            Row("new", "k: r1/W", "FAIL", "wrong", impl="k", clause="new-family/r1"),
            Row("bounds", "k @ small/random", "pass", "ok", impl="k", clause="accuracy")]
    table = V.verdict_rows(audit_outcomes(rows, impls={"k": "k"}, backend="cpu"))
    assert [(r.clause.name, r.status) for r in table["k@cpu"]] == [
        ("accuracy", V.PASS), ("brand-new", V.PASS), ("new-family/r1", V.FAIL)]


def test_unknown_clauses_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="clause must be one of"):
        V.clause("acuracy")
    with pytest.raises(ValueError, match="family/route"):
        V.clause("weight-change/")


def test_markdown_and_json_carry_every_row():
    table = V.verdict_rows([_o("accuracy", P), _o("determinism", F, "bits | differ",
                                                  repro="python -m pytest x")])
    md = V.markdown(table)
    assert "| determinism (CONTRACT 6) | **FAIL** | 1 failed | bits \\| differ | `python -m pytest x` |" in md
    data = V.as_json(table)
    assert data["subjects"][0]["verdict"] == V.FAIL
    assert [c["clause"] for c in data["subjects"][0]["clauses"]] == ["accuracy", "determinism"]


def test_a_layer_wrong_from_the_start_is_one_accuracy_row_even_where_accuracy_passed():
    wrong = "AssertionError: team's layer is wrong before any weight change, so {} was not judged"
    rows = {r.clause.name: r for r in V.verdict_rows(
        [_o("weight-change/in_place", F, wrong.format("in_place"), "t1", "rerun 1",
            cause=V.WRONG_FROM_THE_START),
         _o("weight-change/to_dtype", F, wrong.format("to_dtype"), "t2", "rerun 2",
            cause=V.WRONG_FROM_THE_START),
         _o("cuda-graph/in_place", F, wrong.format("in_place"), "t3", "rerun 3",
            cause=V.WRONG_FROM_THE_START)])["k@cpu"]}
    # no accuracy outcome at all (a run of the weight-change tests alone): the row is made
    accuracy = rows["accuracy"]
    assert (accuracy.status, accuracy.failed, accuracy.repro) == (V.FAIL, 3, "rerun 1")
    for route in ("weight-change/in_place", "weight-change/to_dtype", "cuda-graph/in_place"):
        assert rows[route].status == V.NOT_RUN, rows[route]
        assert rows[route].detail == "every case that ran was inaccurate, counted under accuracy"
    # a stale route beside a passing accuracy row stays its own failure
    rows = {r.clause.name: r for r in V.verdict_rows(
        [_o("accuracy", P),
         _o("weight-change/in_place", F, "in_place/W_up: stale")])["k@cpu"]}
    assert rows["accuracy"].status == V.PASS and rows["weight-change/in_place"].status == V.FAIL


def test_causes_are_read_from_the_exception_or_what_it_was_raised_from():
    from magi_moe.judge.accuracy import Inaccurate

    assert V.cause_of(Inaccurate("any words at all", "baseline")) == V.INACCURATE
    assert V.cause_of(V.LayerWrongFromTheStart("x")) == V.WRONG_FROM_THE_START
    try:
        try:
            raise Inaccurate("k: FAILED on bounds", "bounds")
        except Inaccurate as exc:
            raise RuntimeError("a property violated") from exc
    except RuntimeError as chained:
        assert V.cause_of(chained) == V.INACCURATE
    assert V.cause_of(AssertionError("k: FAILED on bounds before any weight change")) is None
    try:  # a negative control's expected inaccuracy, then a failure of another kind
        try:
            raise Inaccurate("planted, expected", "bounds")
        except Inaccurate:
            raise AssertionError("the control's own check failed")
    except AssertionError as handled:
        assert V.cause_of(handled) is None
    assert V.cause_of(None) is None


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
    rc, data, log = _conformance("magi_moe.tests.outside_narrow_example:IMPL", tmp_path, "-m", "not slow")
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
    rc, data, log = _conformance("magi_moe.tests.outside_broken:VERSION_KEYED_LAYER", tmp_path,
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
def _audit_rows(subject=lambda s: s):
    """Rows as the sections make them: the implementation, clause and skip kind as data.
    ``subject`` rewords every subject, which must change nothing in the verdict."""
    from magi_moe.audit.rows import SUITE, Row

    def row(section, subj, status, result, data=None, **facts):
        return Row(section, subject(subj), status, result, data or {}, **facts)

    return [row("selfcheck", "interpret: rounding", "pass", "ok", impl=SUITE, clause="suite-self-check"),
            row("selfcheck", "interpret: truncation", "info", "observed", impl=SUITE,
                clause="suite-self-check"),
            row("bounds", "fused-layer @ small/random", "pass", "ok", {"preset": "small", "probe": "random"},
                impl="fused-layer", clause="accuracy", backend="cpu"),
            row("bounds", "fused @ small(Dh=64,I=128)/swamp", "FAIL", "too wrong",
                {"preset": "small(Dh=64,I=128)", "probe": "swamp"}, impl="fused", clause="accuracy"),
            row("determinism", "fused.layer()", "pass", "0/10 differ", impl="fused", clause="determinism"),
            row("determinism", "fused-layer", "info", "3/10 differ; not declared deterministic",
                impl="fused-layer", clause="determinism", backend="cpu",
                skip=V.not_declared("does not declare deterministic")),
            row("cache", "fused: param_data_copy/W_gate", "FAIL", "stale: served stale weights",
                impl="fused", clause="weight-change/param_data_copy"),
            row("cache", "fused: to_device/all", "skip", "needs a layer on a CUDA device",
                impl="fused", clause="weight-change/to_device"),
            row("cache", "fused", "info", "its layer offers no pack count", impl="fused"),
            row("graphs", "fused-layer: in_place/W_gate", "info", "capture failed: host sync",
                impl="fused-layer", clause="cuda-graph/in_place", backend="cpu",
                skip=V.not_run("cannot be captured: capture failed: host sync")),
            row("discipline", "host sync / allocations / compile", "skip", "CUDA only"),
            row("coverage", "fused", "pass", "audited", impl="fused")]


def _audit_table(rows):
    from magi_moe.audit.clauses import audit_outcomes

    got = audit_outcomes(rows, impls={"fused": "fused", "fused-layer": "pkg.mod:LAYER"},
                         backend="cpu", runs_on={"fused": "interpret"})
    return V.verdict_rows(got)


def test_audit_rows_become_clause_outcomes():
    table = _audit_table(_audit_rows())
    fused = {r.clause.name: r for r in table["fused@interpret"]}
    assert fused["accuracy"].status == V.FAIL
    assert fused["accuracy"].repro == "magi-moe audit --backend cpu --impl fused --preset small --probe swamp"
    assert fused["weight-change/param_data_copy"].status == V.FAIL
    assert fused["weight-change/to_device"].status == V.NOT_RUN
    assert fused["determinism"].status == V.PASS
    assert set(fused) == {"accuracy", "determinism", "weight-change/param_data_copy",
                          "weight-change/to_device"}  # the note and the coverage row judge nothing
    layer = {r.clause.name: r for r in table["fused-layer@cpu"]}
    assert layer["accuracy"].status == V.PASS
    assert layer["determinism"].status == V.NOT_DECLARED
    assert layer["cuda-graph/in_place"].detail.startswith("cannot be captured")
    assert [r.status for r in table["magi-moe"]] == [V.PASS]


def test_reworded_audit_subjects_and_results_change_no_row():
    """The subject is for people: the verdict reads the rows' implementation, clause and kind."""
    def reworded(subject):
        return f"[{subject.upper()}] (reworded)"

    def dicts(table):
        return {s: [(r.clause.name, r.status, r.passed, r.failed, r.skipped, r.repro) for r in rows]
                for s, rows in table.items()}

    assert dicts(_audit_table(_audit_rows(reworded))) == dicts(_audit_table(_audit_rows()))


def test_the_judge_types_an_inaccuracy_and_the_fuzz_properties_keep_the_type():
    """Planted: an output off by a constant is Inaccurate (counted under accuracy wherever it is
    met); one with unwritten elements is the case's own failure; a right one passes."""
    from magi_moe.judge.accuracy import Inaccurate, judge
    from magi_moe.config import preset
    from magi_moe.fuzz.properties import _differential, make_target
    from magi_moe.fuzz.record import PropertyViolation
    from magi_moe.impls import TORCH_BF16
    from magi_moe.problems import random_problem, run_poisoned

    problem = random_problem(preset("tiny"), 16, seed=3)
    right = run_poisoned(TORCH_BF16, problem)
    assert judge(right, problem, TORCH_BF16).require().ok
    with pytest.raises(Inaccurate) as off:
        judge(right + 1, problem, TORCH_BF16).require()
    assert off.value.criterion == "bounds" and V.cause_of(off.value) == V.INACCURATE
    unwritten = right.clone()
    unwritten[0] = float("nan")
    with pytest.raises(AssertionError) as own:
        judge(unwritten, problem, TORCH_BF16).require()
    assert V.cause_of(own.value) is None
    target = make_target("torch-bf16", "cpu")
    record = {"property": "planted", "impl": "torch-bf16", "backend": "cpu"}
    with pytest.raises(PropertyViolation) as violated:
        _differential(target, problem, right + 1, record, "planted")
    assert V.cause_of(violated.value) == V.INACCURATE
    with pytest.raises(PropertyViolation) as violated:
        _differential(target, problem, unwritten, record, "planted")
    assert V.cause_of(violated.value) is None


# -- the plugin reads data -------------------------------------------------------------------------
PLANTED = '''
import pytest

from magi_moe import verdict as V
from magi_moe.judge.accuracy import Inaccurate


@pytest.mark.clause("accuracy")
def test_accuracy(impl_backend):
    raise Inaccurate("the numbers are off", "bounds")


@pytest.mark.clause("edge-shapes")
def test_edge_inaccurate(impl_backend):
    raise RuntimeError("an edge case went wrong") from Inaccurate("any words", "baseline")


@pytest.mark.clause("edge-shapes")
def test_edge_own(impl_backend):
    assert False, "FAILED on bounds"  # the words of an inaccuracy, not its type: the edge's own


@pytest.mark.clause("weight-change/in_place")
def test_layer_wrong_first(impl_backend):
    raise V.LayerWrongFromTheStart("words that name no cause")


@pytest.mark.clause("determinism")
def test_not_declared(impl_backend):
    pytest.skip(V.not_declared("reworded: no promise of repeatable bits"))


@pytest.mark.clause("input-checks")
def test_unsupported(impl_backend):
    pytest.skip(V.unsupported("reworded: too wide for it"))


@pytest.mark.clause("locality")
def test_plain_words(impl_backend):
    pytest.skip("k does not declare deterministic")  # plain text decides nothing: NOT RUN


@pytest.mark.clause("zero-rows")
@pytest.mark.needs("deterministic")
def test_needs(impl_backend):  # reference declares no determinism: a skip mark of that kind
    pass


@pytest.mark.clause("inputs-unchanged")
@pytest.mark.dtypes(__import__("torch").float64)
def test_undeclared_dtype(impl_backend, impl_dtype):
    pass
'''


def _planted_run(tmp_path: Path, verdict_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path / "test_planted.py"), "--impl", "reference",
         "--backend", "cpu", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--rootdir",
         str(tmp_path), "--verdict-dir", str(verdict_dir), *extra],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_the_plugin_reads_skip_kinds_and_causes_as_data_never_words(tmp_path):
    """Planted cases whose words say one thing and whose data another: the rows follow the data."""
    run = _planted_run(tmp_path, tmp_path / "verdict")
    assert run.returncode == 1, run.stdout[-3000:]
    rows = _rows(json.loads((tmp_path / "verdict" / "verdict.json").read_text()))
    got = {c: (r["status"], r["passed"], r["failed"], r["skipped"]) for c, r in rows.items()}
    assert got == {
        "accuracy": (V.FAIL, 0, 3, 0),  # its own, the edge's inaccuracy, the layer wrong first
        "edge-shapes": (V.FAIL, 0, 1, 0),
        "weight-change/in_place": (V.NOT_RUN, 0, 0, 0),
        "determinism": (V.NOT_DECLARED, 0, 0, 1),
        "input-checks": (V.UNSUPPORTED, 0, 0, 1),
        "locality": (V.NOT_RUN, 0, 0, 1),
        "zero-rows": (V.NOT_DECLARED, 0, 0, 1),
    }, run.stdout[-3000:]
    assert rows["determinism"]["detail"] == "reworded: no promise of repeatable bits"


BLOCKING = '''
import os

import pytest


@pytest.mark.clause("accuracy")
def test_passes_and_may_block_the_verdict_dir(impl_backend):
    if os.environ.get("BLOCK_AT"):  # a file where the verdict's directory must go
        with open(os.environ["BLOCK_AT"], "w") as f:
            f.write("in the way")
'''


def test_a_verdict_dir_that_cannot_be_written_at_the_end_is_exit_status_4(tmp_path):
    """Accepted at the start (nothing is in the way yet), blocked by the end: exit 4, as for a
    --verdict-dir refused at the start, with one line saying why; unblocked, the same run exits 0."""
    (tmp_path / "test_blocking.py").write_text(BLOCKING)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    blocked = tmp_path / "blocked"

    def run(**more):
        return subprocess.run(
            [sys.executable, "-m", "pytest", "test_blocking.py", "--impl", "reference",
             "--backend", "cpu", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--rootdir",
             str(tmp_path), "--verdict-dir", str(blocked / "verdict")],
            cwd=tmp_path, env=dict(env, **more), capture_output=True, text=True, timeout=600)

    written = run()
    assert written.returncode == 0 and (blocked / "verdict" / "verdict.json").exists(), written.stdout
    (blocked / "verdict" / "verdict.json").unlink()
    (blocked / "verdict" / "verdict.md").unlink()
    (blocked / "verdict").rmdir()
    blocked.rmdir()
    failed = run(BLOCK_AT=str(blocked))
    assert failed.returncode == 4, failed.stdout[-3000:]
    lines = [ln for ln in failed.stdout.splitlines() if "cannot write the verdict" in ln]
    assert len(lines) == 1 and lines[0].startswith("--verdict-dir: ") and "exit status 4" in lines[0]
