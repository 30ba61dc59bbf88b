"""tvm_ext: BRGEMM and maxDNN microkernels, direct convolution and a primitive library for TVM."""

from . import intrin, kernels, models, ops, tuning
from ._compat import check_environment
from .errors import UnsupportedError
from .pipeline import build, pipeline
from .quantization import quantize
from .report import dispatch_report
from .target import resolve_target, vector_isa
from .transform import gradients  # noqa: F401  (registers tvm_ext's gradients for relax.transform.Gradient)
from .tuning import tune

__version__ = "0.5.39"
__all__ = [
    "UnsupportedError",
    "build",
    "check_environment",
    "dispatch_report",
    "intrin",
    "kernels",
    "models",
    "ops",
    "pipeline",
    "quantize",
    "resolve_target",
    "tune",
    "tuning",
    "vector_isa",
]
