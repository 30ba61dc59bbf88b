"""`relax.training` with tvm_ext's gradients: :class:`SetupTrainer` is TVM's, except that it keeps a
training-mode batch norm whole for `relax.transform.Gradient`.

TVM's SetupTrainer runs `DecomposeOpsForTraining` on the loss function before `Gradient`, because
TVM has no gradient for `batch_norm`: each batch norm becomes about ten stock ops, and its
gradient some thirty more, all on stock TVM in NCHW. `import tvm_ext` registers that gradient
(:mod:`tvm_ext.transform.gradients`), which a build runs on blocked kernels, so the decomposition
is skipped here; everything else (the loss, the inference function's decomposition, the
optimizer, the attributes the Trainer reads) is TVM's own code path.
"""

from __future__ import annotations

import threading

import tvm
from tvm import relax
from tvm.relax.training import SetupTrainer as _TvmSetupTrainer
from tvm.relax.training import setup_trainer as _setup_trainer
from tvm.relax.training.loss import Loss
from tvm.relax.training.optimizer import Optimizer

__all__ = ["SetupTrainer"]

_PATCH = threading.Lock()  # the decomposition is swapped in TVM's module for one call at a time


@tvm.transform.module_pass(opt_level=0, name="tvm_ext.SetupTrainer")
class SetupTrainer:
    """`tvm.relax.training.SetupTrainer` (same arguments and result) that leaves training-mode
    batch norms to tvm_ext's gradient (module docstring). Use `legalize=False` so that
    `tvm_ext.build` sees the ops."""

    def __init__(self, loss: Loss, optimizer: Optimizer, loss_args: list[relax.TensorType], legalize: bool = True):
        self._setup = _TvmSetupTrainer(loss, optimizer, loss_args, legalize)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        decompose = _setup_trainer.DecomposeOpsForTraining
        with _PATCH:
            _setup_trainer.DecomposeOpsForTraining = lambda *_: tvm.transform.Sequential([])  # type: ignore
            try:
                return self._setup(mod)
            finally:
                _setup_trainer.DecomposeOpsForTraining = decompose
