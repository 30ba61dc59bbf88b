"""Arithmetic on constants folded in NumPy (transform.fold_constants_in_numpy): the constants TVM's
FoldConstant computes, without compiling an op each (timm's NFNets standardize every weight in
the graph: FoldConstant took 15 of dm_nfnet_f0's 22 s of build)."""

import numpy as np
import tvm
from reference import rel_err
from tvm import relax

import tvm_ext
from tvm_ext.relax_info import op_name
from tvm_ext.transform import fold_constants_in_numpy


def _ops(mod: tvm.IRModule) -> list[str]:
    names = []
    relax.analysis.post_order_visit(mod["main"], lambda e: names.append(op_name(e)) if op_name(e) else None)
    return names


def _constant_graph(rng, ops) -> tvm.IRModule:
    """main() returning each op of `ops` applied to constants (each a function of the block
    builder's op namespace and a constant maker)."""
    const = lambda *shape: relax.const(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    bb = relax.BlockBuilder()
    with bb.function("main", []):
        with bb.dataflow():
            outs = [bb.emit_output(make(relax.op, const)) for make in ops]
        bb.emit_func_output(relax.Tuple(outs))
    return bb.get()


def _outputs(mod: tvm.IRModule) -> list[np.ndarray]:
    body = mod["main"].body
    values = {b.var: b.value for block in body.blocks for b in block.bindings}
    return [values.get(v, v).value.numpy() for v in body.body.fields]


def test_folds_what_fold_constant_computes():
    """Binary ops with broadcasting and scalars, reshape, permute_dims, instance norm (NFNet's
    weight standardization), each equal to FoldConstant's constant within float32 rounding."""
    ops = [
        lambda op, c: op.add(c(4, 3), c(3)),
        lambda op, c: op.subtract(c(2, 1, 5), c(3, 1)),
        lambda op, c: op.multiply(c(8, 1, 1, 1), relax.const(0.19245009, "float32")),
        lambda op, c: op.divide(c(4, 6), op.add(op.multiply(c(4, 6), c(4, 6)), relax.const(1.0, "float32"))),
        lambda op, c: op.permute_dims(c(2, 3, 4), [2, 0, 1]),
        lambda op, c: op.reshape(op.permute_dims(c(2, 3, 4)), (4, 6)),
        lambda op, c: op.nn.instance_norm(op.reshape(op.add(c(16, 3, 3, 3), relax.const(0.3, "float32")), (1, 16, 27)),
                                          c(16), c(16), channel_axis=1, axes=[0, 2], epsilon=1e-5),
    ]
    mod = _constant_graph(np.random.default_rng(5), ops)
    folded = fold_constants_in_numpy()(mod)
    assert _ops(folded) == [], _ops(folded)
    for got, want in zip(_outputs(folded), _outputs(relax.transform.FoldConstant()(mod)), strict=True):
        assert got.dtype == np.float32 and got.shape == want.shape
        assert rel_err(got, want) <= 1e-6


def test_leaves_what_it_does_not_compute_as_tvm():
    """An instance norm without its scale (TVM's legalization applies gamma regardless), an
    int32 op and an op on a graph input are left to FoldConstant and the build."""
    rng = np.random.default_rng(6)
    mod = _constant_graph(rng, [
        lambda op, c: op.nn.instance_norm(c(1, 4, 9), c(4), c(4), channel_axis=1, axes=[2], scale=False),
        lambda op, c: op.add(relax.const(np.arange(6, dtype=np.int32)), relax.const(np.int32(2))),
    ])
    assert _ops(fold_constants_in_numpy()(mod)) == ["relax.nn.instance_norm", "relax.add"]


def test_standardized_weights_build_as_stock_tvm():
    """conv2d over weights standardized in the graph (timm's ScaledStdConv2d as exported): the
    build folds them and equals stock TVM's."""
    rng = np.random.default_rng(7)
    bb, op = relax.BlockBuilder(), relax.op
    x = relax.Var("x", relax.TensorType((1, 8, 10, 10), "float32"))
    weight = relax.const(rng.standard_normal((16, 8, 3, 3)).astype(np.float32))
    gain = relax.const(rng.uniform(0.5, 1.5, (16, 1, 1, 1)).astype(np.float32))
    with bb.function("main", [x]):
        with bb.dataflow():
            scale = bb.emit(op.reshape(op.multiply(gain, relax.const(1 / np.sqrt(72), "float32")), (16,)))
            w = op.nn.instance_norm(op.reshape(weight, (1, 16, 72)), scale, relax.const(np.zeros(16, np.float32)),
                                    channel_axis=1, axes=[0, 2], epsilon=1e-5)
            out = bb.emit_output(op.nn.conv2d(x, op.reshape(w, (16, 8, 3, 3)), padding=1))
        bb.emit_func_output(out)
    mod = bb.get()
    assert "relax.nn.instance_norm" not in _ops(fold_constants_in_numpy()(mod))
    xv = tvm.runtime.tensor(rng.standard_normal((1, 8, 10, 10)).astype(np.float32))
    got = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](xv).numpy()
    want = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main"](xv).numpy()
    assert rel_err(got, want) <= 1e-5
