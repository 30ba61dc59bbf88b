"""Tutorial 5: train a small CNN through TVM on tvm_ext's kernels.

1. the network as a Relax function (`backbone`: images and parameters in, logits out; see
   `tvm_ext.models.training.digits_cnn` for how it is written);
2. `relax.training.SetupTrainer` adds the loss, its gradient (`relax.transform.Gradient`, which
   uses the gradients `import tvm_ext` registers) and an SGD update; `legalize=False` keeps the
   ops as Relax ops, so that `tvm_ext.build` serves them with its kernels;
3. see what serves the backward pass (`dispatch_report(..., function="backbone_loss_adjoint")`):
   the weight gradients on the X^T dY kernel, the data gradient as forward convolutions;
4. train on scikit-learn's 8x8 digits next to PyTorch from the same initial weights: the losses
   agree step by step; save the loss curve (PNG) and time a step against PyTorch eager.

Run: python tutorials/05_training.py [--steps 50] [--plot training_loss.png]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import tvm
from sklearn.datasets import load_digits
from tvm import relax
from tvm.relax.training import SetupTrainer, Trainer
from tvm.relax.training.loss import CrossEntropyLoss
from tvm.relax.training.optimizer import SGD

import tvm_ext
from tvm_ext.models.training import DIGITS_CNN_SHAPES, digits_cnn, digits_cnn_init, digits_cnn_torch

BATCH, LR = 32, 0.2


def torch_step(params: dict, sgd, x: np.ndarray, y: np.ndarray) -> float:
    loss = torch.nn.functional.cross_entropy(digits_cnn_torch(params, torch.from_numpy(x)), torch.from_numpy(y))
    sgd.zero_grad()
    loss.backward()
    sgd.step()
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--plot", default="training_loss.png", help="where to save the loss curve")
    args = ap.parse_args()

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    steps = min(args.steps, len(images) // BATCH - 1)  # the last batch is held out

    print("1-2. the training module: loss, gradient, SGD (ops kept unlegalized for tvm_ext.build)")
    train_mod = SetupTrainer(CrossEntropyLoss(reduction="mean"), SGD(LR),
                             [relax.TensorType((BATCH, 10), "float32"), relax.TensorType((BATCH,), "int64")],
                             legalize=False)(digits_cnn(BATCH))

    print("3. what serves the forward and backward pass:")
    report = tvm_ext.dispatch_report(train_mod, "llvm", function="backbone_loss_adjoint")
    for row in report:
        if row.kernel != "fallback":
            print(f"   {row.op:26s} {str(row.shapes):36s} {row.kernel}")
    print(f"   ({sum(row.kernel == 'fallback' for row in report)} small ops on stock TVM: the loss, the bias "
          "additions, the linear layer)")

    start = time.perf_counter()
    vm = relax.VirtualMachine(tvm_ext.build(train_mod, "llvm"), tvm.cpu())
    print(f"   built in {time.perf_counter() - start:.1f} s")
    trainer = Trainer(train_mod, vm, tvm.cpu(), zero_init_param_state=False)
    init = digits_cnn_init()  # He's initialization, zero biases; the same for PyTorch
    trainer.load_params([init[name] for name in DIGITS_CNN_SHAPES])
    params = {name: torch.tensor(value, requires_grad=True) for name, value in init.items()}
    sgd = torch.optim.SGD(params.values(), lr=LR)

    held_out = slice(len(images) - BATCH, len(images))
    accuracy = float((trainer.predict(images[held_out]).numpy().argmax(1) == labels[held_out]).mean())
    print(f"4. training {steps} steps of {BATCH} digits (held-out accuracy before: {accuracy:.0%})")
    ours, theirs, ours_s, theirs_s = [], [], 0.0, 0.0
    for step in range(steps):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        start = time.perf_counter()
        ours.append(float(trainer.update([images[batch]], [labels[batch]]).numpy()))
        ours_s += time.perf_counter() - start
        start = time.perf_counter()
        theirs.append(torch_step(params, sgd, images[batch], labels[batch]))
        theirs_s += time.perf_counter() - start
        if step % 10 == 0 or step == steps - 1:
            print(f"   step {step:3d}: loss {ours[-1]:.4f} (PyTorch {theirs[-1]:.4f})")
    accuracy = float((trainer.predict(images[held_out]).numpy().argmax(1) == labels[held_out]).mean())
    drift = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    print(f"   held-out accuracy after: {accuracy:.0%}; largest relative difference from PyTorch's losses: "
          f"{drift:.1e}")
    print(f"   a step: tvm_ext {ours_s / steps * 1e3:.2f} ms, PyTorch eager {theirs_s / steps * 1e3:.2f} ms "
          "(a tiny network: per-call overheads dominate)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(ours, label="TVM + tvm_ext")
    ax.plot(theirs, "--", label="PyTorch")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"   loss curve: {args.plot}")


if __name__ == "__main__":
    main()
