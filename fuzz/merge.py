"""``python -m fuzz merge OUT...``: one summary from the campaigns of N machines.

Machines that share one example database (``--db redis://...``) each write their own
``<out>/summary.json``; this reads them and writes one ``summary.json`` in the same form: totals
added up, a target that ran on several machines counted once with its cases, rounds and seconds
added (its outcome the worst one seen), and each failure listed once (by its reproduction line);
then the merged campaign's per-clause verdict, printed and written as ``verdict.md`` and
``verdict.json`` beside it, in the form a single campaign writes (:mod:`fuzz.campaign_verdict`).
Exit status 1 when any machine found a failure, 2 when a summary cannot be read, when one
campaign is given twice, or when ``--out`` cannot be a directory (checked first), else 0.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from magi_moe.arguments import OneLineParser, refuse

_WORST = ("failed", "error", "passed", "skipped", "not run")  # the first one seen in this order wins
_ADDED = ("tests", "passed", "failed", "skipped", "cases", "rounds")


def summary_path(path: Path) -> Path:
    return (path / "summary.json" if path.is_dir() else path).resolve()


def _read(path: Path) -> dict:
    target = summary_path(path)
    data = json.loads(target.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("totals"), dict):
        raise ValueError(f"{target} is not a campaign summary (no totals)")
    for key in ("targets", "failures"):
        rows = data.get(key, [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{target} is not a campaign summary ({key!r} must be a list of "
                             f"objects, got {type(rows).__name__})")
    if not all(isinstance(r.get("target"), str) for r in data.get("targets", [])):
        raise ValueError(f"{target} is not a campaign summary (a row of 'targets' names no target)")
    return data


def unwritable_directory(path: Path) -> str | None:
    """Why ``path`` cannot be made a directory (one line), or None; asked before any input is read."""
    for here in (path, *path.parents):
        if here.exists():
            if not here.is_dir():
                return f"{str(here)!r} is a file, not a directory"
            if here != path and not os.access(here, os.W_OK):
                return f"{str(here)!r} is not writable"
            return None
    return None


def _same_campaigns(paths: list[Path], summaries: list[dict]) -> str | None:
    """One campaign given twice (the same file, or a copy of it) would count as two machines."""
    seen: dict[str, Path] = {}
    for path, summary in zip(paths, summaries):
        key = json.dumps(summary, sort_keys=True)
        if key in seen:
            return f"{str(path)!r} is the same campaign as {str(seen[key])!r}: give each machine's once"
        seen[key] = path
    return None


def merge_summaries(summaries: list[dict]) -> dict:
    targets: dict[str, dict] = {}
    for summary in summaries:
        for row in summary.get("targets", []):
            merged = targets.setdefault(row["target"], {**row, "cases": 0, "rounds": 0, "seconds": 0.0,
                                                        "outcome": "not run"})
            for key in ("cases", "rounds", "seconds"):
                merged[key] += row.get(key, 0)
            outcomes = (merged["outcome"], row.get("outcome", "not run"))
            merged["outcome"] = min(outcomes, key=lambda o: _WORST.index(o) if o in _WORST else len(_WORST))
    failures = list({f.get("repro") or f.get("nodeid"): f
                     for summary in summaries for f in summary.get("failures", [])}.values())
    rows = list(targets.values())
    starved = [t["target"] for t in rows if t["rounds"] == 0 and t["outcome"] != "skipped"]
    totals = {key: sum(s["totals"].get(key, 0) for s in summaries) for key in _ADDED}
    totals.update(failures=len(failures), targets=len(rows), targets_without_time=len(starved),
                  targets_not_applicable=sum(t["outcome"] == "skipped" for t in rows))
    return {
        "mode": "merged", "machines": len(summaries),
        "backend": sorted({s.get("backend") for s in summaries if s.get("backend")}),
        "seeds": [s.get("seed") for s in summaries],
        "wall_seconds": max((s.get("wall_seconds", 0) for s in summaries), default=0),
        "totals": totals, "targets": rows, "targets_without_time": starved, "failures": failures,
    }


def merge_main(argv: list[str]) -> int:
    from .cli import program_name

    p = OneLineParser(prog=f"{program_name()} merge", description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", metavar="OUT", help="a campaign's --out directory (or its summary.json)")
    p.add_argument("--out", required=True, help="where the merged summary.json goes")
    args = p.parse_args(argv)
    out = Path(args.out)
    why = unwritable_directory(out)
    if why:
        return refuse(p.prog, f"--out must be a directory that can be created, got {args.out!r}: {why}")
    try:
        summaries = [_read(Path(o)) for o in args.outs]
    except (OSError, ValueError) as exc:
        return refuse(p.prog, f"OUT must be a campaign's --out directory or summary.json: {exc}")
    why = _same_campaigns([Path(o) for o in args.outs], summaries)
    if why:
        return refuse(p.prog, f"OUT: {why}")
    merged = merge_summaries(summaries)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return refuse(p.prog, f"--out must be a directory that can be created, got {args.out!r}: {exc}")
    (out / "summary.json").write_text(json.dumps(merged, indent=1))
    t = merged["totals"]
    print(f"[fuzz] merged {merged['machines']} campaigns: {t['targets']} targets, {t['cases']} cases in "
          f"{t['rounds']} rounds, {t['failures']} failures; {t['targets_without_time']} targets got no time")
    for f in merged["failures"]:
        print(f"[fuzz] {f.get('kind')}: {f.get('property') or f.get('nodeid')}: {f.get('message')}\n"
              f"  reproduce: {f.get('repro')}")
    print(f"[fuzz] wrote {out / 'summary.json'}")
    from .campaign_verdict import campaign_outcomes, write_verdict

    backends = ", ".join(merged["backend"]) or "?"
    lines = write_verdict(out, campaign_outcomes(merged, {}),
                          title=f"magi-moe fuzz verdict ({backends}; {merged['machines']} campaigns merged)")
    print("[fuzz] verdict (one row per contract clause):")
    for line in lines:
        print(f"  {line}")
    print(f"[fuzz] wrote {out / 'verdict.md'} and {out / 'verdict.json'}")
    return 1 if merged["failures"] or t["failed"] else 0
