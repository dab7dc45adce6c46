"""Campaigns on several machines sharing one Redis example database (python -m fuzz --db redis://...).

A real ``redis-server`` is started on the loopback for the module (Debian's ``redis-server``
package; the test skips with the reason where none can run). Each "machine" is a separate
campaign process with its own local directory, as on separate hosts: two of them at once find a
planted bug (the broken empty-expert path of tests/fuzz_broken.py); a third, on a fresh local
directory, replays it from the shared database before anything else; a per-commit run reading
the database read-only replays it too, and writes nothing.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from magi_moe.fuzz.huge import REPO_ROOT, child_env

redis = pytest.importorskip("redis", reason="the shared database needs the redis client (pip install 'hypothesis[redis]')")
pytest.importorskip("xdist", reason="the campaign runner scales out with pytest-xdist")

BROKEN = "magi_moe.tests.fuzz_broken:empty_expert_garbage"
TARGET = "tests/test_fuzz_properties.py::test_property[empty_experts-broken-empty-expert@cpu]"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("no redis-server on this machine (Debian: apt-get install -y redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    for _ in range(3):  # a port taken between choosing and binding: try another
        port = _free_port()
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(workdir)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        deadline = time.time() + 15
        while time.time() < deadline and proc.poll() is None:
            try:
                client.ping()
                break
            except redis.RedisError:
                time.sleep(0.1)
        if proc.poll() is None:
            break
    else:
        pytest.skip(f"redis-server would not start: {proc.stdout.read()[-500:]}")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _snapshot(url: str) -> dict:
    client = redis.Redis.from_url(url)
    return {key: sorted(client.smembers(key)) for key in client.keys("*")}


def _campaign(url, tmp_path, name, *extra, seed=1, budget=10, workers=0):
    # Five examples in the first round whatever the budget: on a loaded machine the child's
    # start-up alone can eat 10 s, which left one one-example round that missed the bug.
    out = tmp_path / name
    cmd = [sys.executable, "-m", "fuzz", "--backend", "cpu", "--impl", BROKEN,
           "--properties", "empty_experts", "--budget-seconds", str(budget), "--workers", str(workers),
           "--round-examples", "5", "--first-round-examples", "5", "--no-shrink", "--no-confirm", "--seed", str(seed),
           "--db", url, "--db-local", str(tmp_path / f"{name}-local"), "--out", str(out), *extra]
    return cmd, out


def _run(cmd):
    return subprocess.run(cmd, cwd=REPO_ROOT, env=child_env("cpu"), capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # four campaign processes: 30-55 s on two cores
def test_machines_share_findings_through_redis(redis_url, tmp_path):
    # Two machines at once, each its own process and local directory, one Redis database (one
    # runs its cases in a pytest-xdist worker, the other in pytest's own process).
    runs = [_campaign(redis_url, tmp_path, name, seed=seed, workers=workers)
            for name, seed, workers in (("a", 1, 1), ("b", 2, 0))]
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env("cpu"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cmd, _ in runs]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    summaries = [json.loads((out / "summary.json").read_text()) for _, out in runs]
    found = [s for s in summaries if any(f["kind"] == "violation" for f in s["failures"])]
    assert found, "neither machine found the planted bug:\n" + "\n".join(log[-2000:] for log in logs)
    for proc, summary, log in zip(procs, summaries, logs):  # a found failure is never a pass
        assert proc.returncode == (1 if summary["failures"] else 0), log[-2000:]
        assert summary["totals"]["failed"] >= len({f["nodeid"] for f in summary["failures"]})
    shared = _snapshot(redis_url)
    findings = [json.loads(v) for k, vals in shared.items() if k.endswith(b"magi-moe.fuzz.findings")
                for v in vals]
    assert any(f["record"]["property"] == "empty_experts" for f in findings), findings
    assert len(shared) > 1, "Hypothesis saved no example to Redis"

    # A third machine, fresh local directory: the shared database's failure comes first.
    cmd, out = _campaign(redis_url, tmp_path, "c", seed=3)
    proc = _run(cmd)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert summary["replayed_from_database"]["failing"] >= 1, summary["replayed_from_database"]
    assert summary["order"]["first"] and summary["targets"][0]["target"] == TARGET
    assert summary["targets"][0]["first_failure_case"] == 1, summary["targets"][0]  # replayed, not found anew
    assert summary["totals"]["failed"] >= 1 and summary["failures"]

    # The next commit's CI: read-only, replays it, writes nothing (not even its local directory).
    before = _snapshot(redis_url)
    cmd, out = _campaign(redis_url, tmp_path, "ci", "--replay-only", seed=4)
    proc = _run(cmd)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert summary["mode"] == "replay-only"
    assert summary["replayed_from_database"]["failing"] >= 1
    row = next(t for t in summary["targets"] if t["target"] == TARGET)
    assert row["cases"] >= 1 and row["first_failure_case"] == 1, row  # Hypothesis's own replay
    assert any(t["test"] == TARGET and t["outcome"] == "failed" for t in summary["tests"])
    assert _snapshot(redis_url) == before
    local = tmp_path / "ci-local"
    assert not local.exists() or not any(local.rglob("*")), list(local.rglob("*"))


def test_wrong_database_url_is_refused_before_any_worker(tmp_path, capsys):
    from magi_moe.fuzz.campaign import campaign_main

    for db, reason in (("http://127.0.0.1:1/0", "redis:// URL"),
                       ("redis://127.0.0.1:1/0", "cannot reach the Redis server"),
                       (str(tmp_path / "a-file"), "got the file")):
        (tmp_path / "a-file").write_text("not a database")
        code = campaign_main(["--backend", "cpu", "--db", db, "--out", str(tmp_path / "out"),
                              "--budget-seconds", "5"])
        err = capsys.readouterr().err
        assert code == 2 and reason in err, err
        assert not (tmp_path / "out").exists()  # refused before anything was started or written


def test_each_implementation_set_has_its_own_redis_namespace(redis_url, tmp_path):
    """A Redis --db was once shared by every implementation's campaigns: one implementation's
    campaign opened with another's failure records (the directory --db was already split)."""
    from magi_moe.fuzz.database import load_findings, open_database, save_finding

    def db(impl):
        return open_database(f"{redis_url}#{impl}", local_dir=tmp_path / "local")

    save_finding(db("team_BUGGY"), {"kind": "violation", "nodeid": "t::buggy", "message": "off"})
    assert [f["nodeid"] for f in load_findings(db("team_BUGGY"))] == ["t::buggy"]
    assert load_findings(db("team_GOOD")) == []  # the other set's namespace: nothing of BUGGY's
    assert load_findings(open_database(redis_url, local_dir=tmp_path / "shared-local")) == []
    keys = redis.Redis.from_url(redis_url).keys("*magi-moe.fuzz.findings")
    assert keys and all(b"team_BUGGY:" in k for k in keys), keys
    assert (tmp_path / "local" / "team_BUGGY").is_dir() and not (tmp_path / "local" / "team_GOOD").exists()
