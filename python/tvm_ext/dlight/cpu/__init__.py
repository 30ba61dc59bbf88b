"""dlight rules for LLVM CPUs."""

from .parallel_vectorize import ParallelVectorize
from .row_dot import RowDotProducts

__all__ = ["ParallelVectorize", "RowDotProducts"]
