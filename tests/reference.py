"""Float64 NumPy references the tests compare against, and the seeded weights and one-input
Relax graphs they build."""

from __future__ import annotations

import numpy as np


def random_const(rng: np.random.Generator, *shape: int, scale: float = 0.1):
    """A float32 Relax constant of normal values times `scale` (a test graph's weights)."""
    from tvm import relax

    return relax.const((rng.standard_normal(shape) * scale).astype(np.float32))


def one_input_graph(shape, body):
    """`main(x: float32 tensor of shape)` whose dataflow block is `body(bb, x)` (its output)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def kernel_calls(mod, target, winograd: bool = True) -> list[str]:
    """The kernels `main` calls after tvm_ext's lowering for `target`, in order (layout views
    that dead-code elimination drops later included)."""
    import tvm
    from tvm import relax

    from tvm_ext.strategy.dispatch import lower_to_kernels
    from tvm_ext.strategy.fusion import fusion_passes

    with target:
        lowered = tvm.transform.Sequential(fusion_passes(target) + [lower_to_kernels(target, winograd=winograd)])(mod)
    names = []
    relax.analysis.post_order_visit(lowered["main"], lambda e: names.append(e.args[0].name_hint) if (
        isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir") else None)
    return names


def built_kernels(mod, target) -> list[str]:
    """The names of the kernels a build of `mod` for `target` keeps (after dead-code elimination)."""
    import tvm

    import tvm_ext

    with tvm.transform.PassContext(opt_level=3):
        built = tvm.relax.transform.DeadCodeElimination()(tvm_ext.pipeline(target)(mod))
    return [gv.name_hint for gv, f in built.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


def conv2d_nchw(x, w, bias=None, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1):
    """Direct float64 convolution; padding is (top, left, bottom, right)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (dh, dw) = stride, dilation
    t, left, b, r = padding
    xp = np.pad(x, ((0, 0), (0, 0), (t, b), (left, r)))
    OH = (H + t + b - dh * (R - 1) - 1) // sh + 1
    OW = (W + left + r - dw * (S - 1) - 1) // sw + 1
    out = np.zeros((N, K, OH, OW))
    Kg = K // groups
    for g in range(groups):
        xs = xp[:, g * Cg:(g + 1) * Cg]
        ws = w[g * Kg:(g + 1) * Kg]
        for i in range(R):
            for j in range(S):
                patch = xs[:, :, i * dh: i * dh + sh * (OH - 1) + 1: sh, j * dw: j * dw + sw * (OW - 1) + 1: sw]
                out[:, g * Kg:(g + 1) * Kg] += np.einsum("nchw,kc->nkhw", patch, ws[:, :, i, j])
    if bias is not None:
        out += np.asarray(bias, np.float64)[None, :, None, None]
    return out


def rel_err(actual, expected) -> float:
    """Max error relative to the largest reference magnitude."""
    expected = np.asarray(expected, np.float64)
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-30))
