"""The eager API's cache of compiled signatures: bounded (entries, bytes), least recently used out
first, emptied by clear_cache, one kernel per activation whatever the size, and safe to evict
while other threads run what it held."""

import gc
import os
import threading

import numpy as np
import pytest
from reference import conv2d_nchw, rel_err

from tvm_ext import ops
from tvm_ext.ops import forward


@pytest.fixture
def small_cache():
    """A cache of at most 8 signatures and 64 MiB, emptied before and after the test."""
    ops.clear_cache()
    previous = ops.set_cache_limit(max_entries=8, max_bytes=64 << 20)
    yield 8, 64 << 20
    ops.set_cache_limit(*previous)
    ops.clear_cache()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _within(limit: tuple[int, int]) -> bool:
    entries, nbytes = limit
    return ops.cache_size() <= entries and (ops.cache_bytes() <= nbytes or ops.cache_size() == 1)


def test_an_activation_is_one_kernel_for_every_size(small_cache):
    """The issue: one kernel per element count (200 sizes: +233 MB). Sizes around the vector
    loop's tail are right too."""
    for size in (1, 2, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 3 * 224 * 224 + 5):
        x = np.random.default_rng(size).standard_normal(size, dtype=np.float32) * 5
        np.testing.assert_array_equal(ops.relu(x), np.maximum(x, 0))
        np.testing.assert_array_equal(ops.relu6(x.reshape(1, -1)), np.clip(x, 0, 6).reshape(1, -1))
    assert ops.cache_size() == 2


@pytest.mark.slow
@pytest.mark.long
def test_memory_stays_bounded_over_500_shapes(small_cache):
    """The issue: 200 convolution shapes grew a process from 620 to 1642 MB, and the caches never
    shrank. 500 activation sizes, 40 convolutions and 40 poolings later the cache holds at most
    its limit, and the process grew by ~40 MB (unbounded, the 80 signatures after the
    activations alone took 250 MB; before, the 500 activation sizes took 600 MB more)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 4, 7, 7), dtype=np.float32)
    ops.conv2d(x, rng.standard_normal((8, 4, 3, 3), dtype=np.float32))  # warm: the LLVM backend, the pool
    ops.max_pool2d(x, 2)
    activations = [ops.relu, ops.relu6, ops.sigmoid, ops.silu, ops.gelu, lambda v: ops.leaky_relu(v, 0.1)]
    start = _rss_mb()
    for i in range(500):
        v = rng.standard_normal(i + 1, dtype=np.float32)
        activations[i % len(activations)](v)
        assert _within(small_cache)
    for c in range(1, 41):
        x = rng.standard_normal((1, c, 6, 5 + c % 3), dtype=np.float32)
        w = rng.standard_normal((8, c, 3, 3), dtype=np.float32)
        assert rel_err(ops.conv2d(x, w, padding=1), conv2d_nchw(x, w, padding=(1, 1, 1, 1))) <= 1e-5
        ops.max_pool2d(x, 2)
        assert _within(small_cache)
    gc.collect()
    grown = _rss_mb() - start
    assert grown < 120, f"RSS grew by {grown:.0f} MB over 580 signatures with a cache of 8"


def test_the_byte_limit_evicts_workspaces(small_cache):
    """A convolution's workspace (its padded, blocked input: 4 MiB here) counts: two signatures
    with their kernels are more than 12 MiB, so the older goes."""
    ops.set_cache_limit(max_bytes=12 << 20)
    w = np.ones((8, 8, 3, 3), np.float32)
    ops.conv2d(np.ones((1, 8, 360, 360), np.float32), w, padding=1)
    assert ops.cache_bytes() > 4 * 8 * 362 * 362
    ops.conv2d(np.ones((1, 8, 362, 360), np.float32), w, padding=1)
    assert ops.cache_size() == 1 and ops.cache_bytes() <= 12 << 20


def test_clear_cache_empties_it_and_ops_still_work(small_cache):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 8, 6, 6), dtype=np.float32)
    w = rng.standard_normal((8, 8, 3, 3), dtype=np.float32)
    ops.conv2d(x, w, padding=1)
    ops.relu(x)
    ops.global_avg_pool2d(x)
    assert ops.cache_size() == 3 and ops.cache_bytes() > 0
    ops.clear_cache()
    assert ops.cache_size() == 0 and ops.cache_bytes() == 0
    assert rel_err(ops.conv2d(x, w, padding=1), conv2d_nchw(x, w, padding=(1, 1, 1, 1))) <= 1e-5
    np.testing.assert_array_equal(ops.relu(x), np.maximum(x, 0))
    assert ops.cache_size() == 2


def test_least_recently_used_goes_first(small_cache):
    ops.set_cache_limit(max_entries=2)
    x = np.ones((1, 8, 4, 4), np.float32)
    ops.relu(x)
    ops.sigmoid(x)
    ops.relu(x)  # sigmoid is now the oldest
    ops.gelu(x)
    keys = [key[0][1] for key in forward._CACHE._entries]
    assert keys == ["relu", "gelu"]


def test_set_cache_limit_checks_and_returns_the_previous_limit(small_cache):
    assert ops.set_cache_limit(max_entries=np.int64(5)) == (8, 64 << 20)
    assert ops.set_cache_limit() == (5, 64 << 20)
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        ops.set_cache_limit(max_entries=0)
    with pytest.raises(TypeError, match="max_bytes"):
        ops.set_cache_limit(max_bytes=1.5e9)


def test_an_evicted_kernel_finishes_the_call_running_it(small_cache, monkeypatch):
    """Evicting drops the cache's reference only: a call that holds the kernel keeps its modules
    and workspace alive. Here the whole cache is cleared (and collected) between packing the
    input into the workspace and the convolution reading it."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 16, 9, 9), dtype=np.float32)
    w = rng.standard_normal((16, 16, 3, 3), dtype=np.float32)
    kernel = forward._conv_kernel(x.shape, w.shape, False, (1, 1), (1, 1, 1, 1), (1, 1), 1, None)
    pack_data = kernel.pack_data

    def pack_then_evict(*args):
        pack_data(*args)
        ops.clear_cache()
        gc.collect()

    monkeypatch.setattr(kernel, "pack_data", pack_then_evict)
    assert rel_err(ops.conv2d(x, w, padding=1), conv2d_nchw(x, w, padding=(1, 1, 1, 1))) <= 1e-5
    assert ops.cache_size() == 0


def test_threads_running_while_the_cache_evicts():
    """4 threads over more signatures than a 2-entry cache holds: every call evicts one that
    another thread may be running; every result is right."""
    ops.clear_cache()
    previous = ops.set_cache_limit(max_entries=2)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 8, 10, 10), dtype=np.float32)
    expected = {
        "relu": np.maximum(x, 0),
        "max_pool2d": ops.max_pool2d(x, 2),
        "avg_pool2d": ops.avg_pool2d(x, 3, 1, 1),
        "relu6": np.clip(x, 0, 6),
    }
    calls = {"relu": ops.relu, "max_pool2d": lambda v: ops.max_pool2d(v, 2),
             "avg_pool2d": lambda v: ops.avg_pool2d(v, 3, 1, 1), "relu6": ops.relu6}
    barrier, errors = threading.Barrier(4), []

    def work(i: int) -> None:
        barrier.wait()
        try:
            for j in range(6):
                name = list(calls)[(i + j) % 4]
                np.testing.assert_array_equal(calls[name](x), expected[name], err_msg=name)
                assert ops.cache_size() <= 2
        except BaseException as err:  # noqa: B036 - reported below
            errors.append(err)

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        ops.set_cache_limit(*previous)
        ops.clear_cache()
    if errors:
        raise errors[0]


def test_prepacked_conv2d_keeps_one_packing_per_layout(small_cache):
    """Conv2d kept a packed copy of its weights for every input shape it saw (a server with
    dynamic sizes: a copy of the weights each); the packed layout depends on the plan's blocking,
    which input shapes of the same channels share."""
    rng = np.random.default_rng(10)
    w = rng.standard_normal((16, 16, 3, 3), dtype=np.float32)
    conv = ops.Conv2d(w, padding=1)
    shapes = [(1, 16, 8, 8), (1, 16, 9, 7), (2, 16, 6, 6), (1, 16, 12, 5)]
    for shape in shapes:
        x = rng.standard_normal(shape, dtype=np.float32)
        assert rel_err(conv(x), conv2d_nchw(x, w, padding=(1, 1, 1, 1))) <= 1e-5
    layouts = {(p.kind, p.weight_shape()) for p in (ops.conv2d_plan(s, w.shape, padding=1) for s in shapes)}
    assert len(conv._packed) == len(shapes)
    assert len({id(t) for t in conv._packed.values()}) == len(layouts) < len(shapes)
