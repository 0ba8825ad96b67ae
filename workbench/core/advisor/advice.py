"""What :func:`~workbench.core.advisor.advise` returns (:class:`Advice`): the ranked layouts and those that do not fit,
why none fits, the compiler's confirmation of the top few, and the ranking as a text table and as HTML."""

from __future__ import annotations

import dataclasses
import html
import typing as tp

from workbench.core.advisor.candidate import Candidate, gib
from workbench.core.advisor.confirm import confirm_candidate, demoted_reason
from workbench.core.interop.out_of_sample import accuracy_text
from workbench.core.interop.published import fine_grained_moe
from workbench.core.interop.published_serving import serving_accuracy_text
from workbench.core.tables import html_table

_ROW_HEADER = ("#", "layout", "memory/device", "of HBM", "step", "tokens/s", "MFU", "bound by", "why")  # Advice.rows


@dataclasses.dataclass
class Advice:
    """The ranked layouts (``ranked``: they fit, fastest first) and those that do not fit (``rejected``, each with
    why), for one model, cluster, task and batch. ``considered``: layouts the ledger and step model saw;
    ``pruned``: mesh shapes dropped before that, by reason; ``seconds``: enumeration and ranking time."""

    model: tp.Any
    cluster: tp.Any
    task: str
    batch: tuple[int, int]
    optimizer: str
    ranked: list[Candidate]
    rejected: list[Candidate]
    considered: int
    pruned: dict[str, int]
    seconds: float

    @property
    def best(self) -> Candidate:
        """The fastest layout that fits; a ValueError saying why when none does."""
        if not self.ranked:
            raise ValueError(self.why_none())
        return self.ranked[0]

    def why_none(self) -> str:
        """Why no layout fits, and what would help."""
        if not self.considered:
            pruned = ", ".join(f"{n} {why}" for why, n in self.pruned.items() if n)
            return (f"every mesh shape of {self.cluster.name} was pruned before the ledger ({pruned}): allow more "
                    f"(Constraints), or change the batch so it divides over the data axes")
        smallest = self.rejected[0]
        return (f"no layout fits {self.cluster.name}: the smallest, {smallest.label}, needs "
                f"{gib(smallest.ledger.total)} per device ({smallest.reason}). "
                + ("Fewer sequences, a shorter KV cache or more chips would." if self.task == "decode" else
                   "More microbatches (Constraints.grad_accumulation), fewer tokens per step or more chips would."))

    def confirm(self, k: int = 3, *, progress: tp.Callable[[str], None] | None = None) -> list[Candidate]:
        """Compile the top ``k`` on the virtual cluster (:meth:`confirm_one` each)."""
        return [self.confirm_one(c, progress=progress) for c in list(self.ranked[:k])]

    def confirm_one(self, c: Candidate, *, progress: tp.Callable[[str], None] | None = None) -> Candidate:
        """Compile ``c`` on the virtual cluster: the compiled memory and step time go beside the prediction; on a
        TPU slice (XLA's TPU compiler), if its compiled memory exceeds the HBM it moves from ``ranked`` to
        ``rejected`` with that reason. A GPU cluster's program is XLA:CPU's (in the worker), whose memory is not
        a GPU's: it is shown, not held against the HBM (:func:`~workbench.core.advisor.confirm.confirm_candidate`)."""
        over = confirm_candidate(c, self.model, self.cluster, task=self.task, batch=self.batch,
                                 optimizer=self.optimizer, progress=progress)
        if over and c in self.ranked:
            c.fits = False
            c.reason = demoted_reason(c, self.cluster.hbm_per_device)
            self.ranked.remove(c)
            self.rejected.insert(0, c)
        return c

    # -- display ------------------------------------------------------------------------------------------------
    def rows(self, top: int = 10) -> list[tuple[str, ...]]:
        """``(rank, layout, memory/device, HBM use, step, tokens/s, MFU, bound, reason)`` of the top ``top``; MFU
        (:attr:`StepTime.mfu <workbench.core.cost.step.StepTime.mfu>`) is marked ``≤`` where it is an upper
        bound (no efficiency factor)."""
        hbm = self.cluster.hbm_per_device
        tokens = self.batch[0] * (1 if self.task == "decode" else self.batch[1])
        return [(str(i), c.label, f"{gib(c.ledger.total)}", "-" if hbm is None else f"{c.ledger.total / hbm:.0%}",
                 c.step_text(), c.tokens_text(tokens), c.step.mfu_text(), c.step.bound, c.reason)
                for i, c in enumerate(self.ranked[:top], 1)]

    def table(self, top: int = 10) -> str:
        rows = [_ROW_HEADER, *self.rows(top)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_ROW_HEADER) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
        return "\n".join([self.summary(), *lines])

    __str__ = table

    def summary(self) -> str:
        pruned = ", ".join(f"{n} {why}" for why, n in self.pruned.items() if n)
        steps = [c.step for c in (self.ranked or self.rejected)[:1]]
        how = ""
        if steps and steps[0].measured_model and self.task == "train":
            how = f". Step times and MFU are predictions: {self._accuracy()}" + self._evidence_text()
        elif steps and steps[0].measured_model:
            how = (f". Step times are predictions of the kernels and collectives alone, without a serving engine's "
                   f"own cost a step (cost.serving adds it: {serving_accuracy_text(self.task)})"
                   + ("; advise_serving picks a layout and the requests in flight for a latency or throughput "
                      "target" if self.task == "decode" else ""))
        elif steps and steps[0].ideal:
            how = ". Step times are the ideal roofline (matmuls at peak): MFU marked ≤ is an upper bound"
        batch = f"{self.batch[0]} sequences, KV cache {self.batch[1]}" if self.task == "decode" else \
            f"batch {self.batch[0]} x {self.batch[1]}"
        return (f"{self.task} of {self._model_name()} on {self.cluster.name}, {batch}: "
                f"{self.considered} layouts predicted in {self.seconds:.2f} s, {len(self.ranked)} fit"
                + (f" (pruned before: {pruned})" if pruned else "") + how)

    def _accuracy(self) -> str:
        """How true a prediction here is: every published run, this cluster's chip's own, and for a fine-grained
        MoE the runs of such models the model is not held to."""
        return accuracy_text(self.cluster.chip, moe=fine_grained_moe(self.model))

    def _evidence_text(self) -> str:
        """How many ranked layouts rest on a regime no published run validates (ranked by their range's slow end)."""
        if not any(c.standing is not None for c in self.ranked):
            return ""
        ranges = sum(c.unvalidated for c in self.ranked)
        return (f". {ranges} of {len(self.ranked)} rest on a parallelism no published run validates in its regime: "
                f"their step is a range, ranked by its slow end" if ranges else
                ". Every layout ranked rests on parallelisms published runs validate")

    def _model_name(self) -> str:
        return getattr(getattr(self.model, "config", None), "model_type", type(self.model).__name__)

    def html(self, top: int = 10) -> str:
        """:meth:`table` as an HTML table: the summary line, then the top ``top`` layouts."""
        return (f'<div class="wb-advice" style="font-size:12px"><div>{html.escape(self.summary())}</div>'
                f"{html_table(self.rows(top), header=_ROW_HEADER)}</div>")

    _repr_html_ = html
