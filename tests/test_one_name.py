"""Every module loads under one name only (magi_moe.suite_names): in a checkout, ``audit``,
``fuzz`` and ``tests`` are aliases of ``magi_moe.audit``, ``magi_moe.fuzz`` and ``magi_moe.tests``,
so a module reached by both spellings is one module with one state."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = (ROOT / "audit" / "__init__.py").is_file()


def duplicates(modules) -> dict[str, set[str]]:
    """The project's files loaded as more than one module (``__main__`` aside: ``python -m``
    runs a file as that)."""
    ours = ("magi_moe", "audit", "fuzz", "tests")
    by_file: dict[str, set[str]] = defaultdict(set)
    for name, module in list(modules.items()):
        path = getattr(module, "__file__", None)
        if path and name != "__main__" and name.partition(".")[0] in ours:
            by_file[os.path.realpath(path)].add(module.__name__)
    return {f: names for f, names in by_file.items() if len(names) > 1}


def test_this_pytest_process_loaded_each_file_once():
    assert not duplicates(sys.modules)


@pytest.mark.skipif(not CHECKOUT, reason="an installed wheel has one spelling only")
def test_both_spellings_are_one_module():
    code = """
import sys
import audit.report, fuzz.fuzzers, tests.outside_impl_example
import magi_moe.audit.report, magi_moe.fuzz.fuzzers, magi_moe.tests.outside_impl_example
from magi_moe.fuzz import stateful
import fuzz.stateful
assert audit.report is magi_moe.audit.report
assert fuzz.stateful is stateful
assert tests.outside_impl_example.IMPL is magi_moe.tests.outside_impl_example.IMPL
assert audit.report.__spec__.name == "magi_moe.audit.report"
sys.path.insert(0, %r)
from test_one_name import duplicates
assert not duplicates(sys.modules), duplicates(sys.modules)
print("ONE NAME")
""" % str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "ONE NAME" in run.stdout, run.stderr[-3000:]


@pytest.mark.skipif(not CHECKOUT, reason="an installed wheel has one spelling only")
@pytest.mark.parametrize("package, args", [("audit", ["--help"]), ("fuzz", ["list"])])
def test_python_dash_m_still_runs(package, args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", package, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
