"""``magi-moe``: the suite from any directory, after ``pip install "magi-moe[test]"``.

    magi-moe audit [--backend cpu|interpret|cuda] [--impl NAME ...] ...   # python -m audit
    magi-moe fuzz [--impl NAME ...] ...                                    # python -m fuzz
    magi-moe check IMPL [--backend NAME ...] [-- PYTEST ARGS]              # conformance tests

``check`` runs the conformance suite (every test parametrized by the implementation under test,
from the installed ``magi_moe.tests``) against ``IMPL``: a registered name,
``package.module:attr`` importable from the current directory, or an installed entry point.
On the ``interpret`` backend it sets ``TRITON_INTERPRET=1`` for the pytest process. It ends
with the verdict, one row per contract clause, also written to ``--verdict-dir`` (Markdown and
JSON). Exit statuses are pytest's; 5 means nothing was tested (magi-moe's pytest plugin says why).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

COMMANDS = ("audit", "fuzz", "check")


def check(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="magi-moe check", description=__doc__.split("\n")[0])
    parser.add_argument("impl", help="implementation: a registered name, package.module:attr or "
                                     "an installed entry point of group magi_moe.implementations")
    parser.add_argument("--backend", action="append", default=[],
                        help="cpu, interpret or cuda (repeatable; default: every backend the "
                             "implementation declares that is usable here)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default: ci)")
    parser.add_argument("--verdict-dir", default="magi-moe-verdict", metavar="DIR",
                        help="where the per-clause verdict is written as verdict.md and "
                             "verdict.json (default: ./magi-moe-verdict)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: passed to pytest (e.g. -k tie -x)")
    args = parser.parse_args(argv)
    extra = list(args.pytest_args)
    if "--" in extra:  # argparse keeps the separator in REMAINDER
        extra = extra[extra.index("--") + 1:]
    env = dict(os.environ)
    if "interpret" in args.backend:
        env["TRITON_INTERPRET"] = "1"
    # the current directory first, so that package.module:attr resolves where the user stands
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "magi_moe.tests", "--conformance",
           "--impl", args.impl, "-p", "no:cacheprovider", "--hypothesis-profile", args.profile,
           "-m", "not slow and not benchmark", "--verdict-dir", args.verdict_dir]
    cmd += [a for b in args.backend for a in ("--backend", b)] + extra
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    command, rest = argv[0], argv[1:]
    if command == "audit":
        from .audit.__main__ import cli
        return cli(rest)
    if command == "fuzz":
        from .fuzz.__main__ import main as fuzz_main
        return fuzz_main(rest)
    return check(rest)


if __name__ == "__main__":
    sys.exit(main())
