"""Every module loads under one name, and the product imports none of the suite.

The suite installs inside the product (``magi_moe.audit``, ``magi_moe.fuzz``, ``magi_moe.tests``:
pyproject.toml's package-dir) and names itself so everywhere. In a checkout its folders' own
names reach only a package's face: pytest collects ``tests/`` as the package ``tests`` (its test
modules load as ``tests.test_x``, and import each other relatively), ``python -m audit`` starts
the package ``audit``, whose ``__main__`` imports ``magi_moe.audit.cli``. Those faces hold no
state; every module with any loads once (loaded twice, a module would hold two copies of its
state, a registry or a cache, and ``isinstance`` would fail across them)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = (ROOT / "pyproject.toml").is_file()
SUITE = ("audit", "fuzz", "tests")


def stateless(module) -> bool:
    """A package's face that holds nothing: a docstring, dunders, its submodules."""
    return all(k.startswith("__") or isinstance(v, types.ModuleType) for k, v in vars(module).items())


def duplicates(modules) -> dict[str, set[str]]:
    """The project's files loaded as more than one module (``__main__`` aside: ``python -m``
    runs a file as that; stateless package faces aside)."""
    ours = ("magi_moe", *SUITE)
    by_file: dict[str, set[str]] = defaultdict(set)
    for name, module in list(modules.items()):
        path = getattr(module, "__file__", None)
        if path and name != "__main__" and name.partition(".")[0] in ours and not stateless(module):
            by_file[os.path.realpath(path)].add(module.__name__)
    return {f: names for f, names in by_file.items() if len(names) > 1}


def test_this_pytest_process_loaded_each_file_once():
    assert not duplicates(sys.modules)


@pytest.mark.skipif(not CHECKOUT, reason="python -m audit / fuzz are a checkout's spellings")
@pytest.mark.parametrize("package, args", [("audit", ["--help"]), ("fuzz", ["list"])])
def test_python_dash_m_runs_and_loads_the_suite_under_its_one_name(package, args):
    code = f"""
import runpy, sys
sys.argv = ["python -m {package}", *{args!r}]
try:
    runpy.run_module({package!r}, run_name="__main__", alter_sys=True)
except SystemExit as stop:
    assert not stop.code, stop.code
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_one_name import duplicates
top = sorted(m for m in sys.modules if m.partition(".")[0] in {SUITE!r} and "." in m and not m.endswith("__main__"))
assert not top, top
assert not duplicates(sys.modules), duplicates(sys.modules)
print("ONE NAME")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "ONE NAME" in run.stdout, run.stderr[-3000:]


def suite_names_in(path: Path, root: Path = ROOT) -> list[str]:
    """Where the product module ``path`` names the suite: an import (absolute or relative), or a
    string (not a docstring) that spells a suite module, as ``importlib`` or ``--pyargs`` would
    take it."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = [node.value.partition(":")[0]]
        for name in names:
            parts = name.split(".")
            if parts[0] in SUITE and isinstance(node, (ast.Import, ast.ImportFrom)) or \
                    parts[0] == "magi_moe" and len(parts) > 1 and parts[1] in SUITE:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


@pytest.mark.skipif(not CHECKOUT, reason="the product's own files are told apart in a checkout")
def test_the_product_imports_none_of_the_suite():
    """No file of ``magi_moe/`` imports ``magi_moe.audit``, ``.fuzz`` or ``.tests`` (statically
    or by a string): the suite's ``magi-moe`` commands come through the entry-point group
    ``magi_moe.commands``. (scripts/wheel_view.py's links to the suite are not walked into.)"""
    files = [Path(d) / f for d, _, fs in os.walk(ROOT / "magi_moe") for f in fs if f.endswith(".py")]
    assert len(files) > 20
    found = [hit for f in files for hit in suite_names_in(f)]
    assert not found, "\n".join(found)


def test_the_search_finds_what_it_looks_for(tmp_path):
    """The scan above catches each way of naming the suite (a scan that finds nothing proves
    nothing)."""
    module = tmp_path / "magi_moe" / "bench" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text('"""magi_moe.audit in a docstring is fine."""\n'
                      "from ..audit.judge import judge\nimport magi_moe.fuzz.cli\nimport tests\n"
                      "NAME = 'magi_moe.tests.check:main'\n")
    found = [hit.rpartition(": ")[2] for hit in suite_names_in(module, tmp_path)]
    assert found == ["magi_moe.audit.judge.judge", "magi_moe.fuzz.cli", "tests", "magi_moe.tests.check"], found
