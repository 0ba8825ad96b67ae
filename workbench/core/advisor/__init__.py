"""The layout advisor: every sensible way to lay a model on a cluster, ranked with reasons, confirmed by the compiler.

:func:`advise` enumerates mesh shapes of the cluster's devices over the workbench's axes ``(pp, dp, fsdp, ep, tp,
sp)`` (only those the cluster can hold: :meth:`Cluster.valid_mesh_shapes`), with the remat policies, for ``pp > 1``
the pipelines (1F1B and interleaved, ``m = p, 2p, 4p`` microbatches), and for a train step on ``dp > 1`` ZeRO-1
(the optimizer state split over ``dp``, :mod:`workbench.core.zero`), and drops what makes no sense for
this model and batch (a split that does not divide the heads, the experts, the layers or the batch; ``tp``
across GPU nodes unless allowed; more than ``max_split_axes`` split axes). Each remaining layout is resolved (the
parameters' PartitionSpecs, :class:`~workbench.core.sharding.plan.Layout`), held against the chip's HBM by the memory
ledger (:func:`~workbench.core.cost.ledger.ledger`), and timed by the analytic step model
(:func:`~workbench.core.cost.predicted.predict_step`): nothing is compiled. Layouts that fit are ranked by predicted
step time, each with the reason it wins or loses in words; :meth:`Advice.confirm` compiles the top few on the
virtual cluster (:func:`~workbench.core.compile.virtual.compile_step`) and puts the compiler's memory and collectives
beside the prediction, demoting a layout whose compiled memory does not fit.

What it chooses between, as practitioners do: mesh shapes along whole torus axes and, on TPU, splitting one (a
ring of 4 inside an axis of 16); part of a cluster whose device count nothing divides (the Llama-3 70B layout of
the scaling book uses 8,192 of a v5p pod's 8,960 chips), saying how many chips stay idle; FSDP over the batch and
the sequence together (``fsdp x sp``, both sharding the weights); gradient accumulation (microbatches per step,
tried where a layout does not fit without remat); pipelines with uneven stages (Llama 3 405B's 126 layers on 16);
expert parallelism whose ``ep`` groups are data parallel outside the experts (MaxText's and torchtitan's way),
with the experts split over ``fsdp`` too or kept whole over it (no gathers: what a decode step wants).
Ties (step times within 1 %) go to what a practitioner prefers next: no pipeline, no accumulation, no idle chips,
fewer split axes, more HBM left free; each reason says which decided.

ZeRO's stages: ``dp`` alone is stage 0, ``zero_stage=1`` on ``dp`` is stage 1 (and holds stage 2's split
gradients in a jitted step: ZeRO-2 is ZeRO-1 here), ``fsdp`` is stage 3.

The package, by job: :mod:`.constraints` (what the user fixes, and the mesh shapes, cluster parts and pipelines it
leaves), :mod:`.candidate` (one layout and its figures), :mod:`.search` (:func:`advise`: enumerate, hold against
the HBM), :mod:`.rank` (price and rank, the tie-breaks), :mod:`.reasons` (the words), :mod:`.breakdown` (a step as
the sum a reason writes), :mod:`.advice` (the result and its tables), :mod:`.confirm` (compile and
reconcile the program the step prices: a :class:`~.confirm.Confirmation` per confirmed layout), :mod:`.serving`
(:func:`advise_serving`: the point of the latency-throughput front that meets a latency or throughput target).
"""

from workbench.core.advisor.advice import Advice
from workbench.core.advisor.candidate import Candidate
from workbench.core.advisor.confirm import Confirmation
from workbench.core.advisor.constraints import Constraints
from workbench.core.advisor.reasons import reason
from workbench.core.advisor.search import advise
from workbench.core.advisor.serving import ServingAdvice, advise_serving

__all__ = ["Advice", "Candidate", "Confirmation", "Constraints", "ServingAdvice", "advise", "advise_serving", "reason"]
