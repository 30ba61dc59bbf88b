"""Direct 2-D convolution in blocked layout, tensorized onto the BRGEMM microkernel (LLVM CPU).

Activations are NCHW[x]c, weights OIHW[x]i[y]o (x = input-channel block, y = output-channel
block = the microkernel's n_r). Each microkernel call computes m_r output pixels of one row times
n_r output channels, reducing over (input-channel blocks, kh, kw) x channels in registers. No
im2col and no packing at run time: the blocked tensors have the storage of the plain ones (the
input carries its zero border, whose bytes :meth:`Conv2dPlan.pad_bytes` reports).

Depthwise convolution (one input channel per group) has no reduction over channels to batch, so
it gets its own vector kernel over the channel block; groups whose channels do not fill a vector
block, and every other case outside the tensorized path, use the direct (untensorized) schedule,
with the reason logged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from tvm import s_tir, te, tirx

from ..intrin.cpu import BRGEMM, default_tile, get_brgemm_intrin
from ..target import VectorISA

logger = logging.getLogger("tvm_ext")

KERNEL_ATTR = "tvm_ext.kernel"


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(x) for x in v)
    if len(v) != 2:
        raise ValueError(f"conv2d: {name} must be an int or a pair, got {v}")
    return v


def normalize_padding(padding) -> tuple[int, int, int, int]:
    """int, (ph, pw) or (top, left, bottom, right) -> (top, left, bottom, right)."""
    if isinstance(padding, int):
        pads = (padding,) * 4
    else:
        pads = tuple(int(p) for p in padding)
        if len(pads) == 2:
            pads = (pads[0], pads[1], pads[0], pads[1])
        elif len(pads) != 4:
            raise ValueError(f"conv2d: padding must be an int, (ph, pw) or (top, left, bottom, right), got {padding}")
    if min(pads) < 0:
        raise ValueError(f"conv2d: negative padding {pads}")
    return pads


@dataclasses.dataclass(frozen=True)
class Conv2dWorkload:
    """A forward convolution in NCHW/OIHW terms, validated."""

    N: int
    C: int
    H: int
    W: int
    K: int
    KH: int
    KW: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    dtype: str = "float32"

    @staticmethod
    def make(x_shape: Sequence[int], w_shape: Sequence[int], stride=1, padding=0, dilation=1,
             groups: int = 1, dtype: str = "float32") -> Conv2dWorkload:
        if len(x_shape) != 4:
            raise ValueError(f"conv2d: data must be 4-D NCHW, got shape {tuple(x_shape)}")
        if len(w_shape) != 4:
            raise ValueError(f"conv2d: weight must be 4-D OIHW, got shape {tuple(w_shape)}")
        if dtype != "float32":
            raise ValueError(f"conv2d: dtype {dtype} is not supported (float32 only)")
        N, C, H, W = (int(v) for v in x_shape)
        K, Cg, KH, KW = (int(v) for v in w_shape)
        if groups < 1 or C % groups or K % groups:
            raise ValueError(f"conv2d: groups={groups} must divide in channels {C} and out channels {K}")
        if Cg * groups != C:
            raise ValueError(
                f"conv2d: channel mismatch: data has {C} channels, weight expects {Cg} x {groups} groups"
            )
        wl = Conv2dWorkload(N, C, H, W, K, KH, KW, _pair(stride, "stride"), normalize_padding(padding),
                            _pair(dilation, "dilation"), int(groups), dtype)
        if min(wl.stride) < 1 or min(wl.dilation) < 1:
            raise ValueError(f"conv2d: stride {wl.stride} and dilation {wl.dilation} must be positive")
        if min(N, C, H, W, K, KH, KW) < 1:
            raise ValueError(f"conv2d: empty tensor in shapes {tuple(x_shape)}, {tuple(w_shape)}")
        if wl.OH < 1 or wl.OW < 1:
            raise ValueError(
                f"conv2d: kernel {KH}x{KW} (dilation {wl.dilation}) is larger than the padded input "
                f"{wl.H + wl.padding[0] + wl.padding[2]}x{wl.W + wl.padding[1] + wl.padding[3]}"
            )
        return wl

    @property
    def HP(self) -> int:
        return self.H + self.padding[0] + self.padding[2]

    @property
    def WP(self) -> int:
        return self.W + self.padding[1] + self.padding[3]

    @property
    def OH(self) -> int:
        return (self.HP - (self.KH - 1) * self.dilation[0] - 1) // self.stride[0] + 1

    @property
    def OW(self) -> int:
        return (self.WP - (self.KW - 1) * self.dilation[1] - 1) // self.stride[1] + 1

    @property
    def flops(self) -> int:
        return 2 * self.N * self.K * (self.C // self.groups) * self.KH * self.KW * self.OH * self.OW

    @property
    def depthwise(self) -> bool:
        return self.groups == self.C and self.groups > 1 and self.K == self.C


@dataclasses.dataclass(frozen=True)
class Conv2dPlan:
    """How a workload maps onto the blocked layouts and the microkernel."""

    wl: Conv2dWorkload
    kind: str  # "brgemm", "depthwise" or "direct"
    ic_bn: int  # channels per input block (x)
    oc_bn: int  # channels per output block (y); n_r of the microkernel
    m_r: int  # output pixels per microkernel call
    reason: str = ""  # why not "brgemm"

    @property
    def K_pad(self) -> int:
        """Output channels rounded up to whole blocks (padded weights are zero)."""
        return -(-self.wl.K // self.oc_bn) * self.oc_bn

    @property
    def ICB(self) -> int:
        return self.wl.C // self.ic_bn

    @property
    def OCB(self) -> int:
        return self.K_pad // self.oc_bn

    def data_shape(self) -> tuple[int, ...]:
        """Blocked, padded input: N, C/x, H+pads, W+pads, x."""
        return (self.wl.N, self.ICB, self.wl.HP, self.wl.WP, self.ic_bn)

    def weight_shape(self) -> tuple[int, ...]:
        wl = self.wl
        if self.kind == "depthwise":
            return (self.OCB, wl.KH, wl.KW, self.oc_bn)
        return (self.OCB, (wl.C // wl.groups) // self.ic_bn, wl.KH, wl.KW, self.ic_bn, self.oc_bn)

    def out_shape(self) -> tuple[int, ...]:
        return (self.wl.N, self.OCB, self.wl.OH, self.wl.OW, self.oc_bn)

    def pad_bytes(self) -> int:
        """Bytes the zero border adds to the input over the plain tensor."""
        wl = self.wl
        return 4 * wl.N * wl.C * (wl.HP * wl.WP - wl.H * wl.W)

    def channel_pad_bytes(self) -> int:
        """Bytes of zero output channels added to fill the last block."""
        return 4 * self.wl.N * (self.K_pad - self.wl.K) * self.wl.OH * self.wl.OW


def _largest_divisor(n: int, limit: int, multiple_of: int = 1) -> int:
    for d in range(min(n, limit), 0, -1):
        if n % d == 0 and d % multiple_of == 0:
            return d
    return 0


def plan_conv2d(wl: Conv2dWorkload, isa: VectorISA, m_r: int | None = None, n_r: int | None = None,
                ic_bn: int | None = None) -> Conv2dPlan:
    """Choose blocking and register tile analytically (tuning overrides m_r / n_r / ic_bn)."""
    lanes = isa.lanes
    Cg, Kg = wl.C // wl.groups, wl.K // wl.groups
    if wl.depthwise:
        oc_bn = n_r or _largest_divisor(wl.C, 4 * lanes, lanes) or _largest_divisor(wl.C, 4 * lanes)
        return Conv2dPlan(wl, "depthwise", oc_bn, oc_bn, m_r or min(wl.OW, 8))
    if wl.groups > 1 and Kg % lanes:
        ic = _largest_divisor(Cg, 16)
        kb = _largest_divisor(Kg, 64)
        reason = f"grouped conv with {Kg} output channels per group (not a multiple of {lanes} lanes)"
        return Conv2dPlan(wl, "direct", ic, kb, 1, reason)
    if wl.groups > 1:
        n_choices = [v for v in range(lanes, 4 * lanes + 1, lanes) if Kg % v == 0]
    else:
        k_pad = -(-wl.K // lanes) * lanes
        n_choices = [v for v in range(lanes, 4 * lanes + 1, lanes) if k_pad % v == 0]
    if n_r is not None:
        n_choices = [n_r]
    tile = default_tile(isa, n_choices, wl.OW)
    if m_r is not None:
        tile = (min(m_r, wl.OW), tile[1])
    ic = ic_bn or _largest_divisor(Cg, 16 if Cg > 16 else Cg)
    return Conv2dPlan(wl, "brgemm", ic, tile[1], tile[0])


@dataclasses.dataclass
class Conv2dStages:
    """The convolution of one output row as TE stages: whole microkernel tiles, then a tail.

    A row of OW pixels is ``main`` (the first OW - OW % m_r pixels, a whole number of m_r tiles)
    and ``tail`` (the rest, one narrower microkernel call), each a stage of its own so that no
    microkernel call runs past the row and no tile needs a predicate. :meth:`value` reads the row
    back for the output stage, which applies the epilogue and writes each output element once.
    """

    plan: Conv2dPlan
    main: te.Tensor
    tail: te.Tensor | None

    def value(self, n, ob, oh, ow, o):
        if self.tail is None:
            return self.main[n, ob, oh, ow, o]
        split = self.main.shape[3]
        return tirx.Select(
            ow < split, self.main[n, ob, oh, tirx.min(ow, split - 1), o],
            self.tail[n, ob, oh, tirx.max(ow - split, 0), o])

    def names(self) -> list[str]:
        return [t.op.name for t in (self.main, self.tail) if t is not None]


def conv2d_blocked_compute(plan: Conv2dPlan, data: te.Tensor, weight: te.Tensor,
                           name: str = "conv") -> Conv2dStages:
    """The convolution over blocked layouts (data already carries its zero border)."""
    wl = plan.wl
    sh, sw = wl.stride
    dh, dw = wl.dilation
    if plan.kind == "depthwise":
        kh = te.reduce_axis((0, wl.KH), "kh")
        kw = te.reduce_axis((0, wl.KW), "kw")
        out = te.compute(
            plan.out_shape(),
            lambda n, ob, oh, ow, o: te.sum(
                data[n, ob, oh * sh + kh * dh, ow * sw + kw * dw, o] * weight[ob, kh, kw, o], axis=[kh, kw]),
            name=name,
        )
        return Conv2dStages(plan, out, None)
    icbg = (wl.C // wl.groups) // plan.ic_bn  # input blocks per group
    ocbg = (wl.K // wl.groups) // plan.oc_bn if wl.groups > 1 else plan.OCB  # output blocks per group

    def segment(width: int, start: int, seg_name: str) -> te.Tensor:
        icb = te.reduce_axis((0, icbg), "icb")
        kh = te.reduce_axis((0, wl.KH), "kh")
        kw = te.reduce_axis((0, wl.KW), "kw")
        ic = te.reduce_axis((0, plan.ic_bn), "ic")

        def body(n, ob, oh, ow, o):
            base = (ob // ocbg) * icbg if wl.groups > 1 else 0
            return te.sum(
                data[n, base + icb, oh * sh + kh * dh, (ow + start) * sw + kw * dw, ic]
                * weight[ob, icb, kh, kw, ic, o],
                axis=[icb, kh, kw, ic],
            )

        return te.compute((wl.N, plan.OCB, wl.OH, width, plan.oc_bn), body, name=seg_name)

    if plan.kind == "direct":
        return Conv2dStages(plan, segment(wl.OW, 0, name), None)
    tail = wl.OW % plan.m_r
    main_w = wl.OW - tail
    if main_w == 0:
        return Conv2dStages(plan, segment(tail, 0, name), None)
    return Conv2dStages(plan, segment(main_w, 0, name),
                        segment(tail, main_w, name + "_tail") if tail else None)


def _extent(sch: s_tir.Schedule, loop) -> int:
    return int(sch.get(loop).extent)


def _tensorize_row(sch: s_tir.Schedule, plan: Conv2dPlan, block, lanes: int) -> None:
    """Tile one row segment into microkernel calls and tensorize them."""
    wl = plan.wl
    ow, o, icb, kh, kw, ic = sch.get_loops(block)[-6:]
    m_r = min(plan.m_r, _extent(sch, ow))
    _, owi = sch.split(ow, [None, m_r])
    init = sch.decompose_reduction(block, owi)
    sch.vectorize(sch.get_loops(init)[-1])
    spec = BRGEMM(m_r=m_r, n_r=plan.oc_bn, k=plan.ic_bn, lanes=lanes,
                  batch=(_extent(sch, icb), wl.KH, wl.KW), stride=wl.stride[1], dilation=wl.dilation)
    sch.tensorize(owi, get_brgemm_intrin(spec))


def schedule_conv2d_blocked(sch: s_tir.Schedule, stages: Conv2dStages, lanes: int, out: str,
                            parallel: bool = True) -> None:
    """Tile, tensorize and parallelize a convolution whose output stage is block `out`.

    The output stage's first three loops must be (batch, output-channel block, output row): it is
    the loop nest the threads split. The convolution stages are computed inside its row loop, so
    the accumulators go from registers through an L1-sized row buffer to their final place (with
    the epilogue applied) once.
    """
    plan = stages.plan
    out_block = sch.get_sblock(out)
    n, ob, oh = sch.get_loops(out_block)[:3]
    for name in stages.names():
        sch.compute_at(sch.get_sblock(name), oh, preserve_unit_loops=True)
    if parallel:  # before tensorize: parallel needs the stages' dataflow still compact
        sch.parallel(sch.fuse(n, ob, oh))
    for name in stages.names():
        block = sch.get_sblock(name)
        if plan.kind == "brgemm":
            _tensorize_row(sch, plan, block, lanes)
        elif plan.kind == "depthwise":
            ow, o, kh, kw = sch.get_loops(block)[-4:]
            owo, owi = sch.split(ow, [None, min(plan.m_r, plan.wl.OW)])
            sch.reorder(owo, kh, kw, owi, o)
            sch.vectorize(o)
            init = sch.decompose_reduction(block, kh)
            sch.vectorize(sch.get_loops(init)[-1])
        else:
            sch.decompose_reduction(block, sch.get_loops(block)[-4])


def pack_data(plan: Conv2dPlan, x: te.Tensor, name: str = "data_blocked") -> te.Tensor:
    """NCHW -> N, C/x, H+pads, W+pads, x: the layout change and the zero border in one pass."""
    wl = plan.wl
    top, left = wl.padding[0], wl.padding[1]

    def body(n, cb, h, w, c):
        ih, iw = h - top, w - left
        inside = tirx.all(ih >= 0, ih < wl.H, iw >= 0, iw < wl.W)
        return tirx.if_then_else(inside, x[n, cb * plan.ic_bn + c, ih, iw], tirx.const(0.0, wl.dtype))

    return te.compute(plan.data_shape(), body, name=name)


def pack_weight(plan: Conv2dPlan, w: te.Tensor, name: str = "weight_blocked") -> te.Tensor:
    """OIHW -> O/y, I/x, H, W, x, y (depthwise: O/y, H, W, y); missing output channels are zero."""
    wl = plan.wl
    if plan.kind == "depthwise":
        return te.compute(plan.weight_shape(),
                          lambda ob, r, s, o: w[ob * plan.oc_bn + o, 0, r, s], name=name)

    def body(ob, ib, r, s, i, o):
        k = ob * plan.oc_bn + o
        value = w[tirx.min(k, wl.K - 1), ib * plan.ic_bn + i, r, s]
        return tirx.if_then_else(k < wl.K, value, tirx.const(0.0, wl.dtype)) if plan.K_pad > wl.K else value

    return te.compute(plan.weight_shape(), body, name=name)


def conv2d_nchw_func(plan: Conv2dPlan, lanes: int, bias: bool = False) -> tirx.PrimFunc:
    """A scheduled PrimFunc computing NCHW conv2d (+ bias) through the blocked kernel.

    For the eager API: packing the data (with its border) and the weights are stages of the same
    function, and the output stage writes NCHW straight from the row buffer.
    """
    wl = plan.wl
    x = te.placeholder((wl.N, wl.C, wl.H, wl.W), wl.dtype, name="data")
    w_shape = (wl.K, wl.C // wl.groups, wl.KH, wl.KW)
    w = te.placeholder(w_shape, wl.dtype, name="weight")
    b = te.placeholder((wl.K,), wl.dtype, name="bias") if bias else None
    xb, wb = pack_data(plan, x), pack_weight(plan, w)
    stages = conv2d_blocked_compute(plan, xb, wb)

    def out_body(n, k, oh, ow):
        value = stages.value(n, k // plan.oc_bn, oh, ow, k % plan.oc_bn)
        return value + b[k] if b is not None else value

    y = te.compute((wl.N, wl.K, wl.OH, wl.OW), out_body, name="output")
    func = te.create_prim_func([x, w, *([b] if b is not None else []), y])
    sch = s_tir.Schedule(func)
    out = sch.get_sblock("output")
    n, k, oh, ow = sch.get_loops(out)
    ob, o = sch.split(k, [None, plan.oc_bn])
    sch.reorder(n, ob, oh, o, ow)
    schedule_conv2d_blocked(sch, stages, lanes, "output")
    for name in ("data_blocked", "weight_blocked"):
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        sch.parallel(sch.fuse(*loops[:2]))
    return sch.mod["main"].with_attr(KERNEL_ATTR, f"{plan.kind}_conv2d")
