"""``python -m fuzz``: fuzzing campaigns, and replaying what they found.

    python -m fuzz --backend interpret --impl native --budget-seconds 600 --seed 1 \\
                   --db .hypothesis/fuzz-db --out fuzz-out [--workers 2] [--properties differential,tie_rule]
    python -m fuzz --replay-only --db redis://host:6379/0 --backend interpret  # per commit: replay the nightly findings
    python -m fuzz replay '<record json>' | path/to/failure.json    # one case, exactly (exit 1: fails, 3: cannot run here)
    python -m fuzz rerun 'tests/test_fuzz_stateful.py::test_weight_swaps[fused@cpu]' --db DIR --backend cpu
    python -m fuzz list                                              # the properties and state machines
    python -m fuzz merge machine-a/fuzz-out machine-b/fuzz-out --out merged   # one summary of N machines

A campaign writes ``<out>/summary.json``, ``<out>/junit.xml``, ``<out>/failures/*.json`` (each
with its one-line ``repro``) and ``<out>/pytest.log``; see :mod:`fuzz.campaign`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from magi_moe.arguments import OneLineParser
from magi_moe.backends import BACKENDS

# The fields a failure record may carry (fuzz.properties writes them); a misspelt one is refused
# in one line instead of surfacing as a KeyError or TypeError deep inside the replay.
RECORD_FIELDS = ("property", "impl", "router", "backend", "case", "params")


def program_name(command: str = "fuzz") -> str:
    """How this program was started, for its usage and error lines: ``magi-moe fuzz`` from the
    console script, else ``python -m fuzz``."""
    started = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return f"magi-moe {command}" if started == "magi-moe" else f"python -m {command}"


def record_problem(record: dict) -> str | None:
    """What is wrong with a record's fields (one line), or None."""
    import difflib

    unknown = [k for k in record if k not in RECORD_FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], RECORD_FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"RECORD has an unknown field {unknown[0]!r}{hint}; fields: {', '.join(RECORD_FIELDS)}"
    missing = [k for k in ("property", "backend", "case") if k not in record]
    if missing:
        return f"RECORD must name its {missing[0]!r} (fields: {', '.join(RECORD_FIELDS)})"
    if not isinstance(record["case"], dict) or not isinstance(record.get("params", {}), dict):
        return "RECORD's 'case' and 'params' must be JSON objects"
    return None


def _load_record(text: str) -> dict:
    path = Path(text)
    if not text.lstrip().startswith("{") and path.exists():
        data = json.loads(path.read_text())
        return data.get("record", data)  # a saved failure file or a bare record
    return json.loads(text)


def replay_main(argv: list[str]) -> int:
    parser = OneLineParser(prog=f"{program_name()} replay",
                           description="Replay one recorded case exactly; exit 1 if it still fails.")
    parser.add_argument("record", help="the record JSON, or a failure file written by a campaign")
    args = parser.parse_args(argv)
    try:
        record = _load_record(args.record)
    except (OSError, ValueError) as exc:
        parser.error(f"RECORD must be a record's JSON or a failure file, got {args.record[:80]!r} ({exc})")
    if not isinstance(record, dict):
        parser.error(f"RECORD must be a JSON object, got {type(record).__name__}")
    problem = record_problem(record)
    if problem:
        parser.error(problem)
    if record.get("backend") in BACKENDS:
        BACKENDS[record["backend"]].enable_here()  # before any kernel module is imported
    from .cases import case_from_dict
    from .fuzzers import replay
    from .record import REPLAY_UNAVAILABLE, DeviceFault, PropertyViolation

    try:  # a case that does not parse is bad input, not a finding
        case_from_dict(record["case"])
    except (KeyError, TypeError, ValueError) as exc:
        parser.error(f"RECORD's case does not describe a case: {type(exc).__name__}: {exc}".splitlines()[0])
    print(f"replaying {record.get('property')} on {record.get('impl') or record.get('router')}"
          f"@{record.get('backend')}", flush=True)
    try:
        metrics = replay(record)
    except (PropertyViolation, DeviceFault) as exc:
        print(f"FAIL: {exc}")
        return 1
    except (RuntimeError, ValueError, KeyError, ImportError, AttributeError) as exc:
        # Raised before any case ran (every error of a case is a PropertyViolation): the
        # implementation or backend is not there, e.g. a GPU record replayed on a CPU machine.
        print(f"UNAVAILABLE: cannot replay here: {type(exc).__name__}: {exc}")
        return REPLAY_UNAVAILABLE
    print(f"PASS: {json.dumps(metrics, default=str)}")
    return 0


def list_main(argv: list[str]) -> int:
    parser = OneLineParser(prog=f"{program_name()} list",
                           description="What a campaign can run (--properties): the records of "
                                       "fuzz.fuzzers.PROPERTIES, then the state machines.")
    parser.parse_args(argv)
    from magi_moe.text_tables import format_table

    from .campaign import machine_records
    from .fuzzers import PROPERTIES
    rows = [[p.name, p.on.name + (" (kernels only)" if p.kernels_only else ""), ", ".join(p.needs),
             f"{p.examples:g}", p.summary] for p in PROPERTIES.values()]
    print(format_table(["property", "runs on", "needs", "share of examples", "checks"], rows,
                       numeric_columns=(3,)))
    machines = [[m["name"], m["clause"], ", ".join(m["needs"]), m["summary"]] for m in machine_records()]
    print()
    print(format_table(["state machine", "clause", "needs", "checks"], machines))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "replay":
        return replay_main(argv[1:])
    if argv and argv[0] == "list":
        return list_main(argv[1:])
    if argv and argv[0] == "merge":
        from .merge import merge_main
        return merge_main(argv[1:])
    from .campaign import campaign_main, rerun_main
    if argv and argv[0] == "rerun":
        return rerun_main(argv[1:])
    return campaign_main(argv)


if __name__ == "__main__":
    sys.exit(main())
