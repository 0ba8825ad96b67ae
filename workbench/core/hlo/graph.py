"""How often each computation of an optimised HLO module runs, the module's matmul FLOPs and HBM bytes, and
what its schedule runs while each asynchronous collective is in flight (:func:`async_windows`).

A computation runs once per run of each instruction that calls it (a fusion, a call, a conditional's branch:
counted as if taken), and a while loop's body ``known_trip_count`` times per run of the loop (XLA:TPU records
no count: it is read from the loop's condition). From that: a collective's trips per program execution
(:mod:`workbench.core.hlo.collectives` uses :func:`computation_runs`); the FLOPs of every ``dot`` (also inside fusions),
``2 x prod(result dims) x prod(contracted dims)``, and of every ``convolution`` (XLA:TPU writes dots as
convolutions) times the runs of its computation; the bytes each instruction moves to and from HBM
(:func:`hbm_bytes`). XLA's ``cost_analysis()`` counts a while loop's body once, so for a model whose layers run
in a ``lax.scan`` it reports about one layer's FLOPs.
"""

from __future__ import annotations

import functools
import math
import re
import typing as tp

import numpy as np

from workbench.core.hlo.text import Array, Instruction, Module, element_bits, leaves, parse, shape_tree

_TRIPS = re.compile(r"known_trip_count\D*(\d+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CONV_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")


def _array_dims(shape: str) -> list[int]:
    """An array shape's dims; ``[]`` for a tuple."""
    return list(s.dims) if isinstance(s := shape_tree(shape), Array) else []


def _graph(module: Module) -> tuple[str | None, dict[str, float], dict[str, list[tuple[str, int]]], dict[str, float]]:
    """The entry computation's name, each computation's dot FLOPs for one run, its calls ``[(callee, runs per run
    of the caller)]``, and the FLOPs of each dot or convolution instruction by name."""
    flops_in: dict[str, float] = {}
    dot_flops: dict[str, float] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    defs = {op.name: op for c in module.computations.values() for op in c.instructions}  # names are module-unique
    inferred: list[tuple[str, int, str, str]] = []  # loops without known_trip_count: caller, call index, ...
    for computation in module.computations.values():
        name = computation.name
        flops_in[name], calls[name] = 0.0, []
        shapes: dict[str, str] = {}
        for op in computation.instructions:
            shapes[op.name] = op.shape
            lhs, rhs = (*op.operands, "", "")[:2]
            if op.opcode == "dot" and lhs in shapes and (contract := _CONTRACT.search(op.attributes)):
                k = math.prod(_array_dims(shapes[lhs])[int(i)] for i in contract[1].split(",") if i)
                dot_flops[op.name] = 2.0 * math.prod(_array_dims(shapes[op.name])) * k
            elif op.opcode == "convolution" and lhs in shapes and rhs in shapes:  # XLA:TPU writes some dots so
                operands_and_result = (_array_dims(shapes[n]) for n in (lhs, rhs, op.name))  # dim_labels=bf_io->bf
                dot_flops[op.name] = _convolution_flops(op.attributes, *operands_and_result)
            flops_in[name] += dot_flops.get(op.name, 0.0)
            trips = int(t[1]) if op.opcode == "while" and (t := _TRIPS.search(op.attributes)) else 1
            body = op.attribute("body") if op.opcode == "while" else None
            for callee in op.called:
                if callee == body and not _TRIPS.search(op.attributes) and \
                        (condition := op.attribute("condition")):
                    inferred.append((name, len(calls[name]), op.operands[0] if op.operands else "", condition))
                calls[name].append((callee, trips if callee == body else 1))
    roots = {c.name: c.root.name for c in module.computations.values() if c.root is not None}
    for caller, index, operand, condition in inferred:
        body = calls[caller][index][0]
        calls[caller][index] = (body, _trips_from_condition(operand, condition, body, defs, roots))
    return module.entry, flops_in, calls, dot_flops


def _trips_from_condition(operand: str, condition: str, body: str, defs: dict[str, Instruction],
                          roots: dict[str, str]) -> int:
    """A loop's trip count where XLA recorded none (XLA:TPU does not): its condition compares a counter (a
    tuple element) with a constant, ``i < n`` (or ``n > i``); the counter starts at a constant of the loop's
    initial tuple and the body adds a constant step to it. 1 where the loop is not of that form."""
    def follow(name: str) -> Instruction | None:
        d = defs.get(name)
        while d is not None and d.opcode in ("copy", "bitcast", "convert"):
            d = defs.get(d.operands[0]) if d.operands else None
        return d

    def constant(name: str) -> int | None:
        d = follow(name)
        return int(d.operand_text) if d is not None and d.opcode == "constant" and \
            re.fullmatch(r"-?\d+", d.operand_text.strip()) else None

    def element(name: str) -> int | None:
        d = follow(name)
        return int(i) if d is not None and d.opcode == "get-tuple-element" and (i := d.attribute("index")) else None

    compare = defs.get(roots.get(condition, ""))
    if compare is None or compare.opcode != "compare" or len(args := compare.operands) != 2:
        return 1
    direction = compare.attribute("direction") or ""
    if direction in ("GT", "GE"):  # n > i is i < n
        args, direction = args[::-1], {"GT": "LT", "GE": "LE"}[direction]
    k, bound = element(args[0]), constant(args[1])
    start_tuple = follow(operand)
    if direction not in ("LT", "LE") or k is None or bound is None or start_tuple is None or \
            start_tuple.opcode != "tuple":
        return 1
    start = constant(start_tuple.operands[k]) if k < len(start_tuple.operands) else None
    # the step: the body's result tuple holds counter + constant at position k
    end = defs.get(roots.get(body, ""))
    counter = follow(end.operands[k]) if end is not None and end.opcode == "tuple" and k < len(end.operands) \
        else None
    terms = counter.operands if counter is not None and counter.opcode == "add" else ()
    step = None
    if len(terms) == 2 and k in (element(terms[0]), element(terms[1])):
        step = constant(terms[1] if element(terms[0]) == k else terms[0])
    if start is None or not step or step < 0:
        return 1
    return max(0, -(-(bound - start + (direction == "LE")) // step))


def _window(rest: str, key: str, count: int, default: int) -> list[int]:
    match = re.search(rf"\b{key}=([\dx_]+)", rest)
    return [int(v) for v in match[1].split("x")] if match else [default] * count


def _convolution_flops(rest: str, lhs: list[int], rhs: list[int], out: list[int]) -> float:
    """``2 x`` multiply-adds of a convolution: output batch x output features x the kernel's input features x,
    per spatial dim, the (output position, window tap) pairs that land on the input rather than its padding.
    XLA:TPU writes a dot's batch dims as spatial dims whose window slides over padding (``size=8 pad=7_7``):
    one tap of eight lands, so counting the whole window would count such a dot 8x."""
    labels = _CONV_LABELS.search(rest)
    if labels is None:
        return 0.0
    lhs_l, rhs_l, out_l = labels[1], labels[2], labels[3]
    if (len(lhs_l), len(rhs_l), len(out_l)) != (len(lhs), len(rhs), len(out)):
        return 0.0
    spatial = sorted(c for c in rhs_l if c.isdigit())
    n = len(spatial)
    size = _window(rest, "size", n, 1)
    stride, lhs_dilate, rhs_dilate = (_window(rest, k, n, 1) for k in ("stride", "lhs_dilate", "rhs_dilate"))
    pads = re.search(r"\bpad=([\d_x-]+)", rest)
    pad_lo = [int(p.split("_")[0]) for p in pads[1].split("x")] if pads else [0] * n
    taps = 1
    for i, d in enumerate(spatial):
        o = np.arange(out[out_l.index(d)])[:, None]
        t = np.arange(size[i])[None, :]
        pos = o * stride[i] - pad_lo[i] + t * rhs_dilate[i]
        ok = (pos >= 0) & (pos % lhs_dilate[i] == 0) & (pos // lhs_dilate[i] < lhs[lhs_l.index(d)])
        taps *= int(ok.sum())
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def _runs(entry: str | None, calls: dict[str, list[tuple[str, int]]]) -> dict[str, int]:
    runs: dict[str, int] = {}
    stack = [] if entry is None else [(entry, 1)]
    while stack:  # HLO call graphs are acyclic
        computation, n = stack.pop()
        runs[computation] = runs.get(computation, 0) + n
        stack.extend((callee, n * m) for callee, m in calls.get(computation, []))
    return runs


def computation_runs(hlo_text: str) -> dict[str, int]:
    """Computation name -> runs per execution of the module (computations not reached from the entry are
    absent)."""
    entry, _, calls, _ = _graph(parse(hlo_text))
    return _runs(entry, calls)


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of every dot in ``hlo_text`` (``compiled.as_text()``), each once per run of its computation."""
    entry, flops_in, calls, _ = _graph(parse(hlo_text))
    return sum(n * flops_in.get(c, 0.0) for c, n in _runs(entry, calls).items())


def _inclusive_flops(flops_in: dict[str, float], calls: dict[str, list[tuple[str, int]]]
                     ) -> tp.Callable[[str], float]:
    """Computation name -> the dot FLOPs of one run of it, those of the computations it calls included (a
    fusion's body with the fusions nested in it, a loop's body times its trips)."""
    memo: dict[str, float] = {}

    def flops_of(computation: str) -> float:
        if computation not in memo:
            memo[computation] = flops_in.get(computation, 0.0) + sum(
                m * flops_of(c) for c, m in calls.get(computation, []))
        return memo[computation]

    return flops_of


def op_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its opcode (``"copy"``, ``"fusion"``, ``"while"``, ...), with ``"dot"`` for a dot or a
    convolution and ``"fusion (dot)"`` for a fusion or call whose computations compute one (XLA:CPU fuses
    matmuls into ``ynn_fusion``s): what the op names of a profile are."""
    module = parse(hlo_text)
    _, flops_in, calls, _ = _graph(module)
    flops_of = _inclusive_flops(flops_in, calls)
    kinds: dict[str, str] = {}
    for computation in module.computations.values():
        for op in computation.instructions:
            kind = "dot" if op.opcode in ("dot", "convolution") else op.opcode
            if kind in ("fusion", "call", "custom-call") and any(flops_of(c) > 0 for c in op.called):
                kind = f"{kind} (dot)"
            kinds[op.name] = kind
    return kinds


# -- HBM bytes ------------------------------------------------------------------------------------------
# What an instruction moves between HBM and the chip, after XLA's HloCostAnalysis ("bytes accessed"): its
# operands read and its result written. A fusion reads what its body reads of each operand (a parameter used
# only by slices: those slices, as a layer scan reads one layer of its stacked weights per trip; the buffer of
# an in-place dynamic-update-slice: nothing) and writes its result (a dynamic-update-slice: its update only); a
# slice, dynamic-slice or dynamic-update-slice outside a fusion moves the same (_unfused_traffic).
# Ops that move nothing (tuples, bitcasts, parameters, control flow) count 0, and so do arrays XLA:TPU put
# in on-chip memory (layout ``S(1)``: its memory-space assignment prefetches them into VMEM; the copy in
# counts); the computations control flow calls (loop bodies, branches) count once per run, fusion bodies and
# reducers through their caller.
NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_SLICES = ("dynamic-slice", "slice", "gather")
_CONTROL = ("call", "while", "conditional")  # the computations they call run as computations of their own


@functools.lru_cache(maxsize=4096)
def shape_bytes(shape: str) -> float:
    """Bytes of the arrays of an HLO shape in HBM: one whose layout puts it in another memory space (XLA:TPU's
    ``S(1)``, on-chip VMEM) is not HBM traffic."""
    return sum((math.prod(a.dims) * element_bits(a.dtype) / 8 for a in leaves(shape_tree(shape))
                if not re.search(r"S\([1-9]\d*\)", a.layout)), 0.0)


def fused_computation(op: Instruction) -> str | None:
    """The computation a fusion runs."""
    return op.called[0] if op.opcode == "fusion" and op.called else None


def _written(op: Instruction, by_name: dict[str, Instruction]) -> float:
    """Bytes a fusion body's result writes: an in-place dynamic-update-slice writes its update only."""
    if op.opcode == "dynamic-update-slice" and len(op.operands) > 1 and op.operands[1] in by_name:
        return shape_bytes(by_name[op.operands[1]].shape)
    if op.opcode == "tuple":
        return sum(_written(by_name[a], by_name) for a in op.operands if a in by_name)
    if op.opcode == "bitcast" and op.operands and op.operands[0] in by_name:
        return _written(by_name[op.operands[0]], by_name)
    return shape_bytes(op.shape)


def _unfused_traffic(op: Instruction, shapes: dict[str, str]) -> tuple[dict[int, float], float]:
    """An instruction outside a fusion as :func:`_fusion_traffic` gives a fusion's: the bytes read of each operand
    not read whole, and the bytes written. As XLA's HloCostAnalysis counts them: a slice or dynamic-slice reads and
    writes its result's bytes; a dynamic-update-slice (in place: its buffer is its result) reads and writes its
    update's, the buffer not read (a decode step's KV-cache write: one token's keys, not the cache)."""
    if op.opcode in ("slice", "dynamic-slice") and op.operands:
        return {0: shape_bytes(op.shape)}, shape_bytes(op.shape)
    if op.opcode == "dynamic-update-slice" and len(op.operands) > 1:
        return {0: 0.0}, shape_bytes(shapes.get(op.operands[1], ""))
    return {}, shape_bytes(op.shape)


def _fusion_traffic(body: tp.Sequence[Instruction], nested: tp.Callable[[str], tuple[dict[int, float], float]]
                    ) -> tuple[dict[int, float], float]:
    """A fusion body's bytes read of each parameter (those read whole are absent) and the bytes its root
    writes; ``nested(name)`` is the same for a fusion called inside it."""
    by_name = {op.name: op for op in body}
    users: dict[str, list[Instruction]] = {}
    for op in body:
        for a in dict.fromkeys(op.operands):
            users.setdefault(a, []).append(op)
    partial: dict[int, float] = {}
    for op in body:
        if op.opcode != "parameter" or not op.operand_text.strip().isdigit():
            continue
        read, whole = 0.0, shape_bytes(op.shape)
        for use in users.get(op.name, []):
            if use.opcode in _SLICES and use.operands[0] == op.name:
                read += shape_bytes(use.shape)
            elif use.opcode == "dynamic-update-slice" and use.operands[0] == op.name:
                pass  # the buffer updated in place: not read
            elif (fused := fused_computation(use)) is not None:
                inner = nested(fused)[0]
                read += sum(inner.get(i, whole) for i, a in enumerate(use.operands) if a == op.name)
            else:
                read += whole
        if read < whole:
            partial[int(op.operand_text)] = read
    return partial, (_written(body[-1], by_name) if body else 0.0)


def hbm_bytes(hlo_text: str) -> float:
    """Bytes moved between HBM and the chip by the module ``hlo_text`` (``compiled.as_text()``), each instruction
    once per run of its computation (XLA's ``cost_analysis()`` counts a while loop's body once): the sum of
    :func:`hbm_traffic`."""
    return sum(row[3] for row in hbm_traffic(hlo_text))


def hbm_traffic(hlo_text: str) -> list[tuple[str, str, str, float]]:
    """Per instruction of the module that moves data between HBM and the chip: ``(name, kind, largest array,
    bytes per execution)``. ``kind`` is its opcode, ``fusion (dot)`` for a fusion that multiplies (a convolution or
    dot inside), ``fusion`` for the other fusions; ``largest array`` the shape text of the largest array it reads
    or writes whole (what makes it big); bytes per execution are the instruction's own times the runs of its
    computation; :func:`hbm_bytes` is their sum."""
    computations = parse(hlo_text).computations
    inlined = {c for computation in computations.values() for op in computation.instructions
               if op.opcode not in _CONTROL for c in op.called}
    runs = computation_runs(hlo_text)
    fusions: dict[str, tuple[dict[int, float], float]] = {}

    def traffic(name: str) -> tuple[dict[int, float], float]:
        if name not in fusions:
            fusions[name] = _fusion_traffic(computations[name].instructions if name in computations else (), traffic)
        return fusions[name]

    def multiplies(name: str) -> bool:
        body = computations.get(name)
        return body is not None and any(
            op.opcode in ("convolution", "dot") or (fused_computation(op) and multiplies(fused_computation(op)))
            for op in body.instructions)

    out = []
    for name, computation in computations.items():
        if name in inlined or not runs.get(name):
            continue
        shapes = {op.name: op.shape for op in computation.instructions}
        for op in computation.instructions:
            if op.opcode in NO_TRAFFIC or op.opcode.endswith("-done"):
                continue
            fused = fused_computation(op)
            partial, written = traffic(fused) if fused in computations else _unfused_traffic(op, shapes)
            moved = written + sum(partial.get(i, shape_bytes(shapes.get(a, ""))) for i, a in enumerate(op.operands))
            if moved:
                kind = ("fusion (dot)" if multiplies(fused) else "fusion") if fused in computations else op.opcode
                arrays = [op.shape] + [shapes.get(a, "") for i, a in enumerate(op.operands) if i not in partial]
                largest = max(arrays, key=shape_bytes)
                out.append((op.name, kind, _array_text(largest), runs[name] * moved))
    return out


def _array_text(shape: str) -> str:
    """The largest array of a shape text, as ``f32[8,4096,4096]``."""
    arrays = leaves(shape_tree(shape)) if shape else []
    if not arrays:
        return "-"
    a = max(arrays, key=lambda a: math.prod(a.dims))
    return f"{a.dtype}[{','.join(map(str, a.dims))}]"


# -- Asynchronous collectives and what runs while they are in flight ----------------------------------------
# A scheduled module (``is_scheduled=true``: every optimised module) lists each computation's instructions in
# the order they run. An asynchronous collective is a ``*-start`` and its ``*-done``; whatever the schedule
# puts between them runs while the data travels. Memory-space copies (``copy-start``) are not collectives.
class AsyncWindow(tp.NamedTuple):
    """One asynchronous collective of a scheduled HLO module and the work scheduled while it is in flight."""

    kind: str  # "collective-permute", "all-gather", "all-reduce", ... ("async" for a generic async-start)
    name: str  # its *-start instruction
    computation: str
    runs: int  # runs of its computation per execution of the module
    between: int  # instructions scheduled between its start and its done
    matmul_flops: float  # FLOPs of the dots and convolutions among them (inside fusions too), for one run

    @property
    def overlapped(self) -> bool:
        """A matmul runs while this collective's data travels."""
        return self.matmul_flops > 0


def async_windows(hlo_text: str) -> list[AsyncWindow]:
    """Every asynchronous collective of the module ``hlo_text`` (``compiled.as_text()``, scheduled), with the
    instructions and matmul FLOPs scheduled between its start and its done. Raises ValueError for a module
    that is not scheduled (its instruction order says nothing of when they run)."""
    module = parse(hlo_text)
    if module.attribute("is_scheduled") != "true":
        raise ValueError("the HLO module is not scheduled (is_scheduled=true): pass an optimised module, "
                         "compiled.as_text(), not lowered.as_text()")
    entry, flops_in, calls, dot_flops = _graph(module)
    runs = _runs(entry, calls)
    flops_of = _inclusive_flops(flops_in, calls)
    windows = []
    for name, computation in module.computations.items():
        if not runs.get(name):
            continue
        body = computation.instructions
        for i, op in enumerate(body):
            if not op.opcode.endswith("-start") or op.opcode == "copy-start":
                continue
            done = next((j for j in range(i + 1, len(body)) if body[j].opcode.endswith("-done") and op.name in
                         body[j].operands), len(body))
            middle = body[i + 1:done]
            flops = sum(flops_of(fused) if (fused := fused_computation(o)) else dot_flops.get(o.name, 0.0)
                        for o in middle)
            windows.append(AsyncWindow(op.opcode[:-len("-start")], op.name, name, runs[name], len(middle), flops))
    return windows
