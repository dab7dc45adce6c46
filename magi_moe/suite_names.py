"""One name per module for the suite's folders.

``audit/``, ``fuzz/`` and ``tests/`` sit at the checkout's top level and install inside the wheel
as ``magi_moe.audit``, ``magi_moe.fuzz`` and ``magi_moe.tests`` (the names ``audit`` and ``fuzz``
belong to other projects on the package index). In a checkout both spellings can be imported:
``python -m audit`` and pytest reach the folders by their top-level names, the package by its
own. Loaded twice, a module would hold two copies of its state (a registry, a cache), and
``isinstance`` would fail across them.

So in a checkout the top-level name is an alias: importing ``audit`` gives the module object
``magi_moe.audit``, and ``audit.report`` gives ``magi_moe.audit.report``, loaded once under
that name (:class:`SuiteAliases`, installed by ``magi_moe/__init__.py``). A folder's
``__main__`` is left to the normal finder, so ``python -m audit`` still runs (as ``__main__``).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

SUITE_PACKAGES = ("audit", "fuzz", "tests")


def alias_top_level(name: str) -> None:
    """Called by a suite folder's ``__init__`` when it is imported by its top-level name: the
    name becomes the ``magi_moe.<name>`` package itself (replacing the module being imported,
    which the import system then returns)."""
    sys.modules[name] = importlib.import_module(f"magi_moe.{name}")


class SuiteAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``audit.x`` -> the module ``magi_moe.audit.x``, once the top-level name is an alias."""

    def __init__(self) -> None:
        self._specs: dict[str, object] = {}

    def find_spec(self, fullname, path=None, target=None):
        top, dot, rest = fullname.partition(".")
        if not dot or top not in SUITE_PACKAGES or rest.rpartition(".")[2] == "__main__":
            return None
        real = sys.modules.get(f"magi_moe.{top}")
        if real is None or sys.modules.get(top) is not real:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        # the module loaded (now or before) under its one name; the import system keeps its
        # __name__ and __file__, and sets __spec__ to the alias's, which exec_module puts back
        module = importlib.import_module(f"magi_moe.{spec.name}")
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """Already executed under its own name: only its own spec is put back."""
        for name, spec in list(self._specs.items()):
            if getattr(spec, "name", None) == module.__name__:
                module.__spec__ = self._specs.pop(name)


def install() -> None:
    if not any(isinstance(f, SuiteAliases) for f in sys.meta_path):
        sys.meta_path.insert(0, SuiteAliases())
