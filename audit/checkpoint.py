"""Does an implementation's own layer compute the checkpoint it was given (CONTRACT section 3)?

:func:`check_layer_checkpoint` builds ``impl.layer(config, state_dict, device)`` from a drawn
released-layout checkpoint and holds its output to the float64 reference of the tensors it was
given. The weight-cache audit (:mod:`audit.cache`) judges a layer by what it holds
(``state_dict()``): a layer that loads a name into the wrong place (gate and up swapped, say)
is consistent with what it holds and passes every route there; this check is where it fails.
A tensor the layer reports under a released name must also be the one given.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from magi_moe.config import MoEConfig

from .cache import draw_state, output_ok

PASSED = "passed"
WRONG_CHECKPOINT = "wrong checkpoint"  # right on what it holds, wrong on what it was given
WRONG_LAYER = "wrong layer"            # wrong on what it holds too: accuracy's (or routing's)


@dataclass(frozen=True)
class CheckpointResult:
    status: str  # PASSED, WRONG_CHECKPOINT or WRONG_LAYER
    detail: str
    renamed: tuple[str, ...] = ()  # released names whose held tensor is not the given one

    @property
    def ok(self) -> bool:
        return self.status == PASSED and not self.renamed


def check_layer_checkpoint(impl, config: MoEConfig, device, *, seed: int = 11,
                           num_tokens: int = 24) -> CheckpointResult:
    """``impl.layer`` built from a checkpoint drawn with ``seed``, run on fresh tokens, judged
    against the reference of the given tensors (the worst-case bound of :func:`output_ok`)."""
    device = torch.device(device)
    given = draw_state(config, seed, device)
    layer = impl.layer(config, {k: v.clone() for k, v in given.items()}, device=device)
    held = layer.state_dict()
    renamed = tuple(f"state_dict()[{name!r}] is not the checkpoint's {name}" for name in given
                    if name in held and not torch.equal(
                        held[name].detach().to(given[name].dtype), given[name]))
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, config.hidden_size, generator=gen).to(dtype=config.dtype,
                                                                      device=device)
    with torch.no_grad():
        y = layer(x)
    ok, how = output_ok(config, given, x, y)
    if ok:
        return CheckpointResult(PASSED, how, renamed)
    if all(name in held for name in given) and not output_ok(config, held, x, y)[0]:
        return CheckpointResult(WRONG_LAYER, f"wrong on the weights it holds too ({how})", renamed)
    return CheckpointResult(WRONG_CHECKPOINT, f"{how} against the given tensors", renamed)
