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

import tvm
from tvm import s_tir, tirx

__all__ = ["BATCHED_ATTR", "batch_loop"]

# The function attribute that lists a batch-looped kernel's batched parameters.
BATCHED_ATTR = "tvm_ext.batched_params"


def batch_loop(func: tirx.PrimFunc, batched: Sequence[int], outputs: int = 1) -> tirx.PrimFunc:
    """`func` over a symbolic batch: the parameters at the indices `batched` (leading extent 1)
    become (n, ...) buffers, the others stay as they are (weights, biases). The last `outputs`
    parameters are the ones the kernel writes.

    The kernel was compiled assuming its buffers aligned (64 bytes: LLVM is told so). An image
    whose size is a multiple of that is a view of the batched buffer; any other image is copied
    into an aligned buffer of its own before the kernel (inputs) or out of it after (outputs):
    a 3-channel 230 x 230 padded input is 634,800 bytes an image, and a view of the second one
    would be 16 bytes off."""
    batched = sorted({int(i) for i in batched})
    n = tirx.Var("n", "int64")
    image = tirx.Var("image", "int64")
    params, before, after = [], [], []
    # `image * size` written in each copy in and out made TVM's common-subexpression pass fail
    # ("cse_v2 has been used before definition": a 4-channel 1x1 convolution with a residual);
    # bound once per size ahead of every use, it leaves that pass nothing to extract
    offsets: dict[int, tirx.Var] = {}
    binds: list[tirx.Stmt] = []
    for i, param in enumerate(func.params):
        if i not in batched:
            params.append(param)
            continue
        if int(param.shape[0]) != 1:
            raise ValueError(f"batch_loop: parameter {param.name} has a leading extent of {param.shape[0]}, not 1")
        whole = tirx.decl_buffer((n, *param.shape[1:]), param.dtype, f"{param.name}_batch")
        params.append(whole)
        per_image = 1
        for extent in param.shape[1:]:
            per_image *= int(extent)
        alignment = int(param.data_alignment) if int(param.data_alignment) > 0 else 64
        offset = image * per_image
        if per_image * tvm.runtime.DataType(param.dtype).bits // 8 % alignment == 0:
            # the image's first element's address (an access_ptr keeps the declared element type,
            # which TVM's bf16 legalization changes under it: bf16 kernels failed to build)
            first = tirx.BufferLoad(whole, [image, *[tirx.const(0, "int64")] * (len(param.shape) - 1)])
            before.append(tirx.DeclBuffer(param, data=tirx.call_intrin("handle", "tirx.address_of", first)))
            continue
        before.append(tirx.AllocBuffer(param))
        if per_image not in offsets:  # the image's offset, bound once (see below)
            offsets[per_image] = tirx.Var(f"offset{len(offsets)}", "int64")
            binds.append(tirx.Bind(offsets[per_image], image * per_image))
        offset = offsets[per_image]
        flat = tirx.decl_buffer((per_image,), param.dtype, f"{param.name}_flat", data=param.data)
        batch = tirx.decl_buffer((n * per_image,), param.dtype, f"{param.name}_batch_flat", data=whole.data)
        before += [tirx.DeclBuffer(flat, data=param.data), tirx.DeclBuffer(batch, data=whole.data)]
        j = tirx.Var("j", "int64")
        if i >= len(func.params) - outputs:
            store = tirx.BufferStore(batch, tirx.BufferLoad(flat, [j]), [offset + j])
            after.append(tirx.For(j, tirx.const(0, "int64"), per_image, tirx.ForKind.SERIAL, store))
        else:
            store = tirx.BufferStore(flat, tirx.BufferLoad(batch, [offset + j]), [j])
            before.append(tirx.For(j, tirx.const(0, "int64"), per_image, tirx.ForKind.SERIAL, store))
    body = tirx.SeqStmt([*binds, *before, func.body, *after])
    loop = tirx.For(image, tirx.const(0, "int64"), n, tirx.ForKind.SERIAL, body)
    # under a root block, as every PrimFunc in schedule form (Relax's pattern analysis expects one)
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", loop))
    return tirx.PrimFunc(params, root, attrs=func.attrs).with_attr(BATCHED_ATTR, batched)
