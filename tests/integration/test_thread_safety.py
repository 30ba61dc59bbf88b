"""First calls from many threads at once (a threaded server warming up, MetaSchedule's
postprocessors in worker threads): every thread gets its result, none an error."""

import threading

import numpy as np
import pytest
from reference import conv2d_nchw, rel_err

from tvm_ext import ops
from tvm_ext.intrin.cpu import BRGEMM, get_brgemm_intrin
from tvm_ext.intrin.cpu_depthwise import DepthwiseTile, get_depthwise_intrin

THREADS = 8


def _all_at_once(work, count: int = THREADS) -> list:
    """Run work(i) in `count` threads released together; their results, or the first error."""
    barrier = threading.Barrier(count)
    results, errors = [None] * count, []

    def run(i):
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as err:  # noqa: B036 - reported to the test below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("round_", range(3))
def test_microkernels_register_once_under_threads(round_):
    """The issue: 1-3 of 4 threads raised "TensorIntrin '...' has already been registered"."""
    brgemm = BRGEMM(m_r=3, n_r=16, k=5 + round_, lanes=8, batch=(1, 3, 3))  # a k no layer uses: new
    assert set(_all_at_once(lambda i: get_brgemm_intrin(brgemm))) == {brgemm.name}
    tile = DepthwiseTile(m_r=2, n_r=8, lanes=8, kernel=(3 + round_, 7))
    assert set(_all_at_once(lambda i: get_depthwise_intrin(tile))) == {tile.name}


def test_eager_conv2d_first_calls_from_threads():
    """8 threads making the first call of one new signature together, over fresh signatures."""
    rng = np.random.default_rng(5)
    for channels in (3, 5, 6):
        x = rng.standard_normal((1, channels, 9, 10)).astype(np.float32)
        w = rng.standard_normal((8, channels, 3, 3)).astype(np.float32)
        ref = conv2d_nchw(x, w, padding=(1, 1, 1, 1))
        for out in _all_at_once(lambda i, x=x, w=w: ops.conv2d(x, w, padding=1)):
            assert rel_err(out, ref) <= 1e-5
