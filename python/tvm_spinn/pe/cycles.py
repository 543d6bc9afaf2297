"""Cycles of executed code: the instructions a PE executed (basic blocks counted by the
instruction-set simulator, decoded with ``capstone``) priced by the Cortex-M4's cycle table.

Source: Arm Cortex-M4 Technical Reference Manual r0p1 (ARM DDI 0439B), table 3-1 "Cortex-M4
instruction set summary" (integer: data processing 1, MUL 1, MLA/MLS 2, 32x32->64 multiplies 1,
LDR/STR 2, LDRD/STRD and LDM/STM/PUSH/POP 1 + N, SDIV/UDIV 2-12, branches 1 + P with P the
pipeline refill of 1-3 cycles) and table 7-1 "FPU instruction set" (VADD/VSUB/VMUL/VNEG/VABS/VCMP/
VCVT/VMOV/VMRS/VMSR 1, VMLA/VMLS/VNMLA/VNMLS and the fused VFMA/VFMS/VFNMA/VFNMS 3, VDIV and
VSQRT 14, VLDR/VSTR 2, VLDM/VSTM/VPUSH/VPOP 1 + N).

Load and store pipelining (TRM section 3.3.2, "Load/store timings"): neighbouring load and store
single instructions (LDR/STR and their byte and halfword forms, VLDR/VSTR) pipeline their
address and data phases, so one that directly follows another completes in 1 cycle instead of
2 -- unless its address register is one the previous load wrote (the TRM's dependent case).

Simplifications (named): the pipelining is applied within a basic block only (the first
instruction of a block is never pipelined with the last of the one before); a taken branch to an immediate refills in P = 1 (2 cycles), one through a
register or a POP into PC in P = 2 (the TRM's "normally" cases); a branch not taken is 1; IT is
1 (not folded); SDIV/UDIV take their worst case, 12.
"""

from __future__ import annotations

import capstone

__all__ = ["CYCLES", "instruction_cycles", "executed_cycles", "block_cycles", "block_price"]

#: mnemonic (without condition suffix or width qualifier) -> cycles, or a class handled below
CYCLES = {
    # FPU (TRM table 7-1)
    "vadd": 1, "vsub": 1, "vmul": 1, "vnmul": 1, "vneg": 1, "vabs": 1, "vcmp": 1, "vcmpe": 1,
    "vcvt": 1, "vcvtr": 1, "vmov": 1, "vmrs": 1, "vmsr": 1, "vldr": 2, "vstr": 2,
    "vmla": 3, "vmls": 3, "vnmla": 3, "vnmls": 3, "vfma": 3, "vfms": 3, "vfnma": 3, "vfnms": 3,
    "vdiv": 14, "vsqrt": 14,
    # integer (TRM table 3-1)
    "mul": 1, "muls": 1, "mla": 2, "mls": 2, "smull": 1, "umull": 1, "smlal": 1, "umlal": 1,
    "sdiv": 12, "udiv": 12,
    "ldr": 2, "ldrb": 2, "ldrh": 2, "ldrsb": 2, "ldrsh": 2, "str": 2, "strb": 2, "strh": 2,
    "it": 1, "nop": 1,
}
_MULTI = {"ldm", "ldmia", "ldmdb", "stm", "stmia", "stmdb", "push", "pop", "ldrd", "strd",
          "vldm", "vldmia", "vldmdb", "vstm", "vstmia", "vstmdb", "vpush", "vpop"}
_SINGLE = {"ldr", "ldrb", "ldrh", "ldrsb", "ldrsh", "str", "strb", "strh", "vldr", "vstr"}
_BRANCH_IMM = {"b", "bl", "cbz", "cbnz"}
_BRANCH_REG = {"bx", "blx"}
_CONDS = ("eq", "ne", "cs", "hs", "cc", "lo", "mi", "pl", "vs", "vc", "hi", "ls", "ge", "lt", "gt", "le", "al")

_MD = capstone.Cs(capstone.CS_ARCH_ARM, capstone.CS_MODE_THUMB | capstone.CS_MODE_MCLASS)
_MD.detail = True


def _base(mnemonic: str) -> str:
    """``vmovgt.f32`` -> ``vmov``, ``add.w`` -> ``add``, ``bne`` -> ``b``."""
    m = mnemonic.split(".")[0]
    if m in CYCLES or m in _MULTI or m in _BRANCH_IMM or m in _BRANCH_REG:
        return m
    for c in _CONDS:
        if m.endswith(c) and len(m) > len(c):
            stem = m[: -len(c)]
            if stem in CYCLES or stem in _MULTI or stem in _BRANCH_IMM or stem in _BRANCH_REG or stem in ("add", "sub", "mov"):
                return stem
    return m


def instruction_cycles(insn, taken: bool) -> tuple[str, int]:
    """``(class, cycles)`` of one decoded instruction; ``taken``: whether control left it for
    somewhere other than the next instruction."""
    base = _base(insn.mnemonic)
    if base in _MULTI:
        regs = sum(1 for op in insn.operands if op.type == capstone.arm.ARM_OP_REG) - (
            1 if base in ("ldm", "ldmia", "ldmdb", "stm", "stmia", "stmdb", "vldm", "vldmia", "vldmdb",
                          "vstm", "vstmia", "vstmdb", "ldrd", "strd") else 0)
        pc = base == "pop" and "pc" in insn.op_str
        return base, 1 + max(regs, 1) + (2 if pc else 0)
    if base in _BRANCH_IMM:
        return "branch", 2 if taken else 1
    if base in _BRANCH_REG:
        return "branch", 3 if taken else 1
    return base, CYCLES.get(base, 1)


def _address_regs(insn) -> set:
    return {r for op in insn.operands if op.type == capstone.arm.ARM_OP_MEM
            for r in (op.mem.base, op.mem.index) if r}


def _block_prices(insns) -> list[tuple[str, int, int]]:
    """Per instruction of a basic block: ``(class, cycles if control falls through, cycles if
    it is the block's taken exit)``, with neighbouring load/store singles pipelined."""
    out, prev_single, prev_written = [], False, set()
    for insn in insns:
        name, c_not = instruction_cycles(insn, False)
        _, c_taken = instruction_cycles(insn, True)
        single = _base(insn.mnemonic) in _SINGLE
        if single and prev_single and not (_address_regs(insn) & prev_written):
            c_not, c_taken = c_not - 1, c_taken - 1
        prev_written = set(insn.regs_access()[1]) if single else set()
        prev_single = single
        out.append((name, c_not, c_taken))
    return out


def _decode(machine, address: int, size: int) -> list:
    cache = machine.__dict__.setdefault("_decoded", {})
    key = (address, size)
    if key not in cache:
        code = machine.read(address, size)
        cache[key] = _block_prices(list(_MD.disasm(code, address)))
    return cache[key]


def block_price(machine, address: int, size: int) -> tuple[int, int]:
    """``(cycles, extra)`` of the basic block at ``address`` of ``size`` bytes: its cycles when
    control falls through its last instruction, and what a taken exit adds to them."""
    prices = _decode(machine, address, size)
    if not prices:
        return 0, 0
    return sum(p[1] for p in prices), prices[-1][2] - prices[-1][1]


def executed_cycles(machine) -> tuple[int, dict]:
    """Cycles of everything ``machine`` executed since its counters were cleared, plus the cycles
    it waited on its peripherals (``machine.stall``, rounded up), and the executed instructions
    per class (``{class: count}``, sorted)."""
    total, classes = block_cycles(machine)
    return total - int(-getattr(machine, "stall", 0) // 1), classes


def block_cycles(machine, ranges=None) -> tuple[int, dict]:
    """TRM-priced cycles of the basic blocks ``machine`` executed (only those starting in one of
    the ``[lo, hi)`` address ``ranges`` when given; no peripheral waits), and their executed
    instructions per class (``{class: count}``, sorted)."""
    total, classes = 0, {}
    for key, count in machine.blocks.items():
        if ranges is not None and not any(lo <= key[0] < hi for lo, hi in ranges):
            continue
        prices = _decode(machine, *key)
        taken = machine.taken.get(key, 0)
        for n, (name, c_not, c_taken) in enumerate(prices):
            if n == len(prices) - 1 and taken:
                total += c_taken * taken + c_not * (count - taken)
            else:
                total += c_not * count
            classes[name] = classes.get(name, 0) + count
    return total, dict(sorted(classes.items()))
