"""The step model beside the compiled program: each predicted quantity next to what XLA compiled, and why they differ,
in words taken from the compiled program (HLO op kinds, array shapes and byte counts), never guessed.

:func:`reconcile` returns :class:`Row` s: memory per device (the ledger's parts against XLA's buffer assignment),
matmul FLOPs, HBM traffic, and communication by role (FSDP weight gathers, gradient reductions, the rest by kind and
mesh axes). The compiled side reads the optimised HLO: :func:`hbm_traffic` splits the bytes
:func:`workbench.core.hlo.graph.hbm_bytes` counts by instruction (each once per loop trip), :func:`collective_roles`
says what each collective of the program does:

- ``"gather"``: an all-gather, or an all-reduce whose operand is a zero-filled buffer with the device's block
  written into it (a ``dynamic-update-slice`` into a ``broadcast`` of a constant): XLA:TPU writes FSDP gathers that
  way at some sizes (Llama-3-70B on 1024 v5p chips), and a ring all-reduce moves twice an all-gather's bytes;
- ``"gradient"``: a reduce-scatter, or an all-reduce of a value of the backward pass (its ``op_name`` is under
  ``transpose(...)``, autodiff's transpose), whose result the program then slices (the scanned layers' weight
  gradients reduced whole where a reduce-scatter would do);
- ``"other"``: the rest (TP all-reduces, the embedding's all-to-all, the loss's scalars).

The times come last: compute (the prediction's compute terms against the program's dots at the same efficiency),
memory, communication and the step, each side totalled its own way (the measured model sums its terms and counts
only exposed communication; a compiled step takes the longest of its parts). Where the prediction puts a quantity
at zero because another term holds its work (a decode step's matmuls priced as reading their weights), the row says
where (``Row.held_in``) instead of showing a zero for work that exists.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing as tp

from workbench.core.cost.step_pricing import HBM_BOUND_KERNELS
from workbench.core.hardware.network import transfer
from workbench.core.hlo.graph import NO_TRAFFIC, fused_computation, hbm_traffic, shape_bytes
from workbench.core.hlo.text import Instruction, leaves, parse, shape_tree
from workbench.core.units import format_bytes, format_flops, format_seconds

_OP_NAME = re.compile(r'op_name="([^"]*)"')
# the role of every collective kind but the all-reduce, whose operand decides (collective_roles)
_ROLES = {"all-gather": "gather", "reduce-scatter": "gradient", "all-to-all": "other", "collective-permute": "other"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One quantity, predicted and compiled (``unit``: ``"B"``, ``"s"`` or ``"FLOP"``), and why they differ.
    ``held_in``: where the prediction holds this quantity's work when it puts the quantity itself at zero (a
    decode step's compute, priced as its HBM-bound matmuls), else ``""``."""

    quantity: str
    predicted: float
    compiled: float
    unit: str
    why: str
    held_in: str = ""

    @property
    def ratio(self) -> float:
        """Compiled over predicted (inf where nothing was predicted)."""
        return self.compiled / self.predicted if self.predicted else math.inf if self.compiled else 1.0

    @property
    def predicted_text(self) -> str:
        """The predicted value as a person reads it; where the prediction holds the work in another term, which."""
        return f"in {self.held_in}" if self.held_in and not self.predicted else format_value(self.predicted, self.unit)

    @property
    def compiled_text(self) -> str:
        return format_value(self.compiled, self.unit)

    def __str__(self) -> str:
        ratio = f"{self.ratio:>7.2f}x" if math.isfinite(self.ratio) else f"{'-':>7} "
        return f"{self.quantity:<34}{self.predicted_text:>11}{self.compiled_text:>11}{ratio}  {self.why}"


def format_value(value: float, unit: str) -> str:
    """``value`` in ``unit`` (``"B"``, ``"s"``, ``"FLOP"``) as :mod:`workbench.core.units` writes it (no exponent, a
    sign kept); ``"none"`` for zero, so no "0 ns" stands where a side has nothing of that kind."""
    if not value:
        return "none"
    return {"B": format_bytes, "s": format_seconds, "FLOP": format_flops}[unit](value)


def table(rows: tp.Sequence[Row]) -> str:
    """Rows as a text table."""
    head = f"{'quantity':<34}{'predicted':>11}{'compiled':>11}{'ratio':>7}   why"
    return "\n".join([head, *map(str, rows)])


# -- the compiled program ---------------------------------------------------------------------------------------
def collective_roles(hlo_text: str) -> dict[str, str]:
    """Each collective instruction's name -> ``"gather"``, ``"gradient"`` or ``"other"`` (see the module doc)."""
    module = parse(hlo_text)
    defs = {op.name: op for c in module.computations.values() for op in c.instructions}
    roles = {}
    for computation in module.computations.values():
        for op in computation.instructions:
            kind = op.opcode.removesuffix("-start")
            if kind in _ROLES:
                roles[op.name] = _ROLES[kind]
            elif kind == "all-reduce":
                source = defs.get(op.operands[0]) if op.operands else None
                if source is not None and _zero_filled(source, module, defs):
                    roles[op.name] = "gather"
                elif "transpose(" in _op_name(op) or (source is not None and "transpose(" in _op_name(source)):
                    roles[op.name] = "gradient"
                else:
                    roles[op.name] = "other"
    return roles


def _op_name(op: Instruction) -> str:
    match = _OP_NAME.search(op.attributes)
    return match[1] if match else ""


def _zero_filled(op: Instruction, module: tp.Any, defs: dict[str, Instruction]) -> bool:
    """Whether ``op`` writes a block into a buffer broadcast from a constant: a ``dynamic-update-slice`` (or a
    fusion computing one at its root) whose buffer operand is a ``broadcast``."""
    if op.opcode == "dynamic-update-slice":
        buffer = defs.get(op.operands[0]) if op.operands else None
        return buffer is not None and buffer.opcode == "broadcast"
    fused = fused_computation(op)
    body = module.computations.get(fused) if fused else None
    if body is None or body.root is None:
        return False
    root = body.root
    inner = {o.name: o for o in body.instructions}
    while root.opcode in ("bitcast", "copy") and root.operands and root.operands[0] in inner:
        root = inner[root.operands[0]]
    if root.opcode != "dynamic-update-slice" or not root.operands:
        return False
    buffer = inner.get(root.operands[0])
    if buffer is not None and buffer.opcode == "broadcast":
        return True
    if buffer is not None and buffer.opcode == "parameter" and buffer.operand_text.strip().isdigit():
        index = int(buffer.operand_text)
        outer = defs.get(op.operands[index]) if index < len(op.operands) else None
        return outer is not None and outer.opcode == "broadcast"
    return False


# -- reconciling ------------------------------------------------------------------------------------------------
def reconcile(predicted_step: tp.Any, compiled_step: tp.Any, ledger: tp.Any = None, compiled: tp.Any = None, *,
              seq_len: int | None = None) -> list[Row]:
    """The step model's quantities (``predicted_step``, a :class:`~workbench.core.cost.step.StepTime` of
    :func:`~workbench.core.cost.predicted.predict_step`; ``ledger`` its memory) beside the compiled program's
    (``compiled_step`` = :func:`~workbench.core.cost.compiled_step.step_time` of ``compiled``, a
    :class:`~workbench.core.compile.virtual.CompiledAnalysis`), one :class:`Row` each, with why they differ in
    terms of the compiled HLO. ``seq_len`` names the arrays whose last two dims are ``(seq_len, seq_len)`` as
    attention scores. Without ``compiled`` only the seconds and bytes both steps hold are compared."""
    rows: list[Row] = []
    hlo = getattr(compiled, "hlo_text", "") or ""
    if ledger is not None and compiled is not None:
        rows += _memory_rows(ledger, compiled, hlo, seq_len)
    p, c = predicted_step.roofline, compiled_step.roofline
    rows.append(Row("matmul FLOPs", p.flops, c.flops, "FLOP",
                    "the compiled program's dots and convolutions, each once per loop trip, recompute included"))
    traffic = _traffic_row(p.hbm_bytes, c.hbm_bytes, hlo, seq_len)
    predicted_kinds = ", ".join(f"{w.kind} {format_bytes(w.hbm_bytes)}" for w in predicted_step.parts if w.hbm_bytes)
    if predicted_kinds:
        traffic = dataclasses.replace(traffic, why=f"predicted by layer kind: {predicted_kinds}; {traffic.why}")
    rows.append(traffic)
    rows.append(_compute_row(predicted_step, compiled_step))
    rows.append(Row("memory time", predicted_step.memory_s, compiled_step.memory_s, "s",
                    "the bytes above at the HBM bandwidth fusions reach (the prediction prices its "
                    "memory-bound fusions only; the compiled step every instruction's bytes)"
                    + _terms_text(predicted_step, "memory")))
    rows += _communication_rows(predicted_step, compiled_step, compiled, hlo)
    rows.append(_step_row(predicted_step, compiled_step))
    return rows


def _terms_text(step: tp.Any, part: str) -> str:
    """``"; predicted: matmuls 1.2 s, attention kernels 0.3 s"``: the measured model's non-zero terms of ``part``."""
    terms = [f"{t.name} {format_seconds(t.seconds)}" for t in step.terms if t.part == part and t.seconds]
    return f"; predicted: {', '.join(terms)}" if terms else ""


def _compute_row(predicted_step: tp.Any, compiled_step: tp.Any) -> Row:
    """Compute time: the prediction's compute terms against the compiled program's dots at the efficiency given to
    :func:`~workbench.core.cost.compiled_step.step_time`; where the prediction's compute is zero but it counts
    FLOPs, the terms that hold them (its HBM-bound kernels)."""
    p, c = predicted_step, compiled_step
    holding = [t for t in p.terms if t.name in HBM_BOUND_KERNELS and t.seconds]
    held = ", ".join(f"{t.name} ({format_seconds(t.seconds)})" for t in holding)
    why = f"the compiled program's dots (the matmul FLOPs above, attention's too) at {_percent(c.efficiency)} of peak"
    if p.terms and c.efficiency == p.efficiency:
        why += ", the fraction the prediction's matmuls reach in all"
        if holding:
            why += " (the time its HBM-bound ones spend reading included)"
    why += _terms_text(p, "compute") if p.terms else f"; predicted: its FLOPs at {_percent(p.efficiency)} of peak"
    if held:
        why += (f"; the prediction prices {'these' if not p.compute_s else 'the other'} matmuls and attention as "
                f"reading their operands, which takes longer than multiplying them (few rows, or small matrices): "
                f"their time is in {held}, in the memory time" + ("" if p.compute_s else ", not zero"))
    return Row("compute time", p.compute_s, c.compute_s, "s", why, "" if p.compute_s else held)


def _percent(fraction: float) -> str:
    """``0.42`` -> ``"42%"``, ``0.003`` -> ``"0.3%"`` (a fraction under 1 % is not written as 0 %)."""
    return f"{fraction:.0%}" if fraction >= 0.01 or not fraction else f"{fraction * 100:.1g}%"


def _step_row(predicted_step: tp.Any, compiled_step: tp.Any) -> Row:
    """The step: each side totalled its own way (the measured model's terms summed; a compiled step's parts
    overlapped, the longest, or one after another)."""
    p, c = predicted_step, compiled_step
    if p.terms:
        terms = ", ".join(f"{t.name} {format_seconds(t.seconds)}" for t in p.terms if t.seconds)
        predicted = f"predicted: the sum of its terms ({terms}), only the communication nothing hides counted"
    else:
        predicted = ("predicted: the longest of its compute, memory time and communication" if p.overlap else
                     "predicted: its compute or memory time, then its communication") + \
            (f", plus the pipeline bubble {format_seconds(p.bubble_s)}" if p.bubble_s else "")
    compiled = ("compiled: the longest of its compute, memory time and communication, every collective counted "
                if c.overlap else "compiled: its compute or memory time, then every collective, ") + \
        f"({c.bound}-bound)"
    return Row("step time", p.time_s, c.time_s, "s", f"{predicted}; {compiled}")


def _memory_rows(ledger: tp.Any, compiled: tp.Any, hlo: str, seq_len: int | None) -> list[Row]:
    m = compiled.memory
    held = ledger.params + ledger.optimizer + ledger.inputs + ledger.kv_cache
    inside = ledger.grads + ledger.activations + ledger.temporaries
    top = _largest_values(hlo, seq_len)
    return [
        Row("memory: arguments", held, m.argument, "B",
            "XLA's arguments (parameters, optimizer state or KV cache, token ids) against the ledger's params + "
            "optimizer + KV cache + inputs"),
        Row("memory: inside the step", inside, m.total - m.argument, "B",
            "XLA's peak less its arguments, against the ledger's grads + activations + temporaries; the largest "
            f"arrays the program computes: {top}"),
        Row("memory: total", ledger.total, m.total, "B", "XLA's peak (peak_memory_in_bytes on TPU)"),
    ]


def _largest_values(hlo: str, seq_len: int | None, top: int = 3) -> str:
    """The largest arrays the program's instructions produce: shape, how many instructions, bytes each."""
    if not hlo:
        return "-"
    found: dict[str, tuple[int, float]] = {}
    for computation in parse(hlo).computations.values():
        for op in computation.instructions:
            if op.opcode in NO_TRAFFIC or op.opcode.endswith("-done") or op.opcode == "parameter":
                continue
            for a in leaves(shape_tree(op.shape)):
                text = f"{a.dtype}[{','.join(map(str, a.dims))}]"
                n, size = found.get(text, (0, shape_bytes(text)))
                found[text] = (n + 1, size)
    best = sorted(found.items(), key=lambda kv: -kv[1][1])[:top]
    return "; ".join(f"{text} ({n} instructions, {format_bytes(size)} each{_label(text, seq_len)})"
                     for text, (n, size) in best)


def _label(array: str, seq_len: int | None) -> str:
    dims = [int(d) for d in re.findall(r"\d+", array.split("[", 1)[1])] if "[" in array else []
    return ": attention scores" if seq_len and len(dims) >= 2 and dims[-2:] == [seq_len, seq_len] else ""


def _traffic_row(predicted: float, compiled_bytes: float, hlo: str, seq_len: int | None) -> Row:
    if not hlo:
        return Row("HBM traffic", predicted, compiled_bytes, "B", "no HLO to split the compiled bytes by")
    per_op = hbm_traffic(hlo)
    total = sum(b for *_, b in per_op) or 1.0
    kinds: dict[str, float] = {}
    arrays: dict[str, float] = {}
    for _, kind, array, nbytes in per_op:
        kinds[kind] = kinds.get(kind, 0.0) + nbytes
        arrays[array] = arrays.get(array, 0.0) + nbytes
    by_kind = ", ".join(f"{k} {format_bytes(v)} ({v / total:.0%})"
                        for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:4])
    by_array = ", ".join(f"{a}{_label(a, seq_len)} {format_bytes(v)} ({v / total:.0%})"
                         for a, v in sorted(arrays.items(), key=lambda kv: -kv[1])[:3])
    scores = sum(v for a, v in arrays.items() if _label(a, seq_len))
    why = (f"the compiled bytes count every instruction's operands read and result written (arrays in VMEM, "
           f"layout S(1), excepted), each once per loop trip; by op kind: {by_kind}; by the largest array an "
           f"instruction moves: {by_array}")
    if scores:
        why += (f"; instructions moving attention scores (materialised, f32) account for {format_bytes(scores)}, "
                f"which the step model's flash-attention kernel keeps on chip")
    return Row("HBM traffic", predicted, compiled_bytes, "B", why)


def _communication_rows(predicted_step: tp.Any, compiled_step: tp.Any, compiled: tp.Any, hlo: str) -> list[Row]:
    roles = collective_roles(hlo) if hlo else {}
    groups_p: dict[tuple[str, tuple[str, ...]], list[tp.Any]] = {}
    for t in predicted_step.collectives:
        role = "gather" if t.kind == "all-gather" else "gradient" if t.kind == "reduce-scatter" or \
            "gradient" in t.name else "other"
        groups_p.setdefault((role, t.axes), []).append(t)
    groups_c: dict[tuple[str, tuple[str, ...]], list[tp.Any]] = {}
    for t in compiled_step.collectives:
        groups_c.setdefault((roles.get(t.name, "other"), t.axes), []).append(t)
    names = {"gather": "weight gathers", "gradient": "gradient reductions", "other": "other collectives"}
    rows = []
    for role, axes in sorted(set(groups_p) | set(groups_c), key=lambda k: (list(names).index(k[0]), k[1])):
        ps, cs = groups_p.get((role, axes), []), groups_c.get((role, axes), [])
        seconds_p, seconds_c = sum(t.total_s for t in ps), sum(t.total_s for t in cs)
        rows.append(Row(f"{names[role]} over {','.join(axes) or '-'}", seconds_p, seconds_c, "s",
                        _collective_why(role, ps, cs, compiled_step)))
    exposed = _terms_text(predicted_step, "communication")
    rows.append(Row("communication", predicted_step.comm_s, compiled_step.comm_s, "s",
                    "every collective's time, one after another (the compiled step hides none of it; the "
                    "prediction's exposed share is a term of its own"
                    + (f": {exposed.removeprefix('; predicted: ')})" if exposed else
                       ", none of it exposed here)" if predicted_step.terms else ")")))
    return rows


def _describe(ts: tp.Sequence[tp.Any]) -> str:
    kinds: dict[str, list[float]] = {}
    for t in ts:
        entry = kinds.setdefault(t.kind, [0, 0.0])
        entry[0] += t.runs
        entry[1] += t.nbytes * t.runs
    return ", ".join(f"{runs} {kind} ({format_bytes(nbytes)})" for kind, (runs, nbytes) in kinds.items()) or "none"


def _collective_why(role: str, ps: tp.Sequence[tp.Any], cs: tp.Sequence[tp.Any], compiled_step: tp.Any) -> str:
    """Runs and bytes on both sides, and what the compiled program's collectives would cost written as the
    prediction writes them (the network model's time for the same bytes)."""
    why = f"predicted {_describe(ps)}; compiled {_describe(cs)}"
    bytes_p, bytes_c = sum(t.nbytes * t.runs for t in ps), sum(t.nbytes * t.runs for t in cs)
    reduces = [t for t in cs if t.kind == "all-reduce"]
    mesh, cluster = compiled_step.mesh, compiled_step.cluster
    if role == "gather" and reduces:
        as_gathers = sum(transfer("all-gather", t.nbytes, t.axes, mesh, cluster).seconds * t.runs for t in reduces)
        why += (f"; {sum(t.runs for t in reduces)} compiled runs are all-reduces of a zero-filled buffer holding the "
                f"device's block (dynamic-update-slice into a broadcast constant), an all-gather written as an "
                f"all-reduce: {format_seconds(sum(t.total_s for t in reduces))}, as all-gathers of the same bytes "
                f"{format_seconds(as_gathers)}")
        if bytes_p:
            why += f"; gathered bytes {bytes_c / bytes_p:.2f}x the predicted"
    if role == "gradient" and reduces:
        as_scatters = sum(transfer("reduce-scatter", t.nbytes / math.prod(mesh.get(a, 1) for a in t.axes), t.axes,
                                   mesh, cluster).seconds * t.runs for t in reduces)
        why += (f"; {sum(t.runs for t in reduces)} compiled runs all-reduce backward values (op_name under "
                f"transpose(...)) whole, {format_bytes(sum(t.nbytes * t.runs for t in reduces))}, which the program "
                f"then slices to the device's block: {format_seconds(sum(t.total_s for t in reduces))}, as "
                f"reduce-scatters {format_seconds(as_scatters)}")
    return why


__all__ = ["Row", "collective_roles", "format_value", "hbm_traffic", "reconcile", "table"]
