"""The two pricers of a predicted step's :class:`~.step_counts.StepCounts`: the measured step model
(:func:`measured_step`, the default) and the book's roofline (:func:`roofline_step`, given an ``efficiency``).

The measured model: matmuls, attention kernels and memory-bound fusions run one after another on a device (one
stream of kernels), each at the efficiency :mod:`~workbench.core.hardware.calibration` cites for its shape; the
collectives at the network's attained bandwidth; only the communication nothing hides is added (what hides
what: each parallelism's ``exposed_s`` in :mod:`~workbench.core.cost.parallel`), then the pipeline's bubble.

The roofline overlaps compute, memory and communication (``overlap=True``: the longest part, the book's
assumption) or runs them one after another, with matmuls at ``efficiency`` of peak; the bubble adds either way.
"""

from __future__ import annotations

from workbench.core.cost.kernels import attention_efficiency, attention_rate, gemm_efficiency, memory_seconds
from workbench.core.cost.parallel import data, pipeline, sequence, tensor
from workbench.core.cost.roofline import check_chip, roofline
from workbench.core.cost.step import CollectiveTime, StepTime, Term, WorkPart
from workbench.core.cost.step_counts import ITEM_BYTES, LAYER_KINDS, WORK_KINDS, StepCounts, StepSizes
from workbench.core.hardware.calibration import ADAMW_F32_BYTES, FLASH_BACKWARD, calibration
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.network import transfer

# The measured model's kernel terms whose work is priced as HBM traffic (their operands take longer to read than to
# multiply): the matmuls and attention a decode step runs, which its compute terms then leave at zero.
HBM_BOUND_KERNELS = ("matmuls bound by HBM", "attention bound by HBM")
# The terms that price attention (its kernels and, in decode, its KV cache's read): quadratic in a sequence's
# length where every other term is linear in its tokens.
ATTENTION_TERMS = ("attention kernels", HBM_BOUND_KERNELS[1])


def _work_parts(counts: StepCounts) -> tuple[WorkPart, ...]:
    return tuple(WorkPart(kind, counts.flops[kind], counts.bytes[kind]) for kind in WORK_KINDS
                 if counts.flops[kind] or counts.bytes[kind])


def roofline_step(counts: StepCounts, step: StepSizes, cluster: Cluster, *, efficiency: float, overlap: bool,
                  staged: dict[str, float], model_flops: float) -> StepTime:
    """The step on the roofline: its FLOPs at ``efficiency`` of peak against its HBM bytes, each collective at
    the network's bandwidth, and the bubble on the pipelined layers' busy time."""
    mesh, timed, pipelined_s = dict(step.sizes), [], 0.0
    for (part, kind, axes, nbytes, name), (runs, pipelined, role) in counts.comms.items():
        t = transfer(kind, nbytes, axes, mesh, cluster)
        timed.append(CollectiveTime(kind, axes, nbytes, runs, t.seconds, t.level, t.bound, name, False, part, role))
        if pipelined and step.bubble:
            pipelined_s += t.seconds * runs * staged.get(part, 0.0)
    line = roofline(sum(counts.flops.values()), sum(counts.bytes.values()), cluster, step.rate, efficiency)
    bubble_s = 0.0
    if step.bubble:
        stage_flops = sum(staged[kind] * counts.flops[kind] for kind in LAYER_KINDS)
        stage_bytes = sum(staged[kind] * counts.bytes[kind] for kind in LAYER_KINDS)
        stage = roofline(stage_flops, stage_bytes, cluster, step.rate, efficiency)
        busy = (max(stage.time_s, pipelined_s) if overlap else stage.time_s + pipelined_s)
        bubble_s = pipeline.bubble_s(busy, step.bubble)
    return StepTime(cluster, mesh, line, tuple(timed), efficiency, overlap, None, _work_parts(counts), step.bubble,
                    bubble_s, model_flops)


def measured_step(counts: StepCounts, step: StepSizes, cluster: Cluster, *, overlap: bool, tp_overlap: bool,
                  staged: dict[str, float], model_flops: float, ring_overlap: bool = True) -> StepTime:
    """The step as the measured model prices it (:func:`measured_terms`); its roofline keeps the ideal counts
    with the hardware FLOPs run (``recompute``'s share of what remat="full" recomputes)."""
    mesh = dict(step.sizes)
    timed, terms, achieved = measured_terms(counts, step, cluster, overlap=overlap, tp_overlap=tp_overlap,
                                            staged=staged, ring_overlap=ring_overlap)
    remat, recompute = step.remat_passes, step.recompute
    flops = sum(counts.flops.values())
    line = roofline(flops - (counts.recomputed * (1 - recompute / remat) if remat else 0.0),
                    sum(counts.bytes.values()), cluster, step.rate)
    return StepTime(cluster, mesh, line, timed, achieved, overlap, None, _work_parts(counts), step.bubble,
                    terms[-1].seconds, model_flops, terms)


class _Kernels:
    """A device's kernels at the efficiencies the chip's calibration cites: each priced, the forward's and
    backward's seconds kept per kind, the matmuls' split by what bounds them."""

    def __init__(self, cluster: Cluster, rate: str, attention: str, weight_item_bytes: float):
        check_chip(cluster)
        self.cal = calibration(cluster.chip)
        self.rate = rate
        self.weight_item_bytes = weight_item_bytes  # a stored weight's bytes (a served model's may differ from rate's)
        self.attention_kernel = attention
        self.peaks = {name: cluster.chip.peak_flops(name) / cluster.devices_per_chip for name in {rate, "bf16"}}
        self.bandwidth = cluster.chip.hbm_bandwidth / cluster.devices_per_chip
        self.forward, self.backward = dict.fromkeys(WORK_KINDS, 0.0), dict.fromkeys(WORK_KINDS, 0.0)
        self.gemm_bound = {"compute": 0.0, "memory": 0.0}  # matmul seconds by what bounds each GEMM
        self.attention = {"compute": 0.0, "memory": 0.0}
        self.gemm_flops = 0.0

    def gemm_s(self, rows: float, inner: float, cols: float, dtype: str, runs: float,
               weight_item_bytes: float | None = None) -> float:
        """``runs`` of an ``(rows, inner) @ (inner, cols)`` GEMM; the ``(inner, cols)`` operand takes
        ``weight_item_bytes`` an element (a stored weight's; default the dtype's)."""
        compute = 2 * rows * inner * cols / (self.peaks[dtype] * gemm_efficiency(rows, inner, cols, self.cal, dtype))
        item = ITEM_BYTES[dtype]
        weight = item if weight_item_bytes is None else weight_item_bytes
        memory = memory_seconds(((rows * inner + rows * cols) * item + inner * cols * weight), self.cal,
                                self.bandwidth)
        self.gemm_bound["compute" if compute >= memory else "memory"] += runs * max(compute, memory)
        return runs * max(compute, memory)

    def add_gemms(self, counts: StepCounts) -> float:
        """Price every GEMM, forward and backward; return the matmuls' seconds."""
        for part, m, k, n, forward, backward, again in counts.gemms:
            # low-precision training (Transformer Engine, torchao float8) keeps the LM head in bfloat16
            dtype = "bf16" if part == "embedding+head" else self.rate
            weight = None if part == "embedding+head" else self.weight_item_bytes
            self.forward[part] += self.gemm_s(m, k, n, dtype, forward, weight)
            self.backward[part] += (self.gemm_s(m, n, k, dtype, backward) + self.gemm_s(k, m, n, dtype, backward)
                                    + self.gemm_s(m, k, n, dtype, again))
            self.gemm_flops += 2 * m * k * n * (forward + 2 * backward + again)
        return sum(self.forward.values()) + sum(self.backward.values())

    def add_attention(self, counts: StepCounts) -> float:
        """Price the flash-attention calls (a decode step's bound by reading the KV cache); return their seconds."""
        for dense, causal, length, head_dim, backward, nbytes in counts.attention:
            compute = dense * causal / (self.peaks["bf16"] * attention_efficiency(length, head_dim, self.cal,
                                                                                  self.attention_kernel))
            memory = memory_seconds(nbytes, self.cal, self.bandwidth)
            seconds = max(compute, memory)
            self.forward["attention"] += seconds
            self.backward["attention"] += backward * seconds
            self.attention["compute" if compute >= memory else "memory"] += seconds * (1 + backward)
        return sum(self.attention.values())

    def add_fusions(self, counts: StepCounts, fused_passes: int) -> dict[str, float]:
        """Price the memory-bound fusions of each kind (the layers' at the calibrated multiple of their minimal
        traffic), shared out over the passes; return their seconds by kind."""
        cal, bandwidth = self.cal, self.bandwidth
        fused = {kind: cal.fusion.value * memory_seconds(counts.fused[kind], cal, bandwidth) for kind in LAYER_KINDS}
        fused["embedding+head"] = memory_seconds(counts.fused["embedding+head"], cal, bandwidth)
        for kind, seconds in fused.items():
            self.forward[kind] += seconds / fused_passes
            self.backward[kind] += seconds - seconds / fused_passes
        return fused


def _timed_collectives(counts: StepCounts, step: StepSizes, cluster: Cluster, network: float,
                       staged: dict[str, float]
                       ) -> tuple[list[CollectiveTime], dict[str, float], dict[str, int], float]:
    """Each collective at the attained bandwidth (``network`` of the link's; hops as they are), their seconds and
    runs by role, and the pipelined layers' critical collectives' seconds."""
    mesh, timed, role_s, role_runs, staged_s = dict(step.sizes), [], {}, {}, 0.0
    for (part, kind, axes, nbytes, name), (runs, pipelined, role) in counts.comms.items():
        t = transfer(kind, nbytes, axes, mesh, cluster)
        seconds = t.attained(network)
        timed.append(CollectiveTime(kind, axes, nbytes, runs, seconds, t.level, t.bound, name, False, part, role))
        role_s[role] = role_s.get(role, 0.0) + seconds * runs
        role_runs[role] = role_runs.get(role, 0) + runs
        if pipelined and role in ("tp", "critical"):
            staged_s += seconds * runs * staged.get(part, 0.0)
    return timed, role_s, role_runs, staged_s


def measured_terms(counts: StepCounts, step: StepSizes, cluster: Cluster, *, overlap: bool, tp_overlap: bool,
                   staged: dict[str, float], ring_overlap: bool = True
                   ) -> tuple[tuple[CollectiveTime, ...], tuple[Term, ...], float]:
    """The step as the measured model prices it: its collectives at the network's attained bandwidth, the terms
    whose sum is the step (the bubble last) and the matmuls' achieved fraction of peak.

    FSDP gathers and gradient reductions hide behind the forward's and backward's work
    (:func:`~.parallel.data.exposed_s`), ring attention's passes behind the attention kernels
    (:func:`~.parallel.sequence.exposed_s`; all of them exposed without ``ring_overlap``); tensor-, expert- and
    pipeline-parallel collectives sit between
    dependent matmuls: exposed unless ``tp_overlap`` hides the tensor-parallel ones behind the matmuls
    (:func:`~.parallel.tensor.exposed_s`)."""
    kernels = _Kernels(cluster, step.rate, step.attention, step.weight_item_bytes)
    matmul_s = kernels.add_gemms(counts)
    attention_s = kernels.add_attention(counts)
    fused = kernels.add_fusions(counts, step.fused_passes)
    optimizer_s = memory_seconds(counts.fused["optimizer"], kernels.cal, kernels.bandwidth)
    timed, role_s, role_runs, staged_comm = _timed_collectives(counts, step, cluster, kernels.cal.network.value,
                                                               staged)
    forward_s, backward_s = sum(kernels.forward.values()), sum(kernels.backward.values())
    exposed = (data.exposed_s(role_s.get("gather", 0.0), role_runs.get("gather", 0), role_s.get("grad", 0.0),
                              role_runs.get("grad", 0), forward_s, backward_s, train=step.train, overlap=overlap)
               + sequence.exposed_s(role_s.get("ring", 0.0), attention_s, overlap=overlap and ring_overlap))
    critical = (tensor.exposed_s(role_s.get("tp", 0.0), matmul_s, hidden=tp_overlap and overlap)
                + role_s.get("critical", 0.0))
    achieved = kernels.gemm_flops / (kernels.peaks[step.rate] * matmul_s) if matmul_s else 1.0
    terms = _terms(kernels, achieved, fused, optimizer_s, exposed, critical, overlap=overlap, tp_overlap=tp_overlap)
    bubble_s = 0.0
    if step.bubble:
        busy = sum(staged.get(kind, 0.0) * (kernels.forward[kind] + kernels.backward[kind]) for kind in LAYER_KINDS)
        bubble_s = pipeline.bubble_s(busy + staged_comm, step.bubble)
    terms.append(Term("pipeline bubble", bubble_s, "bubble", f"{step.bubble:.0%} of the schedule's ticks idle"))
    return tuple(timed), tuple(terms), min(1.0, achieved)


# the attention term's words for each kernel (the XLA attention is priced as a flash kernel: its time is not modelled)
_KERNEL_WORDS = {"xla": "flash attention (the XLA attention's time is not modelled)", "flash": "flash attention",
                 "flash_triton": "the 2022 Triton flash attention"}


def _terms(kernels: _Kernels, achieved: float, fused: dict[str, float], optimizer_s: float, exposed: float,
           critical: float, *, overlap: bool, tp_overlap: bool) -> list[Term]:
    """The measured step's terms but the bubble, each with how it was priced."""
    cal = kernels.cal
    return [
        Term("matmuls", kernels.gemm_bound["compute"], "compute", f"{kernels.gemm_flops:.3g} FLOP at {achieved:.0%} "
             f"of peak (each GEMM's shape on the {cal.tile}-wide unit; large ones at {cal.gemm.value:.0%})"),
        Term(HBM_BOUND_KERNELS[0], kernels.gemm_bound["memory"], "memory", f"GEMMs whose operands take longer to "
             f"read than to multiply (few rows: decode), at {cal.hbm.value:.0%} of HBM bandwidth"),
        Term(ATTENTION_TERMS[0], kernels.attention["compute"], "compute",
             f"{_KERNEL_WORDS[kernels.attention_kernel]}, masked tiles skipped, forward and backward "
             f"({FLASH_BACKWARD}x the forward), at {attention_rate(cal, kernels.attention_kernel):.0%} of peak on "
             f"long sequences"),
        Term(HBM_BOUND_KERNELS[1], kernels.attention["memory"], "memory", "reading the KV cache"),
        Term("memory-bound fusions", sum(fused.values()), "memory", f"norms, RoPE, activations, residuals, MoE "
             f"permutes, the loss, at {cal.hbm.value:.0%} of HBM bandwidth ({cal.fusion.value:g}x the minimal "
             f"traffic in the layers)"),
        Term("optimizer update", optimizer_s, "memory", f"AdamW with float32 master weights and moments: "
                                                        f"{ADAMW_F32_BYTES} B of HBM traffic a parameter (reads "
                                                        f"the float32 weight, moments and gradient, writes weight "
                                                        f"and moments)"),
        Term("FSDP and gradient communication, exposed", exposed, "communication",
             "what the forward's and backward's work does not hide, the first gather and the last reduction, "
             "and ring attention's passes the attention kernels do not hide" if overlap else
             "nothing hidden (overlap=False)"),
        Term("TP, EP and PP collectives", critical, "communication",
             "between dependent matmuls, on the critical path" + (" (TP hidden by collective matmuls)"
                                                                   if tp_overlap else "")),
    ]
