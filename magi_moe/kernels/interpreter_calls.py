"""Device-function calls under Triton's CPU interpreter, patched once per launch, not per call.

Triton's interpreter maps ``triton.language`` onto its NumPy builder when a launch starts and
undoes it when the launch ends. It also re-runs that mapping at every call of a ``@triton.jit``
helper inside the kernel (``InterpretedFunction.__call__``), walking every member of
``triton.language`` again: 2-3 ms a call, 20-35% of an interpreted kernel call, for changes
that are already in place. :func:`install` makes a nested call skip the mapping when
the launch already mapped every language module the helper sees (``triton.language``,
``triton.language.core``), and map as before otherwise. What runs is the same code on the same
mapping, so the kernels' bits do not change (``tests/test_interpreter_calls.py`` compares).

Only Triton versions whose interpreter undoes the mapping at the end of a launch
(``_LangPatchScope``: Triton 3.6 and 3.9 both do) get the shortcut; elsewhere :func:`install` leaves
Triton as it is. ``MAGI_MOE_INTERPRETER_SHORTCUT=0`` turns it off.
"""
from __future__ import annotations

import inspect
import os

_STATE: dict = {}  # "original": Triton's _patch_lang once installed


def _applies(interpreter) -> bool:
    """Whether this Triton's interpreter has the shape the shortcut relies on: a module-level
    ``_patch_lang(fn)`` returning a scope that the launch restores."""
    if not (hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope")):
        return False
    try:
        launch = inspect.getsource(interpreter.GridExecutor.__call__)
        nested = inspect.getsource(interpreter.InterpretedFunction.__call__)
    except (AttributeError, OSError, TypeError):
        return False
    return "patch_scope = _patch_lang(" in launch and "patch_scope.restore()" in launch \
        and "_patch_lang(self.fn)" in nested


def install() -> bool:
    """Install the shortcut (idempotent). Returns whether it is in place."""
    if "original" in _STATE:
        return True
    if os.environ.get("MAGI_MOE_INTERPRETER_SHORTCUT", "1") == "0":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not _applies(interpreter):
        return False
    original = interpreter._patch_lang
    mapped: list[set[int]] = []  # the running launch's mapped language modules (one at most)

    def language_modules(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    class _Launch:
        """The launch's own scope: undoing it also ends the launch's record."""

        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:
            mapped.pop()
            self.scope.restore()

    class _AlreadyMapped:
        def restore(self) -> None:
            pass

    def patch_lang_once(fn):
        langs = language_modules(fn)
        if not mapped:  # a launch (GridExecutor), which restores what it maps
            scope = original(fn)
            mapped.append(langs)
            return _Launch(scope)
        if langs <= mapped[-1]:  # a helper inside the launch, seeing nothing new
            return _AlreadyMapped()
        mapped[-1] |= langs  # a helper seeing a module the launch did not: map as Triton does
        return original(fn)

    interpreter._patch_lang = patch_lang_once
    _STATE["original"] = original
    _STATE["module"] = interpreter
    return True


def uninstall() -> None:
    """Put Triton's own mapping back (the bit-for-bit comparison runs both)."""
    if "original" in _STATE:
        _STATE["module"]._patch_lang = _STATE.pop("original")
        _STATE.pop("module")


def installed() -> bool:
    return "original" in _STATE
