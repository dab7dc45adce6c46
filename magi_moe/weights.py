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
                   generator: torch.Generator | None = None,
                   banks: torch.Tensor | None = None) -> ExpertWeights:
    """Fresh N(0, std^2) expert weights rounded to ``dtype`` (the config's by default).

    ``banks``: draw only these banks (int64 indices into ``H*E``); every other bank holds the
    negated weights of a drawn one, so a kernel that reads a wrong bank still reads other
    values. At production widths a few tokens route to a few dozen of the 768 banks, whose full
    draw takes 15 s on one CPU core; this takes a second."""
    dtype = dtype or config.dtype
    HE, Dh, I = config.num_banks, config.head_dim, config.intermediate_size

    def draw(*shape):
        rows = shape[0] if banks is None else banks.numel()
        w = torch.randn(rows, *shape[1:], generator=generator, dtype=torch.float32) * std
        w = w.to(dtype)
        if banks is not None:
            drawn = w
            w = -drawn[torch.arange(shape[0]) % rows]
            w[banks] = drawn
        return w.to(device=device)

    return ExpertWeights(draw(HE, Dh, I), draw(HE, Dh, I), draw(HE, I, Dh))
