"""``python -m fuzz``'s help names every command, and ``list`` shows every property record."""
from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from magi_moe.fuzz.cli import main  # noqa: E402
from magi_moe.fuzz.fuzzers import PROPERTIES  # noqa: E402


def test_help_names_the_other_commands(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for command in ("python -m fuzz replay", "python -m fuzz rerun", "python -m fuzz list"):
        assert command in text, text


@pytest.mark.parametrize("command", ["replay", "rerun", "list"])
def test_each_command_has_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    assert f"python -m fuzz {command}" in capsys.readouterr().out


def test_list_shows_every_property_record_and_every_state_machine(capsys):
    """The state machines (--properties weight_swaps, serving_stream) were once missing from it."""
    from magi_moe.fuzz.campaign import STATE_MACHINES

    assert main(["list"]) == 0
    properties, machines = capsys.readouterr().out.split("\n\n")
    lines = properties.splitlines()
    assert lines[0].split()[:4] == ["property", "runs", "on", "needs"]
    listed = {line.split()[0]: line for line in lines[2:]}
    assert list(listed) == list(PROPERTIES)
    for name, prop in PROPERTIES.items():
        assert prop.on.name in listed[name] and prop.summary in listed[name]
        for need in prop.needs:
            assert need in listed[name]
    lines = machines.splitlines()
    assert lines[0].split()[:3] == ["state", "machine", "clause"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(STATE_MACHINES) == {"weight_swaps", "serving_stream"} and list(rows) == list(STATE_MACHINES)
    assert rows["weight_swaps"][1:3] == ["weight-swaps", "weight_cache"] and rows["serving_stream"][1] == "history"


class _Options:
    """A pytest config as rerun_command reads it: only getoption."""

    def __init__(self, **options):
        self.options = {"--backend": ["cpu"], "--fuzz-db": "db", "--impl": [], **options}

    def getoption(self, name):
        return self.options.get(name)


@pytest.mark.parametrize("profile, no_shrink, expected", [
    ("nightly", False, []),
    ("ci", False, ["--profile", "ci"]),
    ("ci", True, ["--profile", "ci", "--no-shrink"]),
    ("dev", True, ["--profile", "dev", "--no-shrink"]),
])
def test_printed_rerun_line_repeats_the_campaigns_settings(profile, no_shrink, expected, capsys):
    """A ci or unshrunk campaign's rerun line asks for the same settings (a ci round is
    derandomised: the rerun draws the very examples that failed, and fast)."""
    from magi_moe.fuzz.campaign_plugin import rerun_command

    line = rerun_command(_Options(**{"--fuzz-profile": profile, "--fuzz-no-shrink": no_shrink,
                                     "--impl": ["team:IMPL"]}), "tests/test_fuzz_properties.py::t")
    words = line.split()
    assert words[words.index("--impl"):] == ["--impl", "team:IMPL", *expected], line
    # every word parses: the rerun then refuses only the made-up node id, after parsing
    from magi_moe.fuzz.campaign import rerun_main

    args = words[words.index("rerun") + 1:]
    args[0] = "nope.py::x"
    assert rerun_main(args) == 2
    assert "NODEID must name a test of the fuzz suite" in capsys.readouterr().err


# -- one line for bad input, under the name the program was started by -------------------------------
@pytest.mark.parametrize("started, prefix", [("/venv/bin/magi-moe", "magi-moe fuzz: error:"),
                                             ("/src/fuzz/__main__.py", "python -m fuzz: error:")])
def test_errors_name_the_program_as_it_was_started(started, prefix, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [started])
    assert main(["--workers", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"{prefix} --workers must be >= 0, got -1", err


def test_the_audit_names_itself_as_it_was_started(tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = shutil.which("magi-moe", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the magi-moe console script is not installed beside this Python")
    proc = subprocess.run([script, "audit", "--preset", "nope"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("magi-moe audit: error: --preset must be one of"), proc.stderr


_RECORD = {"property": "differential", "impl": "reference", "backend": "cpu", "params": {},
           "case": {"type": "ExpertCase"}}


@pytest.mark.parametrize("record, says", [
    ({**{k: v for k, v in _RECORD.items() if k != "case"}, "cse": {}},
     "RECORD has an unknown field 'cse' (did you mean 'case'?)"),
    ({k: v for k, v in _RECORD.items() if k != "backend"}, "RECORD must name its 'backend'"),
    ({**_RECORD, "case": {"type": "ExpertCase", "confg": {}}}, "RECORD's case does not describe a case"),
    ({**_RECORD, "case": []}, "RECORD's 'case' and 'params' must be JSON objects"),
])
def test_replay_refuses_a_misspelt_record_in_one_line(record, says, capsys):
    import json

    with pytest.raises(SystemExit) as stop:
        main(["replay", json.dumps(record)])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err
    assert "replaying" not in captured.out  # refused before it claims to replay anything


def test_a_child_memory_cap_that_is_no_size_is_refused_before_any_case(monkeypatch, capsys):
    """MAGI_MOE_CHILD_MEMORY_GIB=inf once overflowed inside a case, filed against the implementation."""
    from magi_moe.fuzz.child import CHILD_MEMORY_ENV

    monkeypatch.setenv(CHILD_MEMORY_ENV, "inf")
    assert main(["--impl", "reference", "--out", "never-written"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{CHILD_MEMORY_ENV} must be a finite number of GiB > 0, got 'inf'"), err


def test_a_backend_the_implementation_does_not_declare_is_refused(capsys):
    assert main(["--impl", "magi_moe.tests.outside_broken:CONTENT_CHECKED_LAYER", "--backend",
                 "interpret", "--out", "never-written"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--backend interpret: outside-content-checked-cache does not declare it "
                        "(it declares cpu)"), err
