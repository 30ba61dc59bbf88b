"""Whole networks through the CUDA strategy: built without a GPU, numbers from the emulator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from reference import conv2d_nchw, random_const, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.cuda.toolchain import executable_cuda_source
from tvm_ext.models.torch_reference import to_torch
from tvm_ext.testing import cuda_emulator
from tvm_ext.testing.relax_emulator import dynamic_shared_bytes, emulated_executable, launch_shape, lower

TARGET = "cuda -arch=sm_90"
needs_gxx = pytest.mark.skipif(not cuda_emulator.have_compiler(), reason="g++ is not installed")


def _net(batch: int, seed: int = 0) -> tvm.IRModule:
    """conv-bn-relu, max pool, a residual block, a strided 1x1 conv + sigmoid, a depthwise conv,
    avg pool, global mean and a dense layer: every kind of op the strategy handles, small."""
    rng = np.random.default_rng(seed)

    def const(*shape, scale=0.3):
        return relax.const((rng.standard_normal(shape) * scale).astype(np.float32))

    def bn(x, c):
        stats = [rng.uniform(0.8, 1.2, c), rng.uniform(-0.1, 0.1, c), rng.uniform(-0.1, 0.1, c),
                 rng.uniform(0.8, 1.2, c)]
        call = relax.op.nn.batch_norm(x, *(relax.const(s.astype(np.float32)) for s in stats), axis=1, training=False)
        return bb.emit(relax.TupleGetItem(bb.emit(call), 0))

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, 3, 16, 14), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(bn(bb.emit(relax.op.nn.conv2d(x, const(8, 3, 3, 3), padding=1)), 8)))
            y = bb.emit(relax.op.nn.max_pool2d(y, (3, 3), (2, 2), (1, 1)))
            z = bb.emit(relax.op.nn.relu(bn(bb.emit(relax.op.nn.conv2d(y, const(8, 8, 3, 3), padding=1)), 8)))
            z = bn(bb.emit(relax.op.nn.conv2d(z, const(8, 8, 3, 3), padding=1)), 8)
            y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(z, y))))
            y = bb.emit(relax.op.add(bb.emit(relax.op.nn.conv2d(y, const(12, 8, 1, 1), strides=2)),
                                     const(1, 12, 1, 1)))
            y = bb.emit(relax.op.sigmoid(y))
            y = bb.emit(relax.op.nn.conv2d(y, const(12, 1, 3, 3), padding=1, groups=12))  # depthwise
            y = bb.emit(relax.op.nn.avg_pool2d(y, (2, 2), (2, 2)))
            y = bb.emit(relax.op.mean(y, axis=[2, 3]))
            y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(relax.op.matmul(y, const(12, 10))),
                                                              const(10)))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@needs_gxx
@pytest.mark.parametrize("batch", [4, 3])  # float4 gathers over the batch / scalar ones
def test_network_numbers_on_the_emulator(batch):
    mod = _net(batch)
    lowered = lower(mod, TARGET)
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    x = np.random.default_rng(1).standard_normal((batch, 3, 16, 14)).astype(np.float32)
    out = vm["main"](tvm.runtime.tensor(x)).numpy()
    ref = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert rel_err(out, ref) < 1e-4


def test_lowering_keeps_activations_in_chwn():
    lowered = lower(_net(4), TARGET)
    calls = []
    relax.analysis.post_order_visit(
        lowered["main"], lambda e: calls.append(e.args[0].name_hint)
        if isinstance(e, relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir") else None)
    kinds = [name.removeprefix("tvm_ext_").split("_")[0] for name in calls]
    # into CHWN at the input, after stock TVM's depthwise conv and for the dense layer (its
    # input is a reshape); back to NCHW before the depthwise conv, the mean's reshape and at the
    # output: layouts change at the edges and around fallbacks only
    assert sum(name.startswith("tvm_ext_nchw_to_chwn") for name in calls) == 3
    assert sum(name.startswith("tvm_ext_chwn_to_nchw") for name in calls) == 3
    assert kinds.count("maxdnn") == 5  # four convolutions and the dense layer
    assert any(name.startswith("tvm_ext_sigmoid") for name in calls)
    conv = next(func for gvar, func in lowered.functions_items() if gvar.name_hint.startswith("tvm_ext_maxdnn"))
    assert launch_shape(conv)[1] == (32, 1, 1)  # 8 filters: a 32-row tile of 4 x 8 threads


def test_report_names_the_engine_and_tile_the_build_uses():
    """With tensor_cores the report names the tensor-core tile (the emitter builds the tile of the
    same decision); a bad option or a CPU target is refused."""
    mod = _net(4)
    for tensor_cores, engine in ((False, "ffma"), ("tf32", "mma_tf32")):
        rows = [row for row in tvm_ext.dispatch_report(mod, TARGET, tensor_cores=tensor_cores)
                if row.kernel == "maxdnn_conv2d" and row.op == "nn.conv2d"]
        assert rows and all(f" {engine} tile" in row.reason for row in rows)
    with pytest.raises(tvm_ext.UnsupportedError, match="tensor_cores applies to CUDA"):
        tvm_ext.dispatch_report(mod, "llvm", tensor_cores=True)
    with pytest.raises(ValueError, match="tensor_cores must be"):
        tvm_ext.dispatch_report(mod, TARGET, tensor_cores="fp8")


def test_build_for_cuda_without_gpu_and_report():
    mod = _net(4)
    report = tvm_ext.dispatch_report(mod, TARGET)
    kernels = {(row.op, row.kernel) for row in report}
    assert ("nn.conv2d", "maxdnn_conv2d") in kernels and ("nn.relu", "maxdnn_conv2d epilogue") in kernels
    assert ("nn.max_pool2d", "max_pool2d") in kernels and ("sigmoid", "sigmoid") in kernels
    depthwise = next(row for row in report if row.op == "nn.conv2d" and row.kernel == "fallback")
    assert "depthwise" in depthwise.reason
    ex = tvm_ext.build(mod, TARGET)
    source = executable_cuda_source(ex)
    assert source.count("maxdnn_conv2d") >= 4 and "tvm_ext_max_pool2d" in source
    assert "__syncthreads" in source and "ld.global" not in source  # CUDA C, not PTX, without a GPU


@needs_gxx
def test_network_on_tensor_cores():
    """tensor_cores=True: the convolutions run the tf32 mma.sync tile; tf32 keeps 10 mantissa bits,
    so the network agrees with float64 to about 1e-3, not 1e-6."""
    mod = _net(4)
    lowered = lower(mod, TARGET, tensor_cores=True)
    assert any("mma.sync" in cuda_source for cuda_source in _sources(lowered))
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    x = np.random.default_rng(1).standard_normal((4, 3, 16, 14)).astype(np.float32)
    out = vm["main"](tvm.runtime.tensor(x)).numpy()
    ref = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    assert 1e-6 < rel_err(out, ref) < 1e-2


def _sources(lowered: tvm.IRModule) -> list[str]:
    from tvm_ext.kernels.cuda.toolchain import generate_source
    from tvm_ext.target import resolve_target

    return [generate_source(func, resolve_target(TARGET)) for gvar, func in lowered.functions_items()
            if gvar.name_hint.startswith("tvm_ext_maxdnn")]


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no CUDA device")
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_network_on_the_gpu(tensor_cores):
    mod = _net(4)
    ex = tvm_ext.build(mod, tvm_ext.resolve_target("cuda"), tensor_cores=tensor_cores)
    vm = relax.VirtualMachine(ex, tvm.cuda())
    x = np.random.default_rng(1).standard_normal((4, 3, 16, 14)).astype(np.float32)
    out = vm["main"](tvm.runtime.tensor(x, tvm.cuda())).numpy()
    ref = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    assert rel_err(out, ref) < (1e-2 if tensor_cores else 1e-4)


needs_hopper = pytest.mark.skipif(not tvm.cuda(0).exist or tvm.cuda(0).compute_version != "9.0",
                                  reason="no Hopper GPU")


@pytest.mark.gpu
@needs_hopper
def test_network_on_wgmma_on_the_gpu():
    mod = _net(4)
    ex = tvm_ext.build(mod, "cuda -arch=sm_90a", tensor_cores="wgmma_tf32")
    vm = relax.VirtualMachine(ex, tvm.cuda())
    x = np.random.default_rng(1).standard_normal((4, 3, 16, 14)).astype(np.float32)
    out = vm["main"](tvm.runtime.tensor(x, tvm.cuda())).numpy()
    ref = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    assert 1e-6 < rel_err(out, ref) < 1e-2


@needs_gxx
@pytest.mark.parametrize("channels", [8, 3])  # RSC and CRS reduction order
def test_weights_that_are_inputs_are_laid_out_in_the_graph(channels):
    """A weight that is a function parameter (not a constant) is reordered by graph ops at run time."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, channels, 6, 5), "float32"))
    w = relax.Var("w", relax.TensorType((12, channels, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(x, w, padding=1)))
        bb.emit_func_output(out)
    lowered = lower(bb.get(), TARGET)
    assert any(gvar.name_hint.startswith("tvm_ext_maxdnn") for gvar, _ in lowered.functions_items())
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((4, channels, 6, 5)).astype(np.float32)
    wv = rng.standard_normal((12, channels, 3, 3)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(wv)).numpy()
    assert rel_err(got, conv2d_nchw(xv, wv, padding=(1, 1, 1, 1))) < 1e-4


@needs_gxx
def test_small_grids_split_the_reduction():
    """A grid far below what fills a GPU splits K (kernels/cuda/maxdnn/plan.choose_splits): the 3x3
    conv by taps, the 1x1 by channel steps; a second kernel sums the slices and applies bias,
    residual and relu. Numbers against float64 PyTorch on the emulator; the report says so."""
    rng = np.random.default_rng(7)

    def const(*shape):
        return random_const(rng, *shape)

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64, 6, 6), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(x, const(256, 64, 3, 3), padding=1),
                                                      const(1, 256, 1, 1))))
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(y, const(64, 256, 1, 1)), x)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    report = [row for row in tvm_ext.dispatch_report(mod, TARGET, winograd=False) if row.op == "nn.conv2d"]
    assert [" x 3 split-K slices of its taps" in r.reason for r in report] == [True, False]
    assert " x 2 split-K slices of its steps" in report[1].reason
    lowered = lower(mod, TARGET, winograd=False)  # the 3x3 would run as Winograd
    names = [gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sum(name.endswith("_reduce") for name in names) == 2
    assert any(name.endswith("_split3") for name in names) and any(name.endswith("_split2") for name in names)
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    xv = rng.standard_normal((4, 64, 6, 6)).astype(np.float32)
    out = vm["main"](tvm.runtime.tensor(xv)).numpy()
    ref = to_torch(mod, torch.float64)(torch.from_numpy(xv).double()).numpy()
    assert np.isfinite(out).all() and rel_err(out, ref) < 1e-4


@needs_gxx
def test_wide_ffma_tiles_through_the_graph():
    """256 filters on 512 columns get the 128 x 128 tile of 16 x 8 threads, its 64 KB output tile
    in dynamic shared memory (launched with it); 192 filters the 64 x 128 one. Numbers on the
    emulator against float64 PyTorch."""
    rng = np.random.default_rng(11)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.add(
                relax.op.nn.conv2d(x, random_const(rng, 256, 16, 3, 3), padding=1), random_const(rng, 1, 256, 1, 1))))
            y = bb.emit(relax.op.nn.conv2d(y, random_const(rng, 192, 256, 1, 1)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    report = [row.reason for row in tvm_ext.dispatch_report(mod, TARGET, winograd=False) if row.op == "nn.conv2d"]
    assert report[0].startswith("128x128 ffma tile") and report[1].startswith("64x128 ffma tile"), report
    lowered = lower(mod, TARGET, winograd=False)
    convs = {gv.name_hint: f for gv, f in lowered.functions_items()
             if gv.name_hint.startswith("tvm_ext_maxdnn") and not gv.name_hint.endswith("_reduce")}
    assert sorted(dynamic_shared_bytes(f) for f in convs.values()) == [0, 4 * 128 * 128]
    assert sorted(launch_shape(f)[1][0] for f in convs.values()) == [64, 128]
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    xv = rng.standard_normal((8, 16, 8, 8)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(xv)).numpy()
    ref = to_torch(mod, torch.float64)(torch.from_numpy(xv).double()).numpy()
    assert np.isfinite(got).all() and rel_err(got, ref) < 1e-4
