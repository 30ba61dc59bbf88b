"""Reference networks as Relax modules, built in-process with seeded random weights (no downloads).

`get(name, batch=1)` returns `(mod, params)`: `mod["main"]` takes the NCHW image; the weights are
bound constants (so tvm_ext packs and folds them at build time) and `params` maps their names to
the same NumPy arrays, for building the network elsewhere (PyTorch, ONNX) with equal weights.
Weights follow He initialization and batch-norm statistics are drawn near their identity values,
so activations keep their scale through 50 layers and the comparisons test real numbers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tvm import IRModule, relax

__all__ = ["get", "image_shape", "load_onnx", "names"]


class _Builder:
    """Emits layers into a dataflow block and records their weights."""

    def __init__(self, bb: relax.BlockBuilder, seed: int):
        self.bb = bb
        self.rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}

    def _const(self, name: str, value: np.ndarray) -> relax.Expr:
        self.params[name] = value.astype(np.float32)
        return relax.const(self.params[name])

    def conv(self, x, name: str, cin: int, cout: int, k: int, stride: int = 1, pad: int | None = None,
             groups: int = 1, bn: bool = True, act: str | None = "relu"):
        """conv2d [-> batch norm] [-> relu | relu6]; without batch norm the convolution has a bias."""
        fan_in = cin // groups * k * k
        w = self.rng.standard_normal((cout, cin // groups, k, k)) * np.sqrt(2.0 / fan_in)
        pad = k // 2 if pad is None else pad
        y = self.bb.emit(relax.op.nn.conv2d(x, self._const(f"{name}.weight", w), strides=(stride, stride),
                                            padding=(pad, pad), groups=groups))
        if bn:
            stats = [self.rng.uniform(0.8, 1.2, cout), self.rng.uniform(-0.1, 0.1, cout),
                     self.rng.uniform(-0.1, 0.1, cout), self.rng.uniform(0.8, 1.2, cout)]
            names = ("gamma", "beta", "mean", "var")
            bn_call = relax.op.nn.batch_norm(
                y, *(self._const(f"{name}.bn.{n}", s) for n, s in zip(names, stats, strict=True)), axis=1,
                training=False)
            y = self.bb.emit(relax.TupleGetItem(self.bb.emit(bn_call), 0))
        else:
            bias = self.rng.uniform(-0.1, 0.1, (1, cout, 1, 1))
            y = self.bb.emit(relax.op.add(y, self._const(f"{name}.bias", bias)))
        if act == "relu":
            return self.bb.emit(relax.op.nn.relu(y))
        if act == "relu6":
            return self.bb.emit(relax.op.clip(y, 0.0, 6.0))
        return y

    def max_pool(self, x, k: int, stride: int, pad: int = 0):
        return self.bb.emit(relax.op.nn.max_pool2d(x, (k, k), (stride, stride), (pad, pad)))

    def flatten(self, x):
        n, *rest = (int(v) for v in x.ty.shape)
        return self.bb.emit(relax.op.reshape(x, (n, int(np.prod(rest)))))

    def dense(self, x, name: str, cin: int, cout: int, relu: bool = False):
        w = self.rng.standard_normal((cin, cout)) * np.sqrt((2.0 if relu else 1.0) / cin)
        y = self.bb.emit(relax.op.matmul(x, self._const(f"{name}.weight", w)))
        y = self.bb.emit(relax.op.add(y, self._const(f"{name}.bias", self.rng.uniform(-0.1, 0.1, cout))))
        return self.bb.emit(relax.op.nn.relu(y)) if relu else y


def _network(batch: int, seed: int, size: int, body: Callable[[_Builder, relax.Expr], relax.Expr]):
    bb = relax.BlockBuilder()
    image = relax.Var("data", relax.TensorType((batch, 3, size, size), "float32"))
    with bb.function("main", [image]):
        with bb.dataflow():
            m = _Builder(bb, seed)
            out = bb.emit_output(body(m, image))
        bb.emit_func_output(out)
    return bb.get(), m.params


def _resnet(depth: int, batch: int, seed: int) -> tuple[IRModule, dict]:
    bottleneck = depth >= 50
    blocks = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}[depth]
    expansion = 4 if bottleneck else 1

    def body(m: _Builder, x):
        bb = m.bb
        x = m.conv(x, "stem", 3, 64, 7, stride=2)
        x = m.max_pool(x, 3, 2, 1)
        cin = 64
        for stage, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True)):
            for i in range(count):
                stride = 2 if i == 0 and stage > 0 else 1
                name = f"layer{stage + 1}.{i}"
                cout = width * expansion
                shortcut = x
                if stride != 1 or cin != cout:
                    shortcut = m.conv(x, f"{name}.downsample", cin, cout, 1, stride, act=None)
                if bottleneck:
                    y = m.conv(x, f"{name}.conv1", cin, width, 1)
                    y = m.conv(y, f"{name}.conv2", width, width, 3, stride)
                    y = m.conv(y, f"{name}.conv3", width, cout, 1, act=None)
                else:
                    y = m.conv(x, f"{name}.conv1", cin, width, 3, stride)
                    y = m.conv(y, f"{name}.conv2", width, cout, 3, act=None)
                x = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(y, shortcut))))
                cin = cout
        x = bb.emit(relax.op.mean(x, axis=[2, 3]))
        return m.dense(x, "fc", cin, 1000)

    return _network(batch, seed, 224, body)


def _classifier(m: _Builder, x, widths: tuple[int, ...]):
    """Flatten, then dense layers (relu between them)."""
    x = m.flatten(x)
    for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        x = m.dense(x, f"fc{i + 1}", cin, cout, relu=i + 2 < len(widths))
    return x


def _vgg16(batch: int, seed: int) -> tuple[IRModule, dict]:
    cfg = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

    def body(m: _Builder, x):
        cin = 3
        for i, v in enumerate(cfg):
            if v == "M":
                x = m.max_pool(x, 2, 2)
            else:
                x = m.conv(x, f"features.{i}", cin, v, 3, bn=False)
                cin = v
        return _classifier(m, x, (512 * 7 * 7, 4096, 4096, 1000))

    return _network(batch, seed, 224, body)


def _five_conv_net(batch: int, seed: int, size: int, convs: tuple, pool: int, widths: tuple):
    """Five conv + relu layers (max pooling after the 1st, 2nd and 5th), then the classifier:
    the AlexNet / OverFeat family. `convs`: (in, out, kernel, stride, padding) per layer."""

    def body(m: _Builder, x):
        for i, (cin, cout, k, stride, pad) in enumerate(convs, 1):
            x = m.conv(x, f"conv{i}", cin, cout, k, stride=stride, pad=pad, bn=False)
            if i in (1, 2, 5):
                x = m.max_pool(x, pool, 2)
        return _classifier(m, x, widths)

    return _network(batch, seed, size, body)


def _alexnet(batch: int, seed: int) -> tuple[IRModule, dict]:
    """torchvision's AlexNet (the single-GPU variant of Krizhevsky et al.), 224x224 input."""
    convs = ((3, 64, 11, 4, 2), (64, 192, 5, 1, 2), (192, 384, 3, 1, 1), (384, 256, 3, 1, 1), (256, 256, 3, 1, 1))
    return _five_conv_net(batch, seed, 224, convs, 3, (256 * 6 * 6, 4096, 4096, 1000))


def _overfeat(batch: int, seed: int) -> tuple[IRModule, dict]:
    """OverFeat "fast" (Sermanet et al. 2013), 231x231 input: the maxDNN paper's layers."""
    convs = ((3, 96, 11, 4, 0), (96, 256, 5, 1, 0), (256, 512, 3, 1, 1), (512, 1024, 3, 1, 1), (1024, 1024, 3, 1, 1))
    return _five_conv_net(batch, seed, 231, convs, 2, (1024 * 6 * 6, 3072, 4096, 1000))


def _mobilenet_v2(batch: int, seed: int) -> tuple[IRModule, dict]:
    """MobileNet-v2 (width 1.0): inverted residual blocks with relu6 and depthwise convolutions."""
    blocks = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
              (6, 320, 1, 1))

    def body(m: _Builder, x):
        bb = m.bb
        x = m.conv(x, "stem", 3, 32, 3, stride=2, act="relu6")
        cin = 32
        for stage, (expand, cout, count, first_stride) in enumerate(blocks):
            for i in range(count):
                name, stride = f"block{stage}.{i}", first_stride if i == 0 else 1
                hidden = cin * expand
                y = x if expand == 1 else m.conv(x, f"{name}.expand", cin, hidden, 1, act="relu6")
                y = m.conv(y, f"{name}.dw", hidden, hidden, 3, stride, groups=hidden, act="relu6")
                y = m.conv(y, f"{name}.project", hidden, cout, 1, act=None)
                x = bb.emit(relax.op.add(y, x)) if stride == 1 and cin == cout else y
                cin = cout
        x = m.conv(x, "head", cin, 1280, 1, act="relu6")
        x = bb.emit(relax.op.mean(x, axis=[2, 3]))
        return m.dense(x, "classifier", 1280, 1000)

    return _network(batch, seed, 224, body)


_MODELS: dict[str, Callable[[int, int], tuple[IRModule, dict]]] = {
    "resnet18": lambda batch, seed: _resnet(18, batch, seed),
    "resnet50": lambda batch, seed: _resnet(50, batch, seed),
    "vgg16": _vgg16,
    "alexnet": _alexnet,
    "overfeat": _overfeat,
    "mobilenet_v2": _mobilenet_v2,
}


def image_shape(mod: IRModule) -> tuple[int, ...]:
    """The input shape of a network from :func:`get` (OverFeat takes 231x231 images)."""
    return tuple(int(v) for v in mod["main"].params[0].ty.shape)


def names() -> list[str]:
    """The networks `get` builds."""
    return sorted(_MODELS)


def get(name: str, batch: int = 1, seed: int = 0) -> tuple[IRModule, dict]:
    """(Relax IRModule, weights by name) of network `name` for NCHW images (see :func:`image_shape`)."""
    if name not in _MODELS:
        raise ValueError(f"models.get: unknown network {name!r}; available: {names()}")
    if batch < 1:
        raise ValueError(f"models.get: batch must be positive, got {batch}")
    return _MODELS[name](batch, seed)


def load_onnx(path: str | os.PathLike) -> IRModule:
    """An ONNX model file as a Relax module, its weights bound as constants (as :func:`get`'s are).

    A file that is missing, empty or not an ONNX model is a ValueError naming it: onnx itself
    raises protobuf's DecodeError, which names neither the file nor what was expected.
    """
    import onnx
    from google.protobuf.message import DecodeError
    from tvm.relax.frontend.onnx import from_onnx

    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise ValueError(f"ONNX file {path} is empty")
        model = onnx.load(str(path))
    except OSError as err:
        raise ValueError(f"ONNX file {path} cannot be read: {err.strerror or err}") from None
    except DecodeError as err:
        raise ValueError(f"{path} is not an ONNX model (protobuf cannot decode it: {err})") from None
    if not model.graph.node:  # an empty message decodes from nearly any few bytes
        raise ValueError(f"{path} is not an ONNX model (it decodes to no graph)")
    return from_onnx(model, keep_params_in_input=False)
