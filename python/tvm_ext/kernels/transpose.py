"""An 8x8 float32 transpose in registers, emitted into the layout kernels with TVM's IRBuilder.

NCHW <-> NCHW[x]c and OIHW -> OIHW[x]i[y]o are transposes of (channel, pixel) tiles. Written as
element-wise loops, LLVM compiles them to scalar moves (4x slower than a memcpy of the same
bytes); written as 8 vector loads, three stages of two-input shuffles and 8 vector stores, they
become vunpck/vshuf/vperm sequences and run near memcpy speed. The stages are data
(:data:`STAGES`); :func:`transpose8x8` emits them between the caller's loads and stores.

The intermediate vectors are let bindings (``T.Bind``): a one-element "local" buffer, which a plain
TVMScript assignment makes, is a heap workspace allocated on every iteration of a parallel loop
(measured: 6x slower than the same code with let bindings).
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.tirx.script import builder as T

TILE = 8  # float32 lanes of one ymm register; NEON splits each vector in two

# Stage k pairs vector a with vector b of the previous stage and keeps the lanes `mask` of
# their concatenation (indices >= 8 come from b): (unpacklo/hi, then 64-bit, then 128-bit).
# Each entry: (output names, input names of stage k - 1, [(a, b, mask) per output]).
_LO32, _HI32 = (0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15)
_LO64, _HI64 = (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)
_LO128, _HI128 = (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)
STAGES: tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...] = (
    tuple((2 * (k // 2), 2 * (k // 2) + 1, _LO32 if k % 2 == 0 else _HI32) for k in range(8)),
    tuple((4 * (k // 4) + (k % 4) // 2, 4 * (k // 4) + (k % 4) // 2 + 2, _LO64 if k % 2 == 0 else _HI64)
          for k in range(8)),
    # the last stage yields output rows in the order 0, 4, 1, 5, 2, 6, 3, 7 (see _ROW_OF)
    tuple((k // 2, k // 2 + 4, _LO128 if k % 2 == 0 else _HI128) for k in range(8)),
)
_ROW_OF = (0, 4, 1, 5, 2, 6, 3, 7)  # last-stage vector k holds column _ROW_OF[k] of the input


def transpose8x8(load: Callable[[int], tirx.PrimExpr], store: Callable[[int, tirx.PrimExpr], None]) -> None:
    """Emit, in the current IRBuilder frame, the stores of column j of the 8x8 tile whose row i
    is `load(i)`.

    load(i): an 8-lane vector (e.g. ``X[n, c + i, h, T.Ramp(w, 1, 8)]``); store(j, value): emits
    the store of the 8-lane `value` (e.g. ``T.buffer_store(Y, value, [n, h, w + j, T.Ramp(c, 1, 8)])``).
    """
    rows = [T.Bind(load(i)) for i in range(TILE)]
    for s, stage in enumerate(STAGES, start=1):
        values = [T.Shuffle([rows[a], rows[b]], list(mask)) for a, b, mask in stage]
        if s == len(STAGES):
            for k, value in enumerate(values):
                store(_ROW_OF[k], value)
        else:
            rows = [T.Bind(value) for value in values]
