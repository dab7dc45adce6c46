"""``python -m audit`` end to end at a tiny size: exit status, files, and a broken
implementation named on the command line turning the run red."""
from __future__ import annotations

import json

import pytest
import torch

from magi_moe.backends import BACKENDS

from magi_moe.audit.cli import main
from magi_moe import registry
from magi_moe.implementation import Implementation

FAST = ["--preset", "tiny", "--tokens", "24", "--probe", "random", "--probe", "cancel-up",
        "--no-mpcheck", "--runs", "2"]


@pytest.fixture(autouse=True)
def keep_global_state():
    """main() restores the thread count itself; implementations it loads by
    ``package.module:attr`` stay registered, so the registry is restored here."""
    threads = torch.get_num_threads()
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    assert torch.get_num_threads() == threads


def test_default_run_writes_the_report(tmp_path, capsys):
    # Not the fused layer: its cache audit under the interpreter takes ~30 s (test_audit_cache
    # covers it); native-det brings a kernel into the run when TRITON_INTERPRET=1.
    impls = ["--impl", "reference", "--impl", "torch-bf16"]
    if BACKENDS["interpret"].available:
        impls += ["--impl", "native-det"]
    assert main(FAST + impls + ["--out", str(tmp_path), "--no-controls"]) == 0
    printed = capsys.readouterr().out
    assert "PASSED" in printed and "section" in printed
    for name in ("report.md", "report.json", "error_ratio_hist.png", "error_vs_bound.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["ok"] is True and data["meta"]["presets"] == ["tiny"]
    sections = {row["section"] for row in data["rows"]}
    assert {"selfcheck", "bounds", "routing", "determinism", "cache", "discipline"} <= sections
    bounds = [r for r in data["rows"] if r["section"] == "bounds" and r["status"] == "pass"]
    assert any(r["subject"].startswith("torch-bf16") for r in bounds)
    assert {(r["impl"], r["clause"], r["backend"]) for r in bounds if r["impl"] != "native-det"} == {
        ("reference", "accuracy", "cpu"), ("torch-bf16", "accuracy", "cpu")}  # the verdict's facts
    assert "## bounds" in (tmp_path / "report.md").read_text()


def test_controls_are_flagged(tmp_path):
    assert main(FAST + ["--out", str(tmp_path), "--impl", "reference"]) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    controls = [r for r in rows if r["section"] == "controls"]
    assert len(controls) == 4 and all(r["status"] == "pass" for r in controls)
    assert all("flagged" in r["result"] for r in controls if "control-" in r["subject"])


def test_broken_implementation_fails_the_run(tmp_path, capsys):
    code = main(FAST + ["--out", str(tmp_path), "--no-controls",
                        "--impl", "magi_moe.tests.audit_broken:BF16_DOWN_ACCUMULATION"])
    assert code == 1
    assert "FAILED" in capsys.readouterr().out
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert any(r["status"] == "FAIL" and r["subject"].startswith("broken-bf16-down") for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "--preset must be one of"),
    (["--probe", "ones"], "--probe must be one of"),
    (["--impl", "no-such-impl"], "--impl"),
])
def test_bad_arguments_exit_2(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--backend", "rocm"], "argument --backend: invalid choice", id="backend"),
    pytest.param(["--tokens", "0"], "--tokens must be >= 1", id="tokens-zero"),
])
def test_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _plain_forward(x, table, weights, config, *, out):
    from magi_moe.reference import expert_reference
    return out.copy_(expert_reference(x, table, weights, config, precision="bf16"))


CUDA_ONLY = Implementation("cuda-only-example", _plain_forward, ("cuda",), "bf16-plain",
                           description="declares only the cuda backend (tests the coverage rule)")


def test_an_audit_that_audited_nothing_exits_3(tmp_path, capsys):
    """The cpu backend cannot run an implementation declaring only cuda: the run says so and
    fails instead of printing PASSED over a table of skips."""
    argv = FAST + ["--out", str(tmp_path), "--no-controls", "--impl", f"{__name__}:CUDA_ONLY"]
    assert main(argv) == 3
    printed = capsys.readouterr().out
    assert "NOTHING AUDITED" in printed and "PASSED" not in printed
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["ok"] is False and data["vacuous"] is True
    assert main(argv + ["--allow-no-kernels"]) == 0


def test_a_section_that_raises_keeps_the_rows_it_found(tmp_path):
    """A section's rows are recorded as it yields them (and, through ``rows_as_found``, as an
    auditor reports them by callback): a crash after some rows keeps them and adds one FAIL row
    under the section's name; a section needing an option that is off adds nothing."""
    import io

    from magi_moe.audit.report import Audit, AuditOptions
    from magi_moe.audit.rows import FAIL, PASS, Row
    from magi_moe.audit.sections import SECTIONS, Section
    from magi_moe.audit.sections.streaming import rows_as_found

    def auditor(on_result):
        on_result("first route")
        raise RuntimeError("auditor exploded")

    def run(audit):
        yield Row("made-up", "one", PASS, "yielded before the crash")
        yield from rows_as_found(auditor, lambda found: Row("made-up", found, PASS, "reported"))

    audit = Audit(AuditOptions(out=tmp_path, controls=False), stream=io.StringIO())
    audit.run_section(Section("made-up", run))
    audit.run_section(Section("made-up", run, option="controls"))
    assert [(r.subject, r.status) for r in audit.rows] == [
        ("one", PASS), ("first route", PASS), ("section stopped", FAIL)]
    assert audit.rows[-1].result == "raised RuntimeError: auditor exploded"
    assert len({s.name for s in SECTIONS}) == len(SECTIONS)


def test_the_verdict_reads_each_rows_implementation_and_clause_not_its_subject(tmp_path):
    """A row's subject is for people: the verdict takes the implementation, the clause (its
    section's, unless the row names its own) and a note's skip kind from the row's fields. A row
    naming an implementation only in its subject judges nothing; a section that raises fails its
    own clause under the suite's subject."""
    import io

    from magi_moe import verdict as V
    from magi_moe.audit.report import Audit, AuditOptions
    from magi_moe.audit.rows import FAIL, INFO, PASS, Row
    from magi_moe.audit.sections import Section

    def run(audit):
        yield Row("made-up", "words that name nobody", PASS, "ok", impl="reference")
        yield Row("made-up", "reference @ tiny/random", FAIL, "no impl field: not a case")
        yield Row("made-up", "still nobody", INFO, "3/3 differ", impl="reference",
                  skip=V.not_declared("reworded: makes no promise of repeatable bits"))
        yield Row("made-up", "nobody either", FAIL, "stale", impl="reference",
                  clause="weight-change/in_place")
        yield Row("made-up", "a note", INFO, "offers no pack count", impl="reference")
        raise RuntimeError("auditor exploded")

    audit = Audit(AuditOptions(out=tmp_path, impls=["reference"], controls=False),
                  stream=io.StringIO())
    audit.run_section(Section("made-up", run, clause="determinism"))
    table = V.verdict_rows(audit.outcomes())
    got = {s: [(r.clause.name, r.status, r.passed, r.failed, r.skipped) for r in rows]
           for s, rows in table.items()}
    assert got == {"reference@cpu": [("determinism", V.PASS, 1, 0, 1),
                                     ("weight-change/in_place", V.FAIL, 0, 1, 0)],
                   "magi-moe": [("determinism", V.FAIL, 0, 1, 0)]}
    assert table["reference@cpu"][1].repro == "magi-moe audit --backend cpu --impl reference"
