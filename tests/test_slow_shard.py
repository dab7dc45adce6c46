"""The slow tier's shards (MAGI_MOE_SLOW_SHARD=i/n, tests/conftest.py): CI runs one a commit."""
from __future__ import annotations

import pytest

from magi_moe.tests.conftest import slow_shard


def test_a_shard_is_parsed_and_a_bad_one_refused():
    assert slow_shard("") is None
    assert slow_shard("2/5") == (2, 5)
    for bad in ("5/5", "-1/5", "1/0", "a/b", "3"):
        with pytest.raises(pytest.UsageError, match="MAGI_MOE_SLOW_SHARD"):
            slow_shard(bad)

