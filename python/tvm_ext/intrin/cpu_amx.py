"""The bfloat16 and int8 BRGEMM on AMX (Intel's tile unit, Sapphire Rapids and later): the
implementation of a :class:`~tvm_ext.intrin.cpu.BRGEMM` with ``engine="amx"``; its description is
the dtype's (bf16 in pairs, u8 x s8 in groups of 4).

AMX holds eight tile registers of up to 16 rows x 64 bytes. The m_r x n_r fp32 (int32) tile of C
is up to 2 x 2 tiles of 16 x 16 (tiles 0-3), each k step loads up to two A tiles (16 rows of
pixels, 64 bytes of channels: 32 bf16 or 64 int8; tiles 4-5) and up to two B tiles (k / group
rows of 16 output channels x a group: tiles 6-7) and issues one `tdpbf16ps` (`tdpbusd`) per C
tile: 16 x 16 x k multiply-adds an instruction (the zmm `vdpbf16ps` does 16 x 2). A's rows are
pixels of the blocked input (its channels contiguous,
rows `stride` pixels apart), B is the bf16 BRGEMM's pair layout, C rows are pixels of the blocked
output: all three are strided 2-D tiles as `tileloadd`/`tilestored` read and write them.

TVM has no AMX intrinsics and its legalization would not pass tiles anyway, so each microkernel's
three phases are LLVM IR functions imported into the module (`pragma_import_llvm`, inlined):
`begin` (the tile configuration for its shape, C zeroed or loaded), `step` (one k step), `end`
(C stored). Tile registers are architectural state, which the phases share between calls.
`begin` loads the configuration only where the one in force differs (read back with
`sttilecfg`: all zeros after a `tilerelease`, whoever ran in between): `ldtilecfg` on every
call was 10-36% of a ResNet-50 layer's time, and a task's calls mostly share one shape.
Linux lets a process use the tile data only after asking (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`), which `begin` does once per process (a flag, then the syscall).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..target import AMX_PERMISSION_SYSCALL

__all__ = ["AMX_ROWS", "amx_implementation", "amx_k_step", "amx_llvm"]

AMX_ROWS = 16  # rows of a tile register
AMX_ROW_BYTES = 64


# the dot product of each AMX dtype: C tile += A tile . B tile
AMX_DOT = {"bfloat16": "tdpbf16ps", "int8": "tdpbusd"}


def amx_k_step(spec) -> int:
    """Channels a step reduces: a 64-byte row of A (32 bf16, 64 int8), or all of k if fewer."""
    return min(spec.k, AMX_ROW_BYTES * spec.group // 4)


def _row_tiles(m_r: int) -> list[int]:
    return [AMX_ROWS] * (m_r // AMX_ROWS) + ([m_r % AMX_ROWS] if m_r % AMX_ROWS else [])


def _tag(spec) -> str:
    return f"{spec.dtype}_{spec.m_r}x{spec.n_r}k{amx_k_step(spec)}{'_zero' if spec.init else ''}"


def amx_llvm(spec) -> str:
    """The LLVM IR of `spec`'s three phases (:func:`_tag` names them) and its tile configuration."""
    rows, cols, kstep, group = _row_tiles(spec.m_r), spec.n_r // 16, amx_k_step(spec), spec.group
    tag, dot = _tag(spec), AMX_DOT[spec.dtype]
    a_bytes = 4 // group
    c_tiles = [(i, j, i * cols + j) for i in range(len(rows)) for j in range(cols)]
    colsb, tile_rows = [0] * 16, [0] * 16
    for i, _, t in c_tiles:
        colsb[t], tile_rows[t] = 64, rows[i]
    for i, r in enumerate(rows):
        colsb[4 + i], tile_rows[4 + i] = a_bytes * kstep, r
    for j in range(cols):
        colsb[6 + j], tile_rows[6 + j] = 64, kstep // group
    config = [1] + [0] * 15 + [b for c in colsb for b in (c & 0xFF, c >> 8)] + tile_rows
    config_text = ", ".join(f"i8 {b}" for b in config)

    def gep(base: str, offset: str, name: str) -> str:
        return f"  %{name} = getelementptr i8, ptr %{base}, i64 {offset}\n"

    begin = [f"  call void @tvmext_amx_permit()\n  call void @tvmext_amx_configure(ptr @tvmext_amx_cfg_{tag})\n"]
    step, end = [], []
    for i, _ in enumerate(rows):
        load = f"  call void @llvm.x86.tileloadd64(i8 {4 + i}, ptr %a{i}, i64 %sa)\n"
        step.append(f"  %ao{i} = mul i64 %sa, {AMX_ROWS * i}\n" + gep("a", f"%ao{i}", f"a{i}") + load)
    for j in range(cols):
        load = f"  call void @llvm.x86.tileloadd64(i8 {6 + j}, ptr %b{j}, i64 %sb)\n"
        step.append(gep("b", str(64 * j), f"b{j}") + load)
    for i, j, t in c_tiles:
        step.append(f"  call void @llvm.x86.{dot}(i8 {t}, i8 {4 + i}, i8 {6 + j})\n")
        at = (f"  %co{t} = mul i64 %sc, {AMX_ROWS * i}\n  %cr{t} = add i64 %co{t}, {64 * j}\n"
              + gep("c", f"%cr{t}", f"c{t}"))
        begin.append(f"  call void @llvm.x86.tilezero(i8 {t})\n" if spec.init
                     else at + f"  call void @llvm.x86.tileloadd64(i8 {t}, ptr %c{t}, i64 %sc)\n")
        end.append(at + f"  call void @llvm.x86.tilestored64(i8 {t}, ptr %c{t}, i64 %sc)\n")
    return f"""
@tvmext_amx_cfg_{tag} = linkonce_odr constant [64 x i8] [{config_text}], align 64
@tvmext_amx_permitted = linkonce_odr global i8 0
define linkonce_odr void @tvmext_amx_configure(ptr %cfg) #0 {{
  %now = alloca [64 x i8], align 64
  call void @llvm.x86.sttilecfg(ptr %now)
  %current = load <64 x i8>, ptr %now, align 64
  %wanted = load <64 x i8>, ptr %cfg, align 64
  %differ = icmp ne <64 x i8> %current, %wanted
  %bits = bitcast <64 x i1> %differ to i64
  %same = icmp eq i64 %bits, 0
  br i1 %same, label %ready, label %load
load:
  call void @llvm.x86.ldtilecfg(ptr %cfg)
  br label %ready
ready:
  ret void
}}
define linkonce_odr void @tvmext_amx_permit() #0 {{
  %done = load i8, ptr @tvmext_amx_permitted
  %ask = icmp eq i8 %done, 0
  br i1 %ask, label %request, label %ready
request:
  %r = call i64 (i64, ...) @syscall({", ".join(f"i64 {v}" for v in AMX_PERMISSION_SYSCALL)})
  store i8 1, ptr @tvmext_amx_permitted
  br label %ready
ready:
  ret void
}}
define linkonce_odr void @tvmext_amx_begin_{tag}(ptr %c, i64 %sc) #0 {{
{"".join(begin)}  ret void
}}
define linkonce_odr void @tvmext_amx_step_{tag}(ptr %a, i64 %sa, ptr %b, i64 %sb) #0 {{
{"".join(step)}  ret void
}}
define linkonce_odr void @tvmext_amx_end_{tag}(ptr %c, i64 %sc) #0 {{
{"".join(end)}  ret void
}}
declare i64 @syscall(i64, ...)
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.sttilecfg(ptr)
declare void @llvm.x86.tilezero(i8)
declare void @llvm.x86.tileloadd64(i8, ptr, i64)
declare void @llvm.x86.{dot}(i8, i8, i8)
declare void @llvm.x86.tilestored64(i8, ptr, i64)
attributes #0 = {{ alwaysinline }}
"""


def amx_implementation(spec, signature, a_index, regions) -> tirx.PrimFunc:
    """The microkernel of an AMX `spec`: begin, a step per (batch entry, k step), end
    (`signature`, `a_index`, `regions`: :mod:`tvm_ext.intrin.cpu`'s, shared with the description)."""
    kstep, tag, group = amx_k_step(spec), _tag(spec), spec.group
    a_bytes = 4 // group
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("impl")
        batch, a, b, c = signature(spec, strided=True)
        with T.sblock("root"):
            regions(spec, a, b, c)
            sa = T.Cast("int64", a.strides[2] * spec.stride * a_bytes)  # bytes from a pixel of C's rows to the next
            sb = T.Cast("int64", b.strides[3] * a_bytes)  # bytes from a group of channels to the next
            sc = T.Cast("int64", c.strides[0] * 4)
            with T.attr(0, "pragma_import_llvm", amx_llvm(spec)):
                T.evaluate(T.call_extern("void", f"tvmext_amx_begin_{tag}", T.address_of(c[0, 0]), sc))
                with T.grid(*batch) as (i0, i1, i2), T.serial(spec.k // kstep) as ks:
                    IRBuilder.name_many(["i0", "i1", "i2", "ks"], [i0, i1, i2, ks])
                    a_at = T.address_of(a[tuple(a_index(spec, i0, i1, i2, 0, ks * kstep))])
                    b_at = T.address_of(b[i0, i1, i2, ks * (kstep // group), 0, 0])
                    T.evaluate(T.call_extern("void", f"tvmext_amx_step_{tag}", a_at, sa, b_at, sb))
                T.evaluate(T.call_extern("void", f"tvmext_amx_end_{tag}", T.address_of(c[0, 0]), sc))
    return builder.get()
