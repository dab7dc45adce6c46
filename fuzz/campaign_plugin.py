"""The pytest plugin a campaign loads into every pytest-xdist worker (``-p fuzz.campaign_plugin``).

It turns the ordinary fuzz tests into time-boxed campaign items:

* selects the fuzz targets (tests marked with :func:`fuzz.fuzzers.campaign_target`: the rows
  of the one property test, and the weight-swap machine) of the chosen properties, deselects
  everything else, and orders them as the runner says (targets with known failures first,
  then the list rotated: ``--fuzz-order``), the same on every worker;
* loads the ``campaign`` Hypothesis profile (nightly's settings, the campaign's database from
  :mod:`fuzz.database`, a per-round example budget) before the test modules are imported; with
  ``--fuzz-replay-only`` the profile only replays the (read-only) database and generates nothing;
* gives every target an equal share of the budget, and every target at least one round: rounds
  start at one example and double while the share lasts, so a short budget still reaches every
  target, and a target started past the deadline still runs one one-example round (which
  replays its saved failures first); each round has a fresh seed drawn from a stream seeded by
  the campaign seed and the node id;
* saves every failure as ``<out>/failures/*.json`` with its one-line reproduction, and into the
  database's findings (other machines and the next commit replay it); keeps the flight recorder
  on (``<out>/inflight``) so a case that kills its worker, or a failure found while the run was
  stopped mid-shrink, is still known; a watchdog ends a worker whose case runs past
  ``--fuzz-case-timeout``;
* stops a shrink when the target's share of the budget is spent (the failure is reported with
  the example shrunk so far), so a failing target neither overruns the budget nor starves the
  targets after it;
* on a GPU, runs a device-health probe after every case (:func:`fuzz.record.cuda_health_probe`),
  so a case that breaks the CUDA context is named, not the case after it;
* writes per-item statistics to ``<out>/stats`` (rounds, cases, seconds, the case at which the
  first failure showed, the contract clause and the subject of the verdict row) and the
  ordered target list to ``<out>/targets.json``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from . import record as rec
from .hypothesis_internals import given_settings, seed_run_stream, set_given_settings, set_shrink_deadline

TIMEOUT_EXIT = 76


def pytest_addoption(parser):
    group = parser.getgroup("fuzz campaign")
    group.addoption("--fuzz-out", default=None, help="campaign output directory (turns the plugin on)")
    group.addoption("--fuzz-db", default=".hypothesis/fuzz-db",
                    help="shared example database: a directory or a redis:// URL")
    group.addoption("--fuzz-db-local", default=None, help="local directory paired with a Redis database")
    group.addoption("--fuzz-order", default=None, help="JSON file: {'first': [node ids], 'rotation': N}")
    group.addoption("--fuzz-runner-pid", type=int, default=0,
                    help="the campaign runner's pid: this process group ends once it is gone")
    group.addoption("--fuzz-replay-only", action="store_true",
                    help="replay the database (read-only) and generate nothing: the per-commit run")
    group.addoption("--fuzz-start", type=float, default=None, help="campaign start (epoch seconds)")
    group.addoption("--fuzz-budget", type=float, default=60.0, help="campaign budget in seconds")
    group.addoption("--fuzz-seed", type=int, default=0, help="campaign seed")
    group.addoption("--fuzz-properties", default="", help="comma-separated properties (default: all)")
    group.addoption("--fuzz-profile", default="nightly", help="profile the campaign's profile derives from")
    group.addoption("--fuzz-round-examples", type=int, default=25, help="examples per round")
    group.addoption("--fuzz-first-round-examples", type=int, default=1,
                    help="examples of every target's first round, whatever the time left")
    group.addoption("--fuzz-case-timeout", type=float, default=600.0, help="seconds before a case counts as hung")
    group.addoption("--fuzz-gpus", type=int, default=0, help="spread workers over this many GPUs")
    group.addoption("--fuzz-single-round", action="store_true", help="one round per item (rerun)")
    group.addoption("--fuzz-device", default="cpu", help="device of the backend (for tie_rule items)")
    group.addoption("--fuzz-no-shrink", action="store_true", help="report the first failing example unshrunk")
    group.addoption("--fuzz-size-budget", type=float, default=None, help="shape budget of the strategies")


def _active(config) -> bool:
    return bool(config.getoption("--fuzz-out"))


def _stop_with_runner(runner: int) -> None:
    """A campaign runner killed (even by SIGKILL) leaves its pytest and workers behind, in their
    own session: each watches the runner (by pid: it may be gone before this process starts
    watching) and ends the whole group once it is gone."""
    def alive() -> bool:
        try:
            os.kill(runner, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else: pid reused, the runner is gone
            return False
        return True

    def watch() -> None:
        while alive():
            time.sleep(1.0)
        if os.getpgrp() == os.getsid(0):  # the runner's own session: never a user's shell job
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="fuzz-stop-with-parent", daemon=True).start()


def _worker_index(config) -> int:
    name = getattr(config, "workerinput", {}).get("workerid", "gw0")
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else 0


def pytest_configure(config):
    if not _active(config):
        return
    if config.getoption("--fuzz-runner-pid"):
        _stop_with_runner(config.getoption("--fuzz-runner-pid"))
    from hypothesis import Phase, settings

    from . import profiles

    from .database import open_database

    out = Path(config.getoption("--fuzz-out"))
    base = config.getoption("--fuzz-profile")
    replay_only = config.getoption("--fuzz-replay-only")
    # The runner has already checked that the database answers; each worker opens its own client.
    db = open_database(config.getoption("--fuzz-db"), local_dir=config.getoption("--fuzz-db-local"),
                       read_only=replay_only, check=False)
    config._fuzz_db = db
    if replay_only:  # saved examples only: explicit and reuse phases, never derandomised
        profiles.register_campaign_profile(db, max_examples=config.getoption("--fuzz-round-examples"),
                                           parent=base, derandomize=False,
                                           phases=(Phase.explicit, Phase.reuse))
    elif base == "ci":  # derandomised: one round says all there is to say
        config._fuzz_db = None
        settings.register_profile("campaign", parent=settings.get_profile("ci"))
    else:
        profiles.register_campaign_profile(db, max_examples=config.getoption("--fuzz-round-examples"),
                                           parent=base)
    if config.getoption("--fuzz-no-shrink") and not replay_only:
        settings.register_profile("campaign", parent=settings.get_profile("campaign"),
                                  phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)])
    settings.load_profile("campaign")
    if config.getoption("--fuzz-size-budget"):  # read by the test modules when they are imported
        profiles.SIZE_BUDGETS["campaign"] = config.getoption("--fuzz-size-budget")
    rec.configure_flight_recorder(out / "inflight", exit_on_device_fault=True)
    if config.getoption("--fuzz-device") == "cuda":
        rec.set_health_probe(rec.cuda_health_probe)
    gpus = config.getoption("--fuzz-gpus")
    if gpus > 0 and hasattr(config, "workerinput"):  # one GPU per worker, before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = str(_worker_index(config) % gpus)
    _count_machine_runs()
    _start_watchdog(config.getoption("--fuzz-case-timeout"))


def _count_machine_runs() -> None:
    """A state machine's steps run no :func:`fuzz.record.in_flight` case of their own: each run
    of a machine (a fresh instance, whatever the machine) counts as one case, so a machine
    target's cases are not reported as 0."""
    from hypothesis.stateful import RuleBasedStateMachine

    original = RuleBasedStateMachine.__init__
    if getattr(original, "fuzz_counted", False):
        return

    def counted(self, *args, **kwargs):
        rec.count_case()
        original(self, *args, **kwargs)

    counted.fuzz_counted = True
    RuleBasedStateMachine.__init__ = counted


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
    """The property a fuzz target runs (:func:`fuzz.fuzzers.campaign_target`): the name of the
    record in its row's parameter, else the one the test was marked with; None: no target."""
    fn = getattr(item, "obj", None)
    marked = getattr(fn, "fuzz_property", None)
    param = getattr(fn, "fuzz_property_param", None)
    if marked is None or param is None:
        return marked
    record = getattr(getattr(item, "callspec", None), "params", {}).get(param)
    return getattr(record, "name", marked)


def _impl_of(item) -> str | None:
    """The implementation under test of an item (None: a router, or none)."""
    from magi_moe.pytest_plugin import ImplOnBackend

    params = getattr(getattr(item, "callspec", None), "params", {})
    pair = next((v for v in params.values() if isinstance(v, ImplOnBackend)), None)
    return pair.impl.name if pair is not None else None


def _clause_of(item) -> str:
    """The contract clause a target's verdict row counts under: its ``clause`` mark (a property
    row carries its record's clause, a state machine its own), else ``other``."""
    mark = item.get_closest_marker("clause")
    return str(mark.args[0]) if mark is not None and mark.args else "other"


def _subject_of(item, config) -> str:
    """The verdict row's subject: ``impl@backend``, or ``router NAME@backend`` for a router."""
    from .properties import RouterTarget

    params = getattr(getattr(item, "callspec", None), "params", {})
    router = next((v for v in params.values() if isinstance(v, RouterTarget)), None)
    if router is not None:
        return f"router {router}"
    backend = (config.getoption("--backend") or ["?"])[0]
    return f"{_impl_of(item) or '?'}@{backend}"


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
    items[:] = order_items(keep, _read_order(config.getoption("--fuzz-order")))
    config._fuzz_item_count = len(items)
    # what the verdict needs of every target, whether or not it gets to run
    rows = {item.nodeid: {"property": _property_of(item), "impl": _impl_of(item), "clause": _clause_of(item),
                          "subject": _subject_of(item, config)} for item in items}
    _write_json(Path(config.getoption("--fuzz-out")) / "targets.json",
                {"targets": [item.nodeid for item in items], "collected": [item.nodeid for item in keep],
                 "rows": rows})


def _read_order(path: str | None) -> dict:
    if not path:
        return {}
    return json.loads(Path(path).read_text())


def order_items(items: list, order: dict) -> list:
    """Targets with known failures first (in the order given), then the others rotated by
    ``order['rotation']``: the runner moves the rotation on after every campaign, so a short
    budget never favours the same targets twice. Every worker computes the same order."""
    first = [nodeid for nodeid in order.get("first", [])]
    by_id = {item.nodeid: item for item in items}
    head = [by_id[nodeid] for nodeid in dict.fromkeys(first) if nodeid in by_id]
    taken = {item.nodeid for item in head}
    rest = [item for item in items if item.nodeid not in taken]
    if rest:
        shift = int(order.get("rotation", 0)) % len(rest)
        rest = rest[shift:] + rest[:shift]
    return head + rest


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def _slug(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-120:]


def _round_seed(campaign_seed: int, nodeid: str, round_no: int) -> int:
    digest = hashlib.sha256(f"{campaign_seed}:{nodeid}:{round_no}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _seed_rounds(seed: int) -> None:
    """Seed the stream Hypothesis draws each round's seed from, keeping the example database a
    campaign needs (best effort: without it rounds are seeded from the OS)."""
    seed_run_stream(seed)


def _write_stats(out: Path, item, **stats) -> None:
    _write_json(out / "stats" / f"{_slug(item.nodeid)}.json",
                {"nodeid": item.nodeid, "property": _property_of(item), "impl": _impl_of(item),
                 "clause": _clause_of(item), "subject": _subject_of(item, item.config), **stats})


@contextlib.contextmanager
def _round_examples(item, examples: int | None):
    """Run one round with at most ``examples`` examples (None: the test's own budget). A
    ``@given`` test's settings are baked in at import, so its settings object is swapped for
    the round; a test that builds its settings when it runs (the state machine, through
    :func:`fuzz.profiles.examples`) reads the reloaded campaign profile."""
    if examples is None:
        yield
        return
    from hypothesis import settings

    given = given_settings(item.obj)
    profile = settings.get_profile("campaign")
    if given is not None:
        set_given_settings(item.obj, settings(given, max_examples=min(examples, given.max_examples)))
    settings.register_profile("campaign", parent=profile, max_examples=min(examples, profile.max_examples))
    settings.load_profile("campaign")
    try:
        yield
    finally:
        if given is not None:
            set_given_settings(item.obj, given)
        settings.register_profile("campaign", parent=profile)
        settings.load_profile("campaign")


def _first_failure_case(cases_before: int) -> int | None:
    """The case (1 = the item's first) at which the running item first failed, if it has."""
    path = rec.found_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, AttributeError):
        return None
    return int(data.get("cases", 0)) - cases_before


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
    # An equal share of what is left among the targets not started yet (time a quick target
    # did not use goes to the later ones); past the deadline a target still runs one
    # one-example round, so every target gets time in every campaign, whatever the budget.
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items = max(1, getattr(config, "_fuzz_item_count", 1))
    started = len(list((out / "stats").glob("*.json"))) if (out / "stats").is_dir() else 0
    left = max(1, items - started)
    item_end = min(deadline, now + max(0.0, deadline - now) * min(workers, left) / left)
    single = (config.getoption("--fuzz-single-round") or config.getoption("--fuzz-replay-only")
              or hyp_settings.default.derandomize)
    full = config.getoption("--fuzz-round-examples")
    fn = pyfuncitem.obj
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    rounds, cases_before, began = 0, rec.cases_started(), now
    full = max(1, full)
    examples = max(1, min(full, config.getoption("--fuzz-first-round-examples")))
    first_failure = None
    rec.clear_found()
    rec.set_current_item(pyfuncitem.nodeid)
    # Started, no round finished yet: a target stopped at the hard limit in its first round is
    # reported as such (its time was spent), not as one that got no time.
    _write_stats(out, pyfuncitem, rounds=0, cases=0, seconds=0.0, started=round(began - start, 2),
                 worker=getattr(config, "workerinput", {}).get("workerid", "main"), first_failure_case=None)
    _seed_rounds(_round_seed(config.getoption("--fuzz-seed"), pyfuncitem.nodeid, 0))
    while True:
        t0 = time.time()
        # a failure found in this round shrinks until the target's share ends, then is reported
        set_shrink_deadline(item_end)
        try:
            with _round_examples(pyfuncitem, None if single else examples):
                fn(**kwargs)
        finally:
            rounds += 1
            took = time.time() - t0
            first_failure = first_failure or _first_failure_case(cases_before)
            _write_stats(out, pyfuncitem, rounds=rounds, cases=rec.cases_started() - cases_before,
                         seconds=round(time.time() - began, 3), started=round(began - start, 2),
                         worker=getattr(config, "workerinput", {}).get("workerid", "main"),
                         first_failure_case=first_failure)
        if single:
            return True
        grown = min(2 * examples, full)
        if time.time() + took * grown / examples > item_end:  # the next round would not fit
            return True
        examples = grown


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
    if _active(config) and report.skipped and _property_of(item) is not None:
        _record_skip(config, item, call)
    if not _active(config) or report.when != "call" or not report.failed or call.excinfo is None:
        return
    out = Path(config.getoption("--fuzz-out")) / "failures"
    extra = {"nodeid": item.nodeid, "worker": getattr(config, "workerinput", {}).get("workerid", "main")}
    found = list(_violations(call.excinfo.value))
    from magi_moe.verdict import cause_of

    cause = cause_of(call.excinfo.value)  # e.g. inaccurate: counted under accuracy in the verdict
    if cause:
        extra["cause"] = cause
    saved = []
    for exc in found:
        kind = "device-fault" if isinstance(exc, rec.DeviceFault) else "violation"
        saved.append(rec.save_record(out, exc.record, kind=kind, message=getattr(exc, "reason", str(exc)),
                                     extra=extra))
    if not found:  # e.g. the weight-swap machine: the database replays it through the node id
        text = str(call.excinfo.value).strip().splitlines()
        saved.append(rec.save_failure(out, item.nodeid, message=text[0] if text else repr(call.excinfo.value),
                                      repro=rerun_command(config, item.nodeid), extra=extra))
    rec.clear_found()  # reported: nothing left pending for the runner
    db = getattr(config, "_fuzz_db", None)
    if db is not None and not config.getoption("--fuzz-replay-only"):
        from .database import save_finding
        for path in saved:  # other machines and the next commit replay these
            save_finding(db, json.loads(path.read_text()))


def _record_skip(config, item, call) -> None:
    """A target's skip and its kind for the verdict (junit.xml keeps only the text)."""
    from magi_moe.verdict import skip_kind

    reason = getattr(call.excinfo.value, "msg", None) if call.excinfo is not None else None
    _write_json(Path(config.getoption("--fuzz-out")) / "skips" / f"{_slug(item.nodeid)}.json",
                {"nodeid": item.nodeid, "reason": str(reason or ""), "kind": skip_kind(reason)})


def rerun_command(config, nodeid: str) -> str:
    """The one-line command that replays a failing node from the campaign's database."""
    import shlex
    backends = config.getoption("--backend") or ["cpu"]
    from .database import describe
    from .record import FUZZ_COMMAND
    parts = [f"{FUZZ_COMMAND} rerun", shlex.quote(nodeid), "--db", shlex.quote(describe(config.getoption("--fuzz-db"))),
             "--backend", shlex.quote(backends[0])]
    for impl in config.getoption("--impl") or []:
        parts += ["--impl", shlex.quote(impl)]
    profile = config.getoption("--fuzz-profile")
    if profile and profile != "nightly":  # the rerun's default
        parts += ["--profile", shlex.quote(profile)]
    if config.getoption("--fuzz-no-shrink"):
        parts.append("--no-shrink")
    return " ".join(parts)
