"""TVMScript text -> IR, parsed once per distinct text.

tvm_ext generates its kernels and layout changes as TVMScript text. Parsing is the slowest
step of a build (0.1-0.2 s for a kernel with an unrolled register tile; 24 of the 45 s of a
ResNet-50 build before this cache), and a network repeats the same text for every layer of the
same shape. TVM IR is immutable, so one parsed function can serve every caller. (Intrinsics
are parsed once per description already: ``get_brgemm_intrin`` registers each once.)
"""

from __future__ import annotations

import functools

import tvm.script
from tvm import tirx


@functools.lru_cache(maxsize=1024)
def from_source(text: str) -> tirx.PrimFunc:
    """The PrimFunc of TVMScript `text` (`tvm.script.from_source`), cached by the text."""
    return tvm.script.from_source(text)
