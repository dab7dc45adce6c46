"""``python -m magi_moe.fuzz.serving_replay '<record json>'``: run a logged serving stream
(:mod:`fuzz.serving`) again exactly, as a failing stream's note prints it. Exit 0: it passes
now; 1: it fails again; 3: it cannot run here (its implementation or backend is missing)."""
from __future__ import annotations

import json
import os
import sys

from magi_moe.arguments import OneLineParser
from magi_moe.backends import kernels_backend_on

REPLAY_UNAVAILABLE = 3  # as fuzz.record's


def torch_device_ready(device: str) -> bool:
    import torch

    return torch.device(device).type != "cuda" or torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m magi_moe.fuzz.serving_replay",
                           description="Replay one logged serving stream; exit 1 if it still fails.")
    parser.add_argument("record", help="the record JSON a failing stream printed")
    args = parser.parse_args(argv)
    try:
        record = json.loads(args.record)
    except ValueError as exc:
        parser.error(f"RECORD must be the record's JSON, got {args.record[:80]!r} ({exc})")
    if not isinstance(record, dict):
        parser.error(f"RECORD must be a JSON object, got {type(record).__name__}")
    kernels = kernels_backend_on(record.get("device", "cpu"))  # on the CPU, the interpreter
    if kernels and not any(v.partition("=")[0] in os.environ for v in kernels.process_env):
        kernels.enable_here()  # unless set either way already: before any kernel import
    from .serving import drive, machine_for

    try:
        machine = machine_for(record)
        if record["device"] != "cpu" and not torch_device_ready(record["device"]):
            raise RuntimeError(f"device {record['device']} is not available here")
    except (ValueError, ImportError, AttributeError, RuntimeError) as exc:
        print(f"UNAVAILABLE: cannot replay here: {type(exc).__name__}: {exc}")
        return REPLAY_UNAVAILABLE
    print(f"replaying a {record['machine']} stream of {len(record['steps'])} steps on "
          f"{record['subject']}@{record['device']}", flush=True)
    try:
        drive(machine, record["seed"], record["steps"])
    except Exception as exc:  # noqa: BLE001 -- any error of a step is the finding
        print(f"FAIL: {type(exc).__name__}: {exc}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
