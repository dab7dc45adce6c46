"""``magi-moe check IMPL``: the conformance suite (every test parametrized by the implementation
under test, from this package) run against ``IMPL``: a registered name, ``package.module:attr``
importable from the current directory, or an installed entry point.

On the ``interpret`` backend it sets ``TRITON_INTERPRET=1`` for the pytest process. It ends
with the verdict, one row per contract clause, also written to ``--verdict-dir`` (Markdown and
JSON). Exit statuses are pytest's; 5 means nothing was tested (magi-moe's pytest plugin says why).
A command of ``magi-moe`` through the entry-point group ``magi_moe.commands`` (pyproject.toml).
"""
from __future__ import annotations

import os
import subprocess
import sys

from magi_moe.arguments import OneLineParser
from magi_moe.cli import refuse_bad_impl


def main(argv: list[str]) -> int:
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
    from magi_moe.backends import BACKENDS

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
    # this package, by the name it was imported under (magi_moe.tests once installed)
    cmd = [sys.executable, "-m", "pytest", "--pyargs", __package__, "--conformance",
           "--impl", args.impl, "-p", "no:cacheprovider", "--hypothesis-profile", args.profile,
           "-m", "not slow and not benchmark", "--verdict-dir", args.verdict_dir]
    cmd += [a for b in args.backend for a in ("--backend", b)] + extra
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)
