"""magi-moe: the MAGI-2 head-routed MoE, its float64 oracle, its Triton kernels, and the one
accuracy judge (:mod:`magi_moe.judge`) they are held to.

The suite that audits them (``audit/``, ``fuzz/``, ``tests/`` in a checkout) installs inside this
package as ``magi_moe.audit``, ``magi_moe.fuzz`` and ``magi_moe.tests`` (pyproject.toml's
package-dir: the names ``audit`` and ``fuzz`` belong to other projects on the package index).
The product never imports the suite: the suite's ``magi-moe`` commands reach :mod:`magi_moe.cli`
through the entry-point group ``magi_moe.commands``.
"""
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
