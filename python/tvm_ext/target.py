"""Targets as users write them, and the vector ISA a target implies.

TVM 0.27 rejects command-line target strings ("llvm -mcpu=znver3") and turns plain "llvm" into
baseline x86-64 (no ymm, no FMA). Users still type both, so every public entry point of tvm_ext
goes through :func:`resolve_target`, which accepts a Target, a dict, a tag, a JSON string or a
command-line string, and reads plain "llvm" as "this host's CPU".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Union

from tvm.target import Target, codegen

TargetLike = Union[Target, str, dict, None]


def _cli_value(text: str) -> Any:
    """Convert one `-key=value` value of a command-line target string to a JSON value."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def parse_cli_target(text: str) -> dict:
    """Parse a command-line style target ("llvm -mcpu=znver3 -mattr=+avx2,+fma") to a dict.

    List-valued options (`-mattr`, `-keys`, `-libs`) are split on commas; flags without a value
    are read as true.
    """
    parts = text.split()
    if not parts or parts[0].startswith("-"):
        raise ValueError(f"target string {text!r} does not start with a target kind")
    config: dict[str, Any] = {"kind": parts[0]}
    for opt in parts[1:]:
        if not opt.startswith("-"):
            raise ValueError(f"target string {text!r}: option {opt!r} does not start with '-'")
        key, sep, value = opt.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if key in ("mattr", "keys", "libs", "cl_opt"):
            config[key] = [v for v in value.split(",") if v]
        else:
            config[key] = _cli_value(value) if sep else True
    return config


@functools.lru_cache(maxsize=1)
def usable_cores() -> int:
    """The cores this process may run on (the affinity mask; all cores where the OS cannot say)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


@functools.cache
def host_target() -> Target:
    """The LLVM target for this machine's CPU (its mcpu, hence its vector ISA). Once per process:
    asking LLVM for the CPU took 44 us, most of a small ops.conv2d call's 60."""
    return Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})


def _means_host(kind, attrs: dict) -> bool:
    """An llvm target with no mcpu (and no foreign triple) names this machine."""
    if kind != "llvm" or "mcpu" in attrs or len(set(attrs) - {"kind", "mtriple", "tag", "keys"}) > 0:
        return False
    return str(attrs.get("mtriple", codegen.llvm_get_system_triple())) == codegen.llvm_get_system_triple()


def resolve_target(target: TargetLike = None) -> Target:
    """Turn whatever a user wrote into a TVM Target.

    None and plain "llvm" mean the host CPU. Command-line strings are converted; dicts, tags and
    JSON strings go to TVM as they are. A string TVM cannot parse raises ValueError naming it.
    """
    if target is None:
        return host_target()
    if not isinstance(target, (dict, str)):  # (a Target is neither)
        if isinstance(target, Target):
            return host_target() if _means_host(target.kind.name, dict(target.attrs)) else target
        raise TypeError(f"target must be a Target, dict or str, got {type(target).__name__}")
    if isinstance(target, dict):
        return host_target() if _means_host(target.get("kind"), target) else Target(dict(target))
    text = target.strip()
    if text.startswith("{"):
        return resolve_target(json.loads(text))
    if " " in text:
        return resolve_target(parse_cli_target(text))
    if text == "llvm":
        return host_target()
    try:
        return Target(text)
    except Exception as err:  # TVM raises several error types for unknown strings
        raise ValueError(f"cannot read target {target!r}: {err}") from None


@dataclasses.dataclass(frozen=True)
class VectorISA:
    """The vector unit a microkernel is generated for."""

    name: str  # "avx512", "avx2", "neon", "sse"
    lanes: int  # fp32 lanes per vector register
    registers: int  # architectural vector registers
    asm_fma: tuple[str, ...]  # mnemonics of the vector FMA in the assembly
    asm_register: str  # register-name prefix of one full vector ("%ymm", "%zmm", "v")


AVX512 = VectorISA("avx512", 16, 32, ("vfmadd",), "%zmm")
AVX2 = VectorISA("avx2", 8, 16, ("vfmadd",), "%ymm")
NEON = VectorISA("neon", 4, 32, ("fmla",), "v")
SSE = VectorISA("sse", 4, 16, ("mulps",), "%xmm")


# A kernel's attribute naming the LLVM CPU features its code needs beyond its vector ISA's
# (a bfloat16 BRGEMM: "avx512bf16"): compiled for a CPU without them, LLVM aborts the process
# ("Do not know how to split this operator's operand!"), so builds check first.
CPU_FEATURES_ATTR = "tvm_ext.cpu_features"


def check_cpu_features(mod, target: TargetLike) -> None:
    """Raise UnsupportedError, naming the kernel and the feature, if a PrimFunc of `mod` needs an
    LLVM CPU feature (:data:`CPU_FEATURES_ATTR`) that `target` lacks; before anything compiles."""
    from tvm import tirx

    from .errors import UnsupportedError

    resolved = resolve_target(target)
    for gvar, func in mod.functions_items():
        needs = func.attrs.get(CPU_FEATURES_ATTR) if isinstance(func, tirx.PrimFunc) and func.attrs else None
        if needs is None:
            continue
        missing = [f for f in str(needs).split(",") if not _has_features(resolved, [f])]
        if missing:
            raise UnsupportedError(f"kernel {gvar.name_hint} needs the CPU feature(s) {missing}, which target "
                                   f"{resolved} lacks")


def _has_features(target: TargetLike, features: list[str]) -> bool:
    """Whether `target` is an LLVM CPU with every one of the LLVM `features`."""
    resolved = resolve_target(target)
    if resolved.kind.name != "llvm":
        return False
    with resolved:
        return bool(codegen.llvm_cpu_has_features(features, resolved))


def has_avx512_bf16(target: TargetLike) -> bool:
    """Whether the (resolved) LLVM target has AVX512-BF16's `vdpbf16ps`, which the bfloat16
    BRGEMM issues (:class:`~tvm_ext.intrin.cpu.BRGEMM` with dtype "bfloat16")."""
    return _has_features(target, ["avx512bf16", "avx512f"])


def bf16_dot_doubles_fma(target: TargetLike) -> bool:
    """Whether the target's CPU runs AVX512-BF16's `vdpbf16ps` at twice the fp32 FMA's FLOP rate,
    so that a bfloat16 convolution on it beats fp32 without AMX: AMD's Zen 4 and later do (one
    zmm `vdpbf16ps` a cycle, 64 FLOP: 2.00x our fp32 on ResNet-50's layers, bench/layers.py
    --dtype bf16); Intel's do not (0.55x on Emerald Rapids, which has AMX for bf16)."""
    if not has_avx512_bf16(target):
        return False
    mcpu = str(resolve_target(target).attrs.get("mcpu", ""))
    return mcpu.startswith("znver") and mcpu[5:].isdigit() and int(mcpu[5:]) >= 4


def has_avx512_vbmi(target: TargetLike) -> bool:
    """Whether the (resolved) LLVM target has AVX512-VBMI's byte permutes (`vpermi2b`: Ice Lake,
    Zen 4 and later), which look up a 256-entry byte table 64 bytes at a time."""
    return _has_features(target, ["avx512vbmi", "avx512bw"])


def has_amx_bf16(target: TargetLike) -> bool:
    """Whether the (resolved) LLVM target has AMX with bf16 (`tdpbf16ps`; Sapphire Rapids and
    later), which the BRGEMM's "amx" engine issues."""
    return _has_features(target, ["amx-bf16", "amx-tile"])


def has_vnni(target: TargetLike, lanes: int = 16) -> bool:
    """Whether the (resolved) LLVM target has the int8 BRGEMM's `vpdpbusd` on `lanes` 32-bit lanes:
    AVX512-VNNI's zmm (16), AVX-VNNI's ymm (8; Alder Lake and later, Zen 5)."""
    if lanes == 16:
        return _has_features(target, ["avx512vnni", "avx512f"])
    return lanes == 8 and _has_features(target, ["avxvnni"])


def has_amx_int8(target: TargetLike) -> bool:
    """Whether the (resolved) LLVM target has AMX with int8 (`tdpbusd`)."""
    return _has_features(target, ["amx-int8", "amx-tile"])


# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) on x86-64 Linux: syscall(158, 0x1023, 18)
AMX_PERMISSION_SYSCALL = (158, 0x1023, 18)


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX's tile data: it must ask first
    (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, kernels 5.16 and later; the AMX
    kernels ask again at run time), and an AMX instruction without it kills the process (SIGILL).
    Asked once, here, before a build chooses AMX."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(*AMX_PERMISSION_SYSCALL) == 0
    except (OSError, AttributeError):
        return False


def vector_isa(target: TargetLike) -> VectorISA:
    """The widest fp32 FMA vector ISA the (resolved) LLVM target has."""
    resolved = resolve_target(target)
    if resolved.kind.name != "llvm":
        raise ValueError(f"vector_isa: {resolved.kind.name} is not a CPU (llvm) target")
    with resolved:
        triple = str(resolved.attrs.get("mtriple", "")) or codegen.llvm_get_system_triple()
        if triple.startswith(("aarch64", "arm64")):
            return NEON
        if codegen.llvm_cpu_has_features(["avx512f", "fma"], resolved):
            return AVX512
        if codegen.llvm_cpu_has_features(["avx2", "fma"], resolved):
            return AVX2
    return SSE

