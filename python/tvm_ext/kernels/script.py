"""TVMScript text -> IR, parsed once per distinct text.

Parsing TVMScript is slow (0.1-0.2 s for a kernel with an unrolled register tile; 0.3-1.6 s for
the unrolled Winograd transforms), so the CPU kernels on a build's hot path (convolutions,
microkernels, layout changes, Winograd transforms) are built with TVM's IRBuilder instead. What
is still written as text (the elementwise activations, a parameter's alignment
rewritten in :func:`tvm_ext.kernels.common.accept_user_alignment`) goes through this cache: a
network repeats the same text for every layer of the same shape, and TVM IR is immutable, so
one parsed function can serve every caller.
"""

from __future__ import annotations

import functools

import tvm.script
from tvm import tirx


@functools.lru_cache(maxsize=1024)
def from_source(text: str) -> tirx.PrimFunc:
    """The PrimFunc of TVMScript `text` (`tvm.script.from_source`), cached by the text. The text may
    call the activations' helper functions (:data:`tvm_ext.kernels.vector_math.ACTIVATION_FUNCTIONS`)."""
    from tvm.script.parser.core.entry import _default_globals

    from .vector_math import ACTIVATION_FUNCTIONS

    return tvm.script.from_source(text, extra_vars={**_default_globals(), **ACTIVATION_FUNCTIONS})
