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
    fns = {"slow": _sleeper(60), "fast": _sleeper(1), "fast2": _sleeper(2)}
    groups = timing.pace_groups(fns, iters=50, device=torch.device("cpu"))
    assert [g for g, _ in groups] == [["fast", "fast2"], ["slow"]]
    assert groups[0][1] == 50  # 3 ms an iteration fits 50 calls in half a second
    assert timing.MIN_ITERS <= groups[1][1] < 50  # 60 ms a call does not


def test_every_path_is_timed_with_its_group_count(monkeypatch):
    monkeypatch.setattr(timing, "SLOW_GROUP_SECONDS", 0.3)
    times = timing.time_paths({"fast": _sleeper(1), "slow": _sleeper(40)}, warmup=1, iters=20,
                              flush_mib=256, device=torch.device("cpu"))
    assert list(times) == ["fast", "slow"]
    assert len(times["fast"]) == 20
    assert timing.MIN_ITERS <= len(times["slow"]) <= int(0.3 / 0.04)  # what 0.3 s holds
    assert min(times["slow"]) > 10 * max(1.0, min(times["fast"])) / 2


def test_never_more_calls_than_asked():
    groups = timing.pace_groups({"a": _sleeper(1), "b": _sleeper(30)}, iters=2,
                                device=torch.device("cpu"))
    assert [n for _, n in groups] == [2, 2]


def test_routers_are_paths_of_the_implementations_that_declare_one():
    from magi_moe.bench.paths import ROUTING_PATHS, resolve
    from magi_moe.impls import BUILTINS

    declared = {impl.name + "-routing" for impl in BUILTINS if impl.router is not None}
    assert set(ROUTING_PATHS) == {"routing"} | declared and "fused-routing" in declared
    assert resolve("routing").impl is None and resolve("fused-routing").impl.name == "fused"
    assert all(resolve(name).level == "routing" for name in ROUTING_PATHS)
