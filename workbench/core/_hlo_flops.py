"""Matmul FLOPs of an optimised HLO module, each dot counted once per time it runs.

XLA's ``cost_analysis()`` counts a while loop's body once, so for a model whose layers run in a
``lax.scan`` it reports about one layer's FLOPs. Here every ``dot`` (also inside fusions) counts
``2 x prod(result dims) x prod(contracted dims)``, times the runs of the computation holding it: a loop
body runs its ``known_trip_count`` times per run of its caller, a fused or called computation once per
call. Re-exported by :mod:`workbench.core.inspect` as ``matmul_flops``.
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


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of every dot in ``hlo_text`` (``compiled.as_text()``), loop trips included (see module doc)."""
    flops_in: dict[str, float] = {}  # computation -> dot FLOPs of one run
    calls: dict[str, list[tuple[str, int]]] = {}  # caller -> [(callee, runs per caller run)]
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
    if entry is None:
        return 0.0
    total, stack = 0.0, [(entry, 1.0)]
    while stack:  # HLO call graphs are acyclic
        computation, runs = stack.pop()
        total += runs * flops_in.get(computation, 0.0)
        stack.extend((callee, runs * n) for callee, n in calls.get(computation, []))
    return total
