"""The eager API on valid inputs it refused (read-only arrays, NumPy integers, padding="same",
0-d arrays, empty batches) and on invalid ones, refused with an error naming the argument
before anything is compiled."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference import conv2d_nchw, rel_err

from tvm_ext import ops
from tvm_ext.errors import UnsupportedError

ACTIVATIONS = {
    "relu": (ops.relu, F.relu), "relu6": (ops.relu6, F.relu6), "sigmoid": (ops.sigmoid, torch.sigmoid),
    "silu": (ops.silu, F.silu), "gelu": (ops.gelu, F.gelu),
    "leaky_relu": (lambda x: ops.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2)),
}


def _torch(fn, *arrays, **kw) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "same" with an even kernel: a padded copy
        return fn(*(torch.from_numpy(np.array(a, np.float64)) if isinstance(a, np.ndarray) else a
                    for a in arrays), **kw).numpy()


def _read_only(arr: np.ndarray, aligned: bool) -> np.ndarray:
    """`arr` as read-only memory: 64-byte aligned (shared with TVM as it is) or as np.frombuffer gives it."""
    if aligned:
        out = ops.aligned_empty(arr.shape)
        out[...] = arr
    else:
        out = np.frombuffer(arr.tobytes(), np.float32).reshape(arr.shape)
    out.flags.writeable = False
    return out


@pytest.mark.parametrize("source", ["aligned", "frombuffer", "memmap"])
def test_read_only_arrays_are_inputs_like_any_other(source, tmp_path):
    """The issue: DLPack's BufferError ("Cannot export readonly array") for arrays the ops only read."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 8, 9, 9), dtype=np.float32)
    w = rng.standard_normal((8, 8, 3, 3), dtype=np.float32)
    b = rng.standard_normal(8, dtype=np.float32)
    if source == "memmap":
        for name, arr in (("x", x), ("w", w), ("b", b)):
            np.save(tmp_path / f"{name}.npy", arr)
        xr, wr, br = (np.load(tmp_path / f"{name}.npy", mmap_mode="r") for name in ("x", "w", "b"))
    else:
        xr, wr, br = (_read_only(a, source == "aligned") for a in (x, w, b))
    assert not xr.flags.writeable and not wr.flags.writeable

    ref = conv2d_nchw(x, w, b, padding=(1, 1, 1, 1))
    assert rel_err(ops.conv2d(xr, wr, br, padding=1), ref) <= 1e-5
    assert rel_err(ops.Conv2d(wr, br, padding=1)(xr), ref) <= 1e-5
    np.testing.assert_array_equal(ops.max_pool2d(xr, 3, 2, 1), ops.max_pool2d(x, 3, 2, 1))
    np.testing.assert_array_equal(ops.avg_pool2d(xr, 2), ops.avg_pool2d(x, 2))
    np.testing.assert_array_equal(ops.global_avg_pool2d(xr), ops.global_avg_pool2d(x))
    for name, (ours, _) in ACTIVATIONS.items():
        np.testing.assert_array_equal(ours(xr), ours(x), err_msg=name)
    assert not xr.flags.writeable  # read, never written (nor made writable)


def test_numpy_integers_as_sizes():
    """The issue: "'numpy.int64' object is not iterable" for stride=np.int64(2) and the like."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 8, 11, 10), dtype=np.float32)
    w = rng.standard_normal((16, 8, 3, 3), dtype=np.float32)
    i64, i32 = np.int64, np.int32
    got = ops.conv2d(x, w, stride=i64(2), padding=i32(1), dilation=i64(1), groups=i64(1))
    ref = conv2d_nchw(x, w, stride=(2, 2), padding=(1, 1, 1, 1))
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-5
    got = ops.conv2d(x, w, stride=(i64(1), i32(2)), padding=np.array([1, 2]), dilation=(i64(2), 1))
    ref = conv2d_nchw(x, w, stride=(1, 2), padding=(1, 2, 1, 2), dilation=(2, 1))
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-5
    assert rel_err(ops.Conv2d(w, stride=i64(2), padding=i64(1))(x), conv2d_nchw(x, w, stride=(2, 2),
                                                                             padding=(1, 1, 1, 1))) <= 1e-5
    np.testing.assert_array_equal(ops.max_pool2d(x, i64(3), i64(2), i32(1), dilation=i64(1)),
                                  _torch(F.max_pool2d, x, 3, 2, 1).astype(np.float32))
    np.testing.assert_allclose(ops.avg_pool2d(x, (i64(2), i64(3)), stride=i32(1), padding=(i64(1), 0)),
                               _torch(F.avg_pool2d, x, (2, 3), 1, (1, 0)), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="stride"):
        ops.conv2d(x, w, stride=2.0)
    with pytest.raises(TypeError, match="kernel_size"):
        ops.max_pool2d(x, 2.5)


SAME = [  # kernel, dilation: odd and even totals, so both symmetric and bottom/right-heavy padding
    ((3, 3), 1), ((2, 4), 1), ((1, 1), 1), ((5, 2), 1), ((3, 2), (2, 3)), ((4, 4), 2),
]


@pytest.mark.parametrize("kernel, dilation", SAME)
def test_padding_same_matches_pytorch(kernel, dilation):
    """The issue: "invalid literal for int()". PyTorch puts an odd total's extra at the bottom/right."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 8, 9, 10), dtype=np.float32)
    w = rng.standard_normal((16, 8, *kernel), dtype=np.float32)
    b = rng.standard_normal(16, dtype=np.float32)
    ref = _torch(F.conv2d, x, w, b, padding="same", dilation=dilation)
    got = ops.conv2d(x, w, b, padding="same", dilation=dilation)
    assert got.shape == ref.shape == (1, 16, 9, 10)
    assert rel_err(got, ref) <= 1e-4
    assert rel_err(ops.Conv2d(w, b, padding="same", dilation=dilation)(x), ref) <= 1e-4


def test_padding_valid_and_bad_strings():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 8, 9, 10), dtype=np.float32)
    w = rng.standard_normal((8, 8, 3, 2), dtype=np.float32)
    ref = _torch(F.conv2d, x, w, padding="valid", stride=2)
    got = ops.conv2d(x, w, padding="valid", stride=2)
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4
    assert rel_err(ops.Conv2d(w, padding="valid", stride=2)(x), ref) <= 1e-4
    before = ops.cache_size()
    with pytest.raises(ValueError, match="padding='same'.*strided"):
        ops.conv2d(x, w, padding="same", stride=2)
    with pytest.raises(ValueError, match="padding='same'.*strided"):
        ops.Conv2d(w, padding="same", stride=(1, 2))
    with pytest.raises(ValueError, match="padding must be .*'same'.*'full'"):
        ops.conv2d(x, w, padding="full")
    assert ops.cache_size() == before  # refused before compiling


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_of_a_0d_array_is_0d(name):
    """The issue: a 0-d array came back with shape (1,)."""
    ours, theirs = ACTIVATIONS[name]
    for value in (-2.5, 0.75):
        x = np.array(value, np.float32)
        got = ours(x)
        assert got.shape == () and got.dtype == np.float32
        np.testing.assert_allclose(got, _torch(theirs, x), rtol=1e-6, atol=1e-7)
    assert ours(np.float32(-1.0)).shape == ()


def test_empty_inputs_follow_pytorch_or_name_the_problem():
    """Empty batches give PyTorch's empty result; what PyTorch refuses (or gets inconsistent) is a
    ValueError naming the shape, before any compile: the issue had "Data is not aligned to 64
    bytes" and "Divide by zero"."""
    before = ops.cache_size()
    for name, (ours, _) in ACTIVATIONS.items():
        for shape in ((0,), (2, 0, 3), (0, 8, 1, 1)):
            got = ours(np.empty(shape, np.float32))
            assert got.shape == shape and got.dtype == np.float32, name
    w = np.ones((6, 4, 3, 3), np.float32)
    for kw in ({}, {"padding": "same"}, {"stride": 2, "padding": 1}):
        x = np.empty((0, 4, 8, 7), np.float32)
        ref = _torch(F.conv2d, x, w, **kw)
        assert ops.conv2d(x, w, np.ones(6, np.float32), **kw).shape == ref.shape
        assert ops.Conv2d(w, **kw)(x).shape == ref.shape
    x = np.empty((0, 4, 8, 7), np.float32)
    assert ops.max_pool2d(x, 3, 2, 1).shape == _torch(F.max_pool2d, x, 3, 2, 1).shape
    assert ops.avg_pool2d(x, 2).shape == _torch(F.avg_pool2d, x, 2).shape
    assert ops.max_pool2d(np.empty((2, 0, 8, 7), np.float32), 2).shape == (2, 0, 4, 3)
    assert ops.global_avg_pool2d(x).shape == (0, 4, 1, 1)
    assert ops.global_avg_pool2d(np.empty((3, 0, 5, 5), np.float32)).shape == (3, 0, 1, 1)
    assert ops.cache_size() == before  # nothing compiled for nothing to compute

    with pytest.raises(ValueError, match=r"data of shape \(1, 0, 8, 8\)"):
        ops.conv2d(np.ones((1, 0, 8, 8), np.float32), np.ones((6, 0, 3, 3), np.float32))
    with pytest.raises(ValueError, match=r"weight of shape \(0, 4, 3, 3\) is empty"):
        ops.conv2d(np.ones((1, 4, 8, 8), np.float32), np.ones((0, 4, 3, 3), np.float32))
    with pytest.raises(ValueError, match=r"weight of shape \(6, 4, 0, 3\) is empty"):
        ops.Conv2d(np.ones((6, 4, 0, 3), np.float32))
    with pytest.raises(ValueError, match=r"data of shape \(1, 4, 0, 8\)"):
        ops.conv2d(np.ones((1, 4, 0, 8), np.float32), w, padding=2)
    with pytest.raises(ValueError, match=r"max_pool2d: .*empty 0x8 image"):
        ops.max_pool2d(np.ones((1, 4, 0, 8), np.float32), 2)
    with pytest.raises(ValueError, match=r"global_avg_pool2d: .*empty 0x0 image"):
        ops.global_avg_pool2d(np.ones((1, 2, 0, 0), np.float32))


def test_shapes_past_int32_are_refused_before_compiling():
    """The issue: "Literal value ... exceeds range of int32" mid-compile. np.broadcast_to gives
    the huge arrays as views of one element: refused without being copied."""
    before = ops.cache_size()
    huge = np.broadcast_to(np.float32(1), (1, 1, 50000, 50000))  # 2.5e9 elements, 4 bytes of memory
    for op in (ops.relu, ops.gelu, lambda x: ops.leaky_relu(x, 0.1), ops.global_avg_pool2d,
               lambda x: ops.max_pool2d(x, 2), lambda x: ops.avg_pool2d(x, 2)):
        with pytest.raises(UnsupportedError, match=r"data: shape \(1, 1, 50000, 50000\) has 2500000000 elements.*"
                                                   r"2147483647 \(2\^31 - 1\)"):
            op(huge)
    with pytest.raises(UnsupportedError, match="relu data: shape"):
        ops.relu(np.broadcast_to(np.float32(1), (2**31,)))
    with pytest.raises(UnsupportedError, match="conv2d data: shape"):
        ops.conv2d(huge, np.ones((1, 1, 3, 3), np.float32))
    big = np.broadcast_to(np.float32(1), (1, 1, 46000, 46000))  # fits; padded by 300 it does not
    with pytest.raises(UnsupportedError, match=r"conv2d padded data: shape \(1, 1, 46600, 46600\)"):
        ops.conv2d(big, np.ones((1, 1, 3, 3), np.float32), padding=300)
    with pytest.raises(UnsupportedError, match=r"conv2d output: shape \(1, 2, 46000, 46000\)"):
        ops.conv2d(big, np.ones((2, 1, 1, 1), np.float32))
    assert ops.cache_size() == before


def test_leaky_relu_slope_must_be_a_finite_number():
    """The issue: a TVMScript parse error ("Undefined variable: nan") for a NaN slope."""
    x = np.array([-2.0, -0.0, 0.0, 3.0], np.float32)
    before = ops.cache_size()
    for slope in (float("nan"), float("inf"), -float("inf"), np.float32("nan"), 1e39):
        with pytest.raises(ValueError, match="negative_slope must be a finite"):
            ops.leaky_relu(x, slope)
    for slope in ("0.1", None, [0.1], complex(0.1, 0)):
        with pytest.raises(TypeError, match="negative_slope must be a real number"):
            ops.leaky_relu(x, slope)
    assert ops.cache_size() == before
    np.testing.assert_array_equal(ops.leaky_relu(x, np.float32(0.5)), _torch(F.leaky_relu, x, 0.5))
    np.testing.assert_array_equal(ops.leaky_relu(x, np.int64(2)), _torch(F.leaky_relu, x, 2.0))


def test_prepacked_conv2d_is_refused_on_cuda_before_compiling():
    """ops.Conv2d packs its weights in the CPU kernels' blocked layout; on a CUDA target it
    failed at its first call (an AttributeError on a GPU: the CUDA kernel has no blocked plan).
    It says so at construction; ops.conv2d is the CUDA path."""
    w = np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(np.float32)
    for target in ("cuda -arch=sm_90", "nvidia/nvidia-h100"):
        with pytest.raises(UnsupportedError, match=r"Conv2d: prepacked weights are for CPU"):
            ops.Conv2d(w, padding=1, target=target)
    ops.Conv2d(w, padding=1, target="llvm")  # the CPU still prepacks
