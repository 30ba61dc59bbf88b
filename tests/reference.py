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


def kernel_calls(mod, target, winograd: bool = True, function: str = "main", precision: str = "fp32") -> list[str]:
    """The kernels `function` calls after tvm_ext's lowering for `target`, in order (layout views
    that dead-code elimination drops later included)."""
    import tvm
    from tvm import relax

    from tvm_ext.strategy.dispatch import lower_to_kernels
    from tvm_ext.strategy.fusion import fusion_passes

    with target:
        lower = lower_to_kernels(target, winograd=winograd, precision=precision)
        lowered = tvm.transform.Sequential(fusion_passes(target) + [lower])(mod)
    names = []
    relax.analysis.post_order_visit(lowered[function], lambda e: names.append(e.args[0].name_hint) if (
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


def torch_conv(x, w, stride, padding, dilation, groups):
    """PyTorch's conv2d with tvm_ext's padding forms (int, pair or (top, left, bottom, right))."""
    import torch

    if isinstance(padding, tuple) and len(padding) == 4:  # top, left, bottom, right
        x = torch.nn.functional.pad(x, (padding[1], padding[3], padding[0], padding[2]))
        padding = 0
    return torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, groups)


def random_conv_case(rng):
    """A random convolution (kwargs of ops.conv2d and its gradients) and its (sh, sw): strides
    1-4 and unequal ones, padding (asymmetric too), dilation, groups, depthwise, odd sizes,
    batches of one and more."""
    groups = int(rng.choice([1, 1, 1, 2, 4, 0]))  # 0: depthwise
    cg, kg = int(rng.choice([1, 3, 8, 16])), int(rng.choice([1, 5, 8, 16]))
    if groups == 0:
        groups, cg, kg = int(rng.choice([8, 16, 24])), 1, 1
        c = groups
    else:
        c = groups * cg
    k = groups * kg
    kh, kw = [(1, 1), (3, 3), (3, 3), (5, 5), (1, 3), (3, 1), (2, 2), (7, 7)][rng.integers(8)]
    stride = int(rng.choice([1, 1, 2, 2, 3, 4]))
    if rng.random() < 0.15:
        stride = (int(rng.choice([1, 2])), int(rng.choice([1, 2, 3])))
    dilation = 1 if rng.random() < 0.8 else int(rng.choice([2, 3]))
    if rng.random() < 0.25:
        padding = tuple(int(v) for v in rng.integers(0, 3, size=4))
    else:
        padding = int(rng.integers(0, max(kh, kw) // 2 + 2))
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    pads = padding if isinstance(padding, tuple) else (padding,) * 4
    h = int(rng.integers(max(1, dilation * (kh - 1) + 1 - pads[0] - pads[2]), 20))
    w = int(rng.integers(max(1, dilation * (kw - 1) + 1 - pads[1] - pads[3]), 20))
    n = int(rng.choice([1, 1, 2, 3]))
    return dict(x_shape=(n, c, h, w), w_shape=(k, c // groups, kh, kw), stride=stride, padding=padding,
                dilation=dilation, groups=groups), (sh, sw)


def random_conv_cases(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [random_conv_case(rng)[0] for _ in range(count)]


def tensorized_batch_reduce(spec, m: int, target):
    """The compiled plain batch-reduce C[i, j] = sum over (b0, b1, b2, k) of
    A[b0, b1, i * stride + b2, k] * B[b0, b1, b2, k // g, j, k % g] in `spec`'s types (a BRGEMM of
    the tvm_ext microkernel: g its group of k), C of `m` rows and spec.n_r columns tensorized with
    `spec`'s microkernel a tile of spec.m_r rows at a time."""
    import tvm
    from tvm import s_tir, te

    from tvm_ext.intrin.cpu import get_brgemm_intrin

    b0, b1, b2 = spec.batch
    k, g, n, types = spec.k, spec.group, spec.n_r, spec.types
    a = te.placeholder((b0, b1, (m - 1) * spec.stride + b2, k), types.a, name="A")
    b = te.placeholder((b0, b1, b2, k // g, n, g), types.b, name="B")
    r = [te.reduce_axis((0, e), f"b{d}") for d, e in enumerate(spec.batch)]
    kk = te.reduce_axis((0, k), "k")
    c = te.compute((m, n), lambda i, j: te.sum(a[r[0], r[1], i * spec.stride + r[2], kk].astype(types.c)
                                               * b[r[0], r[1], r[2], kk // g, j, kk % g].astype(types.c),
                                               axis=[*r, kk]), name="C")
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    i, j, *reduction = sch.get_loops(sch.get_sblock("C"))
    io, ii = sch.split(i, [None, spec.m_r])
    jo, ji = sch.split(j, [None, n])
    sch.reorder(io, jo, ii, ji, *reduction)
    sch.decompose_reduction(sch.get_sblock("C"), ii)
    sch.tensorize(ii, get_brgemm_intrin(spec))
    return tvm.compile(sch.mod, target)


def x86_isas() -> list:
    """(VectorISA, LLVM CPU) of each x86 vector ISA the kernels are generated for, narrowest first."""
    from tvm_ext.target import AVX2, AVX512, SSE

    return [(SSE, "x86-64"), (AVX2, "haswell"), (AVX512, "skylake-avx512")]


def host_x86_targets() -> list:
    """(VectorISA, target) for each x86 vector ISA this host executes: SSE (x86-64), AVX2
    (Haswell) and AVX-512 (Skylake-SP) up to the host's own, none on another architecture."""
    import tvm_ext
    from tvm_ext.target import vector_isa

    order = x86_isas()
    host = vector_isa("llvm")
    isas = [isa for isa, _ in order]
    if host not in isas:
        return []
    return [(isa, tvm_ext.resolve_target({"kind": "llvm", "mcpu": mcpu}))
            for isa, mcpu in order[: isas.index(host) + 1]]


def conv3d_ncdhw(x, w, stride=(1, 1, 1), padding=(0, 0, 0, 0, 0, 0), dilation=(1, 1, 1), groups=1):
    """Direct float64 3-D convolution, a 2-D one per output frame and temporal tap; padding is
    (front, top, left, back, bottom, right)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    taps = w.shape[2]
    front, back = padding[0], padding[3]
    xp = np.pad(x, ((0, 0), (0, 0), (front, back), (0, 0), (0, 0)))
    depth = (xp.shape[2] - dilation[0] * (taps - 1) - 1) // stride[0] + 1
    frames = []
    for t in range(depth):
        frames.append(sum(conv2d_nchw(xp[:, :, t * stride[0] + k * dilation[0]], w[:, :, k], None, stride[1:],
                                      (*padding[1:3], *padding[4:6]), dilation[1:], groups) for k in range(taps)))
    return np.stack(frames, axis=2)
