"""Filter taps that read only padding, dropped (transform.drop_padding_taps, and the temporal taps
of transform.conv3d_as_conv2d): DeepLabV3's atrous convolutions dilated 24 and 36 on a 14x14 map
are 1x1 convolutions computed as 3x3 ones (9x the work: 14 of DeepLabV3-MobileNet's 26 ms)."""

import numpy as np
import tvm
from reference import conv2d_nchw, one_input_graph, random_const, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.transform import conv3d_as_conv2d, drop_padding_taps, used_taps


def _convs(mod: tvm.IRModule, op: str = "relax.nn.conv2d") -> list[relax.Call]:
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if (
        isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == op) else None)
    return calls


def _run(ex, x: np.ndarray) -> np.ndarray:
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return (out if isinstance(out, tvm.runtime.Tensor) else out[0]).numpy()


def test_used_taps():
    """A 3-tap temporal filter, padding 1: on one frame only the centre reads it; on two frames
    at stride 2 the first tap reads only the padding; dilated 2 on 2 frames, none but one."""
    assert used_taps(1, 1, 3, 1, 1, 1) == [1]
    assert used_taps(2, 1, 3, 2, 1, 1) == [1, 2]
    assert used_taps(8, 8, 3, 1, 1, 1) == [0, 1, 2]
    assert used_taps(14, 14, 3, 1, 36, 36) == [1]
    assert used_taps(14, 14, 3, 1, 12, 12) == [0, 1, 2]


def test_random_convolutions_keep_their_sums():
    """300 random convolutions with large paddings and dilations: the rewrite's convolution (its
    cropped weights and padding, read from the module) equals the original in float64 on every
    output, and it drops taps in many of them."""
    rng = np.random.default_rng(5)
    cropped = 0
    for _ in range(300):
        c, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        h, w = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        r, s = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        stride, dilation = tuple(int(v) for v in rng.integers(1, 4, 2)), tuple(int(v) for v in rng.integers(1, 9, 2))
        padding = tuple(int(v) for v in rng.integers(0, 20, 4))
        if (h + padding[0] + padding[2] < dilation[0] * (r - 1) + 1
                or w + padding[1] + padding[3] < dilation[1] * (s - 1) + 1):
            continue
        weight = rng.standard_normal((k, c, r, s)).astype(np.float32)
        mod = one_input_graph((1, c, h, w), lambda bb, x, weight=weight, stride=stride, padding=padding,
                              dilation=dilation: relax.op.nn.conv2d(x, relax.const(weight), stride, padding, dilation))
        (conv,) = _convs(drop_padding_taps()(mod))
        new_weight = conv.args[1].value.numpy()
        cropped += new_weight.shape != weight.shape
        x = rng.standard_normal((1, c, h, w))
        want = conv2d_nchw(x, weight, None, stride, padding, dilation)
        got = conv2d_nchw(x, new_weight, None, [int(v) for v in conv.attrs.strides],
                          tuple(int(v) for v in conv.attrs.padding), [int(v) for v in conv.attrs.dilation])
        assert got.shape == want.shape and rel_err(got, want) < 1e-12, (stride, padding, dilation, r, s, h, w)
    assert cropped > 50


def test_an_atrous_pyramid_runs_its_1x1_convolutions():
    """DeepLabV3's ASPP on a 14x14 map: dilation 24 and 36 become 1x1 convolutions (dilation
    12 keeps its 3x3), built by tvm_ext equal to stock TVM's build of the original."""
    rng = np.random.default_rng(6)

    def aspp(bb, x):
        branches = [relax.op.nn.relu(relax.op.nn.conv2d(x, random_const(rng, 16, 32, 3, 3), padding=d, dilation=d))
                    for d in (12, 24, 36)]
        return relax.op.concat(branches, axis=1)

    mod = one_input_graph((1, 32, 14, 14), aspp)
    shapes = [tuple(int(v) for v in c.args[1].ty.shape) for c in _convs(drop_padding_taps()(mod))]
    assert sorted(shapes) == [(16, 32, 1, 1), (16, 32, 1, 1), (16, 32, 3, 3)]
    x = rng.standard_normal((1, 32, 14, 14)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, "llvm"), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-5


def test_a_dead_tap_that_is_not_finite_stays():
    """inf * 0 is NaN: a tap holding an inf keeps the convolution as it was."""
    weight = np.ones((2, 1, 3, 3), np.float32)
    weight[0, 0, 0, 0] = np.inf
    mod = one_input_graph((1, 1, 4, 4), lambda bb, x: relax.op.nn.conv2d(x, relax.const(weight), padding=8, dilation=8))
    assert [tuple(int(v) for v in c.args[1].ty.shape) for c in _convs(drop_padding_taps()(mod))] == [(2, 1, 3, 3)]
    finite = one_input_graph((1, 1, 4, 4), lambda bb, x: relax.op.nn.conv2d(x, relax.const(np.ones_like(weight)),
                                                                            padding=8, dilation=8))
    assert [tuple(int(v) for v in c.args[1].ty.shape) for c in _convs(drop_padding_taps()(finite))] == [(2, 1, 1, 1)]


def test_a_short_clip_gathers_only_the_frames_it_reads():
    """A (3, 3, 3) convolution padded by 1 on a clip of 1 frame reads only its centre tap's
    frame: the 2-D convolution over frames takes C channels, not 3 C; equal to stock TVM."""
    rng = np.random.default_rng(7)
    mod = one_input_graph((2, 8, 1, 6, 6), lambda bb, x: relax.op.nn.conv3d(x, random_const(rng, 4, 8, 3, 3, 3),
                                                                            padding=1))
    (conv,) = _convs(conv3d_as_conv2d()(mod))
    assert tuple(int(v) for v in conv.args[1].ty.shape) == (4, 8, 3, 3)
    x = rng.standard_normal((2, 8, 1, 6, 6)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, "llvm"), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-5
