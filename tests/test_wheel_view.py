"""scripts/wheel_view.py: a bare checkout on ``PYTHONPATH`` (the GPU machine, nothing installed)
gets the wheel's layout, so the suite imports as ``magi_moe.audit`` / ``.fuzz`` / ``.tests`` from
that checkout and ``magi-moe``'s commands and the pytest plugin are found as entry points; and
``--remove`` leaves the checkout as it was."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from magi_moe.tests.developer_scripts import ROOT, in_checkout

CHILD = """
import sys
from importlib.metadata import entry_points
import magi_moe.audit.cli, magi_moe.fuzz.cli, magi_moe.tests.check, magi_moe.judge
here = sys.argv[1]
for m in (magi_moe.audit.cli, magi_moe.fuzz.cli, magi_moe.tests.check, magi_moe.judge):
    assert m.__file__.startswith(here), m.__file__
print(sorted(ep.name for ep in entry_points(group="magi_moe.commands")))
print([ep.dist.name + " " + ep.value for ep in entry_points(group="pytest11") if ep.value.startswith("magi_moe")])
"""


def bare_checkout(where: Path) -> Path:
    """A checkout without the view: its own product files, the suite folders linked."""
    view = {"audit", "fuzz", "tests", "__pycache__"}
    shutil.copytree(ROOT / "magi_moe", where / "magi_moe", ignore=lambda d, names: [
        n for n in names if n == "__pycache__" or Path(d) == ROOT / "magi_moe" and n in view])
    for folder in ("audit", "fuzz", "tests"):
        (where / folder).symlink_to(ROOT / folder, target_is_directory=True)
    (where / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "wheel_view.py", where / "scripts")
    shutil.copy(ROOT / "pyproject.toml", where)
    return where


@in_checkout("wheel_view.py")
def test_a_bare_checkout_imports_the_suite_through_the_view_and_forgets_it_on_remove(tmp_path):
    checkout = bare_checkout(tmp_path / "checkout")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(checkout)}

    def python(*args):
        return subprocess.run([sys.executable, *args], cwd=checkout, env=env, capture_output=True,
                              text=True, timeout=120)

    made = python("scripts/wheel_view.py")
    assert made.returncode == 0 and "magi_moe/audit" in made.stdout, made.stderr
    assert (checkout / "magi_moe" / "audit").resolve() == ROOT / "audit"
    run = python("-c", CHILD, str(checkout))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["['audit', 'check', 'fuzz']", "['magi_moe magi_moe.pytest_plugin']"]

    gone = python("scripts/wheel_view.py", "--remove")
    assert gone.returncode == 0, gone.stderr
    assert not any(p.is_symlink() for p in (checkout / "magi_moe").iterdir())
    assert not list(checkout.glob("*.dist-info"))
    assert python("-c", CHILD, str(checkout)).returncode != 0  # nothing else made it importable
