"""split_running_statistics: a training-mode batch norm's new running statistics read from a copy
of its call placed after y's consumers, so that y can fuse with them."""

import numpy as np
import tvm
from tvm import relax

from tvm_ext.transform import split_running_statistics


def _graph(read_y: bool) -> tvm.IRModule:
    bb, op = relax.BlockBuilder(), relax.op
    x = relax.Var("x", relax.TensorType((2, 4, 3, 3), "float32"))
    gamma, beta, mean, var = (relax.Var(n, relax.TensorType((4,), "float32")) for n in ("g", "b", "m", "v"))
    with bb.function("main", [x, gamma, beta, mean, var]):
        with bb.dataflow():
            norm = bb.emit(op.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=True))
            stats = [bb.emit(relax.TupleGetItem(norm, i)) for i in (1, 2)]
            outs = [bb.emit_output(op.nn.relu(relax.TupleGetItem(norm, 0)))] if read_y else []
            outs += [bb.emit_output(op.multiply(s, relax.const(2.0, "float32"))) for s in stats]
        bb.emit_func_output(relax.Tuple(outs))
    return bb.get()


def _values(bindings) -> list:
    return [b.value for b in bindings]


def test_statistics_read_from_a_copy_after_the_relu():
    mod = _graph(read_y=True)
    split = split_running_statistics()(mod)
    bindings = list(split["main"].body.blocks[0].bindings)
    norms = [b for b in bindings if isinstance(b.value, relax.Call) and b.value.op.name == "relax.nn.batch_norm"]
    assert len(norms) == 2
    relu = next(i for i, b in enumerate(bindings)
                if isinstance(b.value, relax.Call) and b.value.op.name == "relax.nn.relu")
    copy = bindings.index(norms[1])
    assert relu < copy  # after y's consumer
    readers = [b.value.tuple_value for b in bindings if isinstance(b.value, relax.TupleGetItem)]
    assert all(r.same_as(norms[1].var) for r in readers if not r.same_as(norms[0].var))
    assert sum(r.same_as(norms[0].var) for r in readers) == 1  # y alone
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((2, 4, 3, 3)), rng.uniform(0.5, 1.5, 4), rng.standard_normal(4),
            rng.standard_normal(4), rng.uniform(0.5, 1.5, 4)]
    args = [tvm.runtime.tensor(a.astype(np.float32)) for a in args]

    def run(module):
        out = relax.VirtualMachine(tvm.compile(module, "llvm"), tvm.cpu())["main"](*args)
        return [o.numpy() for o in out]

    for got, want in zip(run(split), run(mod), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_batch_norm_read_only_for_its_statistics_is_left_alone():
    mod = _graph(read_y=False)
    split = split_running_statistics()(mod)
    assert split["main"].same_as(mod["main"])


def test_lowering_normalizes_once_with_the_relu_fused():
    """Through the CPU pipeline: one batch norm kernel with the relu in it, whose statistics also
    give the running ones (no statistics-only pass over x, no relu pass)."""
    from reference import kernel_calls

    import tvm_ext

    calls = kernel_calls(_graph(read_y=True), tvm_ext.resolve_target("llvm"))
    norms = [name for name in calls if name.startswith(("tvm_ext_batch_norm", "tvm_ext_batch_statistics"))]
    assert len(norms) == 1 and norms[0].endswith("_relu"), calls
    assert not any(name.startswith(("tvm_ext_relu", "relu")) for name in calls), calls
