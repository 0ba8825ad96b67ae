"""Confirming a layout with the compiler: compile a :class:`~workbench.core.advisor.candidate.Candidate` on the virtual
cluster (:func:`~workbench.core.compile.virtual.compile_step`), time the compiled program, reconcile it with the
prediction (:func:`~workbench.core.cost.reconcile.reconcile`), and say in its note how far the ledger was."""

from __future__ import annotations

import typing as tp

from workbench.core.advisor.candidate import Candidate, gib
from workbench.core.compile.virtual import compile_step
from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.ledger import libtpu_version, zero_parameter_copy_bytes
from workbench.core.cost.reconcile import reconcile
from workbench.core.hardware.calibration import calibration
from workbench.core.units import format_seconds


def confirm_candidate(c: Candidate, model: tp.Any, cluster: tp.Any, *, task: str, batch: tuple[int, int],
                      optimizer: str, progress: tp.Callable[[str], None] | None = None) -> bool:
    """Compile ``c`` (advised for ``model`` on ``cluster``, a ``task`` step of ``batch``) on the virtual cluster:
    its compiled analysis, compiled step, reconciled rows and note go on ``c``. True where the compiled memory
    exceeds the HBM of a TPU slice (XLA's TPU compiler); a GPU cluster's program is XLA:CPU's (in the worker),
    whose memory is not a GPU's: it is shown, not held against the HBM."""
    part = c.cluster or cluster  # the part of the cluster it plans on, when it leaves chips idle
    if progress is not None:
        progress(f"compiling {c.label} for {part.name}")
    why_not = _why_not_compiled(c, part)
    if why_not:
        c.confirm_note = why_not
        return False
    model = model.with_options(remat=c.remat) if hasattr(model, "with_options") else model
    kind = "train" if task == "train" else "forward"
    batch = batch if task != "decode" else (batch[0], 1)
    batch = c.plan.microbatch(batch)  # one microbatch of an accumulation: its memory
    c.compiled = compile_step(model, part, c.mesh_shape, kind=kind, batch=batch,
                              optimizer=optimizer, partition_axis=c.partition_axis, rules=c.rules or None,
                              pipeline=c.pipeline, zero_stage=c.zero_stage)
    # a decode step compiles as a one-token forward without a cache: not the predicted step's model FLOPs
    model_flops = None if task == "decode" else c.step.model_flops / c.grad_accumulation
    # priced as the prediction was: its matmuls' efficiency, and (the measured model) links at the attained fraction
    network = calibration(part.chip).network.value if c.step.measured_model else None
    c.compiled_step = step_time(c.compiled, efficiency=c.step.efficiency, model_flops=model_flops,
                                network_efficiency=network)
    c.reconciled = reconcile(c.step, c.compiled_step, c.ledger, c.compiled, seq_len=batch[1])
    total, hbm = c.compiled.memory.total, cluster.hbm_per_device
    here = _ledger_total_compiled_here(c, model, cluster, task)
    c.confirm_note = _compiled_note(c, total, here, kind)
    if cluster.platform != "tpu":  # XLA:CPU in the worker: bfloat16 math widened, CPU fusion
        c.confirm_note += "; XLA:CPU's buffer assignment (bfloat16 widened), not held against the GPU's HBM"
        return False
    return hbm is not None and total > hbm


def demoted_reason(c: Candidate, hbm: float) -> str:
    """The reason of a layout the compiler demoted: its compiled memory beside the HBM and the ledger's figure."""
    return (f"demoted by the compiler: the compiled step needs {gib(c.compiled.memory.total)} per device > "
            f"{gib(hbm)} HBM (the ledger said {gib(c.ledger.total)})")


def _why_not_compiled(c: Candidate, cluster: tp.Any) -> str:
    """Why ``c`` cannot be compiled for ``cluster`` (the note it gets instead), or ""."""
    if c.pipeline is not None and cluster.platform != "tpu":
        return ("not compiled: a pipelined step compiles for TPU clusters only (XLA:CPU aborts on the "
                "exported pipeline the GPU worker receives)")
    if cluster.platform == "tpu" and cluster.topology is None:
        return (f"not compiled: {cluster.name} is no TPU slice shape, so XLA's TPU compiler has no "
                f"topology to compile it for")
    if c.pipeline is not None and c.pipeline.uneven:
        return "not compiled: the compiled pipeline runs equal stages only (uneven stages are priced)"
    return ""


def _compiled_note(c: Candidate, total: int, here: int, kind: str) -> str:
    """The compiled memory against the ledger's (``here``: the ledger for the compiler that compiled it), and the
    compiled step beside XLA's own estimate where it gives one."""
    note = (f"compiled: {gib(total, decimals=2)} per device (ledger {here / total - 1:+.1%}"
            + ("" if here == c.ledger.total else
               f" for the libtpu {'.'.join(map(str, libtpu_version()))} that compiled it") + "), "
            f"step {c.compiled_step.time_s * 1e3:.3g} ms from the compiled program"
            + ("" if kind == "train" else " (compiled as a forward pass without a cache)")
            + (f" (one of its {c.grad_accumulation} microbatches; the ledger adds the gradient sum)"
               if c.grad_accumulation > 1 else ""))
    if c.compiled_step.xla_seconds is not None:
        note += (f"; XLA's own estimate {format_seconds(c.compiled_step.xla_seconds)} (libtpu's "
                 f"optimal_seconds, a scanned layer counted once) beside the model's "
                 f"{format_seconds(c.step.time_s)}")
    return note


def _ledger_total_compiled_here(c: Candidate, model: tp.Any, cluster: tp.Any, task: str) -> int:
    """``c``'s ledger total for the compiler that compiles here: the cluster's libtpu release may differ from
    the installed one, and the ledger's ZeRO-1 parameter copy depends on it (``ledger`` module doc)."""
    here = libtpu_version()
    if cluster.platform != "tpu" or task != "train" or not c.zero_stage or here is None:
        return c.ledger.total
    layout = c.layout(model)
    return (c.ledger.total - zero_parameter_copy_bytes(layout, c.zero_stage, "tpu", cluster.libtpu)
            + zero_parameter_copy_bytes(layout, c.zero_stage, "tpu", here))
