"""``python -m audit``: run every auditor and write the report (see :mod:`audit.report`).

    python -m audit                                  # CPU: reference + torch-bf16, and the
                                                     #      Triton kernels under the interpreter
    python -m audit --backend interpret              # the Triton kernels under the interpreter
    python -m audit --backend cuda                   # production shapes on a GPU
    python -m audit --impl native --impl mypkg.mod:impl --preset small --tokens 256 --out DIR

Exit status 1 when any check fails, 2 on bad arguments, 3 when no implementation under test
ran (every one skipped: a green audit that audited nothing), unless ``--allow-no-kernels``.
On the CPU backend the Triton kernels are audited under the interpreter: ``TRITON_INTERPRET=1``
is set for the run when Triton is installed (``--no-kernels`` audits the torch paths only).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from magi_moe.arguments import OneLineParser, refuse
from magi_moe.backends import BACKENDS, get_backend, kernels_decorated

# The prefix of its usage and error lines, as it was started: the console script or python -m.
PROG = "magi-moe audit" if Path(sys.argv[0] if sys.argv else "").name == "magi-moe" else "python -m audit"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=tuple(BACKENDS), default="cpu",
                   help="where to run: cpu (default; also runs the kernels if TRITON_INTERPRET=1), "
                        "interpret (sets TRITON_INTERPRET=1), cuda (production shapes)")
    p.add_argument("--impl", action="append", default=[], metavar="NAME",
                   help="implementation to audit (registered name or package.module:attr); "
                        "repeatable; default: every registered one that runs on the backend")
    p.add_argument("--preset", action="append", default=[], metavar="NAME",
                   help="shape preset (repeatable); default: small on the CPU, "
                        "magi2-ep4-local and magi2-full on CUDA")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per problem (default: 128 on the CPU, 4096 on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("audit-report"), help="output directory: report.md, report.json, verdict.md, verdict.json (default audit-report)")
    p.add_argument("--probe", action="append", default=[], metavar="NAME",
                   help="error-bound probe (repeatable; default: all)")
    p.add_argument("--runs", type=int, default=None,
                   help="determinism runs (default: 20 on CUDA, 3 on the CPU)")
    p.add_argument("--no-controls", action="store_true", help="skip the negative controls")
    p.add_argument("--no-mpcheck", action="store_true", help="skip the mpmath validation")
    p.add_argument("--failure-probability", type=float, default=1e-4,
                   help="false-alarm probability of the probabilistic bounds (default 1e-4)")
    p.add_argument("--no-kernels", action="store_true",
                   help="on the cpu backend, do not enable the Triton interpreter (torch paths only)")
    p.add_argument("--allow-no-kernels", action="store_true",
                   help="exit 0 even when no implementation under test ran (every one skipped)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on the CPU backends: 1; the audit's many small "
                        "ops run fastest single-threaded, by far on a loaded machine)")
    args = p.parse_args(argv)
    if args.tokens is not None and args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.runs is not None and args.runs < 2:
        p.error(f"--runs must be >= 2, got {args.runs}")
    if not 0 < args.failure_probability < 1:
        p.error(f"--failure-probability must lie in (0, 1), got {args.failure_probability}")
    return args


def enable_interpreter_for_cpu(argv: list[str] | None = None) -> None:
    """The command line's default on a CPU machine: audit the Triton kernels under the
    interpreter. Called only by the program entry points (``python -m audit``, ``magi-moe
    audit``), never by ``main`` itself, so a test calling ``main`` in-process keeps its env."""
    args = parse_args(argv)
    kernels_on = get_backend(args.backend).audits_kernels_on
    wanted = kernels_on and not args.no_kernels and importlib.util.find_spec("triton") is not None
    if not wanted or get_backend(kernels_on).available:
        return
    if kernels_decorated():
        print("audit: the Triton kernels were imported before the interpreter could be enabled; "
              "set TRITON_INTERPRET=1 before starting Python to audit them on the CPU", file=sys.stderr)
        return
    # Read when kernels are decorated: set before anything imports magi_moe.kernels.
    get_backend(kernels_on).enable_here()
    _notes.append("audit: TRITON_INTERPRET=1 set for this run, so the Triton kernels are audited "
                  "under the CPU interpreter (--no-kernels to skip them)")


_notes: list[str] = []  # printed once the arguments are accepted: a refusal stays one line


def cli(argv: list[str] | None = None) -> int:
    """The program entry: the CPU default above, then :func:`main`."""
    enable_interpreter_for_cpu(argv)
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Read when kernels are decorated: set before anything imports magi_moe.kernels.
    get_backend(args.backend).enable_here()
    import torch

    from magi_moe.config import PRESETS
    from magi_moe.registry import get_implementation

    from .probes import PROBES
    from .report import Audit, AuditOptions

    prog = PROG
    for name in args.preset:
        if name not in PRESETS:
            return refuse(prog, f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
    for name in args.probe:
        if name not in PROBES:
            return refuse(prog, f"--probe must be one of {PROBES}, got {name!r}")
    try:
        for name in args.impl:
            get_implementation(name)
    except (ValueError, TypeError) as exc:
        return refuse(prog, f"--impl: {exc}".splitlines()[0])
    try:  # before the run: a report that cannot be written would lose a finished audit
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return refuse(prog, f"--out must be a directory that can be created, got {str(args.out)!r} "
                            f"({exc.strerror or exc})")
    options = AuditOptions(
        backend=args.backend, impls=args.impl, presets=args.preset, tokens=args.tokens,
        seed=args.seed, out=args.out, probes=tuple(args.probe) or PROBES,
        determinism_runs=args.runs, controls=not args.no_controls,
        mp_validation=not args.no_mpcheck, failure_probability=args.failure_probability,
        allow_no_kernels=args.allow_no_kernels)
    while _notes:
        print(_notes.pop(0), flush=True)
    audit = Audit(options)
    if not audit.backend.available:
        return refuse(prog, f"--backend {args.backend} is unavailable here: "
                            f"{audit.backend.unavailable_reason()}")
    threads = torch.get_num_threads()
    if args.threads or audit.backend.audit_threads:
        torch.set_num_threads(args.threads or audit.backend.audit_threads)
    try:
        return audit.run()
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(cli())
