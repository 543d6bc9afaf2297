"""The one schema of the native instruction set and of the program's native section.

Both sides are produced from this module:

* the C++ header ``src/native_schema.h`` (:func:`render_header`; checked in, and
  ``tests/program/test_native_schema.py`` checks that regenerating it gives the same bytes):
  instruction codes, the word count of every instruction, where a ranked instruction keeps its
  rank, the kind enumerations and the section's framing constants, which the interpreter
  (``src/sim_plan.cc``) and the section decoder (``src/native_section.cc``) use;
* the Python writers: :class:`~tvm_spinn.program.ops.native.NativeBuilder` takes its codes from
  :func:`codes` and checks every instruction's word count against :data:`INSTRUCTIONS` when it
  is emitted, and :mod:`tvm_spinn.program.native_section` writes the section with
  :data:`SECTION`'s layout.

An instruction is its code followed by its fields, one int64 word each, in the order listed.
A field is ``name`` (an integer), ``name:s`` (a slot: constant, argument or temporary),
``name:s?`` (a slot or ``none``, -1) or ``name:f`` (the bits of a float32). A *ranked*
instruction is followed by ``per_dim`` arrays of ``rank`` words (shape, then strides), its rank
being the field ``rank_field``.

Regenerate the header with ``python -m tvm_spinn.program.native_schema src/native_schema.h``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["Field", "Instruction", "INSTRUCTIONS", "KINDS", "SECTION", "codes", "instruction", "render_header"]


@dataclass(frozen=True)
class Field:
    """One word of an instruction: ``kind`` ``"int"``, ``"slot"``, ``"slot?"`` or ``"f32"``."""

    name: str
    kind: str


@dataclass(frozen=True)
class Instruction:
    """An instruction: ``code``, its fixed ``fields`` and, for a ranked one, the field holding
    the rank and the number of rank-long arrays after the fields."""

    name: str
    code: int
    fields: tuple[Field, ...]
    rank_field: str | None = None
    per_dim: int = 0
    doc: str = ""

    @property
    def words(self) -> int:
        """Words of the instruction without its ranked arrays, the code included."""
        return 1 + len(self.fields)

    @property
    def rank_at(self) -> int:
        """Word index of the rank (the code is word 0); -1 if not ranked."""
        if self.rank_field is None:
            return -1
        return 1 + [f.name for f in self.fields].index(self.rank_field)


_KINDS = {"": "int", "s": "slot", "s?": "slot?", "f": "f32"}


def _instr(name, code, spec, doc, rank_field=None, per_dim=0) -> Instruction:
    fields = []
    for word in spec.split():
        fname, _, kind = word.partition(":")
        fields.append(Field(fname, _KINDS[kind]))
    return Instruction(name, code, tuple(fields), rank_field, per_dim, doc)


_IM2COL = "n groups cg h w kh kw oh ow sh sw dh dw pt pl"
_QGEMM = ("a:s b:s out:s acc:s batch m k n a_index:s b_index:s chunk acc_bits za za_vec:s? zb zb_vec:s? "
          "a_sum:s? b_sum:s? groups on_rows out_kind scale:s bias:s? bias_q:s multiplier:s shift:s relu rounding "
          "y_zero y_min y_max")

#: The instruction set, in code order.
INSTRUCTIONS: tuple[Instruction, ...] = (
    _instr("gemm", 0, "a:s b:s c:s batch m k n a_index:s b_index:s bias:s? on_rows relu clip lo:f hi:f outer rows cols",
           "fp32 batched GEMM on the M4F, then the epilogue (bias, ReLU, clip) over [outer, rows, cols]"),
    _instr("im2col", 1, "x:s out:s " + _IM2COL, "fp32 convolution operand gather (padding +0.0)"),
    _instr("depthwise", 2, "x:s w:s out:s n groups mult h w kh kw oh ow sh sw dh dw pt pl bias:s? relu clip lo:f hi:f",
           "direct depthwise convolution"),
    _instr("softmax", 3, "x:s out:s rows cols", "row softmax"),
    _instr("layer_norm", 4, "x:s gamma:s? beta:s? eps:f out:s rows cols", "row layer normalization"),
    _instr("mean", 5, "x:s out:s rows cols", "row mean"),
    _instr("unary", 6, "x:s out:s n kind lo:f hi:f relu", "element-wise unary (kinds: unary.*)"),
    _instr("binary", 7, "a:s b:s out:s kind relu ndim", "broadcast binary (kinds: binary.*): shape, a, b strides",
           "ndim", 3),
    _instr("copy", 8, "src:s dst:s elem_bytes ndim src_off dst_off", "strided copy: shape, src, dst strides",
           "ndim", 3),
    _instr("pool", 9, "x:s out:s planes h w oh ow kh kw sh sw dh dw pt pl is_max include_pad", "2-D pooling"),
    _instr("gather", 10, "table:s indices:s out:s elem_bytes outer extent inner count mode layer axis",
           "gather along an axis (int32 indices, checked)"),
    _instr("qgemm", 11, _QGEMM, "int8 GEMM on the MAC array with the M4F's zero-point terms and epilogue"),
    _instr("flip8", 12, "src:s dst:s n", "uint8 -> int8 with the top bit flipped (u - 128)"),
    _instr("quantize", 13, "x:s out:s n inner channels scale:s zero:s kind", "fp32 -> int8/uint8 (kinds: quant.*)"),
    _instr("dequantize", 14, "x:s out:s n inner channels scale:s zero:s kind", "int8/uint8/int32 -> fp32"),
    _instr("im2col8", 15, "x:s out:s " + _IM2COL + " fill", "1-byte im2col, padding with `fill`"),
    _instr("rms_norm", 16, "x:s weight:s? eps:f out:s rows cols", "row RMS normalization"),
    _instr("fill", 17, "dst:s elem_bytes n bits", "n elements of the value `bits`"),
    _instr("where_less", 18, "a:s b:s c:s d:s out:s ndim", "a < b ? c : d: shape, then a, b, c, d strides",
           "ndim", 5),
    _instr("pool_grad", 19, "dy:s x:s out:s planes h w oh ow kh kw sh sw pt pl", "max_pool2d_backward (fp32)"),
    _instr("cross_entropy", 20, "z:s labels:s out:s rows cols ignore_index", "per-row losses (int32 labels)"),
    _instr("cross_entropy_grad", 21, "z:s labels:s out:s rows cols divisor:f", "(softmax - onehot) / divisor"),
    _instr("rope", 22, "x:s cos:s sin:s out:s half ndim",
           "x * cos + rotate_half(x) * sin over rows of 2 half (x, out contiguous): shape, then cos, sin strides",
           "ndim", 3),
)

#: Enumerations carried in instruction fields: ``{group: ((name, value), ...)}``.
KINDS: dict[str, tuple[tuple[str, int], ...]] = {
    "unary": (("relu", 0), ("clip", 1), ("negative", 2), ("sqrt", 3), ("rsqrt", 4), ("square", 5),
              ("cube", 6), ("tanh", 7), ("gelu", 8), ("gelu_tanh", 9), ("sigmoid", 10)),
    "binary": (("add", 0), ("subtract", 1), ("multiply", 2), ("divide", 3)),
    "qout": (("f32", 0), ("i8", 1), ("u8", 2), ("i32", 3)),
    "quant": (("i8", 1), ("u8", 2), ("i32", 3)),
}

#: The native section's framing (written by :mod:`tvm_spinn.program.native_section`, read by
#: ``src/native_section.cc``; the layout is documented there and in that module).
SECTION = {
    "magic": b"SPINNPLN",
    "version": 1,
    "status_plan": 0,       # the section holds a plan: the program runs without Python
    "status_python": 1,     # a layer has no native description: the section names it
    "const_program": 0,     # a constant read from the program's constant blob
    "const_inline": 1,      # a constant stored in the section
    "align": 64,            # inline constants start at multiples of this (from the section start)
    "max_dims": 8,          # most dimensions of an argument or a ranked instruction
    "none": -1,             # "no buffer" in a slot? field
}


def instruction(name: str) -> Instruction:
    """The instruction called ``name``."""
    return _BY_NAME[name]


_BY_NAME = {i.name: i for i in INSTRUCTIONS}


def codes() -> dict[str, int]:
    """Instruction codes by name, kind values as ``group.name``, and ``max_dims``, ``none``."""
    out = {i.name: i.code for i in INSTRUCTIONS}
    for group, values in KINDS.items():
        if group in ("unary", "binary"):
            out.update({f"{group}.{name}": value for name, value in values})
    out["max_dims"] = SECTION["max_dims"]
    out["none"] = SECTION["none"]
    return out


def _camel(name: str) -> str:
    return "k" + "".join(part.capitalize() for part in name.split("_"))


def render_header() -> str:
    """The text of ``src/native_schema.h``."""
    lines = [
        "// Generated by python -m tvm_spinn.program.native_schema from python/tvm_spinn/program/native_schema.py.",
        "// Do not edit: change the schema and regenerate (tests/program/test_native_schema.py checks it).",
        "#ifndef TVM_SPINN_NATIVE_SCHEMA_H_",
        "#define TVM_SPINN_NATIVE_SCHEMA_H_",
        "",
        "#include <cstdint>",
        "",
        "namespace tvm_spinn {",
        "namespace schema {",
        "",
        "/*! \\brief Instruction codes; each instruction's words follow it (see the schema). */",
        "enum Op : int64_t {",
    ]
    for ins in INSTRUCTIONS:
        ranked = f" [{ins.per_dim} x {ins.rank_field}]" if ins.rank_field else ""
        fields = " ".join(f.name for f in ins.fields)
        lines.append(f"  {_camel(ins.name)} = {ins.code},  // {fields}{ranked}")
    lines += ["};", "", f"constexpr int kNumOps = {len(INSTRUCTIONS)};", "",
              "/*! \\brief Words of each instruction without its ranked arrays (the code included). */",
              "constexpr int64_t kWords[kNumOps] = {" + ", ".join(str(i.words) for i in INSTRUCTIONS) + "};",
              "/*! \\brief Word index of a ranked instruction's rank (-1: not ranked). */",
              "constexpr int64_t kRankAt[kNumOps] = {" + ", ".join(str(i.rank_at) for i in INSTRUCTIONS) + "};",
              "/*! \\brief Rank-long arrays after a ranked instruction's fields. */",
              "constexpr int64_t kPerDim[kNumOps] = {" + ", ".join(str(i.per_dim) for i in INSTRUCTIONS) + "};",
              "/*! \\brief Instruction names, by code. */",
              "constexpr const char* kNames[kNumOps] = {" + ", ".join(f'"{i.name}"' for i in INSTRUCTIONS) + "};",
              ""]
    for group, values in KINDS.items():
        body = ", ".join(f"k{group.capitalize()}{_camel(name)[1:]} = {value}" for name, value in values)
        lines.append(f"enum {group.capitalize()}Kind : int64_t {{ {body} }};")
    magic = ", ".join(f"'{chr(c)}'" for c in SECTION["magic"])
    lines += ["",
              "/*! \\brief The program's native section (src/native_section.cc). */",
              f"constexpr char kSectionMagic[8] = {{{magic}}};",
              f"constexpr uint32_t kSectionVersion = {SECTION['version']};",
              f"constexpr uint32_t kStatusPlan = {SECTION['status_plan']};",
              f"constexpr uint32_t kStatusPython = {SECTION['status_python']};",
              f"constexpr int64_t kConstProgram = {SECTION['const_program']};",
              f"constexpr int64_t kConstInline = {SECTION['const_inline']};",
              f"constexpr int64_t kSectionAlign = {SECTION['align']};",
              f"constexpr int kMaxDims = {SECTION['max_dims']};",
              f"constexpr int64_t kNone = {SECTION['none']};",
              "",
              "}  // namespace schema",
              "}  // namespace tvm_spinn",
              "",
              "#endif  // TVM_SPINN_NATIVE_SCHEMA_H_",
              ""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tvm_spinn.program.native_schema src/native_schema.h
    with open(sys.argv[1], "w", encoding="utf-8", newline="\n") as out:
        out.write(render_header())
