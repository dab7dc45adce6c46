"""Triton kernels. Import lazily: Triton is optional on the CPU reference backend."""
