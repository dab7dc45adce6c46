"""The pytest plugin a campaign loads into every pytest-xdist worker (``-p fuzz.campaign_plugin``).

It turns the ordinary fuzz tests into time-boxed campaign items:

* selects the fuzz targets (tests marked with :func:`fuzz.properties.campaign_target`) of the
  chosen properties and deselects everything else;
* loads the ``campaign`` Hypothesis profile (nightly's settings, the campaign's database, a
  per-round example budget) before the test modules are imported;
* runs each target in rounds, each with a fresh seed drawn from a stream seeded by the campaign
  seed and the node id, until the item's share of the time budget is spent: the shared example
  database replays what earlier rounds, other workers and earlier campaigns found;
* saves every failure as ``<out>/failures/*.json`` with its one-line reproduction, keeps the
  flight recorder on (``<out>/inflight``) so a case that kills its worker is still known, and
  a watchdog ends a worker whose case runs past ``--fuzz-case-timeout``;
* writes per-item statistics to ``<out>/stats`` for the runner's progress line.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from . import record as rec

TIMEOUT_EXIT = 76


def pytest_addoption(parser):
    group = parser.getgroup("fuzz campaign")
    group.addoption("--fuzz-out", default=None, help="campaign output directory (turns the plugin on)")
    group.addoption("--fuzz-db", default=".hypothesis/fuzz-db", help="shared example database directory")
    group.addoption("--fuzz-start", type=float, default=None, help="campaign start (epoch seconds)")
    group.addoption("--fuzz-budget", type=float, default=60.0, help="campaign budget in seconds")
    group.addoption("--fuzz-seed", type=int, default=0, help="campaign seed")
    group.addoption("--fuzz-properties", default="", help="comma-separated properties (default: all)")
    group.addoption("--fuzz-profile", default="nightly", help="profile the campaign's profile derives from")
    group.addoption("--fuzz-round-examples", type=int, default=25, help="examples per round")
    group.addoption("--fuzz-case-timeout", type=float, default=600.0, help="seconds before a case counts as hung")
    group.addoption("--fuzz-gpus", type=int, default=0, help="spread workers over this many GPUs")
    group.addoption("--fuzz-single-round", action="store_true", help="one round per item (rerun)")
    group.addoption("--fuzz-device", default="cpu", help="device of the backend (for tie_rule items)")
    group.addoption("--fuzz-no-shrink", action="store_true", help="report the first failing example unshrunk")
    group.addoption("--fuzz-size-budget", type=float, default=None, help="shape budget of the strategies")


def _active(config) -> bool:
    return bool(config.getoption("--fuzz-out"))


def _worker_index(config) -> int:
    name = getattr(config, "workerinput", {}).get("workerid", "gw0")
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else 0


def pytest_configure(config):
    if not _active(config):
        return
    from hypothesis import settings

    from . import profiles

    out = Path(config.getoption("--fuzz-out"))
    base = config.getoption("--fuzz-profile")
    if base == "ci":  # derandomised: one round says all there is to say
        settings.register_profile("campaign", parent=settings.get_profile("ci"))
    else:
        profiles.register_campaign_profile(config.getoption("--fuzz-db"),
                                           max_examples=config.getoption("--fuzz-round-examples"),
                                           parent=base)
    if config.getoption("--fuzz-no-shrink"):
        from hypothesis import Phase
        settings.register_profile("campaign", parent=settings.get_profile("campaign"),
                                  phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)])
    settings.load_profile("campaign")
    if config.getoption("--fuzz-size-budget"):  # read by the test modules when they are imported
        profiles.SIZE_BUDGETS["campaign"] = config.getoption("--fuzz-size-budget")
    rec.configure_flight_recorder(out / "inflight", exit_on_device_fault=True)
    gpus = config.getoption("--fuzz-gpus")
    if gpus > 0 and hasattr(config, "workerinput"):  # one GPU per worker, before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = str(_worker_index(config) % gpus)
    _start_watchdog(config.getoption("--fuzz-case-timeout"))


def _start_watchdog(timeout: float) -> None:
    def watch():
        while True:
            time.sleep(min(5.0, timeout / 4))
            path = rec.flight_path()
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError, AttributeError):
                continue
            if data.get("status") == "running" and time.time() - data["started"] > timeout:
                data.update(status="timeout", message=f"case ran longer than {timeout:.0f} s")
                path.write_text(json.dumps(data, indent=1, sort_keys=True))
                os._exit(TIMEOUT_EXIT)

    threading.Thread(target=watch, name="fuzz-watchdog", daemon=True).start()


def _property_of(item) -> str | None:
    return getattr(getattr(item, "obj", None), "fuzz_property", None)


def pytest_collection_modifyitems(config, items):
    if not _active(config):
        return
    wanted = {p for p in config.getoption("--fuzz-properties").split(",") if p}
    device = config.getoption("--fuzz-device")
    keep, drop = [], []
    for item in items:
        prop = _property_of(item)
        params = getattr(getattr(item, "callspec", None), "params", {})
        ok = prop is not None and (not wanted or prop in wanted)
        if ok and "device" in params and params["device"] != device:
            ok = False
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    config._fuzz_item_count = len(keep)


def _slug(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-120:]


def _round_seed(campaign_seed: int, nodeid: str, round_no: int) -> int:
    digest = hashlib.sha256(f"{campaign_seed}:{nodeid}:{round_no}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _seed_rounds(seed: int) -> None:
    """Seed the stream Hypothesis draws each round's seed from. ``hypothesis.seed()`` or
    ``--hypothesis-seed`` would also switch the example database off, which a campaign needs;
    this reaches into Hypothesis (best effort: without it rounds are seeded from the OS)."""
    import random

    from hypothesis import core
    local = getattr(core, "threadlocal", None)
    if local is not None and hasattr(local, "_hypothesis_global_random"):
        local._hypothesis_global_random = random.Random(seed)


def _write_stats(out: Path, item, **stats) -> None:
    path = out / "stats" / f"{_slug(item.nodeid)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"nodeid": item.nodeid, "property": _property_of(item), **stats}))
    os.replace(tmp, path)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    config = pyfuncitem.config
    if not _active(config) or _property_of(pyfuncitem) is None:
        return None
    from hypothesis import settings as hyp_settings

    out = Path(config.getoption("--fuzz-out"))
    start = config.getoption("--fuzz-start") or time.time()
    budget = config.getoption("--fuzz-budget")
    deadline = start + budget
    now = time.time()
    # Past the budget, later items are skipped, but only once this worker has run a round: a
    # slow start (a loaded machine, a long collection) must not leave a worker that tested
    # nothing (the runner also exits 2 when no case ran at all).
    if now >= deadline and rec.cases_started() > 0 and not config.getoption("--fuzz-single-round"):
        pytest.skip("campaign budget spent before this item started")
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items = max(1, getattr(config, "_fuzz_item_count", 1))
    item_end = min(deadline, now + budget * workers / items)
    single = config.getoption("--fuzz-single-round") or hyp_settings.default.derandomize
    fn = pyfuncitem.obj
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    rounds, cases_before, began = 0, rec.cases_started(), now
    longest = 0.0
    _seed_rounds(_round_seed(config.getoption("--fuzz-seed"), pyfuncitem.nodeid, 0))
    while True:
        t0 = time.time()
        try:
            fn(**kwargs)
        finally:
            rounds += 1
            longest = max(longest, time.time() - t0)
            _write_stats(out, pyfuncitem, rounds=rounds, cases=rec.cases_started() - cases_before,
                         seconds=round(time.time() - began, 2))
        if single or time.time() + longest > item_end:
            return True


def _violations(exc: BaseException | None, seen=None):
    """PropertyViolation / DeviceFault instances inside ``exc`` (groups, causes, contexts)."""
    seen = seen if seen is not None else set()
    if exc is None or id(exc) in seen:
        return
    seen.add(id(exc))
    if isinstance(exc, (rec.PropertyViolation, rec.DeviceFault)):
        yield exc
        return
    for inner in getattr(exc, "exceptions", ()) or ():
        yield from _violations(inner, seen)
    yield from _violations(exc.__cause__, seen)
    yield from _violations(exc.__context__, seen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    config = item.config
    if not _active(config) or report.when != "call" or not report.failed or call.excinfo is None:
        return
    out = Path(config.getoption("--fuzz-out")) / "failures"
    extra = {"nodeid": item.nodeid, "worker": getattr(config, "workerinput", {}).get("workerid", "main")}
    found = list(_violations(call.excinfo.value))
    for exc in found:
        kind = "device-fault" if isinstance(exc, rec.DeviceFault) else "violation"
        rec.save_record(out, exc.record, kind=kind, message=getattr(exc, "reason", str(exc)), extra=extra)
    if not found:  # e.g. the weight-swap machine: the database replays it through the node id
        text = str(call.excinfo.value).strip().splitlines()
        rec.save_failure(out, item.nodeid, message=text[0] if text else repr(call.excinfo.value),
                         repro=rerun_command(config, item.nodeid), extra=extra)


def rerun_command(config, nodeid: str) -> str:
    """The one-line command that replays a failing node from the campaign's database."""
    import shlex
    backends = config.getoption("--backend") or ["cpu"]
    parts = ["python -m fuzz rerun", shlex.quote(nodeid), "--db", shlex.quote(config.getoption("--fuzz-db")),
             "--backend", shlex.quote(backends[0])]
    for impl in config.getoption("--impl") or []:
        parts += ["--impl", shlex.quote(impl)]
    return " ".join(parts)
