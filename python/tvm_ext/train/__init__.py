"""Training with `relax.training` on tvm_ext's kernels: :class:`SetupTrainer` (TVM's, with batch
norms left whole for tvm_ext's gradient) and :func:`from_torch` (a PyTorch model as a training
backbone whose batch norms' running statistics are states, updated as PyTorch updates them)."""

from .setup_trainer import SetupTrainer
from .torch_import import TorchBackbone, check_deterministic, from_torch

__all__ = ["SetupTrainer", "TorchBackbone", "check_deterministic", "from_torch"]
