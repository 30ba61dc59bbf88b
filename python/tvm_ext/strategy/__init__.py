"""Dispatch strategies: which tvm_ext kernel serves which Relax op, per target family."""

from . import cpu

__all__ = ["cpu"]
