"""Errors tvm_ext raises."""


class UnsupportedError(ValueError):
    """No path (tvm_ext kernel or stock TVM) can compile this input correctly."""
