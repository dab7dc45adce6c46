"""Implementations magi-moe did not write, found by name (docs/PLUGGING_IN.md is the guide).

Two ways to name one wherever an implementation is named (``pytest --impl``, ``python -m
audit --impl``, ``python -m fuzz --impl``, ``MagiMoE(impl=...)``):

- ``package.module:attribute``: the attribute is imported from wherever ``sys.path`` reaches;
- an installed entry point of the group ``magi_moe.implementations``, by its name (which must
  equal the implementation's own name, so results are reported under the name asked for)::

      [project.entry-points."magi_moe.implementations"]
      my-kernel = "my_package.magi_adapter:IMPL"

The attribute is an :class:`~magi_moe.registry.Implementation` or a zero-argument callable that
returns one (a factory, so that heavy imports wait until the implementation is asked for).
Each outside implementation is loaded once per process; :mod:`magi_moe.registry` registers it
under its own name and refuses a name already taken by a different implementation.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect

from .implementation import Implementation

ENTRY_POINT_GROUP = "magi_moe.implementations"

_loaded: dict[str, Implementation] = {}  # by where it came from: "module:attr" or "entry point NAME"


def as_implementation(obj: object, source: str) -> Implementation:
    """``obj`` itself when an Implementation, else the result of calling it with no arguments."""
    if not isinstance(obj, Implementation) and callable(obj):
        required = _required_parameters(obj)
        if required:  # e.g. the forward function itself, named where its declaration belongs
            raise ValueError(
                f"{source} must be a magi_moe.implementation.Implementation or a zero-argument factory "
                f"returning one, got a callable that needs arguments ({', '.join(required)}); a forward "
                f"function is declared as Implementation(forward=...) and that Implementation is named")
        try:
            obj = obj()
        except Exception as exc:  # a factory's heavy import or device check failed
            raise ValueError(f"{source}: its factory raised {described(exc)}") from exc
    if not isinstance(obj, Implementation):
        raise ValueError(f"{source} must be a magi_moe.implementation.Implementation or a zero-argument "
                         f"factory returning one, got {type(obj).__name__}")
    return obj


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line: every command says a load failure in one."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def described(exc: BaseException) -> str:
    """``RuntimeError: no GPU here``: the type says what kind of failure the module met."""
    text = first_line(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _required_parameters(fn) -> list[str]:
    """The parameters ``fn()`` would be missing (none when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def load_spec(spec: str) -> Implementation:
    """The implementation named by ``package.module:attribute`` (imported once per process)."""
    if spec in _loaded:
        return _loaded[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"implementation spec must look like 'package.module:attribute', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot load implementation {spec!r}: importing {module_name!r} failed: "
                         f"{first_line(exc)}") from exc
    except Exception as exc:  # the team's module itself raised (no GPU here, a SyntaxError, ...)
        raise ValueError(f"cannot load implementation {spec!r}: importing {module_name!r} raised "
                         f"{described(exc)}") from exc
    if not hasattr(module, attr):
        raise ValueError(f"cannot load implementation {spec!r}: module {module_name!r} has no "
                         f"attribute {attr!r}")
    impl = as_implementation(getattr(module, attr), f"implementation {spec!r}")
    _loaded[spec] = impl
    return impl


def entry_point_names() -> list[str]:
    """Names of the installed entry points of the group (nothing is imported)."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def load_entry_point(name: str) -> Implementation | None:
    """The implementation an installed entry point of the group provides, or None if none is named so."""
    key = f"entry point {name!r}"
    if key in _loaded:
        return _loaded[key]
    matches = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        return None
    if len({ep.value for ep in matches}) > 1:
        raise ValueError(f"{key} of group {ENTRY_POINT_GROUP!r} is installed more than once, pointing to "
                         f"{sorted(ep.value for ep in matches)}; uninstall all but one")
    ep = matches[0]
    source = f"{key} ({ep.value}) of group {ENTRY_POINT_GROUP!r}"
    try:
        obj = ep.load()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {source}: {first_line(exc)}") from exc
    except Exception as exc:  # the module the entry point names raised while importing
        raise ValueError(f"cannot load {source}: importing it raised {described(exc)}") from exc
    impl = as_implementation(obj, source)
    if impl.name != name:
        raise ValueError(f"{source} provides an implementation named {impl.name!r}; the entry point "
                         f"and the implementation must have the same name")
    _loaded[key] = impl
    return impl


def discover() -> list[Implementation]:
    """Load every installed entry point of the group (to list them, or to run them all)."""
    return [load_entry_point(name) for name in entry_point_names()]


def resolve(name: str) -> Implementation | None:
    """An outside implementation: ``package.module:attribute`` when ``name`` has a colon, else the
    installed entry point of that name; None when no entry point has the name."""
    if ":" in name:
        return load_spec(name)
    return load_entry_point(name)
