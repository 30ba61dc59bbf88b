"""Seeded random Relax graphs with float64 PyTorch references: the property test of the pipeline.

Each graph is drawn from a small grammar of what CNNs do: convolutions of every shape family
(strides, paddings incl. asymmetric, dilations, groups, depthwise, ResNeXt's groups of 2-8) with biases of every
broadcastable shape in either operand order, batch norms, every activation tvm_ext fuses and
the decompositions importers emit (hardswish, x * sigmoid(x)), pooling, adds and products with
operands in both orders and values used two or three times, concat (DenseNet's of several
inputs, batch norm and activation too), split, squeeze-excitation, layer norm over channels,
residual blocks, a flatten + dense head, sometimes a symbolic batch; and videos' (3-D
convolutions, :func:`random_video_graph`).
While the Relax graph is emitted, the same computation runs in PyTorch in float64 on the same
float32 weights and input, so the reference owes nothing to TVM.
`tests/integration/test_random_graphs.py` builds a few hundred; `bench/fuzz.py` runs as many as
asked and prints a reproducer for each failure. PyTorch is a test extra: importing this module needs it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

__all__ = ["RandomGraph", "random_graph", "random_video_graph", "check_graph", "compare_outputs", "bf16_sensitivity",
           "check_bf16_graph", "BF16_TOLERANCE", "quantized_graph", "check_int8_graph", "INT8_DIFFERING",
           "INT8_SHARED_VALUES"]

# The share of an int8 build's outputs that may differ from stock TVM's float arithmetic of the
# same QDQ module: where the float sums land within their rounding of a tie, the exact integer
# ones round the value the other way, and each later layer spreads those steps (seed 7111: 0.01%
# of the first convolution's values, 3% after a SiLU whose float32 differs in its last bit, 5.6%
# of the 198 outputs, a step each); a wrong scale or zero point moves every value, a lost add
# most, by more than a step. Judged on outputs of at least INT8_SHARED_VALUES values: a dense
# layer after a global pooling mixes every value of its input, so one step before it moves all of
# a small output (seed 17640: all 8 logits, by 0.009 of the largest, within the quantization's
# own error of 0.024); those are held to the error bound alone.
INT8_DIFFERING = 0.1
INT8_SHARED_VALUES = 100

# A bf16 build's error bound: a few roundings of 2^-9 along a graph's convolutions (a 6-layer
# network stays within 2e-2: tests/integration/test_precision.py); a wrong answer is off by the
# output's magnitude
BF16_TOLERANCE = 3e-2


@dataclasses.dataclass
class _Value:
    var: relax.Expr
    ref: torch.Tensor  # in the reference dtype, at the concrete batch

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ref.shape)


@dataclasses.dataclass
class RandomGraph:
    """One drawn graph: the module, its float32 input, float64 reference outputs, PyTorch's own
    float32 outputs (how well conditioned the graph is), and the steps of the grammar that made
    it (a readable reproducer with the seed)."""

    seed: int
    module: tvm.IRModule
    inputs: list[np.ndarray]
    expected: list[np.ndarray]
    pytorch_float32: list[np.ndarray]
    steps: list[str]
    winograd: bool

    def tolerance(self) -> float:
        """1e-4 of the largest output magnitude (5e-4 with Winograd: its transforms' float32
        rounding, as in the zoo tests), or 4x PyTorch's own float32 error where the graph is
        ill-conditioned (a layer norm of nearly constant channels amplifies rounding)."""
        pytorch = max(rel_err(o, e) for o, e in zip(self.pytorch_float32, self.expected, strict=True))
        return max(5e-4 if self.winograd else 1e-4, 4 * pytorch)

    def describe(self) -> str:
        return f"seed {self.seed} (winograd={self.winograd}):\n  " + "\n  ".join(self.steps)


class _Builder:
    """Emits Relax bindings and evaluates the same op in torch float64, step by step."""

    def __init__(self, rng: np.random.Generator, bb: relax.BlockBuilder, batch, dtype: torch.dtype):
        self.rng, self.bb, self.batch, self.dtype = rng, bb, batch, dtype
        self.values: list[_Value] = []
        self.steps: list[str] = []

    # --- helpers ------------------------------------------------------------------------------
    def const(self, *shape: int, scale: float = 1.0, positive: bool = False) -> tuple[relax.Expr, torch.Tensor]:
        data = np.asarray(self.rng.standard_normal(shape) * scale)
        if positive:
            data = np.abs(data) + 0.5
        data = np.asarray(data, np.float32)
        return relax.const(data), torch.from_numpy(data).to(self.dtype)

    def emit(self, expr: relax.Expr, ref: torch.Tensor) -> _Value:
        value = _Value(self.bb.emit(expr), ref)
        self.values.append(value)
        return value

    def pick(self, spatial: bool = True, exclude: _Value | None = None) -> _Value:
        """Mostly the newest value (a chain), sometimes an older one (a value read again)."""
        pool = [v for v in self.values if (len(v.shape) == 4 or not spatial) and v is not exclude]
        if not pool:
            pool = [v for v in self.values if len(v.shape) == 4]
        if self.rng.random() < 0.6:
            return pool[-1]
        return pool[int(self.rng.integers(len(pool)))]

    def coin(self, p: float = 0.5) -> bool:
        return bool(self.rng.random() < p)

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    # --- rules --------------------------------------------------------------------------------
    def conv(self, v: _Value | None = None, out_channels: int | None = None, same: bool = False,
             group_size: int | None = None) -> _Value:
        v = v or self.pick()
        _, c, h, w = v.shape
        groups = 1
        if not same and c > 1 and self.coin(0.3):
            groups = c if self.coin(0.6) else self.choice([g for g in (2, 3, 4) if c % g == 0] or [1])
        if group_size:
            groups = c // group_size
        k = out_channels or (groups * int(self.rng.integers(1, 3)) if groups == c and groups > 1
                             else int(self.rng.integers(2, 25)))
        if groups > 1 and k % groups:
            k = groups * max(1, k // groups)
        r, s = self.choice([(1, 1), (3, 3), (3, 3), (5, 5), (7, 7), (1, 3), (3, 1), (2, 2)])
        stride = (1, 1) if same else self.choice([(1, 1), (1, 1), (2, 2), (2, 1), (3, 3)])
        dilation = (2, 2) if not same and self.coin(0.15) else (1, 1)
        er, es = dilation[0] * (r - 1) + 1, dilation[1] * (s - 1) + 1
        if same:
            padding = ((er - 1) // 2, (es - 1) // 2, er - 1 - (er - 1) // 2, es - 1 - (es - 1) // 2)
        elif self.coin(0.2):
            padding = tuple(int(p) for p in self.rng.integers(0, 3, 4))
        else:
            ph, pw = int(self.rng.integers(0, er // 2 + 1)), int(self.rng.integers(0, es // 2 + 1))
            padding = (ph, pw, ph, pw)
        if h + padding[0] + padding[2] < er or w + padding[1] + padding[3] < es:
            padding = ((er - 1) // 2, (es - 1) // 2, er - 1 - (er - 1) // 2, es - 1 - (es - 1) // 2)
        weight, wref = self.const(k, c // groups, r, s, scale=1.0 / np.sqrt(c // groups * r * s))
        ref = F.conv2d(F.pad(v.ref, (padding[1], padding[3], padding[0], padding[2])), wref, None,
                       stride, 0, dilation, groups)
        out = self.emit(relax.op.nn.conv2d(v.var, weight, stride, padding, dilation, groups), ref)
        self.steps.append(f"conv2d {v.shape} -> {out.shape}: kernel {r}x{s} stride {stride} padding {padding} "
                          f"dilation {dilation} groups {groups}")
        return out

    def bias_shapes(self, v: _Value) -> list[tuple[int, ...]]:
        """The shapes a bias added to `v` is drawn from: every broadcastable one."""
        k = v.shape[1]
        return [(1, k, 1, 1), (1, k, 1, 1), (k, 1, 1), (1, 1, 1, 1), (1,), (), (v.shape[3],)]

    def bias(self, v: _Value) -> _Value:
        shape = self.choice(self.bias_shapes(v))
        b, bref = self.const(*shape, scale=0.5)
        first = self.coin(0.3)
        out = self.emit(relax.op.add(b, v.var) if first else relax.op.add(v.var, b), bref + v.ref)
        self.steps.append(f"add bias of shape {shape}" + (" (bias first)" if first else ""))
        return out

    def batch_norm(self, v: _Value) -> _Value:
        c = v.shape[1]
        (gamma, g), (beta, b) = self.const(c), self.const(c, scale=0.5)
        (mean, m), (var, s2) = self.const(c, scale=0.5), self.const(c, scale=0.5, positive=True)
        bn = self.bb.emit(relax.op.nn.batch_norm(v.var, gamma, beta, mean, var, axis=1, epsilon=1e-5,
                                                 training=False))
        ref = F.batch_norm(v.ref, m, s2, g, b, training=False, eps=1e-5)
        self.steps.append("batch_norm (inference)")
        return self.emit(relax.TupleGetItem(bn, 0), ref)

    def activation(self, v: _Value | None = None) -> _Value:
        v = v or self.pick()
        x, ref = v.var, v.ref
        name = self.choice(["relu", "relu", "relu6", "sigmoid", "silu", "x*sigmoid(x)", "gelu", "gelu_tanh",
                            "leaky_relu", "tanh", "hardswish", "hardsigmoid", "exported hardswish"])
        f32 = "float32"
        if name == "relu":
            out = self.emit(relax.op.nn.relu(x), F.relu(ref))
        elif name == "relu6":
            out = self.emit(relax.op.clip(x, 0, 6), F.relu6(ref))
        elif name == "sigmoid":
            out = self.emit(relax.op.sigmoid(x), torch.sigmoid(ref))
        elif name == "silu":
            out = self.emit(relax.op.nn.silu(x), F.silu(ref))
        elif name == "x*sigmoid(x)":
            s = self.emit(relax.op.sigmoid(x), torch.sigmoid(ref))
            out = self.emit(relax.op.multiply(x, s.var) if self.coin() else relax.op.multiply(s.var, x), F.silu(ref))
        elif name == "gelu":
            out = self.emit(relax.op.nn.gelu(x), F.gelu(ref))
        elif name == "gelu_tanh":
            out = self.emit(relax.op.nn.gelu_tanh(x), F.gelu(ref, approximate="tanh"))
        elif name == "leaky_relu":
            alpha = float(self.choice([0.01, 0.1, 0.2]))
            out = self.emit(relax.op.nn.leakyrelu(x, alpha), F.leaky_relu(ref, alpha))
        elif name == "tanh":
            out = self.emit(relax.op.tanh(x), torch.tanh(ref))
        elif name == "exported hardswish":  # torch.export's (x * clamp(x + 3, 0, 6)) / 6, one-sided clips
            shifted = relax.op.add(x, relax.const(3.0, f32))
            clamped = self.bb.emit(relax.op.clip(relax.op.clip(shifted, 0, float("inf")), float("-inf"), 6))
            out = self.emit(relax.op.divide(relax.op.multiply(x, clamped), relax.const(6.0, f32)),
                            ref * torch.clamp(ref + 3, 0, 6) / 6)
        else:  # the torch importer's decompositions, evaluated as written (same float32 rounding)
            clipped = relax.op.clip(relax.op.add(x, relax.const(3.0, f32)), 0, 6)
            hsig = relax.op.divide(clipped, relax.const(6.0, f32))
            hsig_ref = torch.clamp(ref + 3, 0, 6) / 6
            if name == "hardsigmoid":
                out = self.emit(hsig, hsig_ref)
            else:
                out = self.emit(relax.op.multiply(x, self.bb.emit(hsig)), ref * hsig_ref)
        self.steps.append(name)
        return out

    def conv_block(self) -> _Value:
        """conv [+ bias] [-> batch norm] [-> activation]: what networks are made of."""
        out = self.conv()
        if self.coin(0.6):
            out = self.bias(out)
        if self.coin(0.3):
            out = self.batch_norm(out)
        if self.coin(0.6):
            out = self.activation(out)
        return out

    def residual(self) -> _Value:
        """v + conv(v) [+ conv of a shape-keeping conv], shortcut in either operand order."""
        v = self.pick()
        y = self.conv(v, out_channels=v.shape[1], same=True)
        if self.coin(0.5):
            y = self.bias(y)
        if self.coin(0.3):
            y = self.batch_norm(y)
        first = self.coin()
        out = self.emit(relax.op.add(v.var, y.var) if first else relax.op.add(y.var, v.var), v.ref + y.ref)
        self.steps.append("residual add" + (" (shortcut first)" if first else ""))
        return self.activation(out) if self.coin(0.6) else out

    def pool(self) -> _Value:
        v = self.pick()
        _, c, h, w = v.shape
        kind = self.choice(["max", "max", "avg", "global", "mean"])
        if kind in ("global", "mean"):
            if kind == "global":
                out = self.emit(relax.op.nn.adaptive_avg_pool2d(v.var, (1, 1)), v.ref.mean(dim=(2, 3), keepdim=True))
            else:
                out = self.emit(relax.op.mean(v.var, axis=[2, 3], keepdims=True), v.ref.mean(dim=(2, 3), keepdim=True))
            self.steps.append(f"{kind} pool {v.shape}")
            return out
        k = int(self.choice([2, 3, 3])) if min(h, w) >= 3 else min(h, w)
        stride = int(self.choice([1, 2, 2]))
        pad = int(self.rng.integers(0, k // 2 + 1))
        ceil = self.coin(0.3)
        if kind == "max":
            ref = F.max_pool2d(v.ref, k, stride, pad, 1, ceil)
            expr = relax.op.nn.max_pool2d(v.var, (k, k), (stride, stride), (pad, pad), ceil_mode=ceil)
        else:
            include = self.coin()
            ref = F.avg_pool2d(v.ref, k, stride, pad, ceil, include)
            expr = relax.op.nn.avg_pool2d(v.var, (k, k), (stride, stride), (pad, pad), ceil_mode=ceil,
                                          count_include_pad=include)
        self.steps.append(f"{kind} pool {v.shape}: kernel {k} stride {stride} padding {pad} ceil_mode {ceil}")
        return self.emit(expr, ref)

    def binary(self) -> _Value:
        """add or multiply of two values of one shape (maybe one value twice), or with a
        broadcast constant, operands in either order."""
        a = self.pick()
        same = [v for v in self.values if v.shape == a.shape]
        op, fn = self.choice([(relax.op.add, torch.add), (relax.op.add, torch.add), (relax.op.multiply, torch.mul)])
        if self.coin(0.7):
            b = self.choice(same)
            bvar, bref = b.var, b.ref
            what = "itself" if b is a else "another value"
        else:
            shape = self.choice([(1, a.shape[1], 1, 1), (a.shape[1], 1, 1), ()])
            bvar, bref = self.const(*shape, scale=0.5)
            what = f"a constant of shape {shape}"
        first = self.coin()
        expr = op(bvar, a.var) if first else op(a.var, bvar)
        self.steps.append(f"{fn.__name__} {a.shape} with {what}" + (" (it first)" if first else ""))
        return self.emit(expr, fn(bref, a.ref) if first else fn(a.ref, bref))

    def concat(self) -> _Value:
        a = self.pick()
        if self.coin(0.5):
            return self.dense_layer(a)
        partners = [v for v in self.values if len(v.shape) == 4 and v.shape[2:] == a.shape[2:]]
        b = self.choice(partners)
        self.steps.append(f"concat {a.shape} and {b.shape}")
        out = self.emit(relax.op.concat([a.var, b.var], axis=1), torch.cat([a.ref, b.ref], dim=1))
        return self.batch_norm(out) if self.coin(0.4) else out  # DenseNet: a batch norm after a concat

    def dense_layer(self, a: _Value) -> _Value:
        """DenseNet: features of whole vectors (8-32 channels, from shape-keeping convolutions),
        concatenated, [batch norm], [activation] (the channel-affine kernel's input)."""
        features = [a if a.shape[1] % 8 == 0 else self.conv(a, out_channels=8 * int(self.rng.integers(1, 5)),
                                                             same=True)]
        for _ in range(int(self.rng.integers(1, 4))):
            features.append(self.conv(self.choice(features), out_channels=8 * int(self.rng.integers(1, 5)),
                                      same=True))
        self.steps.append(f"concat {' and '.join(str(v.shape) for v in features)}")
        out = self.emit(relax.op.concat([v.var for v in features], axis=1), torch.cat([v.ref for v in features], 1))
        if self.coin(0.6):
            out = self.batch_norm(out)
        return self.activation(out) if self.coin(0.6) else out

    def resnext_block(self) -> _Value:
        """ResNeXt: a convolution to 16-48 channels, then one of groups of 2, 4 or 8 channels in
        and out (several groups to a vector: the grouped tile), bias and activation."""
        width = 16 * int(self.rng.integers(1, 4))
        wide = self.activation(self.bias(self.conv(self.pick(), out_channels=width, same=True)))
        grouped = self.conv(wide, out_channels=width, group_size=self.choice([2, 4, 8]))
        return self.activation(self.bias(grouped)) if self.coin(0.7) else grouped

    def split(self) -> _Value:
        v = self.pick()
        c = v.shape[1]
        if c < 2:
            return self.activation(v)
        at = int(self.rng.integers(1, c))
        parts = self.bb.emit(relax.op.split(v.var, [at], axis=1))
        self.steps.append(f"split {v.shape} at channel {at}")
        self.emit(relax.TupleGetItem(parts, 0), v.ref[:, :at])
        return self.emit(relax.TupleGetItem(parts, 1), v.ref[:, at:])

    def squeeze_excitation(self) -> _Value:
        v = self.pick()
        c = v.shape[1]
        squeezed = self.emit(relax.op.mean(v.var, axis=[2, 3], keepdims=True), v.ref.mean(dim=(2, 3), keepdim=True))
        self.steps.append(f"squeeze-excitation of {v.shape}:")
        hidden = self.conv(squeezed, out_channels=max(1, c // 4), same=True)
        hidden = self.activation(self.bias(hidden))
        gate = self.bias(self.conv(hidden, out_channels=c, same=True))
        gate = self.emit(relax.op.sigmoid(gate.var), torch.sigmoid(gate.ref))
        first = self.coin()
        expr = relax.op.multiply(gate.var, v.var) if first else relax.op.multiply(v.var, gate.var)
        self.steps.append("  sigmoid, scale" + (" (gate first)" if first else ""))
        return self.emit(expr, gate.ref * v.ref)

    def layer_norm(self) -> _Value:
        """ConvNeXt's layer norm over channels of a convolution's output: to NHWC, normalise the
        last axis, back. (Of saturated values, e.g. hardsigmoid's, a layer norm divides float32
        rounding by a spread near zero: PyTorch's own float32 error reaches 1e-4 there.)"""
        v = self.conv()
        c = v.shape[1]
        (gamma, g), (beta, b) = self.const(c), self.const(c, scale=0.5)
        nhwc = self.bb.emit(relax.op.permute_dims(v.var, [0, 2, 3, 1]))
        normed = self.bb.emit(relax.op.nn.layer_norm(nhwc, gamma, beta, axes=[-1], epsilon=1e-6))
        ref = F.layer_norm(v.ref.permute(0, 2, 3, 1), (c,), g, b, 1e-6)
        self.steps.append(f"layer norm over the channels of {v.shape}")
        if self.coin(0.5):  # the rest of ConvNeXt's block, channels-last as torch.export writes it
            normed, ref = self.channels_last_mlp(normed, ref, c)
            return self.emit(relax.op.add(relax.op.permute_dims(normed, [0, 3, 1, 2]), v.var),
                             ref.permute(0, 3, 1, 2) + v.ref)
        return self.emit(relax.op.permute_dims(normed, [0, 3, 1, 2]), ref.permute(0, 3, 1, 2))

    def channels_last_mlp(self, x: relax.Expr, ref: torch.Tensor, c: int) -> tuple[relax.Expr, torch.Tensor]:
        """Linear(c, 4c) -> GELU -> Linear(4c, c) -> layer scale on an NHWC tensor (ConvNeXt)."""
        (w1, w1_ref), (b1, b1_ref) = self.const(c, 4 * c, scale=c ** -0.5), self.const(4 * c, scale=0.5)
        (w2, w2_ref), (b2, b2_ref) = self.const(4 * c, c, scale=(4 * c) ** -0.5), self.const(c, scale=0.5)
        (gamma, g) = self.const(c, scale=0.5)
        approximate = self.coin(0.3)
        hidden = self.bb.emit(relax.op.add(relax.op.matmul(x, w1), b1))
        hidden = self.bb.emit(relax.op.nn.gelu_tanh(hidden) if approximate else relax.op.nn.gelu(hidden))
        out = self.bb.emit(relax.op.multiply(relax.op.add(relax.op.matmul(hidden, w2), b2), gamma))
        h = F.gelu(ref @ w1_ref + b1_ref, approximate="tanh" if approximate else "none")
        self.steps.append(f"  linear {c} -> {4 * c}, gelu{'_tanh' if approximate else ''}, linear {4 * c} -> {c}, "
                          "layer scale, permute back, residual add")
        return out, (h @ w2_ref + b2_ref) * g

    def dense_head(self) -> _Value:
        v = self.pick()
        _, c, h, w = v.shape
        pooled = self.emit(relax.op.nn.adaptive_avg_pool2d(v.var, (1, 1)), v.ref.mean(dim=(2, 3), keepdim=True))
        flat = self.emit(relax.op.reshape(pooled.var, (self.batch, c)), pooled.ref.reshape(-1, c))
        m = int(self.rng.integers(2, 20))
        weight, wref = self.const(c, m, scale=1.0 / np.sqrt(c))
        out = self.emit(relax.op.matmul(flat.var, weight), flat.ref @ wref)
        if self.coin(0.7):
            b, bref = self.const(m, scale=0.5)
            out = self.emit(relax.op.add(out.var, b), out.ref + bref)
        if self.coin(0.5):
            out = self.emit(relax.op.nn.relu(out.var), F.relu(out.ref))
        self.steps.append(f"global pool, flatten, dense {c} -> {m}")
        return out


_RULES: list[tuple[Callable[[_Builder], _Value], float]] = [
    (_Builder.conv_block, 5), (_Builder.residual, 2), (_Builder.activation, 1.5), (_Builder.pool, 1.5),
    (_Builder.binary, 2), (_Builder.concat, 1), (_Builder.split, 0.7), (_Builder.squeeze_excitation, 0.7),
    (_Builder.layer_norm, 0.6), (_Builder.resnext_block, 0.5),
]


class _VideoBuilder(_Builder):
    """The grammar on videos (N, C, D, H, W): 3-D convolutions of every shape family, biases of
    every broadcastable shape in either order, batch norms, activations, residual adds, products
    with per-channel, per-frame and scalar constants, pooling over space or over frames too, channel
    concats, values read again (:func:`random_video_graph`)."""

    def pick(self, spatial: bool = True, exclude: _Value | None = None) -> _Value:
        pool = [v for v in self.values if len(v.shape) == 5 and v is not exclude] or \
            [v for v in self.values if len(v.shape) == 5]
        return pool[-1] if self.rng.random() < 0.6 else pool[int(self.rng.integers(len(pool)))]

    def conv(self, v: _Value | None = None, out_channels: int | None = None, same: bool = False,
             group_size: int | None = None) -> _Value:
        v = v or self.pick()
        c = v.shape[1]
        groups = 1
        if not same and c > 1 and self.coin(0.3):
            groups = c if self.coin(0.5) else self.choice([g for g in (2, 3) if c % g == 0] or [1])
        k = out_channels or groups * int(self.rng.integers(1, 4 if groups > 1 else 13))
        kernel = tuple(int(self.choice([1, 3, 3] if same else [1, 2, 3, 3])) for _ in range(3))
        stride = (1, 1, 1) if same else tuple(int(self.choice([1, 1, 2])) for _ in range(3))
        dilation = (1, 1, 1) if same or not self.coin(0.15) else tuple(int(self.choice([1, 2])) for _ in range(3))
        extent = [d * (r - 1) + 1 for d, r in zip(dilation, kernel, strict=True)]
        if same:  # (odd kernels): the output keeps the input's shape
            padding = (*(e // 2 for e in extent), *(e // 2 for e in extent))
        else:
            padding = tuple(int(p) for p in self.rng.integers(0, 3, 6))
        if any(size + padding[i] + padding[i + 3] < extent[i] for i, size in enumerate(v.shape[2:])):
            padding = (*(e - 1 for e in extent), 0, 0, 0)
        weight, wref = self.const(k, c // groups, *kernel, scale=1.0 / np.sqrt(c // groups * math.prod(kernel)))
        ref = F.conv3d(F.pad(v.ref, (padding[2], padding[5], padding[1], padding[4], padding[0], padding[3])),
                       wref, None, stride, 0, dilation, groups)
        out = self.emit(relax.op.nn.conv3d(v.var, weight, stride, padding, dilation, groups), ref)
        self.steps.append(f"conv3d {v.shape} -> {out.shape}: kernel {kernel} stride {stride} padding {padding} "
                          f"dilation {dilation} groups {groups}")
        return out

    def bias_shapes(self, v: _Value) -> list[tuple[int, ...]]:
        k = v.shape[1]  # the last two: not one value per channel
        return [(1, k, 1, 1, 1), (1, k, 1, 1, 1), (k, 1, 1, 1), (1, 1, 1, 1, 1), (1,), (), (1, 1, v.shape[2], 1, 1),
                (v.shape[4],)]

    def pool(self) -> _Value:
        v = self.pick()
        d, h, w = v.shape[2:]
        temporal = self.coin(0.3) and d >= 2
        k = (2 if temporal else 1, *((3, 3) if min(h, w) >= 3 else (1, 1)))
        stride = (int(self.choice([1, 2])) if temporal else 1, *((2, 2) if self.coin() else (1, 1)))
        pad = (0, *((k[1] // 2,) * 2))
        if self.coin():
            ref = F.max_pool3d(v.ref, k, stride, pad)
            expr = relax.op.nn.max_pool3d(v.var, k, stride, (*pad, *pad))
            kind = "max"
        else:
            ref = F.avg_pool3d(v.ref, k, stride, pad, count_include_pad=False)
            expr = relax.op.nn.avg_pool3d(v.var, k, stride, (*pad, *pad), count_include_pad=False)
            kind = "avg"
        self.steps.append(f"{kind} pool3d {v.shape}: kernel {k} stride {stride} padding {pad}")
        return self.emit(expr, ref)

    def binary(self) -> _Value:
        """add or multiply with a value of the same shape (maybe itself) or a constant per
        channel, per frame or scalar, operands in either order."""
        a = self.pick()
        same = [v for v in self.values if v.shape == a.shape]
        op, fn = self.choice([(relax.op.add, torch.add), (relax.op.multiply, torch.mul)])
        if self.coin(0.6):
            b = self.choice(same)
            bvar, bref, what = b.var, b.ref, "itself" if b is a else "another value"
        else:
            shape = self.choice([(1, a.shape[1], 1, 1, 1), (a.shape[1], 1, 1, 1), (), (1, 1, a.shape[2], 1, 1)])
            bvar, bref = self.const(*shape, scale=0.5)
            what = f"a constant of shape {shape}"
        first = self.coin()
        self.steps.append(f"{fn.__name__} {a.shape} with {what}" + (" (it first)" if first else ""))
        return self.emit(op(bvar, a.var) if first else op(a.var, bvar), fn(bref, a.ref) if first else fn(a.ref, bref))

    def concat(self) -> _Value:
        a = self.pick()
        partners = [v for v in self.values if len(v.shape) == 5 and v.shape[2:] == a.shape[2:]]
        b = self.choice(partners)
        self.steps.append(f"concat {a.shape} and {b.shape}")
        out = self.emit(relax.op.concat([a.var, b.var], axis=1), torch.cat([a.ref, b.ref], dim=1))
        return self.batch_norm(out) if self.coin(0.4) else out

    def head(self) -> _Value:
        """The mean over frames and pixels (torchvision's adaptive average pool), read outside."""
        v = self.pick()
        self.steps.append(f"mean over frames and pixels of {v.shape}")
        return self.emit(relax.op.mean(v.var, axis=[2, 3, 4]), v.ref.mean(dim=(2, 3, 4)))


_VIDEO_RULES: list[tuple[Callable[[_VideoBuilder], _Value], float]] = [
    (_VideoBuilder.conv_block, 5), (_VideoBuilder.residual, 2), (_VideoBuilder.activation, 1.5),
    (_VideoBuilder.pool, 1.5), (_VideoBuilder.binary, 2), (_VideoBuilder.concat, 1),
]


def random_video_graph(seed: int, max_steps: int = 6) -> RandomGraph:
    """Draw video graph number `seed` (3-D convolutions; inputs (N, C, D, H, W)): the same seed
    gives the same graph, weights and input."""
    graph = _draw_video(seed, max_steps, torch.float64)
    graph.pytorch_float32 = _draw_video(seed, max_steps, torch.float32).expected
    return graph


def _draw_video(seed: int, max_steps: int, dtype: torch.dtype) -> RandomGraph:
    rng = np.random.default_rng([seed, 0x3D])
    batch = int(rng.choice([1, 1, 2]))
    symbolic = rng.random() < 0.15
    shape = (batch, int(rng.integers(1, 9)), int(rng.integers(1, 7)), int(rng.integers(5, 13)),
             int(rng.integers(5, 13)))
    n_var = tvm.tirx.Var("n", "int64") if symbolic else None
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n_var if symbolic else batch, *shape[1:]), "float32"))
    data = rng.standard_normal(shape).astype(np.float32)
    builder = _VideoBuilder(rng, bb, n_var if symbolic else batch, dtype)
    builder.steps.append(f"input {shape}" + (" (symbolic batch)" if symbolic else ""))
    rules, weights = zip(*_VIDEO_RULES, strict=True)
    p = np.array(weights) / sum(weights)
    with bb.function("main", [x]):
        with bb.dataflow():
            builder.values.append(_Value(x, torch.from_numpy(data).to(dtype)))
            builder.conv_block()
            for _ in range(int(rng.integers(1, max_steps))):
                rules[int(rng.choice(len(rules), p=p))](builder)
            outputs = [builder.values[-1]]
            if rng.random() < 0.3:
                outputs = [builder.head()]
            elif rng.random() < 0.3 and len(builder.values) > 2:  # an earlier value read outside too
                outputs.append(builder.values[int(rng.integers(1, len(builder.values) - 1))])
            out = bb.emit_output(outputs[0].var if len(outputs) == 1 else relax.Tuple([v.var for v in outputs]))
        bb.emit_func_output(out)
    expected = [v.ref.numpy().astype(np.float64) for v in outputs]
    return RandomGraph(seed, bb.get(), [data], expected, expected, builder.steps,
                       winograd=bool(rng.random() < 0.3))


def random_graph(seed: int, max_steps: int = 7) -> RandomGraph:
    """Draw graph number `seed`: the same seed gives the same graph, weights and input."""
    graph = _draw(seed, max_steps, torch.float64)
    graph.pytorch_float32 = _draw(seed, max_steps, torch.float32).expected
    return graph


def _draw(seed: int, max_steps: int, dtype: torch.dtype) -> RandomGraph:
    """The graph of `seed`, its references computed in `dtype` (the draws do not depend on it)."""
    rng = np.random.default_rng([seed, 0x7E1])
    batch = int(rng.choice([1, 1, 1, 2, 3]))
    symbolic = rng.random() < 0.1
    c, h, w = int(rng.integers(1, 20)), int(rng.integers(5, 19)), int(rng.integers(5, 19))
    n_var = tvm.tirx.Var("n", "int64") if symbolic else None
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n_var if symbolic else batch, c, h, w), "float32"))
    data = rng.standard_normal((batch, c, h, w)).astype(np.float32)
    builder = _Builder(rng, bb, n_var if symbolic else batch, dtype)
    builder.steps.append(f"input {(batch, c, h, w)}" + (" (symbolic batch)" if symbolic else ""))
    rules, weights = zip(*_RULES, strict=True)
    p = np.array(weights) / sum(weights)
    with bb.function("main", [x]):
        with bb.dataflow():
            builder.values.append(_Value(x, torch.from_numpy(data).to(dtype)))
            for _ in range(int(rng.integers(2, max_steps + 1))):
                rules[int(rng.choice(len(rules), p=p))](builder)
            outputs = [builder.values[-1]]
            if rng.random() < 0.2:
                outputs.append(builder.dense_head())
            elif rng.random() < 0.2 and len(builder.values) > 2:
                outputs.append(builder.values[int(rng.integers(1, len(builder.values) - 1))])
            if len(outputs) == 1:
                out = bb.emit_output(outputs[0].var)
            else:
                out = bb.emit_output(relax.Tuple([v.var for v in outputs]))
        bb.emit_func_output(out)
    expected = [v.ref.numpy().astype(np.float64) for v in outputs]
    return RandomGraph(seed, bb.get(), [data], expected, expected, builder.steps,
                       winograd=bool(rng.random() < 0.3))


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """Max error relative to the largest reference magnitude (0 for two empty arrays)."""
    if expected.size == 0:
        return 0.0
    diff = np.abs(np.asarray(actual, np.float64) - expected).max()
    return float(diff / max(np.abs(expected).max(), 1e-30))


def check_graph(graph: RandomGraph, build: Callable[[tvm.IRModule, bool], relax.VMExecutable],
                device: tvm.runtime.Device | None = None, tolerance: float | None = None) -> str | None:
    """Build `graph` with `build(module, winograd)`, run it, compare with the float64 reference:
    None when right, else what is wrong (an exception counts: a crash is a failure too).
    Tolerance: :meth:`RandomGraph.tolerance`, or at least `tolerance` (a bf16 build's)."""
    try:
        got = _outputs(build(graph.module, graph.winograd), graph.inputs, device)
    except Exception as err:  # noqa: BLE001 - the property is "never raises" as much as "right"
        return _failure(err)
    return compare_outputs(graph, got, tolerance)


def _failure(err: Exception) -> str:
    """What a build or run that raised reports: the exception's type and the last line of its message."""
    return f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}"


def _outputs(ex: relax.VMExecutable, inputs: list[np.ndarray],
             device: tvm.runtime.Device | None = None) -> list[np.ndarray]:
    """`main`'s outputs of `ex` on `inputs`, a tuple flattened."""
    out = relax.VirtualMachine(ex, device or tvm.cpu())["main"](*[tvm.runtime.tensor(x) for x in inputs])
    return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]


def compare_outputs(graph: RandomGraph, got: list[np.ndarray], tolerance: float | None = None) -> str | None:
    """None when `got` (the graph's outputs, a tuple flattened) matches the float64 reference
    within :meth:`RandomGraph.tolerance` (or `tolerance`, if larger), else what is wrong."""
    if len(got) != len(graph.expected):
        return f"{len(got)} outputs, expected {len(graph.expected)}"
    tolerance = max(graph.tolerance(), tolerance or 0.0)
    for i, (g, e) in enumerate(zip(got, graph.expected, strict=True)):
        if g.shape != e.shape:
            return f"output {i}: shape {g.shape}, expected {e.shape}"
        if not np.isfinite(g).all() and np.isfinite(e).all():
            return f"output {i}: non-finite values where the reference has none"
        err = rel_err(g, e)
        if not err <= tolerance:
            return f"output {i}: relative error {err:.3g} > {tolerance:.3g}"
    return None


def bf16_sensitivity(graph: RandomGraph, build: Callable[[tvm.IRModule, bool], relax.VMExecutable]) -> float:
    """The relative error of `graph` built by `build(module, winograd)` (fp32) with its
    convolution weights (4-d constants) and inputs rounded to bf16: how far bf16 rounding alone
    moves this graph's output, the scale a bf16 build's error is judged on."""
    import ml_dtypes

    def rounded(a: np.ndarray) -> np.ndarray:
        return a.astype(ml_dtypes.bfloat16).astype(a.dtype) if a.dtype == np.float32 else a

    @relax.expr_functor.mutator
    class RoundWeights(relax.PyExprMutator):
        def visit_constant_(self, op: relax.Constant) -> relax.Expr:
            value = op.data.numpy()
            return relax.const(rounded(value)) if value.ndim == 4 else op

    mod = tvm.IRModule({gv: RoundWeights().visit_expr(f) if isinstance(f, relax.Function) else f
                        for gv, f in graph.module.functions.items()})
    got = _outputs(build(mod, graph.winograd), [rounded(x) for x in graph.inputs])
    return max(rel_err(g, e) for g, e in zip(got, graph.expected, strict=True))


def check_bf16_graph(graph: RandomGraph, build_bf16: Callable[[tvm.IRModule, bool], relax.VMExecutable],
                     build_fp32: Callable[[tvm.IRModule, bool], relax.VMExecutable]) -> tuple[str | None, float | None]:
    """:func:`check_graph` of a bf16 build: right within :data:`BF16_TOLERANCE`, or where the
    graph is that sensitive to rounding, within 4x its :func:`bf16_sensitivity` (`build_fp32`).
    (what is wrong or None, the sensitivity where it was needed)."""
    problem = check_graph(graph, build_bf16, tolerance=BF16_TOLERANCE)
    if not (problem and problem.startswith("output")):
        return problem, None
    sensitivity = bf16_sensitivity(graph, build_fp32)
    return check_graph(graph, build_bf16, tolerance=4 * sensitivity), sensitivity


def quantized_graph(graph: RandomGraph) -> tvm.IRModule:
    """`graph`'s QDQ form by `tvm_ext.quantize`, calibrated on its input and two more random ones
    (the seed's), with uint8 or (every third seed) int8 activations."""
    from ..quantization import quantize

    rng = np.random.default_rng([graph.seed, 0x18])
    x = graph.inputs[0]
    calibration = [x, *(rng.standard_normal(x.shape).astype(np.float32) for _ in range(2))]
    return quantize(graph.module, calibration, activations="int8" if graph.seed % 3 == 0 else "uint8")


def check_int8_graph(graph: RandomGraph, build: Callable[[tvm.IRModule, bool], relax.VMExecutable],
                     target: tvm.target.Target) -> str | None:
    """Build :func:`quantized_graph` of `graph` with `build(module, winograd)` (its convolutions
    on the int8 kernels where the CPU has them) and with stock TVM (the same quantize and
    dequantize ops in float32) for `target`: None when at most :data:`INT8_DIFFERING` of the
    outputs differ and none by more than the quantization's own error (stock TVM's from the
    float64 reference), else what is wrong (an exception counts)."""
    module = quantized_graph(graph)
    expected = _outputs(tvm.compile(module, target), graph.inputs)
    try:
        got = _outputs(build(module, graph.winograd), graph.inputs)
    except Exception as err:  # noqa: BLE001 - the property is "never raises" as much as "right"
        return _failure(err)
    quantization_error = max(rel_err(e, r) for e, r in zip(expected, graph.expected, strict=True))
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if g.shape != e.shape:
            return f"output {i}: shape {g.shape}, stock TVM's {e.shape}"
        scale = max(float(np.abs(e).max()), 1e-30)
        difference = np.abs(g.astype(np.float64) - e) / scale
        differing = float((difference > 1e-5).mean()) if difference.size else 0.0
        if (differing > INT8_DIFFERING and difference.size >= INT8_SHARED_VALUES) or \
                difference.max(initial=0) > max(quantization_error, 1e-5):
            return (f"output {i}: {differing:.1%} of the values differ from stock TVM's, by up to "
                    f"{difference.max(initial=0):.3g} of the largest (the quantization's own error: "
                    f"{quantization_error:.3g})")
    return None
