"""The expert weights as the kernels take them (CONTRACT section 3 layout)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .config import MoEConfig
from .validation import check_same_device, check_tensor


class ExpertWeights(NamedTuple):
    """``w_gate``/``w_up`` ``[H*E, Dh, I]`` and ``w_down`` ``[H*E, I, Dh]``, one dtype and device."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    def to(self, *args, **kwargs) -> "ExpertWeights":
        return ExpertWeights(*(w.to(*args, **kwargs) for w in self))

    def check(self, config: MoEConfig) -> "ExpertWeights":
        HE, Dh, I = config.num_banks, config.head_dim, config.intermediate_size
        check_tensor("w_gate", self.w_gate, shape=(HE, Dh, I))
        check_tensor("w_up", self.w_up, shape=(HE, Dh, I), dtype=self.w_gate.dtype)
        check_tensor("w_down", self.w_down, shape=(HE, I, Dh), dtype=self.w_gate.dtype)
        check_same_device(w_gate=self.w_gate, w_up=self.w_up, w_down=self.w_down)
        return self


def random_weights(config: MoEConfig, *, device="cpu", dtype=None, std: float = 0.02,
                   generator: torch.Generator | None = None) -> ExpertWeights:
    """Fresh N(0, std^2) expert weights rounded to ``dtype`` (the config's by default)."""
    dtype = dtype or config.dtype
    HE, Dh, I = config.num_banks, config.head_dim, config.intermediate_size

    def draw(*shape):
        w = torch.randn(*shape, generator=generator, dtype=torch.float32) * std
        return w.to(device=device, dtype=dtype)

    return ExpertWeights(draw(HE, Dh, I), draw(HE, Dh, I), draw(HE, I, Dh))
