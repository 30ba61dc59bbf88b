"""Post-training quantization of a float32 Relax module: `tvm_ext.quantize(mod, calibration)`.

Relax's importers bring float32 networks; ONNX Runtime's `quantize_static` is the usual way to
an int8 one, but it needs the ONNX model. :func:`quantize` does the same on the Relax module: it
runs the network on the calibration inputs, takes each activation's range (min/max, or
percentiles), and writes the QDQ form ONNX Runtime writes (ONNX Runtime's arithmetic for the
scales, zero points, weights and biases):

- every convolution with constant weights (after batch norms are folded into it) and every
  dense layer (a matmul of a matrix and constant (K, N) weights: ONNX's Gemm, the classifier):
  int8 weights symmetric per output channel, the bias in int32 units of s_x * s_w, its input and
  its output (after a fused relu or relu6) quantized per tensor;
- residual adds of two activations (+ relu) and max pooling: inputs and output quantized (max
  pooling's output with its input's parameters, as max commutes with the quantization);
- everything else (SiLU, concat, ...) stays float32, reading dequantized values.

`tvm_ext.build` then lowers that form onto the int8 kernels (:mod:`tvm_ext.strategy.quantized`),
and stock TVM would run the same module in float: the module means one thing either way.
A relu6 (clip(x, 0, 6)) before a quantize is written as a relu: its calibrated range ends at or
below 6, so the quantization saturates there and the two agree on every value.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import numpy as np
import tvm
from tvm import relax

from .errors import UnsupportedError
from .relax_info import dtype, is_channel_bias, prim_value, static_shape
from .strategy.base import readers_of
from .target import TargetLike, resolve_target
from .transform.fold_batch_norm import fold_batch_norm

logger = logging.getLogger("tvm_ext")

__all__ = ["QUANTIZE_METHODS", "quantize"]

QUANTIZE_METHODS = ("minmax", "percentile")
_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
_SAMPLE = 1 << 16  # values a tensor keeps from each calibration input for percentiles


def _is(expr, op: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op


def _const(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.Constant) else None


@dataclasses.dataclass
class _Plan:
    """What :func:`quantize` quantizes in a function."""

    convs: dict[relax.Var, np.ndarray]  # a conv2d's (or dense matmul's) variable -> its float32 weights
    biases: dict[relax.Var, tuple[relax.Var, np.ndarray]]  # a bias add -> its conv2d or matmul, the bias (K,)
    inputs: dict[relax.Var, set]  # a quantized tensor -> the bindings that read it dequantized
    outputs: set  # tensors a quantized op writes: every reader reads them dequantized
    shares: dict[relax.Var, relax.Var]  # max pooling's output -> its input (same parameters)

    def source(self, tensor: relax.Var) -> relax.Var:
        """The tensor whose parameters `tensor` takes (itself, or a pooled tensor's input's)."""
        while tensor in self.shares:
            tensor = self.shares[tensor]
        return tensor

    def tensors(self) -> list[relax.Var]:
        """The tensors to calibrate (max pooling's outputs take their input's range)."""
        return [t for t in dict.fromkeys([*self.inputs, *self.outputs]) if t not in self.shares]


def _single_block(func: relax.Function) -> relax.DataflowBlock:
    body = func.body
    if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
        raise UnsupportedError("quantize: main must be one dataflow block, as the importers write it")
    return body.blocks[0]


def _float4d(expr, rank: int = 4) -> bool:
    shape = static_shape(expr)
    return isinstance(expr, relax.Var) and shape is not None and len(shape) == rank and \
        dtype(expr) == "float32"


def _output_axis(weights: np.ndarray) -> int:
    """The output channels' axis of a convolution's weights (OIHW) or a dense layer's ((K, N))."""
    return 1 if weights.ndim == 2 else 0


def _relu6_bound(value) -> float | None:
    """hi for clip(x, 0, hi) with hi > 0, else None."""
    if not _is(value, "relax.clip"):
        return None
    lo, hi = (prim_value(arg) for arg in value.args[1:])
    return hi if lo == 0.0 and hi is not None and hi > 0 else None


def _plan(func: relax.Function) -> _Plan:
    block = _single_block(func)
    readers, binding_of = readers_of(func), {b.value: b for b in block.bindings}

    def only_reader(var) -> relax.VarBinding | None:
        """The binding that alone reads `var` (None: several readers, or the function's result)."""
        found = readers.get(var, [])
        return binding_of.get(found[0]) if len(found) == 1 and found[0] is not None else None

    plan = _Plan({}, {}, {}, set(), {})

    def quantized_input(tensor, binding) -> None:
        plan.inputs.setdefault(tensor, set()).add(binding.var)

    def activation_after(var):
        reader = only_reader(var)
        if reader is not None and (_is(reader.value, "relax.nn.relu") or _relu6_bound(reader.value) is not None):
            return reader.var
        return None

    for binding in block.bindings:
        value = binding.value
        if _is(value, "relax.nn.conv2d") or _is(value, "relax.matmul"):
            data, weight = value.args
            w = _const(weight)
            if _is(value, "relax.nn.conv2d"):
                attrs = value.attrs
                layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
                if w is None or w.dtype != np.float32 or not _float4d(data) or layouts != ("NCHW", "OIHW", "NCHW"):
                    continue
            elif w is None or w.dtype != np.float32 or w.ndim != 2 or not _float4d(data, rank=2):
                continue
            end, k = binding.var, w.shape[_output_axis(w)]
            reader = only_reader(end)
            if reader is not None and _is(reader.value, "relax.add"):
                a, b = reader.value.args
                constant = b if a.same_as(end) else a
                bias = _const(constant)
                per_channel = is_channel_bias(constant, k) if w.ndim == 4 else \
                    static_shape(constant) in ((k,), (1, k)) and dtype(constant) == "float32"
                if bias is not None and per_channel:
                    plan.biases[reader.var] = (end, np.broadcast_to(bias.reshape(-1), (k,)))
                    end = reader.var
            activation = activation_after(end)
            out = end if activation is None else activation
            plan.convs[binding.var] = w
            quantized_input(data, binding)
            plan.outputs.add(out)
        elif _is(value, "relax.add") and all(_float4d(arg) for arg in value.args) and \
                static_shape(value.args[0]) == static_shape(value.args[1]):
            for arg in value.args:
                quantized_input(arg, binding)
            reader = only_reader(binding.var)
            plan.outputs.add(reader.var if reader is not None and _is(reader.value, "relax.nn.relu") else binding.var)
        elif _is(value, "relax.nn.max_pool2d") and _float4d(value.args[0]) and str(value.attrs.layout) == "NCHW":
            quantized_input(value.args[0], binding)
            plan.outputs.add(binding.var)
            plan.shares[binding.var] = value.args[0]
    return plan


@dataclasses.dataclass(frozen=True)
class _Parameters:
    scale: np.float32
    zero_point: int
    dtype: str


def _parameters(lo: float, hi: float, dtype: str) -> _Parameters:
    """ONNX Runtime's compute_scale_zp (asymmetric): the range widened to hold 0, the scale
    computed in float64 and stored in float32, the zero point rounded half to even."""
    qmin, qmax = _RANGES[dtype]
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (np.float64(hi) - np.float64(lo)) / (qmax - qmin)
    if scale < np.finfo(np.float32).tiny:
        return _Parameters(np.float32(1.0), 0, dtype)
    return _Parameters(np.float32(scale), int(np.round(qmin - lo / scale)), dtype)


def _quantized_weights(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 weights symmetric per output channel (:func:`_output_axis`) in [-127, 127] and their
    float32 scales (ONNX Runtime's quantize_data with symmetric int8)."""
    outputs = np.moveaxis(w, _output_axis(w), 0)
    absmax = np.abs(outputs.reshape(outputs.shape[0], -1).astype(np.float64)).max(axis=1)
    scale = (2 * absmax / 254).astype(np.float32)
    scale = np.where(scale < np.finfo(np.float32).tiny, np.float32(1.0), scale)
    shape = [1] * w.ndim
    shape[_output_axis(w)] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


def _check(mod, calibration, method: str, percentile: float, activations: str,
           target: TargetLike) -> list[tuple[np.ndarray, ...]]:
    if not isinstance(mod, tvm.IRModule) or "main" not in [g.name_hint for g in mod.get_global_vars()]:
        raise TypeError("quantize: mod must be a Relax IRModule with a main function")
    if resolve_target(target).kind.name != "llvm":
        raise ValueError(f"quantize: the calibration runs on a CPU (an llvm target), not {target!r}")
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"quantize: method must be one of {QUANTIZE_METHODS}, got {method!r}")
    if not 50.0 < percentile <= 100.0:
        raise ValueError(f"quantize: percentile must be in (50, 100], got {percentile!r}")
    if activations not in _RANGES:
        raise ValueError(f"quantize: activations must be 'uint8' or 'int8', got {activations!r}")
    params = mod["main"].params
    samples = []
    for i, sample in enumerate(calibration):
        arrays = (sample,) if isinstance(sample, np.ndarray) else tuple(sample)
        if len(arrays) != len(params):
            raise ValueError(f"quantize: calibration[{i}] has {len(arrays)} arrays; main takes {len(params)}")
        samples.append(tuple(np.asarray(a, dtype=np.float32) for a in arrays))
    if not samples:
        raise ValueError("quantize: calibration is empty (it needs at least one input)")
    return samples


def _calibrate(mod: tvm.IRModule, tensors: list, samples, method: str, percentile: float,
               target: TargetLike) -> dict:
    """Each tensor's (lo, hi) over the calibration inputs."""
    from .pipeline import build

    func = mod["main"]
    block = _single_block(func)
    bb = relax.BlockBuilder(mod)
    with bb.function("calibrated", list(func.params)):
        with bb.dataflow():
            for binding in block.bindings:
                bb.emit_normalized(binding)
            out = bb.emit_output(relax.Tuple(tensors))
        bb.emit_func_output(out)
    # (main itself is left out: only what the calibration runs is built)
    calibrated = tvm.IRModule({g: f for g, f in bb.get().functions_items() if g.name_hint != "main"})
    vm = relax.VirtualMachine(build(calibrated, target, winograd=False), tvm.cpu())
    lows, highs = np.full(len(tensors), np.inf), np.full(len(tensors), -np.inf)
    kept: list[list[np.ndarray]] = [[] for _ in tensors]
    rng = np.random.default_rng(0)
    for sample in samples:
        for i, value in enumerate(vm["calibrated"](*[tvm.runtime.tensor(a) for a in sample])):
            flat = value.numpy().reshape(-1)
            lows[i], highs[i] = min(lows[i], flat.min()), max(highs[i], flat.max())
            if method == "percentile":
                kept[i].append(flat if flat.size <= _SAMPLE else rng.choice(flat, _SAMPLE, replace=False))
    if method == "percentile":
        for i, values in enumerate(kept):
            values = np.concatenate(values)
            lows[i], highs[i] = np.percentile(values, 100 - percentile), np.percentile(values, percentile)
    return {t: (float(lo), float(hi)) for t, lo, hi in zip(tensors, lows, highs, strict=True)}


def _rewrite(func: relax.Function, plan: _Plan, parameters: dict) -> relax.Function:
    """`func` with the QDQ form of `plan`: each quantized tensor followed by its quantize and
    dequantize, quantized convolutions on dequantized int8 weights and int32 biases."""
    block = _single_block(func)
    bb = relax.BlockBuilder()
    dequantized: dict = {}  # a quantized tensor -> its dequantize (the new variable)
    remap: dict = {}  # every variable -> its new one

    def new(expr):
        return remap.get(expr, expr)

    def emit_qdq(tensor, new_var) -> None:
        p = parameters[plan.source(tensor)]
        scale, zero = relax.const(p.scale, "float32"), relax.const(p.zero_point, p.dtype)
        q = bb.emit(relax.op.quantize(new_var, scale, zero, axis=1, out_dtype=p.dtype), f"{tensor.name}_q")
        dequantized[tensor] = bb.emit(relax.op.dequantize(q, scale, zero, axis=1), f"{tensor.name}_dq")
        if tensor in plan.outputs:
            remap[tensor] = dequantized[tensor]

    def substitute(value, binding):
        """`value` reading the new variables (the dequantized ones where this binding is a
        quantized op's)."""
        table = {v: dequantized[v] for v, readers in plan.inputs.items() if binding.var in readers}
        table = {**remap, **table}
        return _Substitute(table).visit_expr(value)

    values = {b.var: b.value for b in block.bindings}
    params = list(func.params)
    with bb.function("main", params, attrs=dict(func.attrs) if func.attrs else None):
        with bb.dataflow():
            for param in params:
                if param in plan.inputs or param in plan.outputs:
                    emit_qdq(param, param)
            for binding in block.bindings:
                var, value = binding.var, binding.value
                if var in plan.convs:
                    w_q, w_scale = _quantized_weights(plan.convs[var])
                    weight = bb.emit(relax.op.dequantize(relax.const(w_q), relax.const(w_scale),
                                                         relax.const(np.zeros(w_scale.size, np.int8)),
                                                         axis=_output_axis(w_q)), f"{var.name}_w")
                    call = substitute(value, binding)
                    value = relax.Call(call.op, [call.args[0], weight], call.attrs)
                elif var in plan.biases:
                    conv, bias_values = plan.biases[var]
                    _, w_scale = _quantized_weights(plan.convs[conv])
                    data_p = parameters[plan.source(values[conv].args[0])]
                    bias_scale = data_p.scale * w_scale  # float32, as ONNX Runtime's
                    b_q = np.clip(np.round(bias_values.astype(np.float64) / bias_scale.astype(np.float64)),
                                  np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
                    k = b_q.size
                    bias = bb.emit(relax.op.dequantize(relax.const(b_q), relax.const(bias_scale),
                                                       relax.const(np.zeros(k, np.int32)), axis=0),
                                   f"{var.name}_b")
                    if plan.convs[conv].ndim == 4:
                        bias = bb.emit(relax.op.reshape(bias, (1, k, 1, 1)))
                    value = relax.op.add(new(conv), bias)
                elif _relu6_bound(value) is not None and var in plan.outputs:
                    value = relax.op.nn.relu(new(value.args[0]))  # exact: see the module docstring
                else:
                    value = substitute(value, binding)
                remap[var] = bb.emit(value, var.name)
                if var in plan.inputs or var in plan.outputs:
                    emit_qdq(var, remap[var])
            out = bb.emit_output(_Substitute(remap).visit_expr(func.body.body))
        bb.emit_func_output(out)
    return bb.get()["main"]


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Variables replaced per a table (the rest of the expression as it is)."""

    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def visit_var_(self, op: relax.Var) -> relax.Expr:
        return self.table.get(op, op)

    def visit_dataflow_var_(self, op: relax.DataflowVar) -> relax.Expr:
        return self.table.get(op, op)


def quantize(mod: tvm.IRModule, calibration: Iterable[np.ndarray | Sequence[np.ndarray]], *,
             method: str = "minmax", percentile: float = 99.999, activations: str = "uint8",
             target: TargetLike = None) -> tvm.IRModule:
    """The QDQ (int8) form of float32 `mod` (see the module docstring), calibrated on
    `calibration`: inputs of main (an array each, or a tuple of arrays for several inputs).

    `method` "minmax" takes each activation's range over all of them (ONNX Runtime's default),
    "percentile" its `percentile` and 100 - `percentile` percentiles (of up to 65536 values an
    input), which ignores outliers. `activations`: "uint8" (asymmetric, the int8 kernels' native
    input) or "int8". `target`: the CPU the float32 calibration runs on (the host by default).
    Convolutions and dense layers of a static shape are quantized (a symbolic batch's stay float32).
    Build the result with :func:`tvm_ext.build`; :func:`tvm_ext.dispatch_report` says which
    convolutions run in int8.
    """
    samples = _check(mod, calibration, method, percentile, activations, target)
    given = mod
    mod = tvm.transform.Sequential([relax.transform.CanonicalizeBindings(), relax.transform.DeadCodeElimination(),
                                    relax.transform.FoldConstant(), fold_batch_norm()])(mod)
    func = mod["main"]
    plan = _plan(func)
    tensors = plan.tensors()
    if not plan.convs:
        logger.info("tvm_ext.quantize: no convolution or dense layer with constant weights; the module stays float32")
        return given
    ranges = _calibrate(mod, tensors, samples, method, percentile, target)
    parameters = {t: _parameters(lo, hi, activations) for t, (lo, hi) in ranges.items()}
    out = tvm.IRModule({**{g: f for g, f in mod.functions_items() if g.name_hint != "main"}})
    out["main"] = _rewrite(func, plan, parameters)
    return out
