"""Give a bare checkout the installed wheel's layout, for machines that run it from ``PYTHONPATH``
with no install of magi_moe (the GPU machine: its own torch and Triton, nothing installed).

    python3 scripts/wheel_view.py            # from anywhere; acts on this script's checkout
    python3 scripts/wheel_view.py --remove   # take the view away again

The suite lives at the checkout's top level (``audit/``, ``fuzz/``, ``tests/``) and installs
inside the product as ``magi_moe.audit``, ``magi_moe.fuzz``, ``magi_moe.tests``
(pyproject.toml's package-dir). Where no install maps those names to this checkout, this lays
the wheel's layout over it: a symbolic link ``magi_moe/<name>`` to each suite folder, and a
``magi_moe-<version>.dist-info`` beside the product holding its entry points (the ``magi-moe``
commands, the pytest plugin), so that ``importlib.metadata`` finds them on ``PYTHONPATH``.
Both are git-ignored and made from pyproject.toml; nothing is imported through a hook, and a
checkout installed with ``pip install -e .`` is left as it is. Prints what it did, one line.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_pyproject(root: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((root / "pyproject.toml").read_text())


def suite_folders(project: dict) -> dict[str, str]:
    """``{"audit": "audit", ...}``: each suite package inside magi_moe, by its folder."""
    package_dir = project["tool"]["setuptools"]["package-dir"]
    return {name.partition(".")[2]: folder for name, folder in package_dir.items()
            if name.startswith("magi_moe.")}


def dist_info(root: Path, project: dict) -> Path:
    return root / f"magi_moe-{project['project']['version']}.dist-info"


def installed_here(root: Path) -> bool:
    """Whether ``magi_moe.audit`` already imports from this checkout in a fresh interpreter
    (an editable install of it); another checkout's install does not count."""
    code = "import magi_moe.audit as a, sys; print(a.__file__)"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    return run.returncode == 0 and Path(run.stdout.strip()).resolve().is_relative_to(root)


def entry_points_text(project: dict) -> str:
    groups = dict(project["project"].get("entry-points", {}))
    if project["project"].get("scripts"):
        groups = {"console_scripts": project["project"]["scripts"], **groups}
    return "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                   for group, eps in groups.items())


def make(root: Path) -> str:
    project = read_pyproject(root)
    links = [root / "magi_moe" / name for name in suite_folders(project)]
    info = dist_info(root, project)
    if not any(p.is_symlink() for p in links) and not info.exists() and installed_here(root):
        return "wheel view: not needed, magi_moe's suite is installed from this checkout"
    for name, folder in suite_folders(project).items():
        link = root / "magi_moe" / name
        if not link.is_symlink():
            link.symlink_to(Path("..") / folder, target_is_directory=True)
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: magi_moe\n"
                                   f"Version: {project['project']['version']}\n")
    (info / "entry_points.txt").write_text(entry_points_text(project))
    return (f"wheel view: {', '.join(f'magi_moe/{p.name}' for p in links)} and {info.name} "
            f"in {root} (python3 scripts/wheel_view.py --remove takes them away)")


def remove(root: Path) -> str:
    project = read_pyproject(root)
    for name in suite_folders(project):
        link = root / "magi_moe" / name
        if link.is_symlink():
            link.unlink()
    shutil.rmtree(dist_info(root, project), ignore_errors=True)
    return f"wheel view: removed from {root}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remove", action="store_true", help="take the view away")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # tests
    args = parser.parse_args(argv)
    print(remove(args.root) if args.remove else make(args.root), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
