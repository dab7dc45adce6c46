"""Before ``tox -e cuda``: does this Python have the GPU stack the environment borrows from it?

``tox -e cuda`` installs nothing (``sitepackages = true``, ``skip_install = true``): it runs the
suite with the machine's own CUDA build of torch and Triton. Without this check a missing
package surfaced as a bare "No module named torch" from pytest's conftest import.
Exits 0 when all is there, 1 with what to do otherwise. Imports nothing it checks for first.
"""
from __future__ import annotations

import importlib.util
import sys

NEEDED = ("torch", "triton", "numpy", "pytest", "hypothesis", "mpmath")


def problems() -> list[str]:
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        return [f"missing from {sys.executable} (the Python tox -e cuda borrows packages from, "
                f"base {sys.base_prefix}): {', '.join(missing)}.",
                "Install them there, with torch and triton as CUDA builds for this machine's "
                f"driver, e.g.  {sys.base_prefix}/bin/python -m pip install torch triton numpy "
                "pytest hypothesis mpmath",
                "No GPU here? Use tox -e cpu (the kernels under the Triton interpreter)."]
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return [f"torch {torch.__version__} ({build}) sees no CUDA GPU: tox -e cuda needs one.",
                "Install a CUDA build of torch matching the driver (nvidia-smi shows it), or use "
                "tox -e cpu on a machine without a GPU."]
    return []


def main() -> int:
    found = problems()
    for line in found:
        print(f"tox -e cuda: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
