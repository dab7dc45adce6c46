"""A layer owns its inputs: every implementation's own layer (``impl.layer``) refuses a forward
it cannot compute, leaving its weights as they were, and refuses a checkpoint it cannot load
instead of loading part of it silently.

The messages are the layer's own, and a refused ``load_state_dict`` may have copied the keys
before the bad one (``torch.nn.Module.load_state_dict`` does): only magi-moe's ``MagiMoE`` is held
to its exact messages and to all-or-nothing loads, in ``tests/test_bad_input.py``. What is judged
here is that the layer raises (``ValueError``, ``TypeError`` or ``RuntimeError``) instead of
computing or loading something.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from magi_moe.audit.cache import draw_state
from magi_moe.config import preset

REFUSALS = (ValueError, TypeError, RuntimeError)


def _wrong_width(layer, config, device):
    x = torch.randn(6, config.hidden_size + 16, device=device).to(config.dtype)
    return layer(x)


def _missing_key(layer, config, device):
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    for name in ("W_gate", "W_up", "W_down"):  # new values, so a half-applied load shows
        if name in state:
            state[name] = torch.randn_like(state[name], dtype=torch.float32).to(state[name].dtype)
    state.pop("W_down", None) if "W_down" in state else state.popitem()
    return layer.load_state_dict(state)


def _wrong_shape(layer, config, device):
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    for name in ("W_gate", "W_up"):
        if name in state:
            state[name] = torch.randn_like(state[name], dtype=torch.float32).to(state[name].dtype)
    if "W_down" not in state:
        pytest.skip("the layer has no parameter named W_down")
    state["W_down"] = state["W_down"][..., :-1].clone()  # one column short
    return layer.load_state_dict(state)


@dataclass(frozen=True)
class LayerInputRow:
    id: str
    call: Callable
    keeps_weights: bool  # judged on the weights after the refusal


ROWS = [LayerInputRow("forward-wrong-width", _wrong_width, True),
        LayerInputRow("load-missing-key", _missing_key, False),
        LayerInputRow("load-wrong-shape", _wrong_shape, False)]


def _weights(layer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in ROWS])
@pytest.mark.clause("layer-inputs")
def test_layer_refuses_bad_input_and_keeps_its_weights(impl_backend, row):
    impl = impl_backend.impl
    config = impl.fit(preset("tiny"))
    device = impl_backend.device
    layer = impl.layer(config, draw_state(config, 3, device), device)
    before = _weights(layer)
    with pytest.raises(REFUSALS):
        row.call(layer, config, device)
    if not row.keeps_weights:
        return
    after = _weights(layer)
    changed = [k for k in before if k not in after or not torch.equal(before[k], after[k])]
    assert not changed, f"{row.id} raised but changed {changed} first"
