"""Confirming a layout with the compiler: compile a :class:`~workbench.core.advisor.candidate.Candidate` on the virtual
cluster (:func:`~workbench.core.compile.virtual.compile_step`), time the compiled program, reconcile it with the
prediction of the same program (:func:`~workbench.core.cost.reconcile.reconcile`), and say in its note how far the
ledger was.

Like is compared with like. The compiled program is the program the prediction prices: a decode step with its KV
cache (an argument, donated and updated in place); a train step of one microbatch where the step accumulates
gradients over several, beside the prediction of that one-microbatch step and its ledger. Such a step is then also
shown whole (:class:`Confirmation`): the predicted step beside the compiled microbatch times the microbatches plus
what the accumulation adds as the prediction counts it (the gradients' running sum in memory; one optimizer update
a step instead of one a microbatch). A prefill compiles as a forward pass without a cache, and says so.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from workbench.core.advisor.candidate import Candidate, gib
from workbench.core.compile.virtual import compile_step
from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.ledger import ledger, libtpu_version, zero_parameter_copy_bytes
from workbench.core.cost.price import price
from workbench.core.cost.reconcile import Row, format_value, reconcile
from workbench.core.hardware.calibration import calibration
from workbench.core.plan import Plan, program_text
from workbench.core.units import format_seconds

# The quantities a confirmed row shows first (the step and its parts, and the memory); the rest support them.
MAIN_QUANTITIES = ("step time", "compute time", "memory time", "communication", "memory: total")
# reconcile's quantities that are a peak, not a sum over the step's work: a step of microbatches holds one at a time
_PEAKS = ("memory: arguments", "memory: inside the step", "memory: total")


@dataclasses.dataclass(frozen=True)
class ConfirmRow:
    """One quantity of a confirmed layout: ``row``, the prediction of the compiled program against it (one
    microbatch where the step accumulates), with :mod:`~workbench.core.cost.reconcile`'s reason; and the step's:
    ``predicted_step``, ``accumulation`` (what running ``m`` microbatches in one step adds to ``m`` one-microbatch
    programs, as the prediction counts it: the predicted step less ``m`` predicted programs; for a peak, the step's
    ledger less the program's) and ``compiled_step`` (``m`` compiled programs, or one for a peak, plus it)."""

    row: Row
    predicted_step: float
    accumulation: float
    compiled_step: float

    @property
    def quantity(self) -> str:
        return self.row.quantity


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """What confirming a layout found: ``program``, what the compiled program is, in words; ``microbatches`` the
    step runs it (1 but for gradient accumulation); ``rows`` every reconciled quantity (:class:`ConfirmRow`)."""

    program: str
    microbatches: int
    rows: tuple[ConfirmRow, ...]

    def __getitem__(self, quantity: str) -> ConfirmRow:
        for r in self.rows:
            if r.quantity == quantity:
                return r
        raise KeyError(f"no quantity {quantity!r}; these are reconciled: {[r.quantity for r in self.rows]}")

    @property
    def header(self) -> tuple[str, ...]:
        """The columns of :meth:`cells`: the program's prediction and compile, and with accumulation the step's."""
        if self.microbatches == 1:
            return ("", "predicted", "compiled")
        m = self.microbatches
        return ("", "predicted step", "predicted microbatch", "compiled microbatch", "accumulation adds",
                f"compiled step ({m} x microbatch + accumulation)")

    def cells(self, quantities: tp.Sequence[str] | None = None) -> list[tuple[tuple[str, ...], str]]:
        """``(cells, why)`` for each of ``quantities`` (default: all), the cells under :attr:`header`, every number
        as :mod:`workbench.core.units` writes it (:func:`~workbench.core.cost.reconcile.format_value`) and a
        prediction that holds a quantity's work in another term saying which; ``why`` is the program's row's reason
        (with accumulation, said to be one microbatch's)."""
        rows = self.rows if quantities is None else [self[q] for q in quantities]
        out = []
        for r in rows:
            unit = r.row.unit
            if self.microbatches == 1:
                cells = (r.quantity, r.row.predicted_text, r.row.compiled_text)
            else:
                step = Row(r.quantity, r.predicted_step, r.compiled_step, unit, "", r.row.held_in)
                cells = (r.quantity, step.predicted_text, r.row.predicted_text, r.row.compiled_text,
                         _signed(r.accumulation, unit), step.compiled_text)
            out.append((cells, r.row.why if self.microbatches == 1 else f"for one microbatch: {r.row.why}"))
        return out

    def table(self) -> str:
        """The program in words, then every quantity's cells and why, as text."""
        widths = [max(len(c[i]) for c in [self.header, *(cells for cells, _ in self.cells())])
                  for i in range(len(self.header))]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
        return "\n".join([f"compiled program: {self.program}", line(self.header),
                          *(f"{line(cells)}\n    why: {why}" for cells, why in self.cells())])


def _signed(value: float, unit: str) -> str:
    return "none" if not value else ("+" if value > 0 else "") + format_value(value, unit)


# what compile_step builds (a Plan's defaults): the workbench's own attention (scores in HBM), the loss over the
# whole vocabulary at once, nothing offloaded, the residual stream whole over tp
WORKBENCH_PROGRAM = Plan({}).program()


def confirm_candidate(c: Candidate, model: tp.Any, cluster: tp.Any, *, task: str, batch: tuple[int, int],
                      optimizer: str, progress: tp.Callable[[str], None] | None = None) -> bool:
    """Compile ``c`` (advised for ``model`` on ``cluster``, a ``task`` step of ``batch``; a decode step's batch is
    ``(sequences, KV cache length)``) on the virtual cluster: its compiled analysis, compiled step, reconciled rows
    (the compiled program against its own prediction), :class:`Confirmation` and note go on ``c``. True where the
    compiled step's memory (the program's, plus an accumulation's gradient sum) exceeds the HBM of a TPU slice
    (XLA's TPU compiler); a GPU cluster's program is XLA:CPU's (in the worker), whose memory is not a GPU's: it is
    shown, not held against the HBM."""
    part = c.cluster or cluster  # the part of the cluster it plans on, when it leaves chips idle
    if progress is not None:
        progress(f"compiling {c.label} for {part.name}")
    why_not = _why_not_compiled(c, part, model, task)
    if why_not:
        c.confirm_note = why_not
        return False
    model = model.with_options(remat=c.remat) if hasattr(model, "with_options") else model
    m = c.grad_accumulation if task == "train" else 1
    kind = {"train": "train", "decode": "decode"}.get(task, "forward")
    program = (batch[0], 1) if task == "decode" else c.plan.microbatch(batch) if task == "train" else batch
    c.compiled = compile_step(model, part, c.mesh_shape, kind=kind, batch=program, optimizer=optimizer,
                              partition_axis=c.partition_axis, rules=c.rules or None, pipeline=c.pipeline,
                              zero_stage=c.zero_stage, kv_length=batch[1] if task == "decode" else None)
    # the prediction and ledger of the program compiled: the workbench's (XLA attention, the loss whole, nothing
    # offloaded), one microbatch's train step where the step accumulates
    other_program = c.plan.program() != WORKBENCH_PROGRAM
    if other_program and c.reledger is None:
        raise ValueError(f"{c.label} is planned as {program_text(c.plan.program())}, but compiles as the workbench's "
                         f"program and carries no way to count that program's ledger (Candidate.reledger): confirm "
                         f"a row of advise()")
    step_ledger = c.reledger(**WORKBENCH_PROGRAM) if other_program else c.ledger
    predicted, held = c.step, step_ledger
    if m > 1:
        efficiency = None if c.step.measured_model else c.step.efficiency
        predicted = price(c.plan.replace(grad_accumulation=1), model, part, program, task, efficiency=efficiency)
        held = ledger(model, c.layout(model), kind=task, batch=program, optimizer=optimizer, remat=c.remat,
                      cluster=part, zero_stage=c.zero_stage, **WORKBENCH_PROGRAM)
    # priced as the prediction was: its matmuls' efficiency, and (the measured model) links at the attained fraction
    network = calibration(part.chip).network.value if c.step.measured_model else None
    c.compiled_step = step_time(c.compiled, efficiency=predicted.efficiency, model_flops=predicted.model_flops,
                                network_efficiency=network)
    seq_len = program[1]
    c.reconciled = reconcile(predicted, c.compiled_step, held, c.compiled, seq_len=seq_len)
    whole = c.reconciled if m == 1 else reconcile(c.step, c.compiled_step, step_ledger, c.compiled, seq_len=seq_len)
    c.confirmation = Confirmation(_program_words(c, model, part, task, batch, program, optimizer), m,
                                  tuple(_step_rows(c.reconciled, whole, m)))
    total = c.confirmation["memory: total"].compiled_step
    here = _ledger_total_compiled_here(c, held.total, model, cluster, task)
    c.confirm_note = _compiled_note(c, held.total, here, task)
    if other_program:
        c.confirm_note += (f"; compiled as the workbench's program ({program_text(WORKBENCH_PROGRAM)}), not the "
                           f"ranked one ({program_text(c.plan.program())}): held against that program's ledger, "
                           f"{gib(step_ledger.total, decimals=2)}, where the ranking's was "
                           f"{gib(c.ledger.total, decimals=2)}")
    if cluster.platform != "tpu":  # XLA:CPU in the worker: bfloat16 math widened, CPU fusion
        c.confirm_note += "; XLA:CPU's buffer assignment (bfloat16 widened), not held against the GPU's HBM"
        return False
    hbm = cluster.hbm_per_device
    return hbm is not None and total > hbm


def _step_rows(program: list[Row], whole: list[Row], m: int) -> tp.Iterator[ConfirmRow]:
    """Each of the program's rows with the step's: ``whole`` holds the same quantities predicted for the step (one
    it lacks, the step's prediction has none of)."""
    step = {r.quantity: r.predicted for r in whole}
    for r in program:
        if m == 1:
            yield ConfirmRow(r, r.predicted, 0.0, r.compiled)
            continue
        predicted_step = step.get(r.quantity, 0.0)
        times = 1 if r.quantity in _PEAKS else m
        added = predicted_step - times * r.predicted
        yield ConfirmRow(r, predicted_step, added, times * r.compiled + added)


def _program_words(c: Candidate, model: tp.Any, part: tp.Any, task: str, batch: tuple[int, int],
                   program: tuple[int, int], optimizer: str) -> str:
    """What the compiled program is, in words: its step, batch and cache, the attention it runs, its compiler."""
    if part.platform == "tpu":
        compiler = f"XLA's TPU compiler ahead of time for {part.name}"
    else:
        compiler = (f"XLA:CPU in a worker with {part.num_devices} simulated devices standing in for {part.name} "
                    f"(bfloat16 math widened to float32: its memory and bytes are not a GPU's)")
    attention = getattr(model, "attn_mechanism", "")
    attention = f", with the model's {attention!r} attention" if attention else ""
    if task == "decode":
        return (f"one decode step: {batch[0]} sequences each write one new token into a KV cache of {batch[1]:,} "
                f"positions and attend over it (the cache an argument of the program, donated and updated in "
                f"place, as generate's decode loop runs it){attention}; compiled by {compiler}")
    if task != "train":
        return (f"a forward pass over {batch[0]} sequences of {batch[1]:,} tokens without a KV cache (the "
                f"prefill's cache writes are not in it){attention}; compiled by {compiler}")
    recompute = f" (recomputing the forward: remat {c.remat})" if c.remat != "none" else ""
    m = c.grad_accumulation
    if m == 1:
        return (f"one train step: {batch[0]} sequences of {batch[1]:,} tokens, forward, backward{recompute} and the "
                f"{optimizer} update{attention}; compiled by {compiler}")
    return (f"one train step of one microbatch: {program[0]} of the step's {batch[0]} sequences of {batch[1]:,} "
            f"tokens, forward, backward{recompute} and the {optimizer} update{attention}; compiled by {compiler}. "
            f"The step runs {m} such microbatches one after another, sums their gradients and updates once: the "
            f"compiled step is the compiled microbatch x {m} (its memory once) plus what the accumulation adds as "
            f"the prediction counts it (the gradients' running sum held beside one microbatch's activations; one "
            f"optimizer update instead of {m})")


def demoted_reason(c: Candidate, hbm: float) -> str:
    """The reason of a layout the compiler demoted: its compiled memory beside the HBM and the ledger's figure."""
    confirmation = getattr(c, "confirmation", None)
    total = confirmation["memory: total"].compiled_step if confirmation else c.compiled.memory.total
    return (f"demoted by the compiler: the compiled step needs {gib(total)} per device > "
            f"{gib(hbm)} HBM (the ledger said {gib(c.ledger.total)})")


def _why_not_compiled(c: Candidate, cluster: tp.Any, model: tp.Any, task: str) -> str:
    """Why ``c`` cannot be compiled for ``cluster`` as the step predicted (the note it gets instead), or ""."""
    if c.pipeline is not None and cluster.platform != "tpu":
        return ("not compiled: a pipelined step compiles for TPU clusters only (XLA:CPU aborts on the "
                "exported pipeline the GPU worker receives)")
    if cluster.platform == "tpu" and cluster.topology is None:
        return (f"not compiled: {cluster.name} is no TPU slice shape, so XLA's TPU compiler has no "
                f"topology to compile it for")
    if c.pipeline is not None and c.pipeline.uneven:
        return "not compiled: the compiled pipeline runs equal stages only (uneven stages are priced)"
    if task == "decode" and not hasattr(model, "abstract_cache"):
        return (f"not compiled: {type(model).__name__} has no KV cache to compile a decode step with, and a forward "
                f"pass without one is not the step priced")
    return ""


def _compiled_note(c: Candidate, program_ledger: int, here: int, task: str) -> str:
    """The compiled memory against the ledger of the same program (``here``: that ledger for the compiler that
    compiled it), and the compiled step beside XLA's own estimate where it gives one."""
    confirmation = c.confirmation
    total, m = c.compiled.memory.total, confirmation.microbatches
    what = {"decode": " (a decode step with its KV cache)",
            "train": f" for one of its {m} microbatches" if m > 1 else ""}.get(
        task, " (a forward pass without a cache)")
    note = (f"compiled{what}: {gib(total, decimals=2)} per device (its ledger {here / total - 1:+.1%}"
            + ("" if here == program_ledger else
               f" for the libtpu {'.'.join(map(str, libtpu_version()))} that compiled it") + ")")
    if m > 1:
        step = confirmation["memory: total"].compiled_step
        note += (f", {gib(step, decimals=2)} with the gradients' sum the step holds; step "
                 f"{format_seconds(confirmation['step time'].compiled_step)} from {m} compiled microbatches "
                 f"({format_seconds(c.compiled_step.time_s)} each)")
    else:
        note += f", step {format_seconds(c.compiled_step.time_s)} from the compiled program"
    if c.compiled_step.xla_seconds is not None:
        note += (f"; XLA's own estimate {format_seconds(c.compiled_step.xla_seconds)} (libtpu's "
                 f"optimal_seconds, a scanned layer counted once) beside the model's "
                 f"{format_seconds(confirmation['step time'].row.predicted)}")
    return note


def _ledger_total_compiled_here(c: Candidate, total: int, model: tp.Any, cluster: tp.Any, task: str) -> int:
    """The ledger ``total`` of ``c``'s compiled program for the compiler that compiles here: the cluster's libtpu
    release may differ from the installed one, and the ledger's ZeRO-1 parameter copy depends on it (``ledger``
    module doc)."""
    here = libtpu_version()
    if cluster.platform != "tpu" or task != "train" or not c.zero_stage or here is None:
        return total
    layout = c.layout(model)
    return (total - zero_parameter_copy_bytes(layout, c.zero_stage, "tpu", cluster.libtpu)
            + zero_parameter_copy_bytes(layout, c.zero_stage, "tpu", here))
