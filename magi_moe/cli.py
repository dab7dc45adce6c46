"""``magi-moe``: the suite from any directory, once magi_moe is installed (docs/PLUGGING_IN.md).

    magi-moe audit [--backend cpu|interpret|cuda] [--impl NAME ...] ...   # python -m audit
    magi-moe fuzz [--impl NAME ...] ...                                    # python -m fuzz
    magi-moe check IMPL [--backend NAME ...] [-- PYTEST ARGS]              # conformance tests
    magi-moe example [NAME [--out FILE]]                                   # worked examples

``check`` runs the conformance suite (every test parametrized by the implementation under test,
from the installed ``magi_moe.tests``) against ``IMPL``: a registered name,
``package.module:attr`` importable from the current directory, or an installed entry point.
On the ``interpret`` backend it sets ``TRITON_INTERPRET=1`` for the pytest process. It ends
with the verdict, one row per contract clause, also written to ``--verdict-dir`` (Markdown and
JSON). Exit statuses are pytest's; 5 means nothing was tested (magi-moe's pytest plugin says why).

``example`` lists the worked examples shipped inside the package; ``example NAME`` prints one
(``--out FILE`` writes it, refusing to overwrite a file), ready for ``magi-moe check FILE:IMPL``.

Every command imports ``package.module:attr`` from the current directory first, as ``python -m``
does. A bad command or ``--impl`` is one line on stderr and exit 2, before any work starts.
"""
from __future__ import annotations

import os
import subprocess
import sys

from .arguments import OneLineParser

COMMANDS = ("audit", "fuzz", "check", "example")


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


def check(argv: list[str]) -> int:
    parser = OneLineParser(prog="magi-moe check", description=__doc__.split("\n")[0])
    parser.add_argument("impl", help="implementation: a registered name, package.module:attr or "
                                     "an installed entry point of group magi_moe.implementations")
    parser.add_argument("--backend", action="append", default=[],
                        help="cpu, interpret or cuda (repeatable; default: every backend the "
                             "implementation declares that is usable here)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default: ci)")
    parser.add_argument("--verdict-dir", default="magi-moe-verdict", metavar="DIR",
                        help="where the per-clause verdict is written as verdict.md and "
                             "verdict.json (default: ./magi-moe-verdict)")
    parser.epilog = "arguments after -- are passed to pytest (e.g. -- -k tie -x)"
    # split at "--" first: argparse's REMAINDER would also swallow a --backend after IMPL
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]
    from .backends import BACKENDS

    unknown = [b for b in args.backend if b not in BACKENDS]
    if unknown:
        parser.error(f"--backend must be one of {sorted(BACKENDS)}, got {unknown[0]!r}")
    env = dict(os.environ)
    for name in args.backend:
        BACKENDS[name].enable_here(env)
        BACKENDS[name].enable_here()  # before the check below imports any kernel
    why = refuse_bad_impl(args.impl)
    if why:
        print(f"magi-moe check: {why}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "magi_moe.tests", "--conformance",
           "--impl", args.impl, "-p", "no:cacheprovider", "--hypothesis-profile", args.profile,
           "-m", "not slow and not benchmark", "--verdict-dir", args.verdict_dir]
    cmd += [a for b in args.backend for a in ("--backend", b)] + extra
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"magi-moe: unknown command {argv[0]!r}; expected one of {', '.join(COMMANDS)} "
              f"(magi-moe --help)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    use_current_directory()
    if command == "audit":
        from .audit.__main__ import cli
        return cli(rest)
    if command == "fuzz":
        from .fuzz.__main__ import main as fuzz_main
        return fuzz_main(rest)
    if command == "example":
        return example(rest)
    return check(rest)


if __name__ == "__main__":
    sys.exit(main())
