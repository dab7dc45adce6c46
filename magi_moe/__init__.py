"""magi-moe: the MAGI-2 head-routed MoE, its float64 oracle and Triton kernels, under audit."""
from .config import PRESETS, MoEConfig, preset
from .layer import MagiMoE
from .reference import expert_reference, layer_reference, swiglu7
from .registry import Implementation, get_implementation, implementations, register
from .routing import RouteTable, Routes, build_route_table, route, select_experts
from .weights import ExpertWeights, random_weights

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "MoEConfig", "preset", "MagiMoE", "expert_reference", "layer_reference", "swiglu7",
    "Implementation", "get_implementation", "implementations", "register", "RouteTable", "Routes",
    "build_route_table", "route", "select_experts", "ExpertWeights", "random_weights",
]
