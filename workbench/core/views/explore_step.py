"""The step a sharding explorer describes, and its mesh on a cluster: the rules behind the explorer's controls.

The explorer's controls name a task, a batch ``(B, T)`` and an optimizer, and the plan a
:class:`~workbench.core.sharding.plan.Layout` carries beyond its specs (remat policy, pipeline, ZeRO stage, gradient
accumulation); these functions turn them into what the core prices and counts, so that the widget only reads its
controls and draws: the step's batch (:func:`step_batch`), its pipeline (:func:`step_pipeline`), its
:class:`~workbench.core.plan.Plan` (:func:`step_plan`, the record an advisor's row holds), its memory ledger
(:func:`step_ledger`), its predicted time (:func:`predicted_step`) and a compiled step's time
(:func:`compiled_step_time`). The ledger and the predicted step count a step as the advisor does, through the same
core functions (the ledger's ``grad_accumulation``: one microbatch's activations beside the gradients' sum;
:func:`~workbench.core.cost.price.price`), so a row opened in the explorer shows the row's memory and step time.

:func:`explorer_mesh` is the explorer's mesh (on a cluster, from axis sizes),
:func:`pipelined` the partition axis on a ``pp`` mesh, :func:`resolve_on` a given layout (or its JSON) re-resolved
on the explorer's model, and :func:`chart_bytes` a bar chart's numbers in the unit its title writes.

>>> step_batch("decode", (8, 512)), step_batch("train", (8, 512))
(((8, 1), 512), ((8, 512), None))
>>> chart_bytes(3 * 2**20, [2**20, 2**21])
('MiB', [1.0, 2.0])
"""

from __future__ import annotations

import typing as tp

from workbench.core.axes import BATCH, LENGTH, PartitionAxis
from workbench.core.compile.steps import full_mesh_shape
from workbench.core.cost import ledger as ledgers
from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.flops import model_flops
from workbench.core.cost.price import price
from workbench.core.cost.step import StepTime
from workbench.core.hardware.cluster import cluster_mesh
from workbench.core.mesh import MESH_AXES
from workbench.core.pipeline import PipelineConfig, default_config, pipeline_partition_axis, stage_padded
from workbench.core.plan import Plan, microbatch
from workbench.core.sharding import export as layout_export
from workbench.core.sharding.plan import Layout
from workbench.core.units import format_bytes

__all__ = ["batch_split", "chart_bytes", "chosen_pipeline", "compiled_step_time", "experts_over_fsdp",
           "explorer_mesh", "names_auto_axes", "pipelined", "predicted_step", "resolve_on", "step_batch",
           "step_ledger", "step_model", "step_pipeline", "step_plan"]


# -- the step -------------------------------------------------------------------------------------------
def step_batch(task: str, batch: tuple[int, int]) -> tuple[tuple[int, int], int | None]:
    """``(batch, kv_length)`` of a ``task`` step of ``batch = (B, T)``, as the ledger and the predicted step take
    them: a decode step is ``(B, 1)``, one new token per sequence, against a KV cache of ``T`` positions; a train
    step or a prefill is ``(B, T)``. (The advisor writes the same rule for its ``batch_tokens``.)"""
    b, t = batch
    return ((b, 1), t) if task == "decode" else ((b, t), None)


def chosen_pipeline(layout: Layout, schedule: str, microbatches: int, virtual_stages: int = 2
                    ) -> PipelineConfig | None:
    """The pipeline over the ``pp`` axis of ``layout``'s mesh that runs ``schedule`` with ``microbatches`` (and
    ``virtual_stages`` per device where interleaved), its stages uneven where they do not divide the model's stacked
    layers, as the advisor offers them; None on a mesh without ``pp``. A ValueError (from
    :class:`~workbench.core.pipeline.PipelineConfig`) says what to change for a choice that does not make one."""
    pp = dict(layout.mesh.shape).get("pp", 1)
    if pp == 1:
        return None
    v = virtual_stages if schedule == "interleaved" else 1
    c = layout.config
    layers = c.num_hidden_layers - c.first_dense_layers
    return PipelineConfig(pp, microbatches, schedule, v, uneven=layers % (pp * v) != 0)


def step_pipeline(layout: Layout, batch_size: int) -> PipelineConfig | None:
    """The layout's pipeline; on a mesh with ``pp > 1`` and none given, 1F1B over a batch of ``batch_size``
    sequences (:func:`workbench.core.pipeline.default_config`)."""
    if layout.pipeline is not None or dict(layout.mesh.shape).get("pp", 1) == 1:
        return layout.pipeline
    return default_config(layout.mesh, batch_size)


def step_plan(layout: Layout, *, task: str, batch: tuple[int, int]) -> Plan:
    """The :class:`~workbench.core.plan.Plan` of one ``task`` step of ``batch = (B, T)`` on ``layout``: its mesh's
    axis sizes; for a train step the layout's remat policy (None counts as "none"), pipeline
    (:func:`step_pipeline`), ZeRO stage and gradient accumulation (a prefill or decode step has no backward: no
    remat, pipeline, ZeRO or accumulation); the mesh axes the layout splits the batch over (its partition axis'
    batch field) and whether its expert weights are split over fsdp (:func:`experts_over_fsdp`)."""
    train = task == "train"
    return Plan(dict(layout.mesh.shape), remat=(layout.remat or "none") if train else "none",
                pipeline=step_pipeline(layout, batch[0]) if train else None,
                zero_stage=layout.zero_stage if train else 0,
                grad_accumulation=layout.grad_accumulation if train else 1,
                batch_axes=layout.partition_axis.mesh_axes_for(BATCH, layout.mode),
                experts_fsdp=experts_over_fsdp(layout))


def experts_over_fsdp(layout: Layout) -> bool:
    """Whether ``layout`` splits its expert weights (those split over the ``ep`` axis) over ``fsdp`` or ``sp`` too,
    so a step gathers them as it gathers every weight: False only on a mesh with ``ep > 1`` and ``fsdp x sp > 1``
    where no expert weight names either (the advisor's experts kept whole over fsdp)."""
    pa, sizes = layout.partition_axis, dict(layout.mesh.shape)
    ep, data = pa.expert_parallel_axis, (pa.fully_sharded_data_parallel_axis, pa.sequence_parallel_axis)
    if sizes.get(ep, 1) == 1 or all(sizes.get(a, 1) == 1 for a in data):
        return True
    named = [{a for entry in p.spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}
             for p in layout.params]
    experts = [axes for axes in named if ep in axes]
    return not experts or any(axes & set(data) for axes in experts)


def step_ledger(model: tp.Any, layout: Layout, cluster: tp.Any, *, task: str, batch: tuple[int, int],
                optimizer: str, program: tp.Mapping[str, tp.Any] | None = None) -> ledgers.Ledger:
    """The memory ledger of one ``task`` step (:func:`workbench.core.cost.ledger.ledger`) of ``batch = (B, T)``
    against the cluster's HBM, run as :func:`step_plan` says: a train step with its remat policy, ZeRO stage and
    gradient accumulation (one microbatch's activations, the gradients' sum beside them), on a ``pp > 1`` mesh
    its pipeline, whose uneven stages are held as the deepest one on every device
    (:func:`~workbench.core.pipeline.stage_padded`), as the advisor holds them. ``program`` (``Plan.program()``:
    the attention kernel, vocabulary tiles, offload, sequence parallelism; default the workbench's own) is the
    program counted."""
    plan = step_plan(layout, task=task, batch=batch)
    rows, kv_length = step_batch(task, batch)
    padded = stage_padded(model, plan.pipeline)
    if padded is not model:
        layout = layout.replace(padded)
    return ledgers.ledger(padded, layout, kind=task, batch=rows, kv_length=kv_length, optimizer=optimizer,
                          remat=plan.remat, cluster=cluster, pipeline=plan.pipeline, zero_stage=plan.zero_stage,
                          grad_accumulation=plan.grad_accumulation,
                          **{**dict(program or {}), **({"offload": False} if task != "train" else {})})


def predicted_step(layout: Layout, cluster: tp.Any, *, task: str, batch: tuple[int, int]) -> StepTime:
    """One ``task`` step of ``batch = (B, T)`` on ``layout`` run as :func:`step_plan` says, timed from the model's
    shapes on ``cluster`` (:func:`workbench.core.cost.price.price`: the advisor's step model), before any compile."""
    rows, kv_length = step_batch(task, batch)
    return price(step_plan(layout, task=task, batch=batch), layout.config, cluster, rows, task, kv_length=kv_length)


def step_model(model: tp.Any, attention: str = "", remat: str | None = None) -> tp.Any:
    """The model a compiled step runs: ``model`` with ``attention`` (an implementation's name; ``""`` its own) and
    with the ``remat`` policy when given (a cluster's step: the one the ledger counts), each only where it differs."""
    if attention and attention != getattr(model, "attn_mechanism", attention):
        model = model.with_attention(attention)
    if remat is not None and remat != getattr(model, "remat", remat):
        model = model.with_options(remat=remat)
    return model


def compiled_step_time(analysis: tp.Any, layout: Layout, cluster: tp.Any, *, kind: str,
                       batch: tuple[int, int]) -> StepTime:
    """A step compiled for ``cluster`` (its ``CompiledAnalysis``) timed on the cluster's network; a train step with
    its MFU (the model FLOPs of ``batch`` per device). A forward's model FLOPs depend on which logits it needs, so
    its MFU is not shown."""
    share = model_flops(layout.config, batch) / cluster.num_devices if kind == "train" else None
    return step_time(analysis, model_flops=share)


def batch_split(layout: Layout, task: str, batch: tuple[int, int]) -> str:
    """How a step's token batch splits over the layout's mesh, with the resolver's reasons (why a split was
    dropped): a decode step's ``(B, 1)``, else ``(B, T)``; with gradient accumulation (a train step), the
    microbatch the ledger holds."""
    b, t = step_batch(task, batch)[0]
    k = layout.grad_accumulation if task == "train" else 1
    micro = microbatch((b, t), k)
    rows, positions = layout.partition_axis.explain((BATCH, LENGTH), layout.mode, shape=micro, mesh=layout.mesh)
    runs = f" in {k} microbatches of {micro[0]} run one after another" if k > 1 else ""
    return f"batch {b} × {t} tokens{runs}: rows {rows.reason}; positions {positions.reason}"


# -- the mesh and the layout ------------------------------------------------------------------------------
def explorer_mesh(mesh: tp.Any, cluster: tp.Any) -> tp.Any:
    """The explorer's mesh: ``mesh`` as given, or with a ``cluster`` the mesh of axis sizes (a mapping such as
    ``{"fsdp": 16, "tp": 4}``; default every device on ``fsdp``) placed on the cluster's devices."""
    if cluster is None:
        if mesh is None or isinstance(mesh, tp.Mapping):
            raise ValueError("give a mesh (make_mesh(...)), or cluster=Cluster... with the axis sizes "
                             "({'fsdp': 16, 'tp': 4})")
        return mesh
    if mesh is None:
        valid = cluster.valid_mesh_shapes(len(MESH_AXES))
        full = tuple(cluster.num_devices if a == "fsdp" else 1 for a in MESH_AXES)
        mesh = dict(zip(MESH_AXES, full if full in valid else valid[0], strict=True))
    if isinstance(mesh, tp.Mapping):
        return cluster_mesh(cluster, full_mesh_shape(mesh, cluster), MESH_AXES)
    if mesh.size != cluster.num_devices or tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"the mesh has {mesh.size} devices on axes {tuple(mesh.axis_names)}; {cluster.name} has "
                         f"{cluster.num_devices}: pass the axis sizes ({{'fsdp': ..., 'tp': ...}}) or "
                         f"cluster_mesh(cluster, ...)")
    return mesh


def pipelined(partition_axis: PartitionAxis | None, mesh: tp.Any) -> PartitionAxis | None:
    """On a mesh with ``pp > 1`` the stacked layers are the pipeline's stages: the layers over ``pp``
    (:func:`workbench.core.pipeline.pipeline_partition_axis`) unless the partition axis already puts them on an
    axis; else ``partition_axis`` as given."""
    if dict(mesh.shape).get("pp", 1) > 1 and (partition_axis or PartitionAxis()).layer_axis is None:
        return pipeline_partition_axis(partition_axis)
    return partition_axis


def resolve_on(layout: Layout | str, model: tp.Any, current: Layout, cluster: tp.Any = None) -> Layout:
    """``layout`` (a Layout, or its JSON) resolved on ``model``, whose layout is ``current``, on ``cluster``'s
    devices when given; a ValueError when it was planned for another cluster or resolved for another model."""
    if isinstance(layout, str):
        doc = layout_export.read(layout)
        shape, _ = doc["mesh"]
        # a cluster export cannot name (a custom GPU one) says so: no layout was planned for it
        if doc["cluster"] is not None and (cluster is None or doc["cluster"] != layout_export.cluster_spec(cluster)):
            where = f"an explorer on {cluster.name}" if cluster is not None else "an explorer without a cluster"
            raise ValueError(f"this layout was planned for the cluster {doc['cluster']}, not for {where}; "
                             f"open it in ShardingExplorer(model, cluster=...) with that cluster")
        mesh = (explorer_mesh(shape, cluster) if cluster is not None else
                current.mesh if dict(current.mesh.shape) == shape else None)
        return Layout.from_json(layout, model, mesh=mesh)
    if not isinstance(layout, Layout):
        raise TypeError(f"load takes a Layout or its JSON (Layout.to_json()); got {type(layout).__name__}")
    if [(p.path, p.shape) for p in layout.params] != [(p.path, p.shape) for p in current.params]:
        raise ValueError("this layout was resolved for another model (its parameter paths or shapes differ); "
                         "resolve it on this explorer's model: Layout.of(explorer.model, ...)")
    mesh = layout.mesh if cluster is None else explorer_mesh(layout.mesh, cluster)
    return Layout.of(model, mesh, layout.partition_axis, layout.rules, layout.mode, remat=layout.remat,
                     pipeline=layout.pipeline, zero_stage=layout.zero_stage, grad_accumulation=layout.grad_accumulation)


def names_auto_axes(layout: Layout) -> bool:
    """Whether a parameter's PartitionSpec names a mesh axis that is not Explicit (``jax.typeof`` leaves those
    out of an array's type)."""
    explicit = set(layout.mesh.explicit_axes)
    return any(a not in explicit for p in layout.params for entry in p.spec if entry is not None
               for a in ((entry,) if isinstance(entry, str) else entry))


# -- charts -----------------------------------------------------------------------------------------------
def chart_bytes(total: int, values: tp.Iterable[int]) -> tuple[str, list[float]]:
    """The unit :func:`~workbench.core.units.format_bytes` writes ``total`` in, and each of ``values`` in that
    unit (three decimals): a chart's axis in the unit its title shows."""
    unit = format_bytes(total).rsplit(" ", 1)[1]
    return unit, [float(format_bytes(v, unit, decimals=3).split()[0]) for v in values]
