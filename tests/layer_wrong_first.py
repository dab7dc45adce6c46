"""A layer already wrong with its first weights, met by the weight-change, graph and checkpoint
tests alike: nothing of their own is left to judge, so they end the case the one way the verdict
(:mod:`magi_moe.verdict`) counts it, by the exception's type, whatever its words."""
from __future__ import annotations

from typing import NoReturn

import pytest

from magi_moe.verdict import LayerWrongFromTheStart, not_run


def layer_wrong_from_the_start(impl, detail: str) -> NoReturn:
    """End the case. With its own router the layer routes with code the routing clause judges:
    a NOT RUN skip pointing there. Otherwise :class:`LayerWrongFromTheStart`, which the verdict
    counts under accuracy: one root cause, one FAIL row."""
    if impl.router is not None:
        pytest.skip(not_run(f"{impl.name}'s layer is wrong before any weight change, with its own "
                            f"router (see the routing clause): {detail}"))
    raise LayerWrongFromTheStart(f"{impl.name}'s layer FAILED on bounds before any weight change: "
                                 f"{detail}")
