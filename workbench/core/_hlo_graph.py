"""How often each computation of an optimised HLO module runs, and the module's matmul FLOPs.

A computation runs once per run of each instruction that calls it (a fusion, a call, a conditional's branch:
counted as if taken), and a while loop's body ``known_trip_count`` times per run of the loop. From that:
a collective's trips per program execution (:mod:`workbench.core.inspect` uses :func:`computation_runs`), and
the FLOPs of every ``dot`` (also inside fusions), ``2 x prod(result dims) x prod(contracted dims)`` times the
runs of its computation. XLA's ``cost_analysis()`` counts a while loop's body once, so for a model whose layers
run in a ``lax.scan`` it reports about one layer's FLOPs. ``matmul_flops`` is re-exported by
:mod:`workbench.core.inspect`.
"""

from __future__ import annotations

import math
import re

_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\((?P<params>.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*\w+\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][\w\-]*)\("
                    r"(?P<args>[^)]*)\)(?P<rest>.*)$")
_ARRAY = re.compile(r"^\w+\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r"known_trip_count\D*(\d+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _graph(hlo_text: str) -> tuple[str | None, dict[str, float], dict[str, list[tuple[str, int]]]]:
    """The entry computation's name, each computation's dot FLOPs for one run, and its calls
    ``[(callee, runs per run of the caller)]``."""
    flops_in: dict[str, float] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, computation, shapes = None, None, {}
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
        if m["op"] == "dot":
            lhs = m["args"].split(",")[0].strip().lstrip("%")
            contract = _CONTRACT.search(m["rest"])
            if lhs in shapes and contract is not None:
                k = math.prod(shapes[lhs][i] for i in _dims(contract[1]))
                flops_in[computation] += 2.0 * math.prod(shapes[m["name"]]) * k
        trips = int(t[1]) if m["op"] == "while" and (t := _TRIPS.search(m["rest"])) else 1
        for single, branches in _CALLS.findall(m["rest"]):
            for callee in (single,) if single else branches.split(","):
                callee = callee.strip().lstrip("%")
                is_body = re.search(rf"body=%?{re.escape(callee)}\b", m["rest"]) is not None
                calls[computation].append((callee, trips if is_body else 1))
    return entry, flops_in, calls


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
