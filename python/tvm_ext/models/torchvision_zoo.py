"""torchvision's classification models as Relax modules: networks nobody here wrote.

Random weights (no downloads), batch-norm statistics calibrated on random images so activations
keep a realistic scale, exported with `torch.export` and imported with
`relax.frontend.torch.from_exported_program`, as a new user would. torchvision's compiled ops do
not load with the CPU torch wheel; the classification models use none of them, so its two
modules that register them are stubbed before the import. Needs torch and torchvision (a test
and bench extra).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import tvm

__all__ = ["FAMILIES", "VIDEO", "import_torchvision", "load", "calibrate", "export"]

# One model of each torchvision classification family (the zoo the tests and bench/zoo.py run).
FAMILIES = (
    "resnet18", "resnext50_32x4d", "wide_resnet50_2", "densenet121", "googlenet", "inception_v3",
    "squeezenet1_1", "shufflenet_v2_x1_0", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0",
    "efficientnet_v2_s", "regnet_x_400mf", "regnet_y_400mf", "mnasnet1_0", "convnext_tiny", "vgg11_bn",
    "alexnet",
)

# the smallest input each family takes (its own pooling shrinks it to nothing below)
MIN_SIZE = {"inception_v3": 75}

# torchvision's video classification models built from 3-D convolutions (N, 3, frames, H, W)
VIDEO = ("r3d_18", "mc3_18", "r2plus1d_18")

_STUBBED = ("torchvision._meta_registrations", "torchvision._autograd_registrations")


def import_torchvision() -> types.ModuleType:
    """torchvision, imported without the modules that register its compiled (detection) ops."""
    if "torchvision" not in sys.modules:
        for name in _STUBBED:
            sys.modules.setdefault(name, types.ModuleType(name))
    import torchvision

    return torchvision


def load(name: str, size: int = 64, seed: int = 0, frames: int | None = None):
    """torchvision model `name` in eval mode: random weights, its batch norms' statistics taken
    from two batches of random `size` x `size` images (clips of `frames` such images, for a
    video model) in training mode, then frozen."""
    import torch

    torchvision = import_torchvision()
    torch.manual_seed(seed)
    options = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    return calibrate(torchvision.models.get_model(name, weights=None, **options), size, frames)


def calibrate(model, size: int = 64, frames: int | None = None):
    """`model` in eval mode, its batch norms' statistics taken from two batches of four random
    `size` x `size` images (or clips of `frames` of them) in training mode (random weights keep a
    realistic scale so)."""
    import torch

    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(4, 3, *(() if frames is None else (frames,)), size, size))
    return model.eval()


def export(model, size: int = 64, batch: int = 1, seed: int = 1, dynamic_batch: bool = False,
           frames: int | None = None) -> tuple:
    """(Relax module, input as NumPy) of `model` exported at `batch` x 3 x `size` x `size` (NCHW),
    or with `frames` `batch` x 3 x `frames` x `size` x `size` (NCDHW, a video model's clips);
    `dynamic_batch`: the batch dimension symbolic (torch.export.Dim)."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    shape = (batch, 3, *(() if frames is None else (frames,)), size, size)
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    shapes = {"x": {0: torch.export.Dim("batch", min=1, max=64)}} if dynamic_batch else None
    with torch.no_grad():
        program = torch.export.export(_taking_x(model), (x,), dynamic_shapes=shapes)
    mod: tvm.IRModule = from_exported_program(program, keep_params_as_input=False)
    return mod, x.numpy()


def _taking_x(model):
    """`model` behind a forward whose argument is called x (the name dynamic_shapes uses)."""
    import torch

    class TakingX(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x)

    return TakingX()
