"""One wording for a layer already wrong with its first weights, met by the weight-change, graph
and checkpoint tests alike: nothing of their own is left to judge, so they report it once, as
the verdict (:mod:`magi_moe.verdict`) counts it."""
from __future__ import annotations

from magi_moe.verdict import LAYER_WRONG_FROM_THE_START


def layer_wrong_from_the_start(impl, detail: str) -> tuple[str | None, list[str]]:
    """``(why it was not judged, failures)``. With its own router the layer routes with code the
    routing clause judges: a skip pointing there. Otherwise the accuracy judge's finding, worded
    so that the verdict counts it under accuracy: one root cause, one FAIL row."""
    if impl.router is not None:
        return (f"{impl.name}'s layer is wrong before any weight change, with its own router "
                f"(see the routing clause): {detail}"), []
    return None, [f"{impl.name}'s {LAYER_WRONG_FROM_THE_START}: {detail}"]
