"""The MAGI-2 head-routed MoE layer as an ``nn.Module`` with the released checkpoint names."""
from __future__ import annotations

from typing import Literal, Mapping

import torch
from torch import nn

from .backends import backends_on
from .checkpoint import check_state_dict
from .config import PARAM_DTYPES, MoEConfig
from .dispatch import choose_implementation
from .implementation import Implementation, set_default_layer
from .packed_weights import PackedWeightCache
from .registry import get_implementation
from .routing import build_route_table
from .validation import check_bool, check_device, check_tensor
from .weights import ExpertWeights

BiasSource = Literal["expert_bias_ema", "expert_bias", "none"]
BIAS_SOURCES = ("expert_bias_ema", "expert_bias", "none")


def refill_in_place(module: nn.Module, state_dict, prefix: str, local_metadata: dict) -> None:
    """Turn ``load_state_dict(..., assign=True)`` into an in-place copy for ``module``'s own
    tensors when each incoming tensor matches the existing one's shape, dtype and device (and
    the existing one is real, not meta): the storage a captured CUDA graph reads stays valid."""
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    own = {**module._parameters, **module._buffers}
    for name, current in own.items():
        incoming = state_dict.get(prefix + name)
        if current is None or incoming is None:
            continue
        if (current.is_meta or not isinstance(incoming, torch.Tensor)
                or incoming.shape != current.shape or incoming.dtype != current.dtype
                or incoming.device != current.device):
            return
    local_metadata["assign_to_params_buffers"] = False


class Router(nn.Module):
    """Holds the auxiliary-free selection biases (``router.expert_bias[_ema]`` in checkpoints)."""

    def __init__(self, num_banks: int, device=None):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(num_banks, dtype=torch.float32, device=device))
        self.register_buffer("expert_bias_ema", torch.zeros(num_banks, dtype=torch.float32, device=device))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        refill_in_place(self, state_dict, prefix, local_metadata)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class MagiMoE(nn.Module):
    """``y = MoE(x)`` for ``x`` ``[S, H*Dh]``.

    Parameters (CONTRACT section 3): ``gate [H*E, Dh]`` fp32, ``W_gate``/``W_up`` ``[H*E, Dh, I]``,
    ``W_down [H*E, I, Dh]`` in ``config.dtype``; buffers ``router.expert_bias`` and
    ``router.expert_bias_ema`` ``[H*E]`` fp32. ``bias_source`` picks the selection bias:
    ``expert_bias_ema`` (vLLM-Omni's default), ``expert_bias`` (SandAI's original) or ``none``.
    ``impl`` forces an implementation (a name or an Implementation); by default
    :mod:`magi_moe.dispatch` chooses. An implementation with a ``layer_forward`` (``fused``)
    runs the whole layer through it on the layer's tensors (``x``, ``gate``, the selection
    bias, the expert weights, the config); any other gets its routing and its ``forward``.
    Whatever it returns must be ``[S, H*Dh]``: another shape is refused, naming it.

    ``weight_cache``: the :class:`~magi_moe.packed_weights.PackedWeightCache` that packs
    ``W_gate``/``W_up`` into one bank for the fused path (its docstring says what it promises),
    or None when the forced implementation keeps no cache. A forced implementation declaring
    ``weight_cache`` packs at construction, so aliases taken afterwards stay aliases.

    Under CUDA graphs (:attr:`graph_promises`, CONTRACT section 8b): a captured forward replays
    the addresses it captured. Changes that write the existing storage (in-place ops,
    ``copy_``, ``param.data.copy_``, ``load_state_dict``, writes under ``inference_mode``) are
    seen by the replay. ``load_state_dict(..., assign=True)`` refills the existing storage in
    place when shape, dtype and device match, so it is seen too. A storage swap the layer cannot
    intercept (``param.data = new``, ``set_``, a module-wide ``.to(...)``) needs a recapture;
    the layer keeps the captured storage alive, so a stale replay never reads freed memory.
    """

    # Routes (audit.cache names) whose change a captured graph does not see: recapture after them.
    graph_promises = {"param_data_assign": "recapture", "to_dtype": "recapture",
                      "to_device": "recapture"}

    def __init__(self, config: MoEConfig, *, bias_source: BiasSource = "expert_bias_ema",
                 deterministic: bool = False, impl: str | Implementation | None = None,
                 device=None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a magi_moe.config.MoEConfig (MoEConfig(...) or "
                            f"preset(name)), got {type(config).__name__}")
        if bias_source not in BIAS_SOURCES:
            raise ValueError(f"bias_source must be one of {BIAS_SOURCES}, got {bias_source!r}")
        check_bool("deterministic", deterministic)
        device = check_device("device", device)
        self.config = config
        self.bias_source = bias_source
        self.deterministic = deterministic
        self.impl = get_implementation(impl) if isinstance(impl, str) else impl
        _check_forced_impl(self.impl, deterministic)
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
        self._graph_pins: list[torch.Tensor] = []
        if self.impl is not None and "weight_cache" in self.impl.capabilities:
            self.weight_cache.ensure(self.W_gate, self.W_up)

    # Module-wide casts (``.to(torch.bfloat16)``, ``.half()``, ``.float()``) are how serving
    # stacks load a model; the router must come through them in fp32 and unrounded (CONTRACT
    # section 3), or selection scores lose precision and the fused router rejects the gate (the
    # GPU fuzz campaign's weight-swap machine found that). Device moves apply as usual.
    # The expert weights take the cast, and the config follows them: after ``layer.half()`` the
    # layer runs in fp16 (``config.dtype`` is float16), after ``layer.float()`` in fp32 (the
    # dispatcher then picks native or the reference). A cast to a dtype the layer cannot run in
    # (not a MoEConfig dtype) raises before any tensor changes. A forced implementation without
    # the new dtype refuses the forward with its input check, not the cast: weight round trips
    # through fp32 (load in fp32, cast back) stay possible.
    _FP32_TENSORS = ("gate", "router.expert_bias", "router.expert_bias_ema")

    def _apply(self, fn, recurse=True):
        config = self._config_after(fn)
        # detached aliases: the fp32 storage survives even where conversion swaps tensors
        before = {name: self._fp32_tensor(name).detach() for name in self._FP32_TENSORS}
        super()._apply(fn, recurse)
        self.config = config
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

    def _config_after(self, fn) -> MoEConfig:
        """The config after applying ``fn`` to the weights, found on an empty probe tensor."""
        weights = self.W_down
        dtype = fn(torch.empty(0, dtype=weights.dtype, device=weights.device)).dtype
        if dtype == self.config.dtype:
            return self.config
        if dtype not in PARAM_DTYPES:
            raise ValueError(f"cannot cast the layer to {dtype}: its weights must have one of "
                             f"the dtypes {PARAM_DTYPES} (MoEConfig.dtype)")
        return self.config.replace(dtype=dtype)

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
        check_state_dict(layer.state_dict(), state_dict)
        device = state_dict["W_gate"].device
        layer = layer.to_empty(device=device)
        layer.load_state_dict(state_dict)
        return layer

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """``nn.Module.load_state_dict``, all or nothing: every key, shape and dtype (exact with
        ``assign=True``) and the router rows' finiteness are checked before any tensor changes
        (:func:`magi_moe.checkpoint.check_state_dict`). A parent module's load goes through
        torch's own per-module loader instead and gets none of this."""
        check_state_dict(self.state_dict(), state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

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
        _refuse_meta(x, self.W_gate)
        check_tensor("x", x, shape=(None, cfg.hidden_size), dtype=cfg.dtype, device=self.W_gate.device)
        if x.numel() and x.stride(-1) != 1:
            x = x.contiguous()  # the kernels read rows through a row stride, columns densely
        impl = self.implementation(x)
        if self.impl is not None:
            _check_runs_here(impl, x)
        if x.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
            self._pin_for_graph()
        if impl.layer_forward is not None and self.weight_cache is not None:
            return _checked_output(impl, "layer_forward", self._whole_layer(impl, x), x)
        routes = impl.route(x, self.gate, self.selection_bias, cfg)
        table = build_route_table(routes, cfg)
        weights = self.expert_weights()
        if "strided_weights" not in impl.capabilities and not all(w.is_contiguous() for w in weights):
            # gate/up are views into the fused path's bank; a kernel that needs dense weights
            # gets a copy per call on this (rare: forced impl, torch.compile) path.
            weights = ExpertWeights(*(w.contiguous() for w in weights))
        with torch.no_grad():
            y = impl(x, table, weights, cfg)
        return _checked_output(impl, "forward", y, x).to(x.dtype)

    def _whole_layer(self, impl: Implementation, x: torch.Tensor) -> torch.Tensor:
        """``impl.layer_forward`` on this layer's tensors, its packed bank made current first.
        Not while ``torch.compile`` traces: repointing parameters is no graph op, and the traced
        path reads the parameters as they are (the bank is only their layout)."""
        if not torch.compiler.is_compiling():
            with torch.no_grad():
                self.weight_cache.ensure(self.W_gate, self.W_up)
        return impl.layer_forward(x, self.gate, self.selection_bias, self.expert_weights(),
                                  self.config)

    def _pin_for_graph(self) -> None:
        """Keep the storage a graph being captured reads alive: after a swap the layer cannot
        intercept, a replay then reads the old values (recapture, see the class docstring),
        never memory the allocator handed to someone else."""
        self._graph_pins = [t.detach() for t in (*self.parameters(), *self.buffers())]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # assign=True would swap storage under a captured graph: refill in place instead
        # whenever every tensor fits the existing one (shape, dtype, device; not meta).
        refill_in_place(self, state_dict, prefix, local_metadata)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"{self.config.describe()}, bias_source={self.bias_source}, deterministic={self.deterministic}"


def _check_forced_impl(impl: object, deterministic: bool) -> None:
    """A forced implementation must be one, and must keep the layer's promises: the
    deterministic one (as expert parallelism refuses it too)."""
    if impl is None:
        return
    if not isinstance(impl, Implementation):
        raise TypeError(f"impl must be None, an implementation name or a "
                        f"magi_moe.registry.Implementation, got {type(impl).__name__} {impl!r}")
    if deterministic and not impl.deterministic:
        raise ValueError(f"impl: deterministic=True but {impl.name!r} does not declare "
                         f"'deterministic'")


def _refuse_meta(x: object, weight: torch.Tensor) -> None:
    """Meta tensors carry no data: a forward on them would fail deep inside routing."""
    if isinstance(x, torch.Tensor) and x.is_meta:
        raise ValueError("x is a meta tensor (shape only, no data): the layer computes on real "
                         "tensors; pass x on a real device such as 'cpu' or 'cuda'")
    if weight.is_meta:
        raise ValueError("the layer's weights are meta tensors (no data): load them first "
                         "(MagiMoE.from_state_dict, or to_empty(device=...) then load_state_dict)")


def _checked_output(impl: Implementation, what: str, y: object, x: torch.Tensor) -> torch.Tensor:
    """The layer returns ``[S, H*Dh]`` whatever the implementation returned: a wrong shape is
    refused here, naming who returned it, instead of reaching the caller's next layer."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"impl {impl.name!r}: its {what} must return a torch.Tensor of shape "
                        f"{tuple(x.shape)}, got {type(y).__name__}")
    if y.shape != x.shape:
        raise ValueError(f"impl {impl.name!r}: its {what} returned shape {tuple(y.shape)}, expected "
                         f"{tuple(x.shape)} ([S, H*Dh], the shape of x)")
    return y


def _check_runs_here(impl: Implementation, x: torch.Tensor) -> None:
    """A forced implementation must run on ``x``'s device: refused here, before the weight cache
    or a kernel is touched, naming the implementation (a plain CPU process has no Triton
    driver). Dispatch never picks one that cannot."""
    device = x.device
    if impl.skip_reason(device):
        enabling = [b.env_prefix().strip() for b in backends_on(device.type)
                    if b.process_env and b.name in impl.backends]
        hint = (f" (its Triton kernels run on a {device.type.upper()} only under {enabling[0]}, set "
                "before importing magi_moe; impl='reference' runs anywhere)" if enabling else "")
        raise ValueError(f"impl: {impl.name!r} runs on the backends {impl.backends}, not on "
                         f"device {device}{hint}")


def _magi_moe_layer(impl: Implementation, config: MoEConfig, state_dict, device) -> MagiMoE:
    """The default ``Implementation.layer``: magi-moe's module around the implementation."""
    return MagiMoE.from_state_dict(state_dict, config, impl=impl)


set_default_layer(_magi_moe_layer)
