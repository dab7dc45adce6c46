"""Checks of a checkpoint dict against a layer, all made before anything is loaded, so a load
that raises leaves the layer exactly as it was (``MagiMoE.load_state_dict`` and
``MagiMoE.from_state_dict`` both call :func:`check_state_dict`)."""
from __future__ import annotations

from typing import Mapping

import torch

from .validation import check_finite, check_tensor

# Router rows (CONTRACT section 3): one NaN or inf here makes every output NaN (softmax mixes the
# whole head) or silently mis-routes, so they are read once, at load time.
ROUTER_KEYS = ("gate", "router.expert_bias", "router.expert_bias_ema")


def check_state_dict(expected: Mapping[str, torch.Tensor], state_dict: Mapping[str, object], *,
                     strict: bool = True, assign: bool = False) -> None:
    """Raise naming the key unless ``state_dict`` can be loaded into tensors like ``expected``
    (the layer's own ``state_dict()``; its device and dtype are the targets).

    * keys: with ``strict``, exactly the expected names (missing and unexpected listed);
    * every given value: a floating-point tensor of the expected shape, holding values (not on
      the meta device) unless ``assign``;
    * ``assign=True`` adopts the given tensors as they are: each must have the expected dtype,
      and the layer's tensors must end up on one device;
    * router rows (gate and selection biases): finite (one host sync per tensor).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if strict and (missing or unexpected):
        raise ValueError(f"state_dict keys do not match the released layout: "
                         f"missing {missing}, unexpected {unexpected}")
    given = [name for name in expected if name in state_dict]
    for name in given:
        value = check_tensor(f"state_dict[{name!r}]", state_dict[name], shape=tuple(expected[name].shape))
        if not value.is_floating_point():
            raise ValueError(f"state_dict[{name!r}] must be a floating-point tensor, got "
                             f"{_name(value.dtype)}")
        if not assign and value.device.type == "meta":
            raise ValueError(f"state_dict[{name!r}] is on the meta device (it holds no values to "
                             f"copy); load real tensors, or use assign=True")
        if assign and value.dtype != expected[name].dtype:
            raise ValueError(f"state_dict[{name!r}] must have dtype {_name(expected[name].dtype)} "
                             f"with assign=True (the layer adopts the tensor as it is), got "
                             f"{_name(value.dtype)}")
    if assign:
        ends_on = {name: (state_dict[name] if name in state_dict else expected[name]).device
                   for name in expected}
        if len(set(ends_on.values())) > 1:
            listing = ", ".join(f"{n} on {d}" for n, d in ends_on.items())
            raise ValueError(f"state_dict: with assign=True every tensor of the layer must end up "
                             f"on one device, got {listing}")
    for name in ROUTER_KEYS:
        if name in state_dict and state_dict[name].device.type != "meta":
            check_finite(f"state_dict[{name!r}]", state_dict[name])


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
