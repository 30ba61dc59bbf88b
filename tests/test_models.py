"""Reference networks: built in-process, compiled through tvm_ext, equal to stock TVM and PyTorch."""

import numpy as np
import pytest
import torch
import tvm
from reference import rel_err
from tvm import relax

import tvm_ext
from tvm_ext import cli, models

TARGET = tvm_ext.resolve_target("llvm")


def test_names_and_errors():
    assert {"resnet18", "resnet50"} <= set(models.names())
    with pytest.raises(ValueError, match="unknown network"):
        models.get("lenet")
    with pytest.raises(ValueError, match="batch"):
        models.get("resnet18", batch=0)


def test_resnet18_through_tvm_ext_matches_stock_tvm_and_pytorch():
    mod, params = models.get("resnet18", batch=1)
    report = tvm_ext.dispatch_report(mod, TARGET)
    convs = [r for r in report if r.op == "nn.conv2d"]
    assert len(convs) == 20 and all(r.kernel == "brgemm_conv2d" for r in convs)
    assert sum(r.reason == "fused" for r in report) >= 40  # bias (folded BN), shortcut, relu
    served = [r for r in report if r.op in ("nn.conv2d", "nn.max_pool2d", "nn.relu")]
    assert all(r.kernel != "fallback" for r in served), [r for r in served if r.kernel == "fallback"]
    x = np.random.default_rng(5).standard_normal((1, 3, 224, 224)).astype("float32")
    ours = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    stock = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert ours.shape == (1, 1000) and np.abs(ours).max() > 1e-2  # not a degenerate output
    assert rel_err(ours, stock) <= 1e-4
    with torch.inference_mode():
        eager = cli.torch_resnet(params)(torch.from_numpy(x)).numpy()
    assert rel_err(ours, eager) <= 1e-4


def test_cli_report(capsys):
    assert cli.main(["report", "--model", "resnet18"]) == 0
    out = capsys.readouterr().out
    assert "brgemm_conv2d" in out and "nn.max_pool2d" in out
