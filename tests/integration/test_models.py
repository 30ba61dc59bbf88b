"""Reference networks: built in-process, compiled through tvm_ext, equal to stock TVM and PyTorch."""

import numpy as np
import pytest
import torch
import tvm
from reference import rel_err
from tvm import relax

import tvm_ext
from tvm_ext import cli, models
from tvm_ext.models.torch_reference import TorchModule, to_torch

TARGET = tvm_ext.resolve_target("llvm")


def test_names_and_errors():
    assert set(models.names()) == {"resnet18", "resnet50", "vgg16", "alexnet", "overfeat", "mobilenet_v2"}
    with pytest.raises(ValueError, match="unknown network"):
        models.get("lenet")
    with pytest.raises(ValueError, match="batch"):
        models.get("resnet18", batch=0)


def test_resnet18_through_tvm_ext_matches_stock_tvm_and_pytorch():
    mod, _ = models.get("resnet18", batch=1)
    report = tvm_ext.dispatch_report(mod, TARGET)
    convs = [r for r in report if r.op == "nn.conv2d"]
    assert len(convs) == 20 and all(r.kernel in ("brgemm_conv2d", "winograd_conv2d") for r in convs)
    assert sum(r.kernel == "winograd_conv2d" for r in convs) == 13  # the stride-1 3x3 layers past the stem
    assert sum(r.reason == "fused" for r in report) >= 40  # bias (folded BN), shortcut, relu
    served = [r for r in report if r.op in ("nn.conv2d", "nn.max_pool2d", "nn.relu")]
    assert all(r.kernel != "fallback" for r in served), [r for r in served if r.kernel == "fallback"]
    x = np.random.default_rng(5).standard_normal((1, 3, 224, 224)).astype("float32")
    ours = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    stock = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert ours.shape == (1, 1000) and np.abs(ours).max() > 1e-2  # not a degenerate output
    assert rel_err(ours, stock) <= 1e-4
    with torch.inference_mode():
        eager = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    assert rel_err(ours, eager) <= 1e-4


# Stock TVM runs these at about 1.5 GFLOP/s (naive loops): it is the reference only where that
# takes seconds; every network is checked against the float64 PyTorch evaluation of the same graph.
_STOCK_TOO = {"mobilenet_v2", "alexnet"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mobilenet_v2", "alexnet", *(pytest.param(name, marks=pytest.mark.long)
                                                          for name in ("overfeat", "vgg16")), "resnet50"])
def test_network_through_tvm_ext_matches_float64_reference(name):
    mod, _ = models.get(name, batch=1)
    report = tvm_ext.dispatch_report(mod, TARGET)
    served = [r for r in report if r.op in ("nn.conv2d", "nn.max_pool2d", "nn.relu", "clip", "matmul")]
    assert served and all(r.kernel != "fallback" for r in served), [r for r in served if r.kernel == "fallback"]
    if name in ("alexnet", "overfeat"):  # their second layer, stride-1 5x5
        assert [r.reason for r in report if r.op == "nn.conv2d"][1] == "Winograd F(4x4, 5x5)"
    x = np.random.default_rng(6).standard_normal(models.image_shape(mod)).astype("float32")
    ours = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert ours.shape == (1, 1000) and np.abs(ours).max() > 1e-2
    with torch.inference_mode():
        eager = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    assert rel_err(ours, eager) <= 1e-4
    if name in _STOCK_TOO:
        stock = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        assert rel_err(ours, stock) <= 1e-4


def test_torch_reference_covers_every_op_of_the_networks():
    """The reference evaluates what it is given, not what tvm_ext lowered: an unknown op is an error."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.cumsum(x, axis=1)))
        bb.emit_func_output(out)
    with pytest.raises(NotImplementedError, match="cumsum"):
        to_torch(bb.get())(torch.zeros(1, 4))


def test_cli_cuda_target(capsys):
    assert cli.main(["report", "--model", "resnet18", "--target", "cuda -arch=sm_90"]) == 0
    assert "maxdnn_conv2d" in capsys.readouterr().out
    assert cli.main(["report", "--model", "resnet18", "--target", "cuda -arch=sm_90", "--tensor-cores", "tf32"]) == 0
    assert "mma_tf32 tile" in capsys.readouterr().out
    assert cli.main(["report", "--model", "resnet18", "--tensor-cores", "bf16"]) == 2  # an LLVM target
    assert "--tensor-cores applies to CUDA targets" in capsys.readouterr().err
    assert cli.main(["report", "--model", "resnet18", "--target", "cuda -arch=sm_80", "--tensor-cores",
                     "wgmma_tf32"]) == 2  # wgmma is Hopper's (sm_90a)
    assert "wgmma exists on sm_90a only" in capsys.readouterr().err
    assert cli.main(["report", "--model", "resnet18", "--target", "nvidia/nvidia-h100", "--tensor-cores",
                     "wgmma_bf16"]) == 0
    assert "wgmma_bf16 tile" in capsys.readouterr().out
    assert cli.main(["demo", "--model", "resnet18", "--target", "nvidia/nvidia-h100"]) == 2  # CPU-only commands
    assert "runs on the CPU" in capsys.readouterr().err


def test_cli_report(capsys):
    assert cli.main(["report", "--model", "resnet18"]) == 0
    out = capsys.readouterr().out
    assert "brgemm_conv2d" in out and "winograd_conv2d" in out and "nn.max_pool2d" in out
    assert cli.main(["report", "--model", "resnet18", "--direct"]) == 0
    assert "winograd" not in capsys.readouterr().out


def test_torch_module_wraps_the_reference():
    mod, _ = models.get("mobilenet_v2")
    x = torch.from_numpy(np.random.default_rng(9).standard_normal(models.image_shape(mod)).astype("float32"))
    with torch.inference_mode():
        np.testing.assert_array_equal(TorchModule(mod)(x).numpy(), to_torch(mod)(x).numpy())


def _planned_storage_bytes(lowered: tvm.IRModule) -> int:
    sizes = []
    relax.analysis.post_order_visit(lowered["main"], lambda e: sizes.append(int(e.args[0].values[0])) if (
        isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.vm.alloc_storage") else None)
    return sum(sizes)


def test_resnet50_plans_no_workspace_beyond_activations():
    """Planned activation storage no larger than stock TVM's, and no kernel of ours allocates
    more than its register tile's accumulators (no im2col, no packing buffer at run time)."""
    from tvm.s_tir.analysis import calculate_allocated_bytes

    from tvm_ext.kernels.common import KERNEL_ATTR

    mod, _ = models.get("resnet50")
    ours = tvm_ext.pipeline(TARGET)(mod)
    with TARGET:
        stock = relax.get_pipeline("default")(mod)
    assert 0 < _planned_storage_bytes(ours) <= _planned_storage_bytes(stock)
    kernels = tvm.IRModule({gv: f for gv, f in ours.functions_items()
                            if isinstance(f, tvm.tirx.PrimFunc) and KERNEL_ATTR in f.attrs})
    assert len(kernels.functions) > 20
    for name, scopes in calculate_allocated_bytes(kernels).items():
        assert sum(int(v) for v in scopes.values()) <= 2048, (name, dict(scopes))
    assert "pack_weight" not in ours["main"].script(), "weights must be packed at build time"
