"""The README's main job installs ``.[triton,audit]`` and runs the audit: every section must run
with only those extras. The test extra's other packages are hidden from a child audit (an
import of one fails as it would in that environment), and the audit must pass on the oracle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _requirement_names(extra: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for req in project["optional-dependencies"][extra]:
        name = req.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        names.add(name.replace("-", "_"))
    return names


# import names of the test extra's distributions, where they differ
IMPORT_NAMES = {"pytest_benchmark": "pytest_benchmark", "pytest_xdist": "xdist"}

HIDE = """
import importlib.abc, sys
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the audit extra)")
sys.meta_path.insert(0, Hidden())
from magi_moe.audit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_audit_runs_with_only_the_audit_extra(tmp_path):
    only_test = _requirement_names("test") - _requirement_names("audit") - {"triton"}
    hidden = sorted(IMPORT_NAMES.get(n, n) for n in only_test)
    assert "pytest" in hidden  # the audit must not need the test runner
    proc = subprocess.run(
        [sys.executable, "-c", HIDE.format(hidden=set(hidden)), "--backend", "cpu", "--no-kernels",
         "--no-mpcheck", "--no-controls", "--impl", "reference", "--preset", "tiny", "--tokens", "8",
         "--out", str(tmp_path / "audit")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "not in the audit extra" not in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
