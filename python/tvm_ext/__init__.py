"""tvm_ext: BRGEMM and maxDNN microkernels, direct convolution and a primitive library for TVM."""

from . import intrin, kernels, ops
from ._compat import check_environment
from .errors import UnsupportedError
from .target import resolve_target, vector_isa

__version__ = "0.1.0"
__all__ = ["UnsupportedError", "check_environment", "intrin", "kernels", "ops", "resolve_target", "vector_isa"]
