"""Where the layer-level sections (checkpoint, cache) build an implementation's own layer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from magi_moe.config import MoEConfig, preset
from magi_moe.implementation import UnsupportedShape

if TYPE_CHECKING:
    from ..report import Audit


def layer_config(audit: Audit, impl) -> tuple[MoEConfig | None, str | None]:
    """``(config, why not)``: the smallest preset ``impl`` supports that its layer is built at
    here, or the reason it cannot run. Layer checks do not depend on the shape; production
    layers would cost seconds each to draw, and interpreted kernels pay per operation."""
    sizes = ("tiny", "small") if audit.backend.small_audit_inputs else ("small", "tiny")
    config = next((preset(n) for n in sizes if impl.supports(preset(n)) is None), None)
    if config is None:  # a narrow shape rule: the smallest preset moved inside it, as check does
        config = fitted(impl, preset(sizes[0]))
    why = audit.runnable_here(impl) or (None if config else impl.supports(preset(sizes[0])))
    return (None, why) if why else (config, None)


def fitted(impl, config: MoEConfig) -> MoEConfig | None:
    """``config`` moved inside ``impl``'s declaration (:meth:`Implementation.fit`), or None
    when nothing near fits."""
    try:
        return impl.fit(config)
    except UnsupportedShape:
        return None
