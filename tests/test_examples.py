"""The worked examples an installed wheel hands a team (``magi-moe example``): listed, printed,
written; both pass ``magi-moe check`` on the cpu backend as written out, and the same check fails
a copy with one planted bug, so passing means something."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from magi_moe import cli
from magi_moe.examples import EXAMPLES, example_source

ROOT = Path(__file__).resolve().parents[1]


def _status(run) -> int:
    """The exit status of a command, returned or raised (argparse's refusals exit)."""
    try:
        return run()
    except SystemExit as stop:
        return stop.code


def test_the_examples_are_listed(capsys):
    assert cli.main(["example"]) == 0
    out = capsys.readouterr().out
    for name, (_, what) in EXAMPLES.items():
        assert f"{name:<8} {what}" in out


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_example_is_printed_as_shipped(capsys, name):
    assert cli.main(["example", name]) == 0
    printed = capsys.readouterr().out
    shipped = (Path(cli.__file__).parent / "examples" / EXAMPLES[name][0]).read_text()
    assert printed == shipped and "IMPL = Implementation(" in printed


def test_out_writes_the_file_and_never_overwrites(capsys, tmp_path):
    target = tmp_path / "kernel.py"
    assert cli.main(["example", "kernel", "--out", str(target)]) == 0
    assert target.read_text() == example_source("kernel")
    target.write_text("# the team's own edits\n")
    capsys.readouterr()
    assert _status(lambda: cli.main(["example", "kernel", "--out", str(target)])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out cannot be written" in err and "File exists" in err
    assert target.read_text() == "# the team's own edits\n"


@pytest.mark.parametrize("argv, says", [
    (["example", "kernal"], "NAME must be one of kernel, layer, got 'kernal'"),
    (["example", "--out", "x.py"], "--out needs an example NAME"),
])
def test_bad_example_arguments_are_one_line(capsys, argv, says):
    assert _status(lambda: cli.main(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_the_examples_are_in_the_wheel():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "magi_moe.examples" in packages


def _check_written(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess:
    """``magi-moe check NAME:IMPL --backend cpu`` from a directory holding only the written file."""
    (tmp_path / f"{name}.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "magi_moe.cli", "check", f"{name}:IMPL", "--backend", "cpu",
                           "--verdict-dir", str(tmp_path / "verdict"), "--", "-q", "-x"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_written_example_passes_check(tmp_path, name):
    done = _check_written(tmp_path, name, example_source(name))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"example-{'loop' if name == 'kernel' else 'layer'}@cpu: PASS" in done.stdout


# One planted bug per example: each must turn the same check red.
PLANTED = {
    "kernel": ("down * table.sorted_probs[lo:hi, None]", "down"),           # routing weight dropped
    "layer": ("self.router.expert_bias_ema, cfg)", "None, cfg)"),          # selects without the bias
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_check_fails_an_example_with_a_planted_bug(tmp_path, name):
    right, wrong = PLANTED[name]
    source = example_source(name)
    assert source.count(right) == 1
    done = _check_written(tmp_path, name, source.replace(right, wrong))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "FAIL" in done.stdout


def _documented_example_blocks() -> list[str]:
    """The Python blocks docs/PLUGGING_IN.md marks as the layer example's own code."""
    text = (ROOT / "docs" / "PLUGGING_IN.md").read_text()
    blocks = []
    for part in text.split("<!-- example: layer -->")[1:]:
        body = part.split("```python\n", 1)[1].split("```", 1)[0]
        blocks.append(body)
    return blocks


def test_the_documented_worked_layer_is_the_shipped_one():
    blocks = _documented_example_blocks()
    assert len(blocks) == 2
    source = example_source("layer")
    for block in blocks:
        for chunk in block.split("\n\n\n"):  # the doc joins the file's pieces, each verbatim
            assert chunk.strip() and chunk.strip() in source, chunk[:200]
