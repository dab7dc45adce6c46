"""The implementations under test, by name: magi-moe's own (:data:`magi_moe.impls.BUILTINS`,
plain data) and outside ones found by :mod:`magi_moe.plugins`. What an implementation is and
declares lives in :mod:`magi_moe.implementation`; nothing else in magi-moe asks for one by
name except the user's ``--impl`` and the dispatch policy's choice among the built-ins.
"""
from __future__ import annotations

from . import plugins
from .implementation import (CAPABILITIES, PRECISION_MODELS, Implementation, RowLauncher,  # noqa: F401
                             ShapeRule)
from .impls import BUILTINS

__all__ = ["CAPABILITIES", "PRECISION_MODELS", "Implementation", "RowLauncher", "ShapeRule",
           "get_implementation", "implementations", "load_implementation", "register"]

_REGISTRY: dict[str, Implementation] = {impl.name: impl for impl in BUILTINS}


def register(impl: Implementation, *, replace: bool = False) -> Implementation:
    """Add ``impl`` under its name; a name taken by a different implementation is refused
    (results would be reported under a name that means two things) unless ``replace``."""
    if not isinstance(impl, Implementation):
        raise TypeError(f"impl must be an Implementation, got {type(impl).__name__}")
    taken = _REGISTRY.get(impl.name)
    if taken is not None and taken is not impl and not replace:
        raise ValueError(f"an implementation named {impl.name!r} is already registered; give "
                         f"yours its own name so that its results are reported under it")
    _REGISTRY[impl.name] = impl
    return impl


def get_implementation(name: str | Implementation) -> Implementation:
    """A registered implementation by name, or an outside one (:mod:`magi_moe.plugins`):
    ``package.module:attribute``, or the name of an installed entry point of the group
    ``magi_moe.implementations``. An Implementation is returned as it is."""
    if isinstance(name, Implementation):
        return name
    if not isinstance(name, str):
        raise TypeError(f"implementation must be a name (str) or an Implementation, "
                        f"got {type(name).__name__}")
    if name in _REGISTRY:
        return _REGISTRY[name]
    found = plugins.resolve(name)
    if found is not None:
        return register(found)
    installed = plugins.entry_point_names()
    raise ValueError(f"implementation must be one of {sorted(_REGISTRY)}, an entry point of group "
                     f"{plugins.ENTRY_POINT_GROUP!r} (installed: {installed or 'none'}) or "
                     f"'package.module:attr', got {name!r}")


def load_implementation(spec: str) -> Implementation:
    """Import ``package.module:attribute``: an Implementation, or a zero-argument factory of one,
    loaded once per process and registered under its own name."""
    return register(plugins.load_spec(spec))


def implementations() -> list[Implementation]:
    return list(_REGISTRY.values())
