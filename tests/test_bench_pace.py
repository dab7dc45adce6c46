"""magi_moe.bench.timing's pace groups: a host-bound path is never alternated with a fast one
(between its calls the GPU idles and drops its clocks), and a slow group gets fewer calls."""
from __future__ import annotations

import time

import torch

from magi_moe.bench import timing


def _sleeper(ms: float):
    return lambda: time.sleep(ms / 1e3)


def test_a_path_ten_times_slower_is_timed_in_a_group_of_its_own(monkeypatch):
    monkeypatch.setattr(timing, "SLOW_GROUP_SECONDS", 0.5)
    groups = timing.group_by_pace({"slow": 60.0, "fast": 1.0, "fast2": 2.0}, iters=50)
    assert [g for g, _ in groups] == [["fast", "fast2"], ["slow"]]
    assert groups[0][1] == 50  # 3 ms an iteration fits 50 calls in half a second
    assert groups[1][1] == 8  # 60 ms a call fits 8


def test_a_slow_group_gets_at_least_min_iters_and_never_more_than_asked(monkeypatch):
    monkeypatch.setattr(timing, "SLOW_GROUP_SECONDS", 0.5)
    assert [n for _, n in timing.group_by_pace({"a": 1.0, "b": 900.0}, iters=50)] == \
        [50, timing.MIN_ITERS]
    assert [n for _, n in timing.group_by_pace({"a": 1.0, "b": 30.0}, iters=2)] == [2, 2]


def test_every_path_is_timed_with_its_group_count(monkeypatch):
    """Measured for real: host sleeps far apart (1 ms and 400 ms a call) on any machine load."""
    monkeypatch.setattr(timing, "SLOW_GROUP_SECONDS", 1.0)
    times = timing.time_paths({"fast": _sleeper(1), "slow": _sleeper(400)}, warmup=1, iters=6,
                              flush_mib=256, device=torch.device("cpu"))
    assert list(times) == ["fast", "slow"]
    assert len(times["fast"]) == 6 and len(times["slow"]) == timing.MIN_ITERS
    assert min(times["slow"]) >= 400


def test_routers_are_paths_of_the_implementations_that_declare_one():
    from magi_moe.bench.paths import ROUTING_PATHS, resolve
    from magi_moe.impls import BUILTINS

    declared = {impl.name + "-routing" for impl in BUILTINS if impl.router is not None}
    assert set(ROUTING_PATHS) == {"routing"} | declared and "fused-routing" in declared
    assert resolve("routing").impl is None and resolve("fused-routing").impl.name == "fused"
    assert all(resolve(name).level == "routing" for name in ROUTING_PATHS)
