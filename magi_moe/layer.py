"""The MAGI-2 head-routed MoE layer as an ``nn.Module`` with the released checkpoint names."""
from __future__ import annotations

from typing import Literal, Mapping

import torch
from torch import nn

from .config import MoEConfig
from .dispatch import choose_implementation
from .packed_weights import PackedWeightCache
from .registry import Implementation, get_implementation
from .routing import build_route_table, route
from .validation import check_finite, check_tensor
from .weights import ExpertWeights

BiasSource = Literal["expert_bias_ema", "expert_bias", "none"]
BIAS_SOURCES = ("expert_bias_ema", "expert_bias", "none")


class Router(nn.Module):
    """Holds the auxiliary-free selection biases (``router.expert_bias[_ema]`` in checkpoints)."""

    def __init__(self, num_banks: int, device=None):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(num_banks, dtype=torch.float32, device=device))
        self.register_buffer("expert_bias_ema", torch.zeros(num_banks, dtype=torch.float32, device=device))


class MagiMoE(nn.Module):
    """``y = MoE(x)`` for ``x`` ``[S, H*Dh]``.

    Parameters (CONTRACT section 3): ``gate [H*E, Dh]`` fp32, ``W_gate``/``W_up`` ``[H*E, Dh, I]``,
    ``W_down [H*E, I, Dh]`` in ``config.dtype``; buffers ``router.expert_bias`` and
    ``router.expert_bias_ema`` ``[H*E]`` fp32. ``bias_source`` picks the selection bias:
    ``expert_bias_ema`` (vLLM-Omni's default), ``expert_bias`` (SandAI's original) or ``none``.
    ``impl`` forces an implementation by name; by default :mod:`magi_moe.dispatch` chooses.

    ``weight_cache``: the :class:`~magi_moe.packed_weights.PackedWeightCache` that packs
    ``W_gate``/``W_up`` into one bank for the fused path (its docstring says what it promises),
    or None when the forced implementation keeps no cache. With ``impl="fused"`` the weights are
    packed at construction, so aliases taken afterwards stay aliases of the parameters.
    """

    def __init__(self, config: MoEConfig, *, bias_source: BiasSource = "expert_bias_ema",
                 deterministic: bool = False, impl: str | Implementation | None = None,
                 device=None):
        super().__init__()
        if bias_source not in BIAS_SOURCES:
            raise ValueError(f"bias_source must be one of {BIAS_SOURCES}, got {bias_source!r}")
        self.config = config
        self.bias_source = bias_source
        self.deterministic = deterministic
        self.impl = get_implementation(impl) if isinstance(impl, str) else impl
        HE, Dh, I = config.num_banks, config.head_dim, config.intermediate_size
        empty = lambda *shape, dtype: nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))  # noqa: E731
        self.gate = empty(HE, Dh, dtype=torch.float32)
        self.W_gate = empty(HE, Dh, I, dtype=config.dtype)
        self.W_up = empty(HE, Dh, I, dtype=config.dtype)
        self.W_down = empty(HE, I, Dh, dtype=config.dtype)
        self.router = Router(HE, device=device)
        self.reset_parameters()
        keeps_cache = self.impl is None or "weight_cache" in self.impl.capabilities
        self.weight_cache = PackedWeightCache() if keeps_cache else None
        if self.impl is not None and self.impl.name == "fused":
            self.weight_cache.ensure(self.W_gate, self.W_up)

    # Module-wide casts (``.to(torch.bfloat16)``, ``.half()``, ``.float()``) are how serving
    # stacks load a model; the router must come through them in fp32 and unrounded (CONTRACT
    # section 3), or selection scores lose precision and the fused router rejects the gate (the
    # GPU fuzz campaign's weight-swap machine found that). Device moves apply as usual.
    _FP32_TENSORS = ("gate", "router.expert_bias", "router.expert_bias_ema")

    def _apply(self, fn, recurse=True):
        # detached aliases: the fp32 storage survives even where conversion swaps tensors
        before = {name: self._fp32_tensor(name).detach() for name in self._FP32_TENSORS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._fp32_tensor(name)
            if new.dtype != torch.float32:  # restore the exact fp32 values on the new device
                restored = old.to(device=new.device)
                if isinstance(new, nn.Parameter):
                    new.data = restored
                else:
                    owner, _, attr = name.rpartition(".")
                    self.get_submodule(owner)._buffers[attr] = restored
        return self

    def _fp32_tensor(self, name: str) -> torch.Tensor:
        owner, _, attr = name.rpartition(".")
        return getattr(self.get_submodule(owner) if owner else self, attr)

    def invalidate_weight_cache(self) -> None:
        """Make the next fused forward repack ``W_gate``/``W_up`` (see PackedWeightCache)."""
        if self.weight_cache is not None:
            self.weight_cache.invalidate()

    @torch.no_grad()
    def reset_parameters(self, weight_std: float = 0.02, gate_std: float = 0.25) -> None:
        self.gate.normal_(0.0, gate_std)
        for w in (self.W_gate, self.W_up, self.W_down):
            w.copy_(torch.randn(w.shape, device=w.device) * weight_std)
        self.router.expert_bias.zero_()
        self.router.expert_bias_ema.zero_()

    # -- checkpoints -------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config: MoEConfig,
                        **kwargs) -> "MagiMoE":
        """Build a layer from a released-layout checkpoint dict (names and shapes of CONTRACT 3).

        Missing or unexpected keys, wrong shapes and non-finite router weights raise ValueError."""
        layer = cls(config, device="meta", **kwargs)
        expected = set(layer.state_dict())
        missing, unexpected = expected - set(state_dict), set(state_dict) - expected
        if missing or unexpected:
            raise ValueError(f"state_dict keys do not match the released layout: "
                             f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        for name, ref in layer.state_dict().items():
            check_tensor(f"state_dict[{name!r}]", state_dict[name], shape=tuple(ref.shape))
        for name in ("gate", "router.expert_bias", "router.expert_bias_ema"):
            check_finite(f"state_dict[{name!r}]", state_dict[name])
        device = state_dict["W_gate"].device
        layer = layer.to_empty(device=device)
        layer.load_state_dict(state_dict)
        return layer

    # -- forward -------------------------------------------------------------------------------
    @property
    def selection_bias(self) -> torch.Tensor | None:
        if self.bias_source == "none":
            return None
        return getattr(self.router, self.bias_source)

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.W_gate, self.W_up, self.W_down)

    def implementation(self, x: torch.Tensor) -> Implementation:
        return self.impl or choose_implementation(x.device, x.dtype, deterministic=self.deterministic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        check_tensor("x", x, shape=(None, cfg.hidden_size), dtype=cfg.dtype, device=self.W_gate.device)
        impl = self.implementation(x)
        if impl.name == "fused" and self.weight_cache is not None:
            return self._fused_forward(x)
        routes = route(x, self.gate, self.selection_bias, cfg)
        table = build_route_table(routes, cfg)
        weights = self.expert_weights()
        if impl.name.startswith("native") and not all(w.is_contiguous() for w in weights):
            # gate/up are views into the fused path's bank; the native kernel needs dense
            # weights, so this (rare: forced impl, torch.compile) path pays a copy per call.
            weights = ExpertWeights(*(w.contiguous() for w in weights))
        with torch.no_grad():
            y = impl(x, table, weights, cfg)
        return y.to(x.dtype)

    @torch.no_grad()
    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fused routing + fused experts on the packed bank: no host sync, no workspace
        allocation once warm (the output is the one allocation per call)."""
        from .kernels.fused_routing import fused_layer_forward  # Triton imported only when used

        self.weight_cache.ensure(self.W_gate, self.W_up)
        return fused_layer_forward(x, self.gate, self.selection_bias, self.expert_weights(),
                                   self.config)

    def extra_repr(self) -> str:
        return f"{self.config.describe()}, bias_source={self.bias_source}, deterministic={self.deterministic}"
