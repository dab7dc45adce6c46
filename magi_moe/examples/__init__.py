"""Worked examples shipped inside the package, so an installed wheel can hand them to a team:
``magi-moe example`` lists them, ``magi-moe example NAME`` prints one (``--out FILE`` writes it).
Each is a complete, correct implementation that ``magi-moe check`` passes on the cpu backend."""
from __future__ import annotations

from importlib import resources

# name -> (module file inside this package, what it shows)
EXAMPLES: dict[str, tuple[str, str]] = {
    "kernel": ("kernel.py", "a kernel implementation: forward(x, table, weights, config, *, out) "
                            "and its declaration"),
    "layer": ("layer.py", "a layer implementation: its own nn.Module (routing, selection bias, "
                          "router submodule, dtypes) declared through layer_factory"),
}


def example_source(name: str) -> str:
    """The source text of the worked example ``name``."""
    if not isinstance(name, str) or name not in EXAMPLES:
        raise ValueError(f"example must be one of {sorted(EXAMPLES)}, got {name!r}")
    return resources.files(__package__).joinpath(EXAMPLES[name][0]).read_text(encoding="utf-8")
