"""kernels.batch_loop: a kernel for one image, run over a symbolic batch, computes for each image
exactly what the one-image kernel computes (plain, tensorized and depthwise kernels)."""

import numpy as np
import pytest
import tvm

from tvm_ext.kernels import conv2d as C
from tvm_ext.kernels import layout
from tvm_ext.kernels.batch_loop import BATCHED_ATTR, batch_loop
from tvm_ext.target import resolve_target, vector_isa
from tvm_ext.tuning import space

TARGET = resolve_target("llvm")


def _compile(func):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), TARGET)["main"]


def _shapes(func) -> list[tuple[int, ...]]:
    return [tuple(int(e) for e in p.shape) for p in func.params]


def _per_image_and_batched(func, batched: list[int], images: int = 3) -> float:
    """Max difference between the batched kernel on `images` images and the one-image kernel run
    on each of them (unbatched parameters are shared)."""
    one, many = _compile(func), _compile(batch_loop(func, batched))
    shapes = _shapes(func)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(((images,) if i in batched else ()) + (s[1:] if i in batched else s))
              .astype("float32") for i, s in enumerate(shapes[:-1])]
    out = tvm.runtime.empty((images, *shapes[-1][1:]), "float32", tvm.cpu())
    many(*[tvm.runtime.tensor(a) for a in inputs], out)
    worst = 0.0
    for image in range(images):
        single = tvm.runtime.empty(shapes[-1], "float32", tvm.cpu())
        args = [a[image:image + 1].copy() if i in batched else a for i, a in enumerate(inputs)]
        one(*[tvm.runtime.tensor(a) for a in args], single)
        worst = max(worst, float(np.abs(single.numpy()[0] - out.numpy()[image]).max()))
    return worst


def test_a_layout_kernel_over_a_batch():
    func = layout.pack_nchwc_func((1, 8, 5, 5), 8, (1, 1, 1, 1))
    assert _per_image_and_batched(func, [0, 1]) == 0.0


@pytest.mark.parametrize("x_shape, w_shape, groups", [((1, 32, 14, 14), (64, 32, 3, 3), 1),
                                                      ((1, 32, 14, 14), (32, 1, 3, 3), 32),
                                                      ((1, 16, 9, 9), (24, 16, 1, 1), 1),
                                                      ((1, 3, 23, 23), (16, 3, 3, 3), 1)])
def test_a_tensorized_convolution_over_a_batch(x_shape, w_shape, groups):
    isa = vector_isa(TARGET)
    pad = (1, 1, 1, 1) if w_shape[2] == 3 else (0, 0, 0, 0)
    plan = C.plan_conv2d(C.Conv2dWorkload.make(x_shape, w_shape, (1, 1), pad, (1, 1), groups), isa)
    func = space.default_kernel(plan, C.Epilogue(bias=True, activation="relu"), isa)
    batched = [0, len(func.params) - 1]  # data and output; weights and bias are shared
    assert _per_image_and_batched(func, batched) == 0.0
    assert [int(i) for i in batch_loop(func, batched).attrs[BATCHED_ATTR]] == batched


def test_an_image_that_is_not_a_multiple_of_the_alignment_is_copied_not_viewed():
    """A 3-channel 25 x 25 padded input is 7,500 bytes an image: a view of the second image would
    break the 64-byte alignment the kernel was compiled for, so it is copied into an aligned buffer;
    an output image of 16 x 23 x 23 floats (a multiple of 64 bytes) is a view."""
    isa = vector_isa(TARGET)
    plan = C.plan_conv2d(C.Conv2dWorkload.make((1, 3, 23, 23), (16, 3, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1), isa)
    func = space.default_kernel(plan, C.Epilogue(nchw_out=True), isa)
    text = batch_loop(func, [0, len(func.params) - 1]).script()
    assert "T.alloc_buffer((1, 1, 25, 25, 3))" in text and "OUT = T.decl_buffer((1, 16, 23, 23)" in text
    assert _per_image_and_batched(func, [0, len(func.params) - 1], images=4) == 0.0


def test_only_a_one_image_parameter_can_be_batched():
    func = layout.pack_nchwc_func((2, 8, 5, 5), 8, (0, 0, 0, 0))
    with pytest.raises(ValueError, match="leading extent of 2"):
        batch_loop(func, [0, 1])


def test_a_small_convolution_with_a_residual_over_a_symbolic_batch_builds():
    """A 4-channel 1x1 convolution with a residual add (its images copied in and out, 48 bytes
    each): TVM's common-subexpression pass failed on the copies' offsets ("cse_v2 has been used
    before definition"; the random graph seed 9067). Built, it equals stock TVM at batch 1 and 3."""
    from reference import one_input_graph, random_const, rel_err
    from tvm import relax

    import tvm_ext

    rng = np.random.default_rng(9067)
    w = random_const(rng, 4, 4, 1, 1, scale=0.5)
    mod = one_input_graph((tvm.tirx.Var("n", "int64"), 4, 1, 3),
                          lambda bb, x: relax.op.clip(relax.op.add(x, relax.op.nn.conv2d(x, w)), 0, 6))
    ours, stock = tvm_ext.build(mod, TARGET), tvm.compile(mod, TARGET)
    for n in (1, 3):
        x = tvm.runtime.tensor(rng.standard_normal((n, 4, 1, 3)).astype("float32"))
        got, want = (relax.VirtualMachine(ex, tvm.cpu())["main"](x).numpy() for ex in (ours, stock))
        assert rel_err(got, want) < 1e-6
