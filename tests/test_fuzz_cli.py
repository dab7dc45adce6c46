"""``python -m fuzz``'s help names every command, and ``list`` shows every property record."""
from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from magi_moe.fuzz.__main__ import main  # noqa: E402
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


def test_list_shows_every_property_record(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["property", "runs", "on", "needs"]
    listed = {line.split()[0]: line for line in lines[2:]}
    assert list(listed) == list(PROPERTIES)
    for name, prop in PROPERTIES.items():
        assert prop.on.name in listed[name] and prop.summary in listed[name]
        for need in prop.needs:
            assert need in listed[name]


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
