"""Where a jitted program's time goes: the XLA operations of a ``jax.profiler`` trace, counted and timed.

:func:`profile` runs a callable under ``jax.profiler.trace(log_dir, create_perfetto_trace=True)``, which writes
``plugins/profile/<run>/perfetto_trace.json.gz`` (Chrome trace-event JSON, times in microseconds), and
:func:`read_trace` reads that file back. What the runtime records there, per backend:

- XLA:CPU (jax 0.10): one complete event (``"ph": "X"``) per executed thunk, i.e. per HLO instruction of the
  optimised program, named after it (``dot.64``, ``fusion.3``, ``copy.188``, ``while.3``) and carrying
  ``args.hlo_op``, ``args.hlo_module`` (``jit__step``) and ``args.run_id`` (one per execution). They run on the
  runtime's worker threads (``tf_XLAEigen/...``, ``tf_XLAPjRtCpuClient/...``), several at once when the
  program's dependencies allow. An op inside a loop is an event per trip; a ``while`` is an event too, spanning
  its body's ops.
- GPU and TPU traces tag their device events with ``hlo_op`` / ``hlo_module`` the same way.

Events with an ``hlo_op`` are the ops; one that has another op of its run nested inside it on its own thread
(a loop, a conditional, a call) is control flow: its time is its body's, so it is listed apart
(:attr:`Profile.control`) and not added to the ops' total. Everything else in the trace (Python functions,
dispatch, the runtime's own spans) is left out.

>>> import jax, jax.numpy as jnp
>>> a = jnp.ones((256, 256))
>>> p = profile(jax.jit(jnp.dot).lower(a, a).compile(), a, a, runs=2)  # doctest: +SKIP
>>> p.ops[0].kind, p.ops[0].count  # XLA:CPU ran the dot as a YNNPACK fusion, ynn_fusion  # doctest: +SKIP
('fusion (dot)', 2)
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import html
import json
import os
import re
import tempfile
import time
import typing as tp

import jax

from workbench.core.checks import positive_int
from workbench.core.hlo.graph import op_kinds
from workbench.core.hlo.text import parse
from workbench.core.tables import Html, html_table
from workbench.core.units import format_seconds

_SUFFIX = re.compile(r"\.\d+$")


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One HLO instruction of the traced program: ``count`` executions (loop trips included), ``total_s`` seconds
    over all of them. ``kind``: its opcode read from the program's HLO text where given (``"dot"``, ``"fusion
    (dot)"`` for a fusion that computes a matmul, ``"copy"``, ...), else its name without the numeric suffix
    (``dot.64`` -> ``dot``; XLA:CPU's ``ynn_fusion.3`` -> ``ynn_fusion``, which may or may not hold a dot)."""

    name: str
    count: int
    total_s: float
    kind: str = ""


@dataclasses.dataclass(frozen=True)
class Profile:
    """The ops of ``module`` over ``runs`` executions, longest total first.

    ``device_s``: each run's span, from its first op's start to its last op's end, summed over the runs;
    ``busy_s``: the time at least one op was running (the union of the ops' intervals), at most ``device_s``;
    ``op_s``: the ops' times added up, more than ``busy_s`` where ops ran at once. ``wall_s``: the calls as
    Python saw them (``time.perf_counter`` around each call and ``block_until_ready``), dispatch and the
    profiler's own overhead included. ``other_modules``: seconds of ops of other programs that ran in the
    traced calls (a wrapper's small jitted helpers), by module.
    """

    module: str
    runs: int
    ops: tuple[OpTime, ...]
    control: tuple[OpTime, ...]
    device_s: float
    busy_s: float
    wall_s: float
    other_modules: dict[str, float] = dataclasses.field(default_factory=dict)
    trace_path: str = ""

    @property
    def op_s(self) -> float:
        return sum(op.total_s for op in self.ops)

    @property
    def step_s(self) -> float:
        """One run's span on the device(s), averaged over the runs."""
        return self.device_s / self.runs if self.runs else 0.0

    def by_kind(self) -> list[OpTime]:
        """The ops grouped by kind (``dot``, ``fusion``, ``copy``, ...), longest total first."""
        groups: dict[str, list[OpTime]] = collections.defaultdict(list)
        for op in self.ops:
            groups[op.kind].append(op)
        merged = [OpTime(kind, sum(o.count for o in ops), sum(o.total_s for o in ops), kind)
                  for kind, ops in groups.items()]
        return sorted(merged, key=lambda o: -o.total_s)

    def share(self, op: OpTime) -> float:
        """``op``'s time as a fraction of the runs' span (``device_s``)."""
        return op.total_s / self.device_s if self.device_s else 0.0

    def rows(self, top: int = 10, by_kind: bool = False) -> list[tuple[str, int, str, str]]:
        """``(op, count, total time, % of the step)`` for the ``top`` longest ops (or kinds)."""
        ops = self.by_kind() if by_kind else self.ops
        return [(op.name, op.count, format_seconds(op.total_s), f"{self.share(op):.1%}") for op in ops[:top]]

    def summary(self) -> str:
        overlap = self.op_s / self.busy_s if self.busy_s else 0.0
        return (f"{self.module}: {self.runs} run(s), {format_seconds(self.step_s)} a run on the device "
                f"({format_seconds(self.wall_s / max(self.runs, 1))} a call as Python saw it); "
                f"{len(self.ops)} distinct ops, {sum(o.count for o in self.ops)} executions, "
                f"{overlap:.2f} running at once on average")

    def __str__(self) -> str:
        lines = [self.summary(), f"{'op':<32}{'count':>7}{'time':>12}{'% of step':>11}"]
        lines += [f"{n:<32}{c:>7}{t:>12}{s:>11}" for n, c, t, s in self.rows()]
        return "\n".join(lines)

    def html(self, top: int = 10) -> str:
        """The summary line, the ``top`` longest ops and the ops by kind, as HTML tables."""
        esc = html.escape
        kinds = {o.name: o.kind for o in self.ops}

        def label(n: str) -> Html:
            k = kinds.get(n, n)
            return Html(f"<code>{esc(n)}</code>" + (f" <small>{esc(k)}</small>" if k != _SUFFIX.sub("", n) else ""))

        def table(first: str, rows: list[tuple[str, int, str, str]]) -> str:
            return html_table([(label(n), c, t, s) for n, c, t, s in rows],
                              header=(first, "count", "time", "% of step"))

        loops = ", ".join(f"<code>{esc(o.name)}</code> ×{o.count} {esc(format_seconds(o.total_s))}"
                          for o in self.control[:4])
        note = f"<p>control flow (its time is its body's ops): {loops}</p>" if loops else ""
        return (f"<div><p>{esc(self.summary())}</p><div style='display:flex;gap:2em;align-items:flex-start'>"
                f"{table(f'top {top} ops', self.rows(top))}{table('by kind', self.rows(top, by_kind=True))}"
                f"</div>{note}</div>")

    _repr_html_ = html


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def read_trace(path: str | os.PathLike, module: str | None = None, wall_s: float = 0.0, hlo_text: str = ""
               ) -> Profile:
    """The :class:`Profile` of a trace-event JSON file (``.json`` or ``.json.gz``) written by ``jax.profiler``.

    ``module`` picks the program by its ``hlo_module`` name (``"jit__step"``); default: the module of
    ``hlo_text`` (``compiled.as_text()``, which also gives each op its kind), else the one whose ops took the
    most time. Raises ``ValueError`` when the trace holds no events tagged with an ``hlo_op``.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    if not ops:
        raise ValueError(f"{path} has no device op events (none with args.hlo_op): was anything run inside the "
                         f"trace, and did it wait for the result (jax.block_until_ready)?")
    per_module: dict[str, float] = collections.Counter()
    for e in ops:
        per_module[e["args"].get("hlo_module", "")] += e["dur"]
    if module is None and hlo_text:
        module = parse(hlo_text).name or None
    if module is None:
        module = max(per_module, key=per_module.get)
    elif module not in per_module:
        raise ValueError(f"no ops of module {module!r} in {path}; it holds {sorted(per_module)}")
    mine = [e for e in ops if e["args"].get("hlo_module", "") == module]
    by_run: dict[tp.Any, list[dict]] = collections.defaultdict(list)
    for e in mine:
        by_run[e["args"].get("run_id")].append(e)
    leaf_totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    control_totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    device_us = busy_us = 0.0
    for run in by_run.values():
        device_us += max(e["ts"] + e["dur"] for e in run) - min(e["ts"] for e in run)
        by_thread: dict[tp.Any, list[dict]] = collections.defaultdict(list)
        for e in run:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
        leaves = []
        for thread in by_thread.values():
            thread.sort(key=lambda e: (e["ts"], -e["dur"]))
            for i, e in enumerate(thread):
                end = e["ts"] + e["dur"]
                nests = i + 1 < len(thread) and thread[i + 1]["ts"] + thread[i + 1]["dur"] <= end
                totals = control_totals if nests else leaf_totals
                totals[e["name"]][0] += 1
                totals[e["name"]][1] += e["dur"] * 1e-6
                if not nests:
                    leaves.append((e["ts"], end))
        busy_us += _union(leaves)

    kinds = op_kinds(hlo_text) if hlo_text else {}

    def ordered(totals: dict[str, list[float]]) -> tuple[OpTime, ...]:
        ops = (OpTime(n, int(c), s, kinds.get(n) or _SUFFIX.sub("", n)) for n, (c, s) in totals.items())
        return tuple(sorted(ops, key=lambda o: (-o.total_s, o.name)))

    others = {m: us * 1e-6 for m, us in sorted(per_module.items()) if m != module}
    return Profile(module, len(by_run), ordered(leaf_totals), ordered(control_totals), device_us * 1e-6,
                   busy_us * 1e-6, wall_s, others, str(path))


def profile(fn: tp.Callable, *args: tp.Any, runs: int = 3, carry: bool = False, module: str | None = None,
            log_dir: str | os.PathLike | None = None, hlo_text: str | None = None, **kwargs: tp.Any) -> Profile:
    """Call ``fn(*args, **kwargs)`` once to compile and warm up, then ``runs`` times inside
    ``jax.profiler.trace``, each waited for; the :class:`Profile` of those runs.

    ``fn`` is best a compiled program (``jax.jit(f).lower(*args).compile()``): its HLO text then names the
    module to read and each op's kind (a fusion that computes a matmul is ``"fusion (dot)"``).

    ``carry=True``: ``fn`` returns its next first argument first (``state, metrics = train_step(state, batch)``;
    a step that donates its state cannot be called twice on the same one). ``log_dir`` keeps the trace there
    (open ``perfetto_trace.json.gz`` in https://ui.perfetto.dev); default: a temporary directory, removed.
    """
    positive_int("runs", runs)

    def call(args: tuple) -> tuple:
        out = jax.block_until_ready(fn(*args, **kwargs))
        return (out[0], *args[1:]) if carry else args

    args = call(args)
    temporary = tempfile.TemporaryDirectory(prefix="workbench-trace-") if log_dir is None else None
    directory = temporary.name if temporary is not None else os.fspath(log_dir)
    try:
        wall = 0.0
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for _ in range(runs):
                start = time.perf_counter()
                args = call(args)
                wall += time.perf_counter() - start
        traces = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz")),
                        key=os.path.getmtime)
        if not traces:
            raise RuntimeError(f"jax.profiler.trace wrote no perfetto_trace.json.gz under {directory}")
        if hlo_text is None:
            hlo_text = fn.as_text() if isinstance(fn, jax.stages.Compiled) else ""
        result = read_trace(traces[-1], module, wall, hlo_text)
    finally:
        if temporary is not None:
            temporary.cleanup()
    return result if temporary is None else dataclasses.replace(result, trace_path="")


__all__ = ["OpTime", "Profile", "profile", "read_trace"]
