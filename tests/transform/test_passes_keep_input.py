"""tvm_ext's graph passes return a rewritten module and leave the caller's as it was (they used
to assign the rewritten functions into the module they were given)."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from tvm_ext import transform


def _graph() -> tvm.IRModule:
    """conv -> batch norm (inference) -> x * sigmoid(x) -> a channels-last Linear and relu -> a training-mode
    batch norm whose running statistics are returned: something for each pass to rewrite."""
    rng = np.random.default_rng(0)
    const = lambda *shape: relax.const(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    bb, op = relax.BlockBuilder(), relax.op
    x = relax.Var("x", relax.TensorType((1, 8, 4, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.conv2d(x, op.multiply(const(8, 8, 3, 3), relax.const(0.5, "float32")), padding=1))
            norm = bb.emit(op.nn.batch_norm(y, const(8), const(8), const(8), relax.const(np.ones(8, np.float32)),
                                            axis=1, training=False))
            y = bb.emit(relax.TupleGetItem(norm, 0))
            y = bb.emit(op.multiply(y, op.sigmoid(y)))
            y = bb.emit(op.permute_dims(y, [0, 2, 3, 1]))
            y = bb.emit(op.add(op.matmul(y, const(8, 8)), const(8)))
            y = bb.emit(op.permute_dims(y, [0, 3, 1, 2]))
            y = bb.emit(op.permute_dims(op.nn.relu(op.permute_dims(y, [0, 2, 3, 1])), [0, 3, 1, 2]))
            train = bb.emit(op.nn.batch_norm(y, const(8), const(8), const(8), relax.const(np.ones(8, np.float32)),
                                             axis=1, training=True))
            outs = [bb.emit_output(op.nn.relu(relax.TupleGetItem(train, 0)))]
            outs += [bb.emit_output(relax.TupleGetItem(train, i)) for i in (1, 2)]
        bb.emit_func_output(relax.Tuple(outs))
    return bb.get()


PASSES = ["channels_last_as_nchw", "fold_batch_norm", "fold_constants_in_numpy", "matmul_as_conv2d", "recognise_silu",
          "split_running_statistics", "unique_constants"]


@pytest.mark.parametrize("name", PASSES)
def test_pass_leaves_its_input_alone(name):
    mod = _graph()
    before = mod["main"]
    out = getattr(transform, name)()(mod)
    assert mod["main"].same_as(before), f"{name} changed the module it was given"
    if name != "unique_constants":  # (every constant of this graph has one use)
        assert not tvm_ffi.structural_equal(out["main"], before), f"{name} rewrote nothing: the test misses it"
