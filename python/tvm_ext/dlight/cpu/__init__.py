"""dlight rules for LLVM CPUs."""

from .parallel_vectorize import ParallelVectorize

__all__ = ["ParallelVectorize"]
