"""A training run as MaxText and torchtitan configure it, in the workbench's terms: :class:`TrainingRecipe`.

A recipe holds what both formats say about a run: the mesh over the workbench's axes ``(pp, dp, fsdp, ep, tp, sp)``
(and the part of it that spans TPU slices over DCN), the global batch, gradient accumulation, the remat policy, the
ZeRO stage and the pipeline, plus every approximation made on the way in, in words (``notes``). It resolves on a
model (:meth:`TrainingRecipe.layout`) and prices a step (:meth:`TrainingRecipe.price`), on the model the recipe names
when none is given (:meth:`TrainingRecipe.model_config`). The formats live beside it:
:mod:`~workbench.core.interop.maxtext` (YAML) and :mod:`~workbench.core.interop.torchtitan` (TOML).

>>> r = TrainingRecipe({"fsdp": 4, "tp": 2}, batch=(16, 2048), remat="full")
>>> r.devices, r.mesh_shape["tp"]
(8, 2)
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import typing as tp

import jax.numpy as jnp

from workbench.core.axes import DP, EP, FSDP, MODE_TRAIN, SP, TP, PartitionAxis, semantic_names
from workbench.core.checks import is_positive_int
from workbench.core.cost.price import price as price_plan
from workbench.core.hardware.cluster import cluster_mesh
from workbench.core.interop.model_names import preset_name
from workbench.core.mesh import MESH_AXES, axis_sizes
from workbench.core.models.causal_lm import CausalLM
from workbench.core.models.config import ModelConfig
from workbench.core.models.presets import full_config
from workbench.core.pipeline import pipeline_partition_axis
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import PROGRAM_FIELDS, Plan
from workbench.core.sharding.plan import Layout

# The ZeRO stages a recipe may state (DeepSpeed's 0..3); a Layout runs them as workbench.core.zero.ZERO_STAGES says
# (see workbench_zero_stage).
STATED_ZERO_STAGES = (0, 1, 2, 3)
_PARTITION_FIELDS = tuple(f.name for f in dataclasses.fields(PartitionAxis))


@dataclasses.dataclass(frozen=True)
class TrainingRecipe:
    """One training run: ``mesh_shape`` (all devices, per workbench axis; DCN included), ``batch`` = (global
    sequences per step, sequence length), ``remat`` (one of ``REMATS``) and ``source_remat`` (the source's own policy
    name), ``grad_accumulation`` microbatches per step, ``zero_stage`` (0..3: 3 is the ``fsdp`` axis, 1 and 2 the
    optimizer state split over ``dp``), ``pipeline`` (a :class:`PipelineConfig` over ``pp``, or None), ``dcn_shape``
    (how many TPU slices each axis spans; all ones on one slice), ``model`` (the source's model name),
    ``axis_rules`` (``PartitionAxis`` fields the source maps differently from the workbench's defaults, as
    ``(field, mesh axes)``), ``num_layers`` (the layers a pipeline splits, when the source says), the program
    (``attention``, ``vocab_tiles``, ``offload``, ``sequence_parallel``, ``autograd``:
    :class:`~workbench.core.plan.Plan`'s
    fields; a framework's recipe reads its own, the workbench's own program by default) and ``notes`` (every
    approximation, in words)."""

    mesh_shape: tp.Mapping[str, int]
    batch: tuple[int, int]
    remat: str = "full"
    grad_accumulation: int = 1
    zero_stage: int = 0
    pipeline: PipelineConfig | None = None
    dcn_shape: tp.Mapping[str, int] | None = None
    model: str | None = None
    source_remat: str | None = None
    axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = ()
    num_layers: int | None = None
    attention: str = "xla"
    vocab_tiles: int = 1
    offload: bool = False
    sequence_parallel: bool = False
    autograd: str = "jax"
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        mesh = axis_sizes(self.mesh_shape, "mesh_shape")
        dcn = axis_sizes(self.dcn_shape, "dcn_shape")
        uneven = {a: (mesh[a], dcn[a]) for a in MESH_AXES if mesh[a] % dcn[a]}
        if uneven:
            raise ValueError(f"dcn_shape must divide mesh_shape axis by axis (the mesh holds the DCN part times the "
                             f"ICI part); got (mesh, dcn) = {uneven}")
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "dcn_shape", dcn)
        batch = tuple(self.batch) if isinstance(self.batch, tuple | list) else self.batch
        if not isinstance(batch, tuple) or len(batch) != 2 or not all(is_positive_int(b) for b in batch):
            raise ValueError(f"batch is (global sequences per step, sequence length), two positive ints; "
                             f"got {self.batch!r}")
        object.__setattr__(self, "batch", batch)
        if self.zero_stage not in STATED_ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage is one of {STATED_ZERO_STAGES}; got {self.zero_stage!r}")
        rules = tuple(sorted((str(f), tuple(axes)) for f, axes in self.axis_rules))
        unknown = sorted({f for f, _ in rules} - set(_PARTITION_FIELDS))
        if unknown:
            raise ValueError(f"axis_rules name {unknown}, not PartitionAxis fields ({_PARTITION_FIELDS})")
        bad = sorted({a for _, axes in rules for a in axes} - set(MESH_AXES))
        if bad:
            raise ValueError(f"axis_rules name mesh axes {bad}; the workbench's are {MESH_AXES}")
        # canonical: the axes of size > 1 only, and no rule the workbench's default already says
        rules = tuple((f, tuple(a for a in axes if mesh[a] > 1)) for f, axes in rules)
        rules = tuple((f, axes) for f, axes in rules if set(axes) != set(default_field_axes(f, mesh)))
        object.__setattr__(self, "axis_rules", rules)
        object.__setattr__(self, "notes", tuple(self.notes))
        _ = self.plan  # the remat policy, accumulation and pipeline checked once, as every Plan is

    # -- what a recipe says ---------------------------------------------------------------------------------
    @property
    def devices(self) -> int:
        """Devices the run uses: the product of the mesh's axis sizes."""
        return math.prod(self.mesh_shape.values())

    @property
    def slices(self) -> int:
        """TPU slices the run spans: the product of ``dcn_shape``."""
        return math.prod(self.dcn_shape.values())

    @property
    def ici_shape(self) -> dict[str, int]:
        """The mesh inside one slice: ``mesh_shape / dcn_shape`` axis by axis."""
        return {a: self.mesh_shape[a] // self.dcn_shape[a] for a in MESH_AXES}

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch splits over (``axis_rules``' ``batch_axis``, else the workbench's ``fsdp, dp``)."""
        return dict(self.axis_rules).get("batch_axis", ("fsdp", "dp"))

    @property
    def data_ways(self) -> int:
        """How many ways the batch splits: the product of :attr:`batch_axes`' sizes."""
        return math.prod(self.mesh_shape[a] for a in self.batch_axes)

    def partition_axis(self) -> PartitionAxis:
        """``PartitionAxis()`` with :attr:`axis_rules` applied, its layers split over ``pp`` when pipelined."""
        pa = PartitionAxis().replace(**dict(self.axis_rules))
        return pipeline_partition_axis(pa) if self.mesh_shape["pp"] > 1 else pa

    def same_run(self, other: TrainingRecipe) -> bool:
        """Equal but for ``notes`` and ``source_remat`` (what a round trip through another format may reword)."""
        strip = dict(notes=(), source_remat=None)
        return dataclasses.replace(self, **strip) == dataclasses.replace(other, **strip)

    # -- from the workbench ---------------------------------------------------------------------------------
    @classmethod
    def from_layout(cls, layout_or_mesh_shape: tp.Any, *, batch: tuple[int, int], remat: str | None = None,
                    pipeline: PipelineConfig | None = None, zero_stage: int | None = None,
                    grad_accumulation: int | None = None, model: str | None = None, num_layers: int | None = None,
                    program: tp.Mapping[str, tp.Any] | None = None) -> TrainingRecipe:
        """The recipe of a :class:`~workbench.core.sharding.plan.Layout`, an advisor ``Candidate`` (anything with
        ``mesh_shape``, ``remat``, ``pipeline``, ``zero_stage``, ``grad_accumulation``) or a plain mesh shape dict.
        Keywords given override what the object carries. ZeRO: the object's stage 1 (optimizer state over ``dp``)
        is kept, else stage 3 when ``fsdp > 1``. ``num_layers`` (the pipelined layers) defaults to a Layout's model
        config's; ``program`` (``Plan.program()``: attention, vocab_tiles, offload, sequence_parallel) to a
        Candidate's plan's, else the workbench's own."""
        obj = layout_or_mesh_shape
        if isinstance(obj, tp.Mapping):
            shape, carried = dict(obj), {}
        elif hasattr(obj, "mesh_shape"):
            shape, carried = dict(obj.mesh_shape), _carried(obj)
        elif hasattr(obj, "mesh") and hasattr(obj.mesh, "shape"):
            shape, carried = dict(obj.mesh.shape), _carried(obj)
        else:
            raise TypeError(f"from_layout takes a Layout, an advisor Candidate or a mesh shape dict; got "
                            f"{type(obj).__name__}")
        remat = remat if remat is not None else carried.get("remat") or "full"
        pipeline = pipeline if pipeline is not None else carried.get("pipeline")
        zero = zero_stage if zero_stage is not None else carried.get("zero_stage") or 0
        accumulation = grad_accumulation if grad_accumulation is not None else carried.get("grad_accumulation", 1)
        shape = axis_sizes(shape, "mesh_shape")
        if zero == 0 and shape["fsdp"] > 1:
            zero = 3
        rules = ()
        pa = carried.get("partition_axis")
        if isinstance(pa, PartitionAxis):
            rules = _partition_overrides(pa)
        config = getattr(obj, "config", None)
        if num_layers is None and pipeline is not None and hasattr(config, "num_hidden_layers"):
            num_layers = config.num_hidden_layers - getattr(config, "first_dense_layers", 0)
        if program is None:
            program = obj.plan.program() if isinstance(getattr(obj, "plan", None), Plan) else {}
        return cls(shape, tuple(batch), remat, accumulation, zero, pipeline, model=model, axis_rules=rules,
                   num_layers=num_layers, **program)

    # -- onto a model and a cluster -------------------------------------------------------------------------
    def check_cluster(self, cluster: tp.Any) -> None:
        """A ValueError saying what to change when ``cluster`` cannot run this recipe's mesh as the source lays it
        out: a different device count, another number of TPU slices, or slices spread over other axes."""
        if cluster.num_devices != self.devices:
            raise ValueError(f"the recipe's mesh {self._shape_text()} has {self.devices} devices; {cluster.name} has "
                             f"{cluster.num_devices}. Pick a cluster of {self.devices} devices, or re-read the "
                             f"source with num_devices={cluster.num_devices} (its -1 axes fill the rest)")
        if cluster.platform != "tpu":
            return
        if cluster.slices != self.slices:
            raise ValueError(f"the recipe spans {self.slices} TPU slice(s) over DCN "
                             f"({self._shape_text(self.dcn_shape)}); "
                             f"{cluster.name} has {cluster.slices}: use Cluster.tpu(topology, slices={self.slices})")
        dcn, _ = cluster.dcn_split(tuple(self.mesh_shape.values()))
        if dcn != tuple(self.dcn_shape.values()):
            have = dict(zip(MESH_AXES, dcn, strict=True))
            raise ValueError(f"the recipe puts its slices on {self._shape_text(self.dcn_shape)} but the workbench lays "
                             f"slices on the outermost axes that take them ({self._shape_text(have)}, "
                             f"Cluster.dcn_split); move the DCN parallelism to those axes")

    def mesh(self, cluster: tp.Any) -> tp.Any:
        """The mesh of this recipe on ``cluster`` (:func:`~workbench.core.hardware.cluster.cluster_mesh`), checked
        first."""
        self.check_cluster(cluster)
        return cluster_mesh(cluster, tuple(self.mesh_shape.values()), MESH_AXES)

    def model_config(self) -> ModelConfig:
        """The full-size config of the model the recipe names (MaxText's ``model_name``, torchtitan's ``name/flavor``),
        resolved by :func:`~workbench.core.interop.model_names.preset_name`; a ValueError when it names none."""
        if self.model is None:
            raise ValueError("the recipe names no model (MaxText model_name, torchtitan [model] name and flavor): pass "
                             "the model's config")
        return full_config(preset_name(self.model))

    def _config(self, model_config: tp.Any) -> tp.Any:
        """``model_config`` as given, a preset or recipe model name resolved, or (None) the recipe's own model."""
        if model_config is None:
            return self.model_config()
        return full_config(preset_name(model_config)) if isinstance(model_config, str) else model_config

    def layout(self, model: tp.Any = None, cluster: tp.Any = None) -> tp.Any:
        """This recipe resolved on ``model`` (a live or ``lazy_init`` model; None: the recipe's own model, built
        abstractly in bfloat16) on ``cluster``'s mesh, carrying its remat policy, pipeline, ZeRO stage (as a Layout
        takes it) and gradient accumulation."""
        if cluster is None:
            raise TypeError("layout(model, cluster) needs the cluster: layout(cluster=Cluster.h100(nodes=...))")
        if model is None or isinstance(model, str | ModelConfig):
            model = CausalLM.lazy_init(self._config(model), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        return Layout.of(model, self.mesh(cluster), self.partition_axis(), None, MODE_TRAIN, remat=self.remat,
                         pipeline=self.pipeline, zero_stage=self.workbench_zero_stage,
                         grad_accumulation=self.grad_accumulation)

    @property
    def workbench_zero_stage(self) -> int:
        """The ``zero_stage`` a workbench ``Layout`` and ``predict_step`` take: 1 for ZeRO-1/2 (optimizer state
        over ``dp``), else 0 (ZeRO-3 is the ``fsdp`` axis itself)."""
        return 1 if self.zero_stage in (1, 2) and self.mesh_shape["dp"] > 1 else 0

    @property
    def program(self) -> dict[str, tp.Any]:
        """``attention``, ``vocab_tiles``, ``offload``, ``sequence_parallel``, ``autograd`` (:meth:`Plan.program`)."""
        return {name: getattr(self, name) for name in PROGRAM_FIELDS}

    @property
    def plan(self) -> Plan:
        """How the workbench runs this recipe's step: its :class:`~workbench.core.plan.Plan` (the mesh, remat,
        pipeline, ZeRO stage as a Layout takes it, accumulation, batch axes and the program)."""
        return Plan(self.mesh_shape, remat=self.remat, pipeline=self.pipeline, zero_stage=self.workbench_zero_stage,
                    grad_accumulation=self.grad_accumulation, batch_axes=self.batch_axes, **self.program)

    def price(self, model_config: tp.Any = None, cluster: tp.Any = None, **kwargs: tp.Any) -> tp.Any:
        """The predicted train step of ``model_config`` (a ModelConfig or a model name; None: the model the recipe
        names, :meth:`model_config`) on ``cluster`` under this recipe (:func:`workbench.core.cost.price.price` of
        :attr:`plan`); ``kwargs`` set the plan's other fields (``dtype``, ``recompute``, ``tp_overlap`` ...) or go to
        the pricer (``efficiency``, ``overlap``)."""
        if cluster is None:
            raise TypeError("price(model_config, cluster) needs the cluster: price(cluster=Cluster.h100(nodes=...)) "
                            "prices the model the recipe names")
        self.check_cluster(cluster)
        model_config = self._config(model_config)
        if self.pipeline is not None and self.grad_accumulation > 1:
            raise ValueError(f"the recipe pipelines {self.pipeline.num_microbatches} microbatches and accumulates "
                             f"{self.grad_accumulation} steps; the step model prices one of the two: fold the "
                             f"accumulation into the pipeline's microbatches (num_microbatches="
                             f"{self.pipeline.num_microbatches * self.grad_accumulation})")
        plan_fields = {f.name for f in dataclasses.fields(Plan)}
        plan = self.plan.replace(**{k: v for k, v in kwargs.items() if k in plan_fields})
        options = {k: v for k, v in kwargs.items() if k not in plan_fields}
        return price_plan(plan, model_config, cluster, self.batch, "train", **options)

    def _shape_text(self, shape: tp.Mapping[str, int] | None = None) -> str:
        shape = self.mesh_shape if shape is None else shape
        return " x ".join(f"{a}={n}" for a, n in shape.items() if n > 1) or "one device"


def default_field_axes(field: str, sizes: tp.Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that ``PartitionAxis()``'s ``field`` maps to (roles looked up)."""
    pa = PartitionAxis()
    roles = {DP: pa.data_parallel_axis, FSDP: pa.fully_sharded_data_parallel_axis, EP: pa.expert_parallel_axis,
             TP: pa.tensor_parallel_axis, SP: pa.sequence_parallel_axis}
    value = getattr(pa, field)
    entries = (value,) if isinstance(value, str) else tuple(value or ())
    return tuple(a for a in (roles.get(e, e) for e in entries) if sizes.get(a, 1) > 1)


def _carried(obj: tp.Any) -> dict[str, tp.Any]:
    """The recipe-relevant attributes an advisor Candidate or a Layout carries."""
    names = ("remat", "pipeline", "zero_stage", "grad_accumulation", "partition_axis")
    return {n: getattr(obj, n) for n in names if hasattr(obj, n)}


def _partition_overrides(pa: PartitionAxis) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The semantic fields of ``pa`` that differ from ``PartitionAxis()`` (roles looked up), as mesh axes. The
    layer axis is left out: a recipe's ``pp`` sets it."""
    default, out = PartitionAxis(), []
    for semantic in semantic_names():
        if semantic in (DP, FSDP, EP, TP, SP):
            continue  # the roles: a recipe's degrees set them
        train_field = default.field_for(semantic)
        if train_field == "layer_axis":
            continue
        have, want = pa.mesh_axes_for(semantic), default.mesh_axes_for(semantic)
        if have != want:
            out.append((train_field, have))
    return tuple(out)


def recipe_of(candidate: tp.Any, batch: tuple[int, int], **kwargs: tp.Any) -> TrainingRecipe:
    """The :class:`TrainingRecipe` of an advisor ``Candidate`` (or a Layout) for ``batch``: ready for
    ``to_maxtext`` / ``to_torchtitan``."""
    return TrainingRecipe.from_layout(candidate, batch=batch, **kwargs)


def read_text(text_or_path: str | pathlib.Path) -> str:
    """The text of a config: ``text_or_path`` itself, or the file it names (a Path, or a one-line string naming an
    existing file)."""
    if isinstance(text_or_path, pathlib.Path):
        return text_or_path.read_text()
    if not isinstance(text_or_path, str):
        raise TypeError(f"a config is its text or a path to it; got {type(text_or_path).__name__}")
    if "\n" not in text_or_path and len(text_or_path) < 4096:
        path = pathlib.Path(text_or_path).expanduser()
        if path.is_file():
            return path.read_text()
    return text_or_path


def config_int(key: str, value: tp.Any, *, allow_fill: bool = False) -> int:
    """A config file's ``key``: ``value`` as a positive int (a float like ``4.0`` too; -1 with ``allow_fill``), or a
    ValueError naming ``key``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not (is_positive_int(value) or (allow_fill and value == -1)):
        fill = " or -1 (fill the rest)" if allow_fill else ""
        raise ValueError(f"{key} must be a positive integer{fill}; got {value!r}")
    return value


def fill_degrees(degrees: dict[str, int], total: int | None, *, what: str, how: str) -> dict[str, int]:
    """``degrees`` with its one -1 set so they multiply to ``total`` (MaxText's ``fill_unspecified_mesh_axes``,
    torchtitan's ``ParallelDims``). ValueErrors say what to change: two -1s, a -1 without ``total``, a product
    ``total`` does not hold."""
    fill = [k for k, v in degrees.items() if v == -1]
    if len(fill) > 1:
        raise ValueError(f"{what}: {fill} are all -1; at most one axis may fill the rest. Set all but one")
    known = math.prod(v for v in degrees.values() if v != -1)
    if fill:
        if total is None:
            raise ValueError(f"{fill[0]} = -1 fills the rest of the devices, so reading it needs {how}; or set "
                             f"{fill[0]} to a number")
        if total % known:
            raise ValueError(f"{what}: the other axes multiply to {known}, which does not divide {total} ({how}); "
                             f"change them or {fill[0]}")
        degrees = {**degrees, fill[0]: total // known}
    elif total is not None and known != total:
        raise ValueError(f"{what}: {', '.join(f'{k}={v}' for k, v in degrees.items() if v != 1) or 'all ones'} "
                         f"multiply to {known} devices, not {total} ({how}); change a degree or set one to -1")
    return degrees


def global_batch_int(value: float, key: str, explain: str) -> int:
    """``value`` (a product of a fractional per-device batch) as a positive int, or a ValueError naming ``key``."""
    rounded = round(value)
    if rounded < 1 or abs(value - rounded) > 1e-6:
        raise ValueError(f"{key} gives {value:g} sequences per step ({explain}), not a whole positive number; "
                         f"change {key}")
    return int(rounded)
