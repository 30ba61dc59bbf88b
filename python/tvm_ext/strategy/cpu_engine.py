"""Which CPU engine serves a float32 convolution: the blocked BRGEMM kernel (or Winograd) or the
maxDNN tile with the images in the vector lanes (:mod:`tvm_ext.kernels.conv2d_maxdnn`): the
CPU rule of :func:`tvm_ext.strategy.decide.decide` for the tile."""

from __future__ import annotations

from ..intrin.cpu import tile_efficiency
from ..kernels import conv2d as _conv
from ..kernels.conv2d_maxdnn import MaxDNNCpuPlan
from ..target import VectorISA, usable_cores

__all__ = ["MAXDNN_MODES", "blocked_efficiency", "check_maxdnn", "estimates", "maxdnn_decision", "tile_out_block",
           "tile_pass_bytes"]

# `maxdnn` option values: "auto" (the cost model chooses per layer), "always" (every eligible
# convolution: tests and benchmarks), "never".
MAXDNN_MODES = ("auto", "always", "never")


def check_maxdnn(maxdnn: str) -> None:
    """Refuse a bad `maxdnn` option before anything is compiled."""
    if maxdnn not in MAXDNN_MODES:
        raise ValueError(f"maxdnn must be one of {MAXDNN_MODES}, got {maxdnn!r}")


def tile_out_block(plan: _conv.Conv2dPlan) -> int:
    """The channel block the tile's output pass writes: the one the blocked kernel would have
    written (its readers were planned for it), or where that does not divide the output
    channels the largest one that does, in whole 8-channel transposes if it can."""
    k = plan.wl.K
    return _conv.largest_divisor(k, plan.oc_bn, multiple_of=8) or _conv.largest_divisor(k, plan.oc_bn)


def _ineligible(wl: _conv.Conv2dWorkload, blocked: _conv.Conv2dPlan, constant_weight: bool) -> str | None:
    """Why the tile cannot serve `wl` in a graph (None: it can)."""
    if not constant_weight:
        return "run-time weights (the tile's are packed at build time)"
    if wl.groups != 1:
        return "grouped (the blocked kernels' own plans)"
    if blocked.kind != "brgemm":
        return f"the blocked kernel's plan is {blocked.kind}"
    return None


# The cost model, in FMA-slot time (flops / the share of FMA slots a kernel fills):
# - the blocked kernel's k step issues m_r x vectors FMAs, m_r broadcasts and `vectors` loads of
#   weights that stream from L2 (a block's weights outgrow L1): L2 gives about 32 bytes per
#   FMA slot (Zen 4: 32 B a cycle, one 512-bit FMA; Xeon: 64 B, two), so rows of one output
#   pixel (m_r = 1: a squeeze-excitation's, a classifier's) run at half speed on AVX-512;
# - the tile fills its slots over images padded to whole tiles (MaxDNNCpuPlan.fma_efficiency),
#   plus its two layout passes: element-wise transposes at about 10 GB/s a core, against 117
#   GFLOP/s: 12 FLOPs of FMA time a byte.
L2_BYTES_PER_FMA = 32
PASS_FLOPS_PER_BYTE = 12
# The tile is chosen where its estimate is this much faster: where both kernels fill their FMA
# slots they measured within 0.9-1.05x of each other (bench/layers.py --engine auto).
MARGIN = 1.1


def blocked_efficiency(plan: _conv.Conv2dPlan, isa: VectorISA) -> float:
    """The share of FMA slots the blocked kernel fills: its register tile's, the weights' stream
    from L2, the output channels padded to whole blocks."""
    vectors = plan.oc_bn // isa.lanes
    streamed = min(1.0, L2_BYTES_PER_FMA * plan.m_r / (4 * isa.lanes))
    return tile_efficiency(plan.m_r, vectors) * streamed * plan.wl.K / plan.K_pad


def tile_pass_bytes(plan: MaxDNNCpuPlan) -> int:
    """Bytes the two layout passes read and write: the input into the tile's layout, its output
    back to blocks."""
    images, (hp, wp), wl = plan.images, plan.padded_hw, plan.wl
    into = wl.N * wl.C * wl.H * wl.W + images * hp * wp * wl.C
    back = images * wl.OH * wl.OW * plan.groups * plan.outputs + wl.N * wl.K * wl.OH * wl.OW
    return 4 * (into + back)


def estimates(plan: MaxDNNCpuPlan, blocked: _conv.Conv2dPlan) -> tuple[float, float]:
    """(the tile's time, the blocked kernel's) in FLOPs of FMA-slot time."""
    flops = plan.wl.flops
    tile = flops / plan.fma_efficiency() + PASS_FLOPS_PER_BYTE * tile_pass_bytes(plan)
    return tile, flops / blocked_efficiency(blocked, plan.isa)


def maxdnn_decision(wl: _conv.Conv2dWorkload, isa: VectorISA, blocked: _conv.Conv2dPlan,
                    winograd: _conv.Conv2dPlan | None, constant_weight: bool,
                    mode: str = "auto") -> tuple[MaxDNNCpuPlan | None, str]:
    """The tile's plan for `wl` and why it serves it instead of the blocked plan `blocked`, or
    None (and with "always", why not). "auto" leaves a layer that may run as Winograd (`winograd`: its plan) to it: its
    2.25-4x fewer multiplies are more than the tile gains anywhere it was measured."""
    check_maxdnn(mode)
    if mode == "never":
        return None, ""
    refused = _ineligible(wl, blocked, constant_weight)
    if refused is not None:  # (said where the tile was asked for everywhere)
        return None, f"not on the maxDNN tile: {refused}" if mode == "always" else ""
    plan = MaxDNNCpuPlan.make(wl, isa, threads=usable_cores())
    tile = f"{plan.rows}x{plan.cols} tile, images in the vector lanes"
    if mode == "always":
        return plan, f"{tile} (maxdnn='always')"
    if winograd is not None:
        return None, ""
    tile_flops, blocked_flops = estimates(plan, blocked)
    if tile_flops * MARGIN > blocked_flops:
        return None, ""
    return plan, f"{tile}: estimated {blocked_flops / tile_flops:.1f}x the blocked kernel"
