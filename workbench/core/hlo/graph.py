"""How often each computation of an optimised HLO module runs, the module's matmul FLOPs and HBM bytes, and
what its schedule runs while each asynchronous collective is in flight (:func:`async_windows`).

A computation runs once per run of each instruction that calls it (a fusion, a call, a conditional's branch:
counted as if taken), and a while loop's body ``known_trip_count`` times per run of the loop (XLA:TPU records
no count: it is read from the loop's condition). From that: a collective's trips per program execution
(:mod:`workbench.core.hlo.collectives` uses :func:`computation_runs`); the FLOPs of every ``dot`` (also inside fusions),
``2 x prod(result dims) x prod(contracted dims)``, and of every ``convolution`` (XLA:TPU writes dots as
convolutions) times the runs of its computation; the bytes each instruction moves to and from HBM
(:func:`hbm_bytes`). XLA's ``cost_analysis()`` counts a while loop's body once, so for a model whose layers run
in a ``lax.scan`` it reports about one layer's FLOPs. ``matmul_flops`` is re-exported by
:mod:`workbench.core.hlo.collectives`.
"""

from __future__ import annotations

import math
import re
import typing as tp

import numpy as np

_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\((?P<params>.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*\w+\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][\w\-]*)\("
                    r"(?P<args>[^)]*)\)(?P<rest>.*)$")
_ARRAY = re.compile(r"^\w+\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r"known_trip_count\D*(\d+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CONV_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _graph(hlo_text: str) -> tuple[str | None, dict[str, float], dict[str, list[tuple[str, int]]]]:
    """The entry computation's name, each computation's dot FLOPs for one run, and its calls
    ``[(callee, runs per run of the caller)]``."""
    entry, flops_in, calls, _ = _graph_and_dots(hlo_text)
    return entry, flops_in, calls


def _graph_and_dots(hlo_text: str) -> tuple[str | None, dict[str, float], dict[str, list[tuple[str, int]]],
                                            dict[str, float]]:
    """:func:`_graph`, and the FLOPs of each dot or convolution instruction by name."""
    flops_in: dict[str, float] = {}
    dot_flops: dict[str, float] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, computation, shapes = None, None, {}
    defs: dict[str, tuple[str, str, str]] = {}  # instruction name (unique in a module) -> op, operands, rest
    roots: dict[str, str] = {}
    inferred: list[tuple[str, int, str, str]] = []  # loops without known_trip_count: caller, call index, ...
    for line in hlo_text.splitlines():
        if (header := _HEADER.match(line)) is not None:
            computation = header["name"]
            entry = computation if header["entry"] else entry
            shapes = {name: _dims(dims) for name, dims in _PARAM.findall(header["params"])}
            flops_in.setdefault(computation, 0.0)
            calls.setdefault(computation, [])
            continue
        if computation is None or (m := _INSTR.match(line)) is None:
            continue
        array = _ARRAY.match(m["type"])
        shapes[m["name"]] = _dims(array[1]) if array else []
        defs[m["name"]] = (m["op"], m["args"], m["rest"])
        if line.lstrip().startswith("ROOT"):
            roots[computation] = m["name"]
        if m["op"] == "dot":
            lhs = m["args"].split(",")[0].strip().lstrip("%")
            contract = _CONTRACT.search(m["rest"])
            if lhs in shapes and contract is not None:
                k = math.prod(shapes[lhs][i] for i in _dims(contract[1]))
                dot_flops[m["name"]] = 2.0 * math.prod(shapes[m["name"]]) * k
                flops_in[computation] += dot_flops[m["name"]]
        elif m["op"] == "convolution":  # XLA:TPU writes a dot as a convolution: dim_labels=bf_io->bf
            lhs, rhs = ([a.strip().lstrip("%") for a in m["args"].split(",")] + ["", ""])[:2]
            if lhs in shapes and rhs in shapes:
                dot_flops[m["name"]] = _convolution_flops(m["rest"], shapes[lhs], shapes[rhs], shapes[m["name"]])
                flops_in[computation] += dot_flops[m["name"]]
        trips = int(t[1]) if m["op"] == "while" and (t := _TRIPS.search(m["rest"])) else 1
        for single, branches in _CALLS.findall(m["rest"]):
            for callee in (single,) if single else branches.split(","):
                callee = callee.strip().lstrip("%")
                is_body = re.search(rf"body=%?{re.escape(callee)}\b", m["rest"]) is not None
                if is_body and not _TRIPS.search(m["rest"]) and (cond := re.search(r"condition=%?([\w.\-]+)",
                                                                                    m["rest"])):
                    inferred.append((computation, len(calls[computation]), m["args"], cond[1]))
                calls[computation].append((callee, trips if is_body else 1))
    for caller, index, operand, condition in inferred:
        body = calls[caller][index][0]
        calls[caller][index] = (body, _trips_from_condition(operand, condition, body, defs, roots))
    return entry, flops_in, calls, dot_flops


def _trips_from_condition(operand: str, condition: str, body: str, defs: dict[str, tuple[str, str, str]],
                          roots: dict[str, str]) -> int:
    """A loop's trip count where XLA recorded none (XLA:TPU does not): its condition compares a counter (a
    tuple element) with a constant, ``i < n`` (or ``n > i``); the counter starts at a constant of the loop's
    initial tuple and the body adds a constant step to it. 1 where the loop is not of that form."""
    def follow(name: str) -> tuple[str, str, str] | None:
        d = defs.get(name.strip().lstrip("%"))
        while d is not None and d[0] in ("copy", "bitcast", "convert"):
            d = defs.get(d[1].split(",")[0].strip().lstrip("%"))
        return d

    def constant(name: str) -> int | None:
        d = follow(name)
        return int(d[1]) if d is not None and d[0] == "constant" and re.fullmatch(r"-?\d+", d[1].strip()) else None

    def element(name: str) -> int | None:
        d = follow(name)
        return int(i[1]) if d is not None and d[0] == "get-tuple-element" and (i := re.search(r"index=(\d+)", d[2])) \
            else None

    compare = defs.get(roots.get(condition, ""))
    if compare is None or compare[0] != "compare" or len(args := compare[1].split(",")) != 2:
        return 1
    direction = re.search(r"direction=(\w+)", compare[2])
    direction = direction[1] if direction else ""
    if direction in ("GT", "GE"):  # n > i is i < n
        args, direction = args[::-1], {"GT": "LT", "GE": "LE"}[direction]
    k, bound = element(args[0]), constant(args[1])
    start_tuple = follow(operand.split(",")[0])
    if direction not in ("LT", "LE") or k is None or bound is None or start_tuple is None or start_tuple[0] != "tuple":
        return 1
    start = constant(start_tuple[1].split(",")[k]) if k < len(start_tuple[1].split(",")) else None
    # the step: the body's result tuple holds counter + constant at position k
    end = defs.get(roots.get(body, ""))
    counter = follow(end[1].split(",")[k]) if end is not None and end[0] == "tuple" and k < len(end[1].split(",")) \
        else None
    terms = counter[1].split(",") if counter is not None and counter[0] == "add" else []
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
    entry, _, calls = _graph(hlo_text)
    return _runs(entry, calls)


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of every dot in ``hlo_text`` (``compiled.as_text()``), each once per run of its computation."""
    entry, flops_in, calls = _graph(hlo_text)
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
    _, flops_in, calls = _graph(hlo_text)
    flops_of = _inclusive_flops(flops_in, calls)
    kinds: dict[str, str] = {}
    for line in hlo_text.splitlines():
        if (m := _INSTR.match(line)) is None:
            continue
        op = m["op"]
        if op in ("dot", "convolution"):
            op = "dot"
        elif op in ("fusion", "call", "custom-call"):
            callees = [c.strip().lstrip("%") for single, branches in _CALLS.findall(m["rest"])
                       for c in ((single,) if single else branches.split(","))]
            op = f"{op} (dot)" if any(flops_of(c) > 0 for c in callees) else op
        kinds[m["name"]] = op
    return kinds


# -- HBM bytes ------------------------------------------------------------------------------------------
# What an instruction moves between HBM and the chip, after XLA's HloCostAnalysis ("bytes accessed"): its
# operands read and its result written. A fusion reads what its body reads of each operand (a parameter used
# only by slices: those slices, as a layer scan reads one layer of its stacked weights per trip; the buffer of
# an in-place dynamic-update-slice: nothing) and writes its result (a dynamic-update-slice: its update only).
# Ops that move nothing (tuples, bitcasts, parameters, control flow) count 0, and so do arrays XLA:TPU put
# in on-chip memory (layout ``S(1)``: its memory-space assignment prefetches them into VMEM; the copy in
# counts); the computations control flow calls (loop bodies, branches) count once per run, fusion bodies and
# reducers through their caller.
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_SLICES = ("dynamic-slice", "slice", "gather")
_ARRAYS = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_INLINED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


class _Op(tp.NamedTuple):
    name: str
    op: str
    args: list[str]  # operand names
    nbytes: float  # result bytes
    raw: str  # the operand text (a parameter's index)
    calls: str | None  # the computation a fusion runs


def _type_bytes(type_text: str) -> float:
    """Bytes of the arrays of an HLO type in HBM: one whose layout puts it in another memory space (XLA:TPU's
    ``S(1)``, on-chip VMEM) is not HBM traffic."""
    total = 0.0
    for dtype, dims, layout in _ARRAYS.findall(re.sub(r"/\*.*?\*/", "", type_text)):
        if re.search(r"S\([1-9]\d*\)", layout):
            continue
        bits = 8 if dtype == "pred" else int(m[1]) if (m := re.match(r"(?:bf|[sufc])(\d+)", dtype)) else 0
        total += math.prod(_dims(dims)) * bits / 8
    return total


def _ops(hlo_text: str) -> tuple[dict[str, list[_Op]], set[str]]:
    """Per computation its instructions, and the computations run inside an instruction (fusion bodies,
    reducers), not by control flow."""
    out: dict[str, list[_Op]] = {}
    inlined: set[str] = set()
    computation = None
    for line in hlo_text.splitlines():
        if (header := _HEADER.match(line)) is not None:
            computation = header["name"]
            out[computation] = []
        elif computation is not None and (m := _INSTR.match(line)) is not None:
            called = _INLINED.findall(m["rest"]) if m["op"] != "call" else []
            inlined.update(called)
            out[computation].append(_Op(m["name"], m["op"], _OPERANDS.findall(m["args"]), _type_bytes(m["type"]),
                                        m["args"], called[0] if m["op"] == "fusion" and called else None))
    return out, inlined


def _written(op: _Op, by_name: dict[str, _Op]) -> float:
    """Bytes a fusion body's result writes: an in-place dynamic-update-slice writes its update only."""
    if op.op == "dynamic-update-slice" and len(op.args) > 1 and op.args[1] in by_name:
        return by_name[op.args[1]].nbytes
    if op.op == "tuple":
        return sum(_written(by_name[a], by_name) for a in op.args if a in by_name)
    if op.op == "bitcast" and op.args and op.args[0] in by_name:
        return _written(by_name[op.args[0]], by_name)
    return op.nbytes


def _fusion_traffic(body: list[_Op], nested: tp.Callable[[str], tuple[dict[int, float], float]]
                    ) -> tuple[dict[int, float], float]:
    """A fusion body's bytes read of each parameter (those read whole are absent) and the bytes its root
    writes; ``nested(name)`` is the same for a fusion called inside it."""
    by_name = {op.name: op for op in body}
    users: dict[str, list[_Op]] = {}
    for op in body:
        for a in dict.fromkeys(op.args):
            users.setdefault(a, []).append(op)
    partial: dict[int, float] = {}
    for op in body:
        if op.op != "parameter" or not op.raw.strip().isdigit():
            continue
        read = 0.0
        for use in users.get(op.name, []):
            if use.op in _SLICES and use.args[0] == op.name:
                read += use.nbytes
            elif use.op == "dynamic-update-slice" and use.args[0] == op.name:
                pass  # the buffer updated in place: not read
            elif use.op == "fusion" and use.calls:
                inner = nested(use.calls)[0]
                read += sum(inner.get(i, op.nbytes) for i, a in enumerate(use.args) if a == op.name)
            else:
                read += op.nbytes
        if read < op.nbytes:
            partial[int(op.raw)] = read
    return partial, (_written(body[-1], by_name) if body else 0.0)


def hbm_bytes(hlo_text: str) -> float:
    """Bytes moved between HBM and the chip by the module ``hlo_text`` (``compiled.as_text()``), each instruction
    once per run of its computation (XLA's ``cost_analysis()`` counts a while loop's body once)."""
    computations, inlined = _ops(hlo_text)
    runs = computation_runs(hlo_text)
    fusions: dict[str, tuple[dict[int, float], float]] = {}

    def traffic(name: str) -> tuple[dict[int, float], float]:
        if name not in fusions:
            fusions[name] = _fusion_traffic(computations.get(name, []), traffic)
        return fusions[name]

    total = 0.0
    for computation, body in computations.items():
        if computation in inlined or not runs.get(computation):
            continue
        sizes = {op.name: op.nbytes for op in body}
        moved = 0.0
        for op in body:
            if op.op in _NO_TRAFFIC or op.op.endswith("-done"):
                continue
            partial, written = traffic(op.calls) if op.calls in computations else ({}, op.nbytes)
            moved += written + sum(partial.get(i, sizes.get(a, 0.0)) for i, a in enumerate(op.args))
        total += runs[computation] * moved
    return total


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
    if not re.search(r"^HloModule\s[^\n]*\bis_scheduled=true", hlo_text, re.M):
        raise ValueError("the HLO module is not scheduled (is_scheduled=true): pass an optimised module, "
                         "compiled.as_text(), not lowered.as_text()")
    computations, _ = _ops(hlo_text)
    entry, flops_in, calls, dot_flops = _graph_and_dots(hlo_text)
    runs = _runs(entry, calls)
    flops_of = _inclusive_flops(flops_in, calls)
    windows = []
    for computation, body in computations.items():
        if not runs.get(computation):
            continue
        for i, op in enumerate(body):
            if not op.op.endswith("-start") or op.op == "copy-start":
                continue
            done = next((j for j in range(i + 1, len(body)) if body[j].op.endswith("-done") and op.name in
                         body[j].args), len(body))
            middle = body[i + 1:done]
            flops = sum(flops_of(o.calls) if o.op == "fusion" and o.calls else dot_flops.get(o.name, 0.0)
                        for o in middle)
            windows.append(AsyncWindow(op.op[:-len("-start")], op.name, computation, runs[computation],
                                       len(middle), flops))
    return windows
