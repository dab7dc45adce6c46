"""``magi-moe``: the suite from any directory, once magi_moe is installed (docs/PLUGGING_IN.md).

    magi-moe audit [--backend cpu|interpret|cuda] [--impl NAME ...] ...   # python -m audit
    magi-moe fuzz [--impl NAME ...] ...                                    # python -m fuzz
    magi-moe check IMPL [--backend NAME ...] [-- PYTEST ARGS]              # conformance tests
    magi-moe example [NAME [--out FILE]]                                   # worked examples

``example`` is the product's own: it lists the worked examples shipped inside the package;
``example NAME`` prints one (``--out FILE`` writes it, refusing to overwrite a file), ready for
``magi-moe check FILE:IMPL``. The other commands are the suite's (``audit``, ``fuzz``, ``check``:
:mod:`magi_moe.tests.check` runs the conformance tests against ``IMPL``): each is an entry point
of the group ``magi_moe.commands`` (pyproject.toml), a function of the arguments returning the
exit status, found here by name, so the product never imports the suite.

Every command imports ``package.module:attr`` from the current directory first, as ``python -m``
does. A bad command or ``--impl`` is one line on stderr and exit 2, before any work starts.
"""
from __future__ import annotations

import os
import sys
from importlib.metadata import EntryPoint, entry_points

from .arguments import OneLineParser

# The suite's commands: entry points of this group, each ``main(argv) -> exit status``.
COMMAND_GROUP = "magi_moe.commands"


def use_current_directory() -> None:
    """Make the current directory importable, for this process and its children, as ``python -m``
    does: the console script's ``sys.path`` starts at its own bin directory instead."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH")]))


def refuse_bad_impl(name: str) -> str | None:
    """Why ``--impl name`` cannot be loaded (one line), or None. Checked before any pytest or
    campaign starts, so that a typo is one line and exit 2, not a failed run."""
    from .registry import get_implementation

    try:
        get_implementation(name)
    except (ValueError, TypeError) as exc:
        return f"--impl: {exc}".splitlines()[0]
    return None


def example(argv: list[str]) -> int:
    from .examples import EXAMPLES, example_source

    parser = OneLineParser(prog="magi-moe example",
                           description="print or write a worked example implementation")
    parser.add_argument("name", nargs="?", help=f"one of {', '.join(EXAMPLES)} (none: list them)")
    parser.add_argument("--out", metavar="FILE", help="write the example to FILE instead of printing it")
    args = parser.parse_args(argv)
    if args.name is None:
        if args.out:
            parser.error("--out needs an example NAME")
        for name, (_, what) in EXAMPLES.items():
            print(f"{name:<8} {what}")
        print("magi-moe example NAME prints one; --out FILE writes it, then: magi-moe check "
              "FILE_STEM:IMPL --backend cpu")
        return 0
    if args.name not in EXAMPLES:
        parser.error(f"NAME must be one of {', '.join(EXAMPLES)}, got {args.name!r}")
    text = example_source(args.name)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.out, "x", encoding="utf-8") as f:  # "x": never overwrite the team's file
            f.write(text)
    except OSError as exc:
        parser.error(f"--out cannot be written: {args.out!r} ({exc.strerror or exc})")
    print(f"wrote {args.out}")
    return 0


def installed_commands() -> dict[str, EntryPoint]:
    """The suite's commands that the installed distribution declares, by name (none where
    magi_moe is not installed: a bare checkout on ``PYTHONPATH``, see scripts/wheel_view.py),
    in name order (the metadata's own order differs between an editable and a wheel install)."""
    return {ep.name: ep for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    suite = installed_commands()
    command, rest = argv[0], argv[1:]
    if command != "example" and command not in suite:
        print(f"magi-moe: unknown command {command!r}; expected one of "
              f"{', '.join([*suite, 'example'])} (magi-moe --help)", file=sys.stderr)
        return 2
    use_current_directory()
    if command == "example":
        return example(rest)
    return suite[command].load()(rest)


if __name__ == "__main__":
    sys.exit(main())
