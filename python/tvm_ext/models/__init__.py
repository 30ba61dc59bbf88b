"""Reference networks as Relax modules, built in-process with seeded random weights (no downloads).

`get(name, batch=1)` returns `(mod, params)`: `mod["main"]` takes the NCHW image; the weights are
bound constants (so tvm_ext packs and folds them at build time) and `params` maps their names to
the same NumPy arrays, for building the network elsewhere (PyTorch, ONNX) with equal weights.
Weights follow He initialization and batch-norm statistics are drawn near their identity values,
so activations keep their scale through 50 layers and the comparisons test real numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tvm import IRModule, relax

__all__ = ["get", "names"]


class _Builder:
    """Emits layers into a dataflow block and records their weights."""

    def __init__(self, bb: relax.BlockBuilder, seed: int):
        self.bb = bb
        self.rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}

    def _const(self, name: str, value: np.ndarray) -> relax.Expr:
        self.params[name] = value.astype(np.float32)
        return relax.const(self.params[name])

    def conv_bn(self, x, name: str, cin: int, cout: int, k: int, stride: int = 1, relu: bool = True):
        fan_in = cin * k * k
        w = self.rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / fan_in)
        y = self.bb.emit(relax.op.nn.conv2d(x, self._const(f"{name}.weight", w), strides=(stride, stride),
                                            padding=(k // 2, k // 2)))
        stats = [self.rng.uniform(0.8, 1.2, cout), self.rng.uniform(-0.1, 0.1, cout),
                 self.rng.uniform(-0.1, 0.1, cout), self.rng.uniform(0.8, 1.2, cout)]
        names = ("gamma", "beta", "mean", "var")
        bn = relax.op.nn.batch_norm(y, *(self._const(f"{name}.bn.{n}", s) for n, s in zip(names, stats, strict=True)),
                                    axis=1, training=False)
        y = self.bb.emit(relax.TupleGetItem(self.bb.emit(bn), 0))
        return self.bb.emit(relax.op.nn.relu(y)) if relu else y

    def dense(self, x, name: str, cin: int, cout: int):
        w = self.rng.standard_normal((cin, cout)) * np.sqrt(1.0 / cin)
        y = self.bb.emit(relax.op.matmul(x, self._const(f"{name}.weight", w)))
        return self.bb.emit(relax.op.add(y, self._const(f"{name}.bias", self.rng.uniform(-0.1, 0.1, cout))))


def _resnet(depth: int, batch: int, seed: int) -> tuple[IRModule, dict]:
    bottleneck = depth >= 50
    blocks = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}[depth]
    expansion = 4 if bottleneck else 1
    bb = relax.BlockBuilder()
    image = relax.Var("data", relax.TensorType((batch, 3, 224, 224), "float32"))
    with bb.function("main", [image]):
        with bb.dataflow():
            m = _Builder(bb, seed)
            x = m.conv_bn(image, "stem", 3, 64, 7, stride=2)
            x = bb.emit(relax.op.nn.max_pool2d(x, (3, 3), (2, 2), (1, 1)))
            cin = 64
            for stage, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True)):
                for i in range(count):
                    stride = 2 if i == 0 and stage > 0 else 1
                    name = f"layer{stage + 1}.{i}"
                    cout = width * expansion
                    shortcut = x
                    if stride != 1 or cin != cout:
                        shortcut = m.conv_bn(x, f"{name}.downsample", cin, cout, 1, stride, relu=False)
                    if bottleneck:
                        y = m.conv_bn(x, f"{name}.conv1", cin, width, 1)
                        y = m.conv_bn(y, f"{name}.conv2", width, width, 3, stride)
                        y = m.conv_bn(y, f"{name}.conv3", width, cout, 1, relu=False)
                    else:
                        y = m.conv_bn(x, f"{name}.conv1", cin, width, 3, stride)
                        y = m.conv_bn(y, f"{name}.conv2", width, cout, 3, relu=False)
                    x = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(y, shortcut))))
                    cin = cout
            x = bb.emit(relax.op.mean(x, axis=[2, 3]))
            logits = m.dense(x, "fc", cin, 1000)
            out = bb.emit_output(logits)
        bb.emit_func_output(out)
    return bb.get(), m.params


_MODELS: dict[str, Callable[[int, int], tuple[IRModule, dict]]] = {
    "resnet18": lambda batch, seed: _resnet(18, batch, seed),
    "resnet50": lambda batch, seed: _resnet(50, batch, seed),
}


def names() -> list[str]:
    """The networks `get` builds."""
    return sorted(_MODELS)


def get(name: str, batch: int = 1, seed: int = 0) -> tuple[IRModule, dict]:
    """(Relax IRModule, weights by name) of network `name` for NCHW images of 224x224."""
    if name not in _MODELS:
        raise ValueError(f"models.get: unknown network {name!r}; available: {names()}")
    if batch < 1:
        raise ValueError(f"models.get: batch must be positive, got {batch}")
    return _MODELS[name](batch, seed)
