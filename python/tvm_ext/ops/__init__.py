"""cuDNN-like eager primitives on NumPy arrays: NCHW data, OIHW weights, NCHW results.

Forward (:mod:`.forward`: convolution, pooling, activations) and backward (:mod:`.backward`:
the gradients, with cuDNN's meaning). Each call compiles its kernel once per signature (shapes,
options, target) into one bounded cache (:func:`set_cache_limit`, :func:`clear_cache`).
"""

from .backward import avg_pool2d_backward, conv2d_backward_data, conv2d_backward_weight, max_pool2d_backward
from .forward import (
    Conv2d,
    aligned_empty,
    avg_pool2d,
    cache_bytes,
    cache_size,
    clear_cache,
    conv2d,
    conv2d_plan,
    gelu,
    global_avg_pool2d,
    hardsigmoid,
    hardswish,
    leaky_relu,
    max_pool2d,
    relu,
    relu6,
    set_cache_limit,
    sigmoid,
    silu,
)

__all__ = ["Conv2d", "aligned_empty", "avg_pool2d", "avg_pool2d_backward", "cache_bytes", "cache_size",
           "clear_cache", "conv2d", "conv2d_backward_data", "conv2d_backward_weight", "conv2d_plan", "gelu",
           "global_avg_pool2d", "hardsigmoid", "hardswish", "leaky_relu", "max_pool2d", "max_pool2d_backward",
           "relu", "relu6", "set_cache_limit", "sigmoid", "silu"]
