"""The slow tier's shards (MAGI_MOE_SLOW_SHARD=i/n, tests/conftest.py): CI runs one a commit."""
from __future__ import annotations

import pytest

from .conftest import slow_shard


def test_a_shard_is_parsed_and_a_bad_one_refused():
    assert slow_shard("") is None
    assert slow_shard("2/5") == (2, 5)
    for bad in ("5/5", "-1/5", "1/0", "a/b", "3"):
        with pytest.raises(pytest.UsageError, match="MAGI_MOE_SLOW_SHARD"):
            slow_shard(bad)


def test_the_shards_balance_the_measured_seconds():
    """Longest first onto the least loaded shard: no two shards differ by more than the longest
    test, and a checkout's and an installed wheel's node ids land in the same shard."""
    from .conftest import SLOW_SECONDS, shard_owners

    rows = [line.split(" ", 1) for line in SLOW_SECONDS.read_text().splitlines() if line.strip()]
    assert rows, f"{SLOW_SECONDS} lists no test"
    owner = shard_owners(8)
    load = [0.0] * 8
    for seconds, nodeid in rows:
        load[owner(f"tests/{nodeid}")] += float(seconds)
        assert owner(f"tests/{nodeid}") == owner(f"magi_moe/tests/{nodeid}")
    assert max(load) - min(load) <= max(float(s) for s, _ in rows)
