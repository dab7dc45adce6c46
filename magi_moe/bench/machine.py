"""What identifies the machine a timing came from: the GPU (name, driver, CUDA), torch and Triton
versions, and whether the Triton interpreter ran. Written into ``python -m magi_moe.bench``'s JSON
and into pytest-benchmark's saved runs (``tests/benchmarks/conftest.py``), so that timings from
different GPUs, drivers or stacks are never compared blindly."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess

import torch


def _driver_version() -> str | None:
    """The NVIDIA display driver (``nvidia-smi``), else the CUDA driver API version torch sees."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=10)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        version = torch._C._cuda_getDriverVersion()  # e.g. 12080 for CUDA 12.8
        return f"cuda-driver-api {version // 1000}.{version % 1000 // 10}"
    except (AttributeError, RuntimeError):
        return None


def machine_info(device: torch.device | str | None = None) -> dict:
    """``device`` default: the current GPU when there is one, else the CPU."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "triton": triton_version, "device": str(device),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"), "gpu": None}
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    compute_capability=f"{props.major}.{props.minor}",
                    cuda=torch.version.cuda, driver=_driver_version())
    return info
