"""The one parser of HLO module text (``compiled.as_text()``): a ``HloModule name, key=value, ...`` header, then
computations, each a header line (``ENTRY %main (a: f32[8]) -> f32[8] {``) and one instruction a line, in schedule
order for a scheduled module: ``ROOT %dot.3 = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, ...`` is its
name, shape, opcode, operands, attributes. A shape is an array ``f32[8,4]{1,0}`` (element type, dims, layout;
``f32[<=4]``: a dynamic dim of at most 4) or a tuple of shapes ``(f32[8]{0}, s32[])``.
"""

from __future__ import annotations

import functools
import re
import typing as tp

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_MODULE = re.compile(r"^HloModule\s+(?P<name>[\w.\-]+)(?P<attributes>.*)$", re.M)
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s(?P<opcode>[a-z][\w\-]*)"
                          r"\((?P<operands>[^)]*)\)(?P<attributes>.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"(\w+)\[([\d,<=]*)\](?:\{([^}]*)\})?")
_DTYPES = (("pred", "bool"), ("bf16", "bfloat16"), (r"s(\d+)", r"int\1"), (r"u(\d+)", r"uint\1"),
           (r"f(\d+)", r"float\1"), (r"f(\d+)(e\w+)", r"float\1_\2"), (r"c(\d+)", r"complex\1"))


class Instruction(tp.NamedTuple):
    """One instruction: ``shape`` its result's shape text, ``operands`` the names of its operands,
    ``operand_text`` what its parentheses hold (a constant's value, a parameter's number), ``attributes`` the
    text after them (``, dimensions={0}, to_apply=%add``)."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    operand_text: str
    attributes: str
    root: bool

    def attribute(self, key: str) -> str | None:
        """The value of attribute ``key`` when it is a name or a number (``body=%loop`` -> ``"loop"``)."""
        match = re.search(rf"(?:^|[\s,]){re.escape(key)}=%?([\w.\-]+)", self.attributes)
        return match[1] if match else None

    @property
    def called(self) -> tuple[str, ...]:
        """The computations it calls: a fusion's body, a reducer, a loop's condition and body, a conditional's
        branches."""
        return tuple(c.strip().lstrip("%") for single, branches in _CALLED.findall(self.attributes)
                     for c in ((single,) if single else branches.split(",")))


class Computation(tp.NamedTuple):
    name: str
    instructions: tuple[Instruction, ...]

    @property
    def root(self) -> Instruction | None:
        return next((op for op in self.instructions if op.root), None)


class Module(tp.NamedTuple):
    """``computations`` by name, in text order; ``entry`` the entry computation's name."""

    name: str
    header: str
    computations: dict[str, Computation]
    entry: str | None

    def attribute(self, key: str) -> str | None:
        """A value of the ``HloModule`` line (``num_partitions`` -> ``"8"``, ``is_scheduled`` -> ``"true"``)."""
        match = re.search(rf"\b{re.escape(key)}=(\w+)", self.header)
        return match[1] if match else None


@functools.lru_cache(maxsize=2)  # the views read one module several times (collectives, trips, FLOPs, bytes)
def parse(hlo_text: str) -> Module:
    """The module ``hlo_text`` (``compiled.as_text()``) read; shared between callers: do not mutate it."""
    computations: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    entry = None
    for line in hlo_text.splitlines():
        if (header := _HEADER.match(line)) is not None:
            current = computations[header["name"]] = []
            entry = header["name"] if header["entry"] else entry
        elif current is not None and (m := _INSTRUCTION.match(line)) is not None:
            current.append(Instruction(m["name"], m["shape"], m["opcode"], tuple(_OPERAND.findall(m["operands"])),
                                       m["operands"], m["attributes"], bool(m["root"])))
    module = _MODULE.search(hlo_text)
    return Module(module["name"] if module else "", module["attributes"] if module else "",
                  {name: Computation(name, tuple(ops)) for name, ops in computations.items()}, entry)


class Array(tp.NamedTuple):
    """One array of a shape: HLO element type (``f32``, ``bf16``, ``pred``), dims, layout text (``1,0``, or
    ``1,0:T(8,128)S(1)`` with tiling and memory space; ``""`` when not printed)."""

    dtype: str
    dims: tuple[int, ...]
    layout: str


def shape_tree(text: str) -> Array | list[tp.Any]:
    """An HLO shape such as ``(f32[2]{0}, (s32[], bf16[4,4]))`` as an :class:`Array`, or a list (nested like the
    tuple) of them."""
    text = re.sub(r"/\*.*?\*/", "", text)
    stack: list[list[tp.Any]] = [[]]
    i = 0
    while i < len(text):
        if text[i] == "(":
            stack.append([])
        elif text[i] == ")":
            done = stack.pop()
            stack[-1].append(done)
        elif match := _ARRAY.match(text, i):
            dims = tuple(int(d.lstrip("<=")) for d in match[2].split(",") if d)  # f32[<=4]: at most 4
            stack[-1].append(Array(match[1], dims, match[3] or ""))
            i = match.end()
            continue
        i += 1
    return stack[0][0] if len(stack[0]) == 1 else stack[0]


def leaves(shape: Array | list[tp.Any]) -> list[Array]:
    """The arrays of a :func:`shape_tree`, in order."""
    return [shape] if isinstance(shape, Array) else [leaf for s in shape for leaf in leaves(s)]


def element_bits(dtype: str) -> int:
    """Bits of one element of an HLO element type: ``pred`` 8, ``bf16`` 16, ``f8e4m3fn`` 8, ``c64`` 64;
    ``token`` 0."""
    if dtype == "pred":
        return 8
    bits = re.match(r"(?:bf|[sufc])(\d+)", dtype)
    return int(bits[1]) if bits else 0


def dtype_name(dtype: str) -> str:
    """NumPy's name for an HLO element type: ``s32`` -> ``int32``, ``f8e4m3fn`` -> ``float8_e4m3fn``."""
    for pattern, name in _DTYPES:
        if re.fullmatch(pattern, dtype):
            return re.sub(pattern, name, dtype)
    return dtype


__all__ = ["COLLECTIVE_KINDS", "Array", "Computation", "Instruction", "Module", "dtype_name",
           "element_bits", "leaves", "parse", "shape_tree"]
