"""Tensor intrinsics: one file per target family."""

from . import cpu

__all__ = ["cpu"]
