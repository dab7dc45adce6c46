"""Triton kernels. Import lazily: Triton is optional on the CPU reference backend."""
from ..backends import interpreter_enabled

if interpreter_enabled():  # launches patch triton.language once, not at every helper call
    from .interpreter_calls import install as _install_interpreter_shortcut

    _install_interpreter_shortcut()
