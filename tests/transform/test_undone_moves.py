"""undone_moves: chains of data moves that leave their start's elements in their order."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_ext.transform import undone_moves


def _moves(steps: list, shape=(1, 6, 1, 35), dtype: str = "uint8") -> tvm.IRModule:
    """x -> steps ("T": a transpose of a 2-D tensor, ("permute", axes), or a shape) -> x * 1 (a
    reader of the moved value) and the moved value."""
    op = relax.op
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = xv
            for step in steps:
                if step == "T":
                    y = bb.emit(op.permute_dims(y, [1, 0]))
                elif step[0] == "permute":
                    y = bb.emit(op.permute_dims(y, step[1]))
                else:
                    y = bb.emit(op.reshape(y, step))
            out = bb.emit_output(relax.Tuple([bb.emit(op.multiply(y, relax.const(np.asarray(1, dtype)))), y]))
        bb.emit_func_output(out)
    return bb.get()


def _count(mod: tvm.IRModule, name: str) -> int:
    return mod["main"].script().count(f"R.{name}(")


@pytest.mark.parametrize("steps, undone", [
    # a dense layer's rows for a 1x1 convolution (1, K, 1, M) -> (K, M) -> (M, K), and back
    ([(6, 35), "T", (1, 5, 7, 6), (35, 6), "T", (1, 6, 1, 35)], True),
    ([(6, 35), "T", "T"], True),  # -> a reshape (6, 35) of x, a view
    ([("permute", [0, 2, 3, 1]), ("permute", [0, 3, 1, 2])], True),
    ([(6, 35), "T", (35, 6)], False),  # one transpose moves the elements
    ([(6, 35), "T", (5, 42), "T"], False),  # two that do not undo each other
    ([("permute", [0, 2, 3, 1]), ("permute", [0, 2, 3, 1])], False),
])
def test_moves_that_undo_each_other_become_a_view_of_their_start(steps, undone):
    """The chain's end becomes x (its shape) or a reshape of x, and nothing else moves; chains
    that move elements stay as they were. Either way the values are the stock build's, and the
    module given is left as it was."""
    mod = _moves(steps)
    before = mod["main"]
    rewritten = undone_moves()(mod)
    assert mod["main"].same_as(before)  # (the module given is left as it was)
    assert (_count(rewritten, "permute_dims") == 0) == undone, rewritten.script()
    if not undone:
        assert _count(rewritten, "permute_dims") == _count(mod, "permute_dims")
    x = np.random.default_rng(0).integers(0, 256, (1, 6, 1, 35)).astype(np.uint8)
    run = lambda m: [t.numpy() for t in relax.VirtualMachine(tvm.compile(m, "llvm"), tvm.cpu())["main"](  # noqa: E731
        tvm.runtime.tensor(x))]
    for got, want in zip(run(rewritten), run(mod), strict=True):
        np.testing.assert_array_equal(got, want)


def test_replay_moves_moves_another_tensor_alike():
    """The moves of x -> reshape -> transpose emitted again on y: y's elements moved as x's."""
    from tvm_ext.transform import replay_moves

    op = relax.op
    x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
    y = relax.Var("y", relax.TensorType((2, 3, 4), "float32"))
    moves = [op.reshape(x, (6, 4))]
    moves.append(op.permute_dims(moves[0], [1, 0]))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(replay_moves(bb, y, moves))
        bb.emit_func_output(out)
    values = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    got = relax.VirtualMachine(tvm.compile(bb.get(), "llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(np.zeros_like(values)), tvm.runtime.tensor(values)).numpy()
    np.testing.assert_array_equal(got, values.reshape(6, 4).T)
