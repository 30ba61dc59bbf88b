"""A kernel for one image, run over a symbolic batch: the batch loop outside the microkernel.

Every tvm_ext kernel computes each image of a batch from that image alone, and the batch is its
outermost axis. :func:`batch_loop` turns a kernel generated for one image into one whose batched
parameters have a symbolic leading extent `n`: a serial loop over the images declares, for each
image, the one-image buffers the kernel was written for as views of the batched ones
(`DeclBuffer` bound to the image's address), and runs the kernel's body on them. The kernel's
own schedule, tensorized microkernel calls and parallel loops are untouched, so a graph exported
with a dynamic batch runs the same code per image as a batch-1 build (and its tuning records).
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import s_tir, tirx

__all__ = ["BATCHED_ATTR", "batch_loop"]

# The function attribute that lists a batch-looped kernel's batched parameters.
BATCHED_ATTR = "tvm_ext.batched_params"


def batch_loop(func: tirx.PrimFunc, batched: Sequence[int]) -> tirx.PrimFunc:
    """`func` over a symbolic batch: the parameters at the indices `batched` (leading extent 1)
    become (n, ...) buffers, the others stay as they are (weights, biases)."""
    batched = sorted({int(i) for i in batched})
    n = tirx.Var("n", "int64")
    image = tirx.Var("image", "int64")
    params, views = [], []
    for i, param in enumerate(func.params):
        if i not in batched:
            params.append(param)
            continue
        if int(param.shape[0]) != 1:
            raise ValueError(f"batch_loop: parameter {param.name} has a leading extent of {param.shape[0]}, not 1")
        whole = tirx.decl_buffer((n, *param.shape[1:]), param.dtype, f"{param.name}_batch")
        per_image = 1
        for extent in param.shape[1:]:
            per_image *= int(extent)
        params.append(whole)
        views.append(tirx.DeclBuffer(param, data=whole.access_ptr("rw", offset=image * per_image)))
    loop = tirx.For(image, tirx.const(0, "int64"), n, tirx.ForKind.SERIAL, tirx.SeqStmt([*views, func.body]))
    # under a root block, as every PrimFunc in schedule form (Relax's pattern analysis expects one)
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", loop))
    return tirx.PrimFunc(params, root, attrs=func.attrs).with_attr(BATCHED_ATTR, batched)
