"""conv2d through tvm_ext.ops against a float64 NumPy reference."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from reference import conv2d_nchw, rel_err

from tvm_ext import ops
from tvm_ext.kernels.conv2d import Conv2dWorkload, normalize_padding
from tvm_ext.target import resolve_target

TOL = 1e-4


def _run_case(rng, N, C, H, W, K, R, S, stride, padding, dilation, groups, bias=True):
    x = rng.standard_normal((N, C, H, W), dtype=np.float32)
    w = rng.standard_normal((K, C // groups, R, S), dtype=np.float32)
    b = rng.standard_normal(K, dtype=np.float32) if bias else None
    y = ops.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    st = stride if isinstance(stride, tuple) else (stride, stride)
    dl = dilation if isinstance(dilation, tuple) else (dilation, dilation)
    ref = conv2d_nchw(x, w, b, st, normalize_padding(padding), dl, groups)
    assert y.shape == ref.shape
    err = rel_err(y, ref)
    assert err <= TOL, f"relative error {err:.2e}"
    return ops.conv2d_plan(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation, groups=groups)


def _random_config(rng):
    """One configuration drawn over the space the kernel claims to cover."""
    filt = [(1, 1), (3, 3), (5, 5), (7, 7), (11, 11), (1, 7), (7, 1), (1, 3), (3, 1), (2, 2)]
    R, S = filt[rng.integers(len(filt))]
    stride = int(rng.choice([1, 1, 2, 4]))
    if rng.random() < 0.15:
        stride = (int(rng.choice([1, 2])), int(rng.choice([1, 2, 3])))
    dilation = 1 if rng.random() < 0.8 else int(rng.choice([2, 3]))
    kind = rng.random()
    if kind < 0.15:  # depthwise
        C = int(rng.choice([8, 16, 24, 32, 48, 96]))
        K, groups = C, C
    elif kind < 0.3:  # grouped
        groups = int(rng.choice([2, 4]))
        C = groups * int(rng.choice([3, 8, 16]))
        K = groups * int(rng.choice([3, 8, 16, 32]))
    else:
        groups = 1
        C = int(rng.choice([1, 3, 4, 16, 17, 32, 64, 96]))
        K = int(rng.choice([1, 8, 16, 24, 32, 40, 64, 96, 100]))
    ph, pw = (R // 2) * (dilation if isinstance(dilation, int) else 1), (S // 2) * dilation
    pad_kind = rng.random()
    if pad_kind < 0.3:
        padding = 0
    elif pad_kind < 0.6:
        padding = (ph, pw)
    else:
        padding = tuple(int(v) for v in rng.integers(0, 4, size=4))
    N = int(rng.choice([1, 1, 2]))
    span_h = (R - 1) * dilation + 1
    span_w = (S - 1) * dilation + 1
    H = int(rng.integers(max(1, span_h - 2), span_h + 20))
    W = int(rng.integers(max(1, span_w - 2), span_w + 24))
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=stride, padding=padding, dilation=dilation,
                groups=groups)


def _valid(cfg) -> bool:
    try:
        Conv2dWorkload.make((cfg["N"], cfg["C"], cfg["H"], cfg["W"]),
                            (cfg["K"], cfg["C"] // cfg["groups"], cfg["R"], cfg["S"]),
                            cfg["stride"], cfg["padding"], cfg["dilation"], cfg["groups"])
        return True
    except ValueError:
        return False


def _configs(count: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        cfg = _random_config(rng)
        if _valid(cfg):
            out.append(cfg)
    return out


RANDOM = _configs(210, seed=20261130)


@pytest.mark.parametrize("index", range(len(RANDOM)), ids=[f"r{i}" for i in range(len(RANDOM))])
def test_random_conv2d(index):
    _run_case(np.random.default_rng(1000 + index), **RANDOM[index])  # its own random data


def test_random_space_is_covered():
    """The random draw exercises every kernel kind, strides, dilation, tails and odd channels."""
    kinds = set()
    for cfg in RANDOM:
        plan = ops.conv2d_plan((cfg["N"], cfg["C"], cfg["H"], cfg["W"]),
                               (cfg["K"], cfg["C"] // cfg["groups"], cfg["R"], cfg["S"]),
                               stride=cfg["stride"], padding=cfg["padding"], dilation=cfg["dilation"],
                               groups=cfg["groups"])
        kinds.add(plan.kind)
    assert kinds == {"brgemm", "depthwise", "grouped", "direct"}
    assert any(c["stride"] == 4 for c in RANDOM) and any(c["dilation"] > 1 for c in RANDOM)
    assert any(c["N"] > 1 for c in RANDOM) and any(c["K"] % 8 for c in RANDOM)
    assert any(isinstance(c["padding"], tuple) and len(c["padding"]) == 4 for c in RANDOM)


FIXED = [
    # name, N, C, H, W, K, R, S, stride, padding, dilation, groups
    ("resnet_stem", 1, 3, 56, 60, 64, 7, 7, 2, 3, 1, 1),
    ("alexnet_conv1_11x11_s4", 1, 3, 67, 67, 64, 11, 11, 4, 2, 1, 1),
    ("1x1_1000", 1, 64, 7, 7, 1000, 1, 1, 1, 0, 1, 1),
    ("c96_k96", 2, 96, 13, 11, 96, 3, 3, 1, 1, 1, 1),
    ("1x7", 1, 32, 9, 17, 48, 1, 7, 1, (0, 3), 1, 1),
    ("7x1", 1, 32, 17, 9, 48, 7, 1, 1, (3, 0), 1, 1),
    ("asymmetric_pad", 1, 16, 10, 12, 32, 3, 3, 1, (0, 1, 2, 1), 1, 1),
    ("dilated", 1, 16, 20, 20, 32, 3, 3, 1, 2, 2, 1),
    ("depthwise_s2", 1, 32, 15, 15, 32, 3, 3, 2, 1, 1, 32),
    # the depthwise microkernel: pixel tails, 24-channel blocks (3 x 24 tiles on AVX2),
    # dilation, 5x5, asymmetric padding, a vertical-only stride, two images
    ("depthwise_tail_c24", 2, 48, 9, 13, 48, 3, 3, 1, 1, 1, 48),
    ("depthwise_dilated_5x5", 1, 64, 17, 19, 64, 5, 5, 1, (2, 4, 3, 4), 2, 64),
    ("depthwise_stride_2x1", 1, 16, 11, 10, 16, 3, 3, (2, 1), (0, 1, 2, 0), 1, 16),
    ("groups_2", 1, 32, 9, 9, 64, 3, 3, 1, 1, 1, 2),
    ("width_1_output", 1, 8, 5, 3, 16, 3, 3, 1, 0, 1, 1),
    ("single_pixel", 1, 16, 1, 1, 16, 1, 1, 1, 0, 1, 1),
    ("5x5_stride2_tail", 1, 24, 23, 29, 40, 5, 5, 2, 2, 1, 1),
    ("non_square_stride", 1, 16, 12, 20, 16, 3, 3, (1, 2), 1, 1, 1),
]


@pytest.mark.parametrize("case", FIXED, ids=[c[0] for c in FIXED])
def test_fixed_awkward(case):
    _, N, C, H, W, K, R, S, stride, padding, dilation, groups = case
    _run_case(np.random.default_rng(7), N, C, H, W, K, R, S, stride, padding, dilation, groups)


def test_without_bias():
    _run_case(np.random.default_rng(1), 1, 16, 8, 8, 16, 3, 3, 1, 1, 1, 1, bias=False)


def test_resnet_layers_use_brgemm():
    plan = ops.conv2d_plan((1, 64, 56, 56), (64, 64, 3, 3), padding=1)
    assert plan.kind == "brgemm" and plan.oc_bn % 8 == 0
    assert ops.conv2d_plan((1, 32, 8, 8), (32, 1, 3, 3), padding=1, groups=32).kind == "depthwise"


@pytest.mark.parametrize(
    "args, message",
    [
        (((1, 16, 8, 8), (8, 15, 3, 3), {}), "channel mismatch"),
        (((1, 16, 8, 8), (8, 16, 3, 3), {"padding": -1}), "negative padding"),
        (((1, 16, 4, 4), (8, 16, 7, 7), {"padding": 1}), "larger than the padded input"),
        (((1, 16, 8, 8), (8, 16, 3, 3), {"groups": 3}), "groups=3"),
        (((1, 16, 8, 8), (8, 16, 3, 3), {"stride": 0}), "must be positive"),
        (((1, 16, 8, 8), (8, 16, 3, 3), {"padding": (1, 2, 3)}), "padding must be"),
    ],
)
def test_bad_input_raises(args, message):
    x_shape, w_shape, kw = args
    x = np.ones(x_shape, np.float32)
    w = np.ones(w_shape, np.float32)
    with pytest.raises(ValueError, match=message):
        ops.conv2d(x, w, **kw)


def test_bad_dtype_raises():
    with pytest.raises(ValueError, match="float64"):
        ops.conv2d(np.ones((1, 4, 5, 5)), np.ones((4, 4, 3, 3), np.float32))
    with pytest.raises(ValueError, match="bias"):
        ops.conv2d(np.ones((1, 4, 5, 5), np.float32), np.ones((4, 4, 3, 3), np.float32),
                   np.ones(3, np.float32))


def test_fallback_is_correct_and_logged(caplog):
    """Groups whose output channels do not fill a vector use the direct schedule, with a reason."""
    with caplog.at_level(logging.WARNING, logger="tvm_ext"):
        plan = _run_case(np.random.default_rng(3), 1, 6, 9, 9, 9, 3, 3, 1, 1, 1, 3)
    assert plan.kind == "direct"
    assert "fallback" in caplog.text and "output channels per group" in caplog.text


def test_compiles_once_per_signature():
    x = np.ones((1, 8, 6, 6), np.float32)
    w = np.ones((8, 8, 3, 3), np.float32)
    ops.conv2d(x, w, padding=1)
    before = ops.cache_size()
    ops.conv2d(x * 2, w, padding=1)
    assert ops.cache_size() == before
    ops.conv2d(x, w, padding=0)
    assert ops.cache_size() > before


def test_kernel_is_built_once_per_plan():
    """Layers of one shape share the built kernel, which scheduling leaves as it was; another
    shape gets its own."""
    import tvm

    from tvm_ext.kernels.conv2d import conv2d_blocked_func, conv2d_blocked_kernel

    plan = ops.conv2d_plan((1, 16, 10, 9), (32, 16, 3, 3), padding=1)
    first = conv2d_blocked_func(plan)
    unscheduled = first.script()
    hits = conv2d_blocked_func.cache_info().hits
    assert conv2d_blocked_func(plan).same_as(first) and conv2d_blocked_func.cache_info().hits == hits + 1
    conv2d_blocked_kernel(plan, 8)  # schedules (splits, tensorizes) the cached function's copy
    assert conv2d_blocked_func(plan).same_as(first) and first.script() == unscheduled
    other = conv2d_blocked_func(ops.conv2d_plan((1, 16, 10, 9), (32, 16, 3, 3), padding=0))
    with pytest.raises(ValueError):
        tvm.ir.assert_structural_equal(other, first)


def _pack_nchwc(x, plan):
    """NumPy reference packing: NCHW -> N, C/x, H+pads, W+pads, x (zero border)."""
    wl = plan.wl
    top, left, bottom, right = wl.padding
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    n, c, h, w = xp.shape
    return np.ascontiguousarray(xp.reshape(n, c // plan.in_bn, plan.in_bn, h, w).transpose(0, 1, 3, 4, 2))


@pytest.mark.parametrize("activation", [None, "relu", "relu6", "sigmoid", "silu", "gelu"])
@pytest.mark.parametrize("shape", [((1, 32, 9, 17), (48, 32, 3, 3), 1, 1), ((2, 16, 12, 11), (32, 16, 1, 1), 2, 0)])
@pytest.mark.parametrize("row_order", ["ob_oh", "oh_ob", "ob_n_oh"])
def test_blocked_kernel_with_fused_epilogue(activation, shape, row_order):
    """The graph-mode kernel: blocked in and out, bias and activation applied in the row write,
    with either order of a task's rows."""
    import dataclasses

    import tvm

    from tvm_ext.kernels.conv2d import Epilogue, conv2d_blocked_kernel, pack_weight_func
    from tvm_ext.target import resolve_target, vector_isa

    x_shape, w_shape, stride, pad = shape
    target = resolve_target("llvm")
    plan = dataclasses.replace(ops.conv2d_plan(x_shape, w_shape, stride=stride, padding=pad), row_order=row_order)
    rng = np.random.default_rng(11)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    b = rng.standard_normal(w_shape[0], dtype=np.float32)
    epilogue = Epilogue(bias=True, activation=activation)
    conv = tvm.compile(conv2d_blocked_kernel(plan, vector_isa(target).lanes, epilogue), target)
    pack_w = tvm.compile(pack_weight_func(plan), target)
    wb = tvm.runtime.empty(plan.weight_shape(), "float32", tvm.cpu())
    pack_w(tvm.runtime.tensor(w), wb)
    bb = np.zeros(plan.K_pad, np.float32)
    bb[: len(b)] = b
    yb = tvm.runtime.tensor(np.full(plan.out_shape(), np.nan, np.float32))  # every element must be written
    conv(tvm.runtime.tensor(_pack_nchwc(x, plan)), wb, tvm.runtime.tensor(bb.reshape(plan.OCB, plan.oc_bn)), yb)
    y = yb.numpy().transpose(0, 1, 4, 2, 3).reshape(x_shape[0], plan.K_pad, plan.wl.OH, plan.wl.OW)[:, : w_shape[0]]
    ref = conv2d_nchw(x, w, b, plan.wl.stride, plan.wl.padding)
    ref = {None: ref, "relu": np.maximum(ref, 0), "relu6": np.clip(ref, 0, 6),
           "sigmoid": 1 / (1 + np.exp(-ref)), "silu": ref / (1 + np.exp(-ref)),
           "gelu": ref * (1 + np.vectorize(math.erf)(ref / math.sqrt(2))) / 2}[activation]
    assert rel_err(y, ref) <= TOL


@pytest.mark.parametrize("case", [
    # x, w, stride, padding, groups, out_pad, residual
    ((2, 32, 9, 17), (48, 32, 3, 3), 1, 1, 1, (1, 1, 1, 1), False),  # a tail segment, batch 2
    ((1, 16, 12, 11), (32, 16, 1, 1), 2, 0, 1, (0, 2, 3, 1), True),  # asymmetric border, shortcut
    ((1, 32, 10, 10), (32, 1, 3, 3), 1, 1, 32, (2, 2, 2, 2), False),  # depthwise
])
def test_blocked_kernel_writes_a_zero_border(case):
    """Epilogue.out_pad: the output is the padded input of the next layer. Its interior equals the
    float64 reference, its border is zero, and nothing is left unwritten (the buffer starts NaN)."""
    import tvm

    from tvm_ext.kernels.conv2d import Epilogue, conv2d_blocked_kernel, pack_weight_func
    from tvm_ext.target import resolve_target, vector_isa

    x_shape, w_shape, stride, pad, groups, out_pad, residual = case
    target = resolve_target("llvm")
    plan = ops.conv2d_plan(x_shape, w_shape, stride=stride, padding=pad, groups=groups)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    b = rng.standard_normal(w_shape[0], dtype=np.float32)
    r = rng.standard_normal(plan.out_shape(), dtype=np.float32)
    epilogue = Epilogue(bias=True, residual=residual, activation="relu", out_pad=out_pad)
    conv = tvm.compile(conv2d_blocked_kernel(plan, vector_isa(target).lanes, epilogue), target)
    wb = tvm.runtime.empty(plan.weight_shape(), "float32", tvm.cpu())
    tvm.compile(pack_weight_func(plan), target)(tvm.runtime.tensor(w), wb)
    bb = np.zeros(plan.K_pad, np.float32)
    bb[: len(b)] = b
    yb = tvm.runtime.tensor(np.full(epilogue.out_shape(plan), np.nan, np.float32))
    args = [tvm.runtime.tensor(_pack_nchwc(x, plan)), wb, tvm.runtime.tensor(bb.reshape(plan.OCB, plan.oc_bn))]
    conv(*args, *([tvm.runtime.tensor(r)] if residual else []), yb)
    y = yb.numpy()
    top, left, bottom, right = out_pad
    wl = plan.wl
    assert y.shape == (wl.N, plan.OCB, wl.OH + top + bottom, wl.OW + left + right, plan.oc_bn)
    inner = y[:, :, top: top + wl.OH, left: left + wl.OW]
    border = y.copy()
    border[:, :, top: top + wl.OH, left: left + wl.OW] = 0
    assert not np.isnan(y).any() and not border.any()
    ref = conv2d_nchw(x, w, b, wl.stride, wl.padding, groups=groups)
    if residual:
        ref = ref + r.transpose(0, 1, 4, 2, 3).reshape(ref.shape)
    got = inner.transpose(0, 1, 4, 2, 3).reshape(wl.N, plan.K_pad, wl.OH, wl.OW)[:, : w_shape[0]]
    assert rel_err(got, np.maximum(ref, 0)) <= TOL


@pytest.mark.parametrize("case", [
    # x, w, stride, padding, groups, data_bn
    ((2, 160, 14, 13), (160, 16, 3, 3), 1, 1, 10, 32),  # RegNet-X: groups of 16 in blocks of 32, batch 2
    ((1, 64, 15, 15), (64, 16, 3, 3), 2, 1, 4, 64),  # four groups in one block, stride 2
    ((1, 128, 9, 9), (256, 32, 3, 3), 1, 0, 4, 64),  # groups of 32 (ResNeXt's last stage), 64 out
    ((1, 96, 7, 7), (96, 32, 1, 1), 1, 0, 3, 96),  # one block of three groups
])
def test_grouped_kernel_reads_wider_blocks(case):
    """Conv2dPlan.data_bn: a grouped convolution reads each group at its offset in its
    producer's wider blocks (no re-blocked copy): the float64 reference, bias and relu."""
    import tvm

    from tvm_ext.kernels.conv2d import Epilogue, conv2d_blocked_kernel, pack_weight_array, plan_conv2d
    from tvm_ext.target import resolve_target, vector_isa

    x_shape, w_shape, stride, pad, groups, data_bn = case
    target = resolve_target("llvm")
    isa = vector_isa(target)
    wl = Conv2dWorkload.make(x_shape, w_shape, stride, pad, 1, groups)
    plan = plan_conv2d(wl, isa, data_bn=data_bn)
    assert (plan.kind, plan.ic_bn, plan.in_bn) == ("brgemm", w_shape[1], data_bn)
    assert plan.data_shape()[1:2] + plan.data_shape()[4:] == (x_shape[1] // data_bn, data_bn)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    b = rng.standard_normal(w_shape[0], dtype=np.float32)
    conv = tvm.compile(conv2d_blocked_kernel(plan, isa.lanes, Epilogue(bias=True, activation="relu")), target)
    yb = tvm.runtime.tensor(np.full(plan.out_shape(), np.nan, np.float32))
    conv(tvm.runtime.tensor(_pack_nchwc(x, plan)), tvm.runtime.tensor(pack_weight_array(plan, w)),
         tvm.runtime.tensor(b.reshape(plan.OCB, plan.oc_bn)), yb)
    y = yb.numpy().transpose(0, 1, 4, 2, 3).reshape(wl.N, plan.K_pad, wl.OH, wl.OW)
    ref = conv2d_nchw(x, w, b, wl.stride, wl.padding, groups=groups)
    assert rel_err(y, np.maximum(ref, 0)) <= TOL


@pytest.mark.parametrize(("x_shape", "w_shape", "groups", "data_bn", "message"), [
    ((1, 64, 8, 8), (64, 64, 3, 3), 1, 32, "only a grouped convolution"),
    ((1, 64, 8, 8), (64, 1, 3, 3), 64, 32, "only a grouped convolution"),  # depthwise
    ((1, 64, 8, 8), (64, 8, 3, 3), 8, 32, "only a grouped convolution"),  # 8 channels a group
    ((1, 96, 8, 8), (96, 32, 3, 3), 3, 48, "do not hold whole groups"),
    ((1, 96, 8, 8), (96, 16, 3, 3), 6, 64, "do not hold whole groups"),  # 96 channels: not whole blocks
    ((1, 64, 8, 8), (64, 16, 3, 3), 4, 16, "do not hold whole groups"),  # not wider
])
def test_wider_data_blocks_are_validated(x_shape, w_shape, groups, data_bn, message):
    from tvm_ext.kernels.conv2d import plan_conv2d
    from tvm_ext.target import AVX512

    with pytest.raises(ValueError, match=message):
        plan_conv2d(Conv2dWorkload.make(x_shape, w_shape, 1, 1, 1, groups), AVX512, data_bn=data_bn)


def test_epilogue_border_is_validated():
    from tvm_ext.kernels.conv2d import Epilogue

    assert Epilogue(out_pad=[1, 0, 1, 0]).out_pad == (1, 0, 1, 0)  # from JSON, a list
    with pytest.raises(ValueError, match="out_pad must be 4 non-negative"):
        Epilogue(out_pad=(1, -1, 0, 0))
    with pytest.raises(ValueError, match="out_pad must be 4 non-negative"):
        Epilogue(out_pad=(1, 1))
    with pytest.raises(ValueError, match="not to nchw_out"):
        Epilogue(nchw_out=True, out_pad=(1, 1, 1, 1))
    assert Epilogue(mask="relu", mask_pad=[0, 1, 0, 1]).mask_pad == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="mask_pad must be 4 non-negative"):
        Epilogue(mask="relu", mask_pad=(1, 1, 1))
    with pytest.raises(ValueError, match="mask read in the blocked layout"):
        Epilogue(mask_pad=(1, 1, 1, 1))


def test_prepacked_conv2d_module():
    """ops.Conv2d packs its weights once per input shape; results equal ops.conv2d's reference."""
    rng = np.random.default_rng(21)
    w = rng.standard_normal((24, 8, 3, 3), dtype=np.float32)
    b = rng.standard_normal(24, dtype=np.float32)
    conv = ops.Conv2d(w, b, stride=2, padding=(1, 0, 2, 1))
    original = w.copy()
    w[...] = 0  # the module copied its weights
    for shape in ((1, 8, 11, 13), (2, 8, 9, 9)):
        x = rng.standard_normal(shape, dtype=np.float32)
        for _ in range(2):  # the second call reuses the packed weights
            assert rel_err(conv(x), conv2d_nchw(x, original, b, (2, 2), (1, 0, 2, 1))) <= TOL
    assert len(conv._packed) == 2
    with pytest.raises(ValueError, match="bias has 3 entries"):
        ops.Conv2d(w, b[:3])
    with pytest.raises(ValueError, match="float32"):
        conv(np.zeros((1, 8, 9, 9), np.float64))


@pytest.mark.parametrize("x_shape,w_shape,groups", [
    ((1, 64, 8, 8), (96, 64, 3, 3), 1),     # register tiles, 3x3 rows cross channel boundaries
    ((1, 32, 8, 8), (40, 32, 1, 1), 1),     # 40 channels: the last block is partly zero
    ((1, 32, 8, 8), (48, 16, 7, 1), 2),     # groups, non-square filter
    ((1, 3, 8, 8), (16, 3, 7, 7), 1),       # 3 input channels: the element-wise schedule
    ((1, 32, 8, 8), (32, 1, 3, 3), 32),     # depthwise
])
def test_pack_weight_is_the_blocked_layout(x_shape, w_shape, groups):
    """pack_weight_func (and pack_weight_array, for build-time constants) write exactly
    OIHW -> O/y, I/x, KH, KW, x, y, zeros past the last channel."""
    import tvm

    from tvm_ext.kernels.conv2d import pack_weight_array, pack_weight_func

    plan = ops.conv2d_plan(x_shape, w_shape, padding=1, groups=groups)
    w = np.random.default_rng(5).standard_normal(w_shape, dtype=np.float32)
    packed = tvm.runtime.tensor(np.full(plan.weight_shape(), np.nan, np.float32))
    tvm.compile(pack_weight_func(plan), resolve_target("llvm"))(tvm.runtime.tensor(w), packed)
    # The layout's definition, element by element (pack_weight_array reshapes and transposes).
    expected = np.zeros(plan.weight_shape(), np.float32)
    for index in np.ndindex(*plan.weight_shape()):
        if plan.kind == "depthwise":
            ob, r, s, o = index
            k, i = ob * plan.oc_bn + o, 0
        else:
            ob, ib, r, s, i, o = index
            k, i = ob * plan.oc_bn + o, ib * plan.ic_bn + i
        if k < w_shape[0]:
            expected[index] = w[k, i, r, s]
    np.testing.assert_array_equal(packed.numpy(), expected)
    np.testing.assert_array_equal(pack_weight_array(plan, w), expected)


@pytest.mark.parametrize("shape, stride", [((1, 32, 14, 14), 2), ((2, 16, 15, 13), (2, 3)), ((1, 8, 7, 7), 3)])
def test_strided_pointwise_convolution_reads_only_the_pixels_it_uses(shape, stride):
    """A strided 1x1 convolution reads every stride-th pixel of the NCHW input in place (no
    packing): same result as PyTorch, for conv2d and the prepacked Conv2d."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((24, shape[1], 1, 1)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    pair = (stride, stride) if isinstance(stride, int) else stride
    ref = conv2d_nchw(x, w, b, stride=pair)
    for got in (ops.conv2d(x, w, b, stride=stride), ops.Conv2d(w, b, stride=stride)(x)):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
