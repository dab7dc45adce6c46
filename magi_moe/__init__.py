"""magi-moe: the MAGI-2 head-routed MoE, its float64 oracle and Triton kernels, under audit.

The suite's own packages import as ``magi_moe.audit``, ``magi_moe.fuzz`` and ``magi_moe.tests``:
an installed wheel carries them inside this package (the names ``audit`` and ``fuzz`` belong to
other projects on the package index), and a source checkout keeps them at its top level
(``audit/``, ``fuzz/``, ``tests/``), which the lines below add to this package's search path.
"""
from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "audit" / "__init__.py").is_file() and not (_Path(__file__).parent / "audit").exists():
    __path__.append(str(_checkout))  # noqa: F821 -- a package's __path__
    from . import suite_names as _suite_names

    _suite_names.install()  # the top-level names audit, fuzz, tests: aliases, one module each
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
