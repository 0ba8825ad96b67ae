"""How a step runs, as one record: the :class:`Plan` the advisor's candidates, the explorer, the recipe readers and
writers and the published runs hold, and that :func:`workbench.core.cost.price.price` prices.

A plan is plain data (no model, no devices): the mesh's axis sizes, the remat policy (and the fraction of a
layer's forward matmuls its backward recomputes, where a framework's policy lies between the named ones), the
pipeline, the ZeRO stage, the gradient-accumulation microbatches, the mesh axes the batch splits over, the dtype,
and the options that change what a step's collectives and experts do. A :class:`~workbench.core.sharding.plan.Layout`
is a plan resolved against a model on a mesh. :func:`microbatch` is what gradient accumulation runs: one of the
``grad_accumulation`` microbatches a step's batch splits into (the ledger holds one microbatch's activations; the
predicted step runs them one after another).

>>> plan = Plan({"fsdp": 16, "tp": 4}, remat="full", grad_accumulation=2)
>>> plan.label()
'fsdp=16 x tp=4, 2 accumulated microbatches'
>>> plan.mesh_shape["pp"], plan.devices
(1, 64)
>>> plan.microbatch((256, 8192))
(128, 8192)
>>> Plan({"fsdp": 8}, remat="some")
Traceback (most recent call last):
ValueError: remat must be one of ('none', 'dots_saveable', 'full'); got 'some'
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing as tp

from workbench.core.checks import batch_shape, one_of, positive_int
from workbench.core.mesh import MESH_AXES, axis_sizes
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.vocab import ATTENTION_KERNELS, AUTOGRADS, REMATS
from workbench.core.zero import check_zero_stage

BATCH_AXES = ("fsdp", "dp")  # PartitionAxis().batch_axis: the axes a batch splits over by default
# the program production runs (Plan's attention, vocab_tiles, offload, sequence_parallel, autograd): a flash kernel,
# sequence parallelism inside tensor parallelism, the loss whole and nothing offloaded unless a recipe says so, JAX's
# autodiff (MaxText's); a PyTorch framework's run adds autograd="pytorch"
PRODUCTION = {"attention": "flash", "vocab_tiles": 1, "offload": False, "sequence_parallel": True, "autograd": "jax"}
PROGRAM_FIELDS = tuple(PRODUCTION)  # the fields of a Plan, a recipe and the advisor's constraints naming the program


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one step runs on a mesh of ``mesh_shape`` (workbench axes; each of ``MESH_AXES`` 1 where not named).

    ``remat`` is the layers' policy (:data:`~workbench.core.vocab.REMATS`) and ``recompute`` the fraction of a
    layer's forward matmuls its backward recomputes (None: 1 under ``"full"``, else 0); ``pipeline`` a
    :class:`~workbench.core.pipeline_schedule.PipelineConfig` over ``pp``; ``zero_stage`` 0 or 1 (ZeRO-1 over
    ``dp``); ``grad_accumulation`` microbatches run one after another; ``batch_axes`` the mesh axes the batch
    splits over; ``dtype`` the parameters' and activations' ("bf16", "int8", "fp8"); ``capacity_factor`` pads each
    expert (None: dropless); ``tp_overlap`` hides tensor parallelism's collectives behind its matmuls (None: the
    platform's default); ``experts_fsdp=False`` keeps expert weights whole over ``fsdp``. The program, which the
    ledger counts (:mod:`workbench.core.cost.ledger`): ``attention`` the kernel
    (:data:`~workbench.core.vocab.ATTENTION_KERNELS`: ``"xla"``, scores materialised, or ``"flash"``, what
    MaxText, torchtitan, Megatron and NeMo run, or ``"flash_triton"``, llm-foundry's 2022 Triton kernel: no scores
    either, at its own rate), ``vocab_tiles`` the chunks the loss's tokens are computed in
    (MaxText's ``num_vocab_tiling``), ``offload`` the saved activations kept in host memory, ``sequence_parallel``
    the activations outside tensor parallelism's matmuls split over ``tp`` (Megatron's ``--sequence-parallel``;
    every published TP run uses it), ``autograd`` whose autodiff decides what a layer keeps without remat
    (:data:`~workbench.core.vocab.AUTOGRADS`: ``"jax"``, every op's residuals, or ``"pytorch"``, PyTorch's autograd
    with fused norm and activation kernels, as torchtitan, Megatron-LM, NeMo and llm-foundry run). The defaults
    are the workbench's own program, the one ``confirm`` and the
    explorer compile; :data:`PRODUCTION` is what the published runs use. The step model prices attention at the
    named flash kernel's rate, and ``"xla"`` at ``"flash"``'s: the XLA attention's time is not modelled.
    """

    mesh_shape: tp.Mapping[str, int]
    remat: str = "full"
    pipeline: PipelineConfig | None = None
    zero_stage: int = 0
    grad_accumulation: int = 1
    batch_axes: tuple[str, ...] = BATCH_AXES
    dtype: tp.Any = "bf16"
    recompute: float | None = None
    capacity_factor: float | None = None
    tp_overlap: bool | None = None
    experts_fsdp: bool = True
    attention: str = "xla"
    vocab_tiles: int = 1
    offload: bool = False
    sequence_parallel: bool = False
    autograd: str = "jax"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "mesh_shape", types.MappingProxyType(axis_sizes(self.mesh_shape, "a plan's mesh")))
        one_of("remat", self.remat, REMATS)
        one_of("attention", self.attention, ATTENTION_KERNELS)
        one_of("autograd", self.autograd, AUTOGRADS)
        set_(self, "vocab_tiles", positive_int("vocab_tiles", self.vocab_tiles,
                                               what="a positive int (chunks the loss's tokens are computed in)"))
        for name in ("offload", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} is True or False; got {getattr(self, name)!r}")
        set_(self, "zero_stage", check_zero_stage(self.zero_stage))
        set_(self, "grad_accumulation", positive_int("grad_accumulation", self.grad_accumulation))
        set_(self, "batch_axes", tuple(self.batch_axes))
        unknown = sorted(set(self.batch_axes) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"batch_axes names axes {unknown}; the workbench's mesh axes are {MESH_AXES}")
        pp = self.mesh_shape["pp"]
        if self.pipeline is not None and not isinstance(self.pipeline, PipelineConfig):
            raise TypeError(f"pipeline is a PipelineConfig or None; got {type(self.pipeline).__name__}")
        if (self.pipeline.num_stages if self.pipeline else 1) != pp:
            raise ValueError(f"a mesh with pp={pp} needs a pipeline of {pp} stages; got "
                             f"{self.pipeline.num_stages if self.pipeline else 'no pipeline'}")

    def __hash__(self) -> int:  # the mesh is a read-only mapping, which hashes as its items
        return hash((tuple(self.mesh_shape.items()), *(getattr(self, f.name) for f in dataclasses.fields(self)[1:])))

    @property
    def devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    def replace(self, **changes: tp.Any) -> Plan:
        """A new plan with ``changes`` (a field's name and its new value), checked as a new one is."""
        return dataclasses.replace(self, **changes)

    def microbatch(self, batch: tuple[int, int]) -> tuple[int, int]:
        """One of this plan's accumulated microbatches of a step's ``batch = (sequences, length)``
        (:func:`microbatch`)."""
        return microbatch(batch, self.grad_accumulation)

    def program(self) -> dict[str, tp.Any]:
        """The program's choices the ledger counts: ``attention``, ``vocab_tiles``, ``offload``,
        ``sequence_parallel``, ``autograd`` (:func:`workbench.core.cost.ledger.ledger`'s keywords)."""
        return {name: getattr(self, name) for name in PROGRAM_FIELDS}

    def label(self) -> str:
        """``"fsdp=16 x tp=4"``, then the pipeline and the accumulated microbatches where there are any."""
        text = " x ".join(f"{a}={n}" for a, n in self.mesh_shape.items() if n > 1) or "one device"
        if self.pipeline is not None:
            p = self.pipeline
            text += f", {p.num_microbatches} microbatches {p.schedule}" + (
                f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
        if self.grad_accumulation > 1:
            text += f", {self.grad_accumulation} accumulated microbatches"
        return text


def program_text(program: tp.Mapping[str, tp.Any]) -> str:
    """A program (:meth:`Plan.program`) in words.

    >>> program_text(PRODUCTION)
    'flash attention, the loss whole, sequence parallel inside tp'
    """
    words = [f"{program['attention']} attention",
             "the loss whole" if program["vocab_tiles"] == 1 else f"the loss in {program['vocab_tiles']} tiles"]
    words += ["saved activations offloaded"] if program["offload"] else []
    words.append("sequence parallel inside tp" if program["sequence_parallel"] else "no sequence parallel")
    words += ["PyTorch autograd's saved set"] if program.get("autograd", "jax") == "pytorch" else []
    return ", ".join(words)


def microbatch(batch: tuple[int, int], grad_accumulation: int) -> tuple[int, int]:
    """``(sequences, length)`` of one of the ``grad_accumulation`` microbatches a step of ``batch = (sequences,
    length)`` runs one after another, summing their gradients; a ValueError naming the counts that divide the
    sequences where this one does not.

    >>> microbatch((12, 1024), 5)
    Traceback (most recent call last):
    ValueError: 12 sequences do not split into 5 microbatches; use a count that divides 12: 1, 2, 3, 4, 6, 12
    """
    rows, length = batch_shape(batch)
    k = positive_int("grad_accumulation", grad_accumulation, what="a positive int (microbatches per step)")
    if rows % k:
        raise ValueError(f"{rows} sequences do not split into {k} microbatches; use a count that divides {rows}: "
                         f"{', '.join(map(str, _divisors(rows)))}")
    return rows // k, length


def _divisors(n: int, most: int = 12) -> list[int]:
    """The divisors of ``n``, smallest first; only the ``most`` smallest and the largest where there are more."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = sorted({*small, *(n // d for d in small)})
    return found if len(found) <= most else [*found[:most - 1], n]


__all__ = ["BATCH_AXES", "PRODUCTION", "PROGRAM_FIELDS", "Plan", "microbatch", "program_text"]
