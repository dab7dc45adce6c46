"""The layer's configuration: one typed, validated object and the released presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

ScoreFunc = Literal["sigmoid", "softmax"]
SCORE_FUNCS = ("sigmoid", "softmax")
PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Head width and intermediate width must be multiples of this: the Triton kernels tile them.
WIDTH_MULTIPLE = 16
# route_scale reaches the kernels as an fp32 scalar: it must be a normal fp32 number, or it
# becomes inf (every output NaN) or rounds to 0 / loses precision as a subnormal.
FP32_NORMAL = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)
# Every tensor's byte size must fit a signed 64-bit offset (the kernels' addressing and torch's).
MAX_TENSOR_BYTES = 2**63 - 1


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing options of one MAGI-2 head-routed MoE layer (CONTRACT section 1).

    ``num_experts`` counts experts *per head*; the layer owns ``num_heads * num_experts`` banks.
    """

    num_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    intermediate_size: int
    score_func: ScoreFunc = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        for name in ("head_dim", "intermediate_size"):
            value = getattr(self, name)
            if value % WIDTH_MULTIPLE:
                raise ValueError(
                    f"MoEConfig.{name} must be a multiple of {WIDTH_MULTIPLE}, got {value}"
                )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k must lie in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"MoEConfig.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}"
            )
        if not isinstance(self.route_norm, bool):
            raise ValueError(f"MoEConfig.route_norm must be a bool, got {self.route_norm!r}")
        scale = self.route_scale
        lo, hi = FP32_NORMAL
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            lo <= float(scale) <= hi
        ):
            raise ValueError(f"MoEConfig.route_scale must be a finite float > 0 in fp32's normal "
                             f"range [{lo:.3g}, {hi:.3g}] (the kernels apply it in fp32), "
                             f"got {scale!r}")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in PARAM_DTYPES:
            raise ValueError(f"MoEConfig.dtype must be one of {PARAM_DTYPES}, got {self.dtype!r}")
        # gate and up together (the packed bank) bound every tensor the layer owns
        bank_bytes = (self.num_heads * self.num_experts * self.head_dim * 2
                      * self.intermediate_size * self.dtype.itemsize)
        if bank_bytes > MAX_TENSOR_BYTES:
            raise ValueError(
                f"MoEConfig sizes overflow 64-bit offsets: num_heads*num_experts*head_dim*"
                f"2*intermediate_size*itemsize = {bank_bytes} bytes (the packed gate/up bank) "
                f"must stay below 2^63")

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def num_banks(self) -> int:
        """Experts over all heads: the leading dimension of every weight tensor."""
        return self.num_heads * self.num_experts

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (
            f"H={self.num_heads} Dh={self.head_dim} E={self.num_experts} K={self.top_k} "
            f"I={self.intermediate_size} {self.score_func} norm={self.route_norm} "
            f"scale={self.route_scale} {str(self.dtype).removeprefix('torch.')}"
        )


_MAGI2 = dict(
    head_dim=256,
    num_experts=256,
    top_k=6,
    intermediate_size=1280,
    score_func="sigmoid",
    route_norm=True,
    route_scale=4.9,
    dtype=torch.bfloat16,
)

PRESETS: dict[str, MoEConfig] = {
    # Released MAGI-2 Preview layer: hidden 3072.
    "magi2-full": MoEConfig(num_heads=12, **_MAGI2),
    # One rank of the released EP8 deployment keeps 3 heads ("EP4-local" in docs/ANCHORS.md).
    "magi2-ep4-local": MoEConfig(num_heads=3, **_MAGI2),
    # Small shapes for fast tests; "tiny" runs under the Triton interpreter in well under a second.
    "tiny": MoEConfig(num_heads=2, head_dim=32, num_experts=8, top_k=2, intermediate_size=64,
                      route_scale=2.5),
    "small": MoEConfig(num_heads=3, head_dim=64, num_experts=16, top_k=4, intermediate_size=128,
                       route_scale=4.9),
    "small-softmax": MoEConfig(num_heads=2, head_dim=48, num_experts=12, top_k=3,
                               intermediate_size=80, score_func="softmax", route_norm=False),
}


def preset(name: str) -> MoEConfig:
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a str, one of {sorted(PRESETS)}, got "
                        f"{type(name).__name__} {name!r}")
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}") from None
