"""Default schedules (dlight rules) for the ops tvm_ext does not serve with a kernel of its own."""

from . import cpu
from .guarded import Guarded, OnAlignedAccesses, aligned_accesses

__all__ = ["Guarded", "OnAlignedAccesses", "aligned_accesses", "cpu"]
