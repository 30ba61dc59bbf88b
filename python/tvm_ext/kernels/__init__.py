"""Compute + schedule per primitive (LLVM CPU)."""

from . import conv2d, elementwise, pool2d

__all__ = ["conv2d", "elementwise", "pool2d"]
