"""Read the generated assembly: is the microkernel's inner loop vector FMAs with no spills?

The loop with the most FMA instructions is the microkernel's unrolled reduction step. Stack
traffic inside it (x86 `(%rsp)`, AArch64 `[sp`) means the register tile did not fit.
"""

from __future__ import annotations

import dataclasses
import re

from .target import VectorISA

_LABEL = re.compile(r"^([.\w$]+):")
_BRANCH = re.compile(r"^(j[a-z]+|b\.[a-z]+|b|cbn?z|tbn?z|ret)\s")


@dataclasses.dataclass
class InnerLoop:
    """The hottest basic block of a function's assembly."""

    label: str
    fma: int  # vector FMA instructions
    fma_on_isa_registers: int  # ... whose operands are full vectors of the ISA
    stack_accesses: int  # stack slots spilled and reloaded inside the loop
    lines: list[str]

    @property
    def spills(self) -> bool:
        return self.stack_accesses > 0


def _blocks(asm: str) -> list[tuple[str, list[str]]]:
    blocks: list[tuple[str, list[str]]] = [("<entry>", [])]
    for raw in asm.splitlines():
        line = raw.split("#")[0].split("//")[0].strip()
        if not line:
            continue
        match = _LABEL.match(line)
        if match:
            blocks.append((match.group(1), []))
        elif not line.startswith("."):
            blocks[-1][1].append(line)
            if _BRANCH.match(line):  # a fall-through block after a branch has no label of its own
                blocks.append((f"{blocks[-1][0]}+", []))
    return blocks


def fma_blocks(asm: str, isa: VectorISA) -> list[InnerLoop]:
    """Every basic block that issues vector FMAs (main tiles, tail tiles, unrolled copies)."""
    # A spill is a fixed stack slot both written and read in the loop; indexed stores to a stack
    # array (the accumulator row buffer written at the end of a tile) are not.
    slot = re.compile(r"(-?\d*\(%rsp\)|\[sp(?:, #-?\d+)?\])")
    found = []
    for label, lines in _blocks(asm):
        fmas = [ln for ln in lines if ln.split()[0].startswith(isa.asm_fma)]
        if not fmas:
            continue
        if isa.name == "neon":
            on_isa = [ln for ln in fmas if re.search(r"v\d+\.4s", ln)]
        else:
            on_isa = [ln for ln in fmas if isa.asm_register in ln]
        slots: dict[str, set[str]] = {}
        for ln in lines:
            for match in slot.finditer(ln):
                role = "store" if ln.rstrip().endswith(match.group(1)) else "load"
                slots.setdefault(match.group(1), set()).add(role)
        spilled = sum(1 for roles in slots.values() if roles == {"load", "store"})
        found.append(InnerLoop(label, len(fmas), len(on_isa), spilled, lines))
    return found


def inner_loop(asm: str, isa: VectorISA) -> InnerLoop:
    """The basic block with the most vector FMAs (the microkernel's inner loop)."""
    blocks = fma_blocks(asm, isa)
    if not blocks:
        raise ValueError(f"no {isa.name} vector FMA in the assembly")
    return max(blocks, key=lambda b: b.fma)
