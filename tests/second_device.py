"""The device a mismatched-device test moves one tensor to."""
from __future__ import annotations

import pytest
import torch


def other_device(device) -> str:
    """``cuda`` for a CPU ``device`` and ``cpu`` for a CUDA one; without a GPU there is no second
    device, and the test skips with the reason the verdict reads as NOT RUN."""
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    return "cpu" if torch.device(device).type == "cuda" else "cuda"
