"""What a layout search may try: the user's :class:`Constraints`, and the cluster parts, mesh shapes and pipelines
they leave, each mesh shape that makes no sense for the model and batch pruned with the number that decides it."""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

from workbench.core.axes import EP, PartitionAxis
from workbench.core.checks import is_int, is_positive_int, one_of
from workbench.core.hardware.cluster import prime_factors
from workbench.core.mesh import MESH_AXES, axis_sizes, mesh_factorizations
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import PROGRAM_FIELDS, Plan

RANKINGS = ("evidence", "model")  # Constraints.ranking
MOST_MICROBATCHES = 16  # Constraints(grad_accumulation=None) tries the divisors of a data shard's sequences up to this


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What the advisor may choose. ``fixed``: axis sizes every layout keeps (``{"tp": 8}``);
    ``tp_across_nodes``: let ``tp`` (and ``sp``) groups span GPU nodes (their all-reduces then run on the
    inter-node network); ``max_split_axes``: mesh axes of size > 1 at most; ``pipeline``: consider ``pp > 1``
    (train steps); ``zero``: consider ZeRO-1 on ``dp > 1`` (train steps); ``headroom``: the fraction of HBM a
    layout must leave free to count as fitting; ``split_physical_axes``: on TPU, also mesh axes that split a torus
    axis (MaxText's ``allow_split_physical_axes``: a ring of 4 inside an axis of 16); ``idle_chips``: when the
    cluster's device count has a prime factor of 5 or more (which divides no batch, head or layer count of powers
    of two), also plan on part of it (:meth:`Cluster.part
    <workbench.core.hardware.cluster.Cluster.part>`), saying how many
    chips stay idle; ``grad_accumulation``: the microbatches per step to try (train, no pipeline) where a layout
    does not fit without remat at fewer (None: every count up to :data:`MOST_MICROBATCHES` that divides the
    sequences a data shard holds: 1, 2, 4, 8, 16 for a power of two, 1, 3, 7 for 21). The program every layout
    runs (:class:`~workbench.core.plan.Plan`'s
    fields of the same names, counted by the ledger): ``attention`` ``"xla"`` (scores in HBM: the workbench's own
    program, what ``confirm`` compiles), ``"flash"`` (what production runs use) or ``"flash_triton"`` (llm-foundry's
    2022 Triton kernel, at its own rate), ``vocab_tiles`` the chunks the
    loss's tokens are computed in, ``offload`` the saved activations in host memory, ``sequence_parallel`` the
    activations outside tensor parallelism's matmuls split over ``tp``, ``autograd`` whose autodiff's saved set
    (``"jax"`` or ``"pytorch"``); ``Constraints(**PRODUCTION)``
    (:data:`workbench.core.plan.PRODUCTION`) plans the program production runs. ``ranking``: ``"evidence"`` (a train
    step resting on a regime no published run validates is a range, ranked by its slow end:
    :mod:`~workbench.core.advisor.regimes`) or ``"model"`` (every layout by the step model's prediction alone, as a
    textbook derivation does). ``pipelines``: the pipelines a ``pp > 1`` layout may run instead of the advisor's own
    (1F1B and interleaved at ``m = p, 2p, 4p``): a recipe's schedule, such as Megatron's 64 microbatches interleaved
    at ``v = 5``; those whose stages are not the mesh's ``pp`` or whose microbatches do not divide a data shard's
    sequences are skipped."""

    fixed: tp.Mapping[str, int] = dataclasses.field(default_factory=dict)
    tp_across_nodes: bool = False
    max_split_axes: int = 3
    pipeline: bool = True
    zero: bool = True
    headroom: float = 0.10
    split_physical_axes: bool = True
    idle_chips: bool = True
    grad_accumulation: tuple[int, ...] | None = None
    attention: str = "xla"
    vocab_tiles: int = 1
    offload: bool = False
    sequence_parallel: bool = False
    autograd: str = "jax"
    ranking: str = "evidence"
    pipelines: tuple[PipelineConfig, ...] = ()

    def accumulations(self, rows: int) -> list[int]:
        """The microbatch counts to try for a data shard of ``rows`` sequences: the given ones dividing it, or
        (``grad_accumulation=None``) every count up to :data:`MOST_MICROBATCHES` that does."""
        counts = self.grad_accumulation or range(1, MOST_MICROBATCHES + 1)
        return [k for k in counts if rows % k == 0]

    def program(self) -> dict[str, tp.Any]:
        """``attention``, ``vocab_tiles``, ``offload``, ``sequence_parallel``, ``autograd``: keywords of ``Plan`` and
        ``ledger``."""
        return {name: getattr(self, name) for name in PROGRAM_FIELDS}

    def __post_init__(self):
        Plan({}, **self.program())  # checks them
        one_of("Constraints.ranking", self.ranking, RANKINGS)
        if not all(isinstance(p, PipelineConfig) for p in self.pipelines):
            raise TypeError(f"Constraints.pipelines is a tuple of PipelineConfig; got {self.pipelines!r}")
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        axis_sizes(self.fixed, "Constraints.fixed")
        given = self.grad_accumulation
        if given is not None and (not given or not all(is_positive_int(k) for k in given)):
            raise ValueError(f"Constraints.grad_accumulation is a tuple of positive ints (microbatches per step, 1 "
                             f"for none), or None for the divisors of a data shard's sequences up to "
                             f"{MOST_MICROBATCHES}; got {given!r}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"Constraints.headroom is a fraction of HBM in [0, 1); got {self.headroom!r}")
        if not is_int(self.max_split_axes) or not 1 <= self.max_split_axes <= len(MESH_AXES):
            raise ValueError(f"Constraints.max_split_axes must be an int in 1..{len(MESH_AXES)}; "
                             f"got {self.max_split_axes!r}")


def cluster_parts(cluster: tp.Any, constraints: Constraints) -> list[tp.Any]:
    """The cluster, and where its device count has a prime factor of 5 or more, the parts of it of the largest
    ``2^a`` and ``3 x 2^a`` devices (:meth:`Cluster.part`), biggest first."""
    n = cluster.num_devices
    if not constraints.idle_chips or not any(p >= 5 for p in prime_factors(n)):
        return [cluster]
    unit = cluster.gpus_per_node if cluster.platform == "gpu" else cluster.slices * cluster.devices_per_chip
    counts = {1 << (n.bit_length() - 1), 3 << max(0, (n // 3).bit_length() - 1)}
    return [cluster] + [cluster.part(k) for k in sorted(counts, reverse=True) if k < n and k % unit == 0 and k >= unit]


@functools.lru_cache(maxsize=64)
def mesh_shapes(cluster: tp.Any, split: bool, max_split_axes: int) -> tuple[tuple[int, ...], ...]:
    """The mesh shapes over :data:`MESH_AXES` a search tries on ``cluster``: those along whole physical axes, and
    with ``split`` (TPU) those that split a torus axis (:func:`~workbench.core.hardware.cluster.torus_layout`),
    of at most
    ``max_split_axes`` axes of size > 1."""
    whole = set(cluster.valid_mesh_shapes(len(MESH_AXES)))
    if cluster.platform != "tpu" or not split:
        return tuple(sorted(whole))
    shapes = set(whole)
    for s in mesh_factorizations(cluster.num_devices):
        sizes = tuple(s.values())
        if sizes in shapes or sum(n > 1 for n in sizes) > max_split_axes:
            continue
        try:
            cluster.check_mesh_shape(sizes)
        except ValueError:
            continue
        shapes.add(sizes)
    return tuple(sorted(shapes))


MICROBATCHES_PER_STAGE = (1, 2, 4)  # m = p, 2p, 4p: the bubble (p - 1) / (v m + p - 1) at 50 %, 33 %, 20 % (v = 1)


def pipeline_configs(p: int, rows_per_shard: int, num_layers: int) -> list[tp.Any]:
    """The pipelines a ``pp = p`` layout may run: 1F1B and interleaved (two or four stages per device, at least two
    layers each) with ``m = p, 2p, 4p`` microbatches where ``m`` divides a data shard's rows. Stages that do not
    divide the layers are uneven, offered where no schedule divides them
    (the deepest ``ceil(L / stages)`` deep, as Llama 3 405B's 126 layers on 16 stages). GPipe is left out: the
    same bubble as 1F1B with ``m`` microbatches stashed instead of ``p``."""
    even, uneven = [], []
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
        if num_layers < 2 * p * v:
            continue  # a virtual stage of one layer: nothing left to overlap its sends with
        split = num_layers % (p * v) != 0
        (uneven if split else even).extend(PipelineConfig(p, k * p, schedule, v, uneven=split)
                                           for k in MICROBATCHES_PER_STAGE if rows_per_shard % (k * p) == 0)
    return even or uneven  # uneven stages only where no schedule splits the layers evenly


SHORT_SHARD = 512  # tokens: a sequence shard shorter than this leaves attention's kernels too little to overlap


def pruned_why(shape: dict[str, int], config: tp.Any, cluster: tp.Any, task: str, batch: tuple[int, int],
               constraints: Constraints) -> str | None:
    """Why a mesh shape makes no sense for this model and batch (a key of ``Advice.pruned``, naming the number that
    decides it), ``""`` for a shape not worth counting (an axis the model or task does not have), or None."""
    b, t = batch
    ep, tp_, sp, pp = shape["ep"], shape["tp"], shape["sp"], shape["pp"]
    experts = config.num_local_experts
    layers = config.num_hidden_layers - config.first_dense_layers
    if (ep > 1 and not experts) or (pp > 1 and (task != "train" or not constraints.pipeline)):
        return ""  # no experts to split, no backward to pipeline: not a choice to report
    if sum(n > 1 for n in shape.values()) > constraints.max_split_axes:
        return f"with more than {constraints.max_split_axes} split axes"
    if any(shape[a] != n for a, n in constraints.fixed.items()):
        return "not of the fixed sizes"
    if pp > 1 and constraints.offload:
        return "with pp and offload (a pipeline's offload is not modelled)"
    if ep > 1 and experts % ep:
        return f"with ep not dividing the {experts} experts"
    if tp_ > 1 and (config.num_attention_heads % tp_ or config.intermediate_size % tp_):
        return f"with tp not dividing the {config.num_attention_heads} heads"
    if sp > 1 and task == "decode":
        return "with sp on a decode step"
    if sp > 1 and (t % sp or t // sp < SHORT_SHARD):
        return f"with sp leaving under {SHORT_SHARD} of the {t} positions per shard"
    data = shape["dp"] * shape["fsdp"] * (ep if tokens_over_ep(shape) else 1)
    if b % data:
        return f"with the {b} sequences not dividing over the data axes"
    if pp > 1 and not pipeline_configs(pp, b // data, layers):
        return "with pp and too few sequences per data shard to microbatch"
    if task == "train" and pp == 1 and not constraints.accumulations(b // data):
        return "with no allowed grad_accumulation dividing the sequences per data shard"
    # tp and sp are the mesh's innermost axes: consecutive GPUs
    if cluster.platform == "gpu" and not constraints.tp_across_nodes and cluster.gpus_per_node % (tp_ * sp):
        return f"with tp x sp across the {cluster.gpus_per_node}-GPU nodes"
    return None


def tokens_over_ep(shape: tp.Mapping[str, int]) -> bool:
    """Whether the token batch splits over ``ep`` as well as the data axes: always with ``ep > 1``, as MaxText (its
    ``activation_batch`` rule names ``expert``) and torchtitan (EP borrows its devices from data parallelism) run
    experts: outside the expert layers an ``ep`` group is data parallel, not a copy of the same work."""
    return shape.get("ep", 1) > 1


def batch_partition_axis(pa: PartitionAxis, shape: tp.Mapping[str, int]) -> PartitionAxis:
    """``pa`` with the batch over ``ep`` too where :func:`tokens_over_ep` says so."""
    if not tokens_over_ep(shape):
        return pa
    over = lambda axes: tuple(dict.fromkeys((*(axes if isinstance(axes, tuple) else (axes,)), EP)))
    return pa.replace(batch_axis=over(pa.batch_axis), decode_batch_axis=over(pa.decode_batch_axis))
