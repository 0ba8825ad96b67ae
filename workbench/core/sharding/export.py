"""A layout exported: as JSON that reads back exactly, and as Python that rebuilds it.

:func:`to_json` writes what a :class:`~workbench.core.sharding.plan.Layout` is made of (the mesh's axis sizes,
the cluster it was planned for, the :class:`PartitionAxis` fields that differ from the default, the regex
rules, the runtime mode and the plan beyond the specs: the remat policy, the pipeline, the ZeRO stage and the
gradient-accumulation microbatches) and :func:`plan_from_json` reads it back as the
arguments of ``Layout.of`` (the mesh built). :func:`to_code` writes the same as a snippet to paste into a
script. ``Layout.to_json`` / ``Layout.from_json`` / ``Layout.to_code`` call these; this module reads a layout
through :class:`LayoutFields` (what it exports) and never imports ``Layout``, so the dependency points one way.

>>> from workbench.core.views.explore import Layout
>>> from workbench.core.mesh import make_mesh
>>> from workbench.core.models import CausalLM, ModelConfig, tiny_config
>>> model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
>>> layout = Layout.of(model, make_mesh(fsdp=4, tp=2), rules=[("embed_tokens", ("__TENSOR_PARALLEL__", "_"))])
>>> Layout.from_json(layout.to_json(), model).specs == layout.specs
True
>>> print(layout.to_code().splitlines()[5])
mesh = wb.make_mesh(fsdp=4, tp=2)
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing as tp

import jax
from jax.sharding import AbstractMesh, AxisType

from workbench.core import axes as ax
from workbench.core.axes import MODE_TRAIN, RUNTIME_MODES, DynamicShardingAxes, PartitionAxis
from workbench.core.checks import is_positive_int, positive_int
from workbench.core.hardware.cluster import INTER_NODE_PER_NODE, NVL72_GPUS, SCALE_OUT_PER_GB200, Cluster, cluster_mesh
from workbench.core.mesh import MESH_AXES, make_mesh
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.zero import check_zero_stage


class LayoutFields(tp.Protocol):
    """What an export reads of a :class:`~workbench.core.sharding.plan.Layout`."""

    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    partition_axis: PartitionAxis
    mode: str
    rules: tuple[tuple[str, tp.Any], ...]
    remat: str | None
    pipeline: PipelineConfig | None
    zero_stage: int
    grad_accumulation: int


FORMAT = "workbench.layout"
VERSION = 1
KEYS = ("format", "version", "mesh", "cluster", "partition_axis", "rules", "mode", "remat", "pipeline", "zero_stage",
        "grad_accumulation")
_PIPELINE_KEYS = ("num_stages", "num_microbatches", "schedule", "virtual_stages", "uneven")  # uneven: written if so
_DEFAULT_PA = PartitionAxis().to_dict()
_PRESETS = {name: value for name, value in vars(ax).items() if isinstance(value, DynamicShardingAxes)}
# the GPU clusters a spec names by their Cluster constructor (a GB200 NVL72 rack has its own form)
GPU_CHIPS = ("h100", "h200", "b200")
_MODE_NAMES = {mode: ax.label(mode) for mode in RUNTIME_MODES}


# -- JSON --------------------------------------------------------------------------------------------
def to_json(layout: LayoutFields, *, cluster: Cluster | None = None) -> str:
    """``layout`` as JSON (keys in the order of :data:`KEYS`; null where a part is absent)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "mesh": _mesh_doc(layout.mesh),
        "cluster": None if cluster is None else cluster_spec(cluster, layout.mesh),
        "partition_axis": {k: v for k, v in layout.partition_axis.to_dict().items() if v != _DEFAULT_PA[k]},
        "rules": [_rule_doc(pattern, axes) for pattern, axes in layout.rules],
        "mode": layout.mode,
        "remat": layout.remat,
        "pipeline": None if layout.pipeline is None else {k: getattr(layout.pipeline, k) for k in _PIPELINE_KEYS
                                                          if k != "uneven" or layout.pipeline.uneven},
        "zero_stage": layout.zero_stage,
        "grad_accumulation": layout.grad_accumulation,
    }
    return _dumps(doc)


def _dumps(doc: dict[str, tp.Any]) -> str:
    """One line per top-level key and per rule, each value compact: short to read, easy to diff."""
    compact = lambda v: json.dumps(v, separators=(", ", ": "))
    lines = []
    for key, value in doc.items():
        if key == "rules" and value:
            value = "[\n" + ",\n".join(f"    {compact(r)}" for r in value) + "\n  ]"
        else:
            value = compact(value)
        lines.append(f"  {json.dumps(key)}: {value}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def plan_from_json(text: str, *, mesh: tp.Any = None) -> dict[str, tp.Any]:
    """What the layout ``text`` describes, as the keyword arguments of ``Layout.of`` besides the model:
    ``mesh, partition_axis, rules, mode, remat, pipeline, zero_stage, grad_accumulation``.

    The mesh: ``mesh`` if given (its axis sizes must be the document's); else, for a named cluster,
    ``cluster_mesh(cluster, ...)``; else ``make_mesh`` on this process's first devices when there are
    enough of them, and an ``AbstractMesh`` of the same sizes (shapes only) when there are not.
    A ValueError says what to change for text that is not such a document.
    """
    doc = read(text)
    shape, types = doc["mesh"]
    cluster = None if doc["cluster"] is None else cluster_from_spec(doc["cluster"])
    if mesh is not None:
        have = dict(mesh.shape)
        if have != shape or tuple(have) != tuple(shape):
            raise ValueError(f"the mesh has axes {have} but the layout was exported on {shape}; pass a mesh with "
                             f"those axis sizes, or mesh=None to build it")
    elif cluster is not None:
        mesh = cluster_mesh(cluster, tuple(shape.values()), tuple(shape))
    else:
        mesh = _local_mesh(shape, types)
    return {"mesh": mesh, **{k: doc[k] for k in ("partition_axis", "rules", "mode", "remat", "pipeline",
                                                  "zero_stage", "grad_accumulation")}}


def read(text: str) -> dict[str, tp.Any]:
    """The parts of a layout document, checked and typed: ``mesh`` as ``({axis: size}, axis types or None)``,
    ``cluster`` as a spec dict or None, ``partition_axis`` a PartitionAxis, ``rules`` a tuple of
    ``(pattern, axes)``, ``pipeline`` a PipelineConfig or None."""
    if not isinstance(text, str | bytes):
        raise ValueError(f"give the JSON text Layout.to_json() wrote; got a {type(text).__name__}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err}); give the text Layout.to_json() wrote") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f'not a workbench layout: the JSON has no "format": "{FORMAT}"; give the text '
                         f"Layout.to_json() wrote")
    if doc.get("version") != VERSION:
        raise ValueError(f"unknown layout format version {doc.get('version')!r}; this workbench reads version "
                         f"{VERSION}: export the layout again with this version, or upgrade workbench")
    unknown = [k for k in doc if k not in KEYS]
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in the layout; its fields are {list(KEYS)}")
    missing = [k for k in ("mesh", "mode") if k not in doc]
    if missing:
        raise ValueError(f"the layout has no {missing}; give the text Layout.to_json() wrote")
    out: dict[str, tp.Any] = {"mesh": _read_mesh(doc["mesh"]), "cluster": doc.get("cluster")}
    if out["cluster"] is not None:
        cluster_from_spec(out["cluster"])  # checked here, built where needed
    try:
        out["partition_axis"] = PartitionAxis.from_dict(_as(dict, doc.get("partition_axis") or {}, "partition_axis"))
    except TypeError as err:
        raise ValueError(f"partition_axis: {err}") from None
    out["rules"] = tuple(_read_rule(r) for r in _as(list, doc.get("rules") or [], "rules"))
    mode = doc["mode"]
    if mode not in RUNTIME_MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {list(RUNTIME_MODES)}")
    out["mode"] = mode
    remat = doc.get("remat")
    if remat is not None and not isinstance(remat, str):
        raise ValueError(f"remat must be a policy name or null; got {remat!r}")
    out["remat"] = remat
    pipeline = doc.get("pipeline")
    if pipeline is not None:
        unknown = [k for k in _as(dict, pipeline, "pipeline") if k not in _PIPELINE_KEYS]
        if unknown:
            raise ValueError(f"unknown pipeline field(s) {unknown}; its fields are {list(_PIPELINE_KEYS)}")
        pipeline = PipelineConfig(**pipeline)
    out["pipeline"] = pipeline
    try:  # absent in documents written before ZeRO-1 was a choice: 0, what they meant
        out["zero_stage"] = check_zero_stage(doc.get("zero_stage", 0))
    except ValueError as err:
        raise ValueError(f"zero_stage: {err}") from None
    k = doc.get("grad_accumulation", 1)  # absent before accumulation travelled with a layout: 1, what they meant
    out["grad_accumulation"] = positive_int("grad_accumulation", k, what="a positive int (microbatches per step)")
    return out


def _as(kind: type, value: tp.Any, what: str) -> tp.Any:
    if not isinstance(value, kind):
        raise ValueError(f"{what} must be a JSON {'object' if kind is dict else 'list'}; got {value!r}")
    return value


def _mesh_doc(mesh: tp.Any) -> dict[str, tp.Any]:
    doc: dict[str, tp.Any] = {"shape": dict(zip(mesh.axis_names, map(int, mesh.axis_sizes), strict=True))}
    types = [t.name for t in mesh.axis_types]
    if any(t != AxisType.Auto.name for t in types):
        doc["axis_types"] = types
    return doc


def _read_mesh(doc: tp.Any) -> tuple[dict[str, int], tuple[AxisType, ...] | None]:
    doc = _as(dict, doc, "mesh")
    unknown = [k for k in doc if k not in ("shape", "axis_types")]
    shape = doc.get("shape")
    if unknown or not isinstance(shape, dict) or not shape or not all(
            isinstance(k, str) and is_positive_int(v) for k, v in shape.items()):
        raise ValueError(f'mesh must be {{"shape": {{axis: positive size, ...}}}} (and optionally "axis_types"); '
                         f"got {doc!r}")
    types = doc.get("axis_types")
    if types is None:
        return shape, None
    names = [t.name for t in AxisType]
    if not isinstance(types, list) or len(types) != len(shape) or any(t not in names for t in types):
        raise ValueError(f"mesh axis_types must list one of {names} per axis; got {types!r}")
    return shape, tuple(AxisType[t] for t in types)


def _local_mesh(shape: dict[str, int], types: tuple[AxisType, ...] | None) -> tp.Any:
    """The mesh on this process's first devices, or an AbstractMesh when there are too few."""
    n, devices = math.prod(shape.values()), jax.devices()
    types = types or (AxisType.Auto,) * len(shape)
    if len(devices) < n:
        return AbstractMesh(tuple(shape.values()), tuple(shape), axis_types=types)
    if tuple(shape) == MESH_AXES and len(set(types)) == 1:
        return make_mesh(**shape, devices=devices[:n], axis_types=types[0])
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=types, devices=devices[:n])


def _entry_doc(entry: tp.Any) -> tp.Any:
    return list(map(_entry_doc, entry)) if isinstance(entry, tuple | list) else entry


def _entry(value: tp.Any, what: str) -> tp.Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return tuple(_entry(v, what) for v in value)
    raise ValueError(f"{what}: an axis entry is a name, null or a list of those; got {value!r}")


def _rule_doc(pattern: str, axes: tp.Any) -> dict[str, tp.Any]:
    if isinstance(axes, DynamicShardingAxes):
        return {"pattern": pattern, "axes": _entry_doc(axes.axes), "mode": axes.mode}
    return {"pattern": pattern, "axes": _entry_doc(axes)}


def _read_rule(doc: tp.Any) -> tuple[str, tp.Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("pattern"), str) or "axes" not in doc or \
            any(k not in ("pattern", "axes", "mode") for k in doc):
        raise ValueError(f'a rule is {{"pattern": regex, "axes": [...]}} (and "mode" for a preset); got {doc!r}')
    axes = _entry(doc["axes"], f"rule {doc['pattern']!r}")
    if "mode" in doc:
        return doc["pattern"], DynamicShardingAxes(axes, doc["mode"])
    return doc["pattern"], axes


# -- clusters ----------------------------------------------------------------------------------------
def cluster_spec(cluster: Cluster, mesh: tp.Any = None) -> dict[str, tp.Any]:
    """``{"tpu": "v5p:4x4x4", "slices": 1}``, ``{"gpu": "h100", "nodes": 8, "gpus_per_node": 8}`` (``"h100"``,
    ``"h200"``, ``"b200"``), ``{"gpu": "gb200", "racks": 2, "gpus_per_rack": 72}`` (GB200 NVL72) or ``{"cpu": 16}``;
    with ``mesh``, checked to map onto the cluster."""
    if not isinstance(cluster, Cluster):
        raise TypeError("cluster must be a workbench.core.hardware.cluster.Cluster (Cluster.tpu(...), "
                        f"Cluster.h100(...)); "
                        f"got {cluster!r}")
    if mesh is not None:
        if mesh.size != cluster.num_devices:
            raise ValueError(f"the layout's mesh has {mesh.size} devices but {cluster.name} has "
                             f"{cluster.num_devices}; export it with the cluster it was planned for")
        cluster.check_mesh_shape(tuple(mesh.axis_sizes))
    if cluster.platform == "tpu":
        return {"tpu": cluster.topology, "slices": cluster.slices}
    if cluster.platform == "cpu":
        return {"cpu": cluster.num_devices}
    chip = next((name for name in GPU_CHIPS if getattr(Cluster, name)().chip == cluster.chip), None)
    if chip is None and cluster.chip == Cluster.gb200_nvl72().chip:
        spec = {"gpu": "gb200", "racks": cluster.nodes, "gpus_per_rack": cluster.gpus_per_node}
        default = cluster.gpus_per_node * SCALE_OUT_PER_GB200
    elif chip is None:
        raise ValueError(f"export knows the GPU clusters of Cluster.h100, h200, b200 and gb200_nvl72; "
                         f"{cluster.name} is none of them")
    else:
        spec, default = {"gpu": chip, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node}, \
            INTER_NODE_PER_NODE
    if cluster.nodes > 1 and cluster.level("inter-node").bandwidth != default:
        spec["inter_node_bandwidth"] = cluster.level("inter-node").bandwidth
    return spec


def cluster_from_spec(spec: tp.Any) -> Cluster:
    """The Cluster a :func:`cluster_spec` dict names; a ValueError saying what a spec looks like otherwise."""
    forms = {"tpu": ("tpu", "slices"), "gpu": ("gpu", "nodes", "gpus_per_node", "inter_node_bandwidth"),
             "cpu": ("cpu",)}
    if isinstance(spec, dict) and spec.get("gpu") == "gb200":
        forms["gpu"] = ("gpu", "racks", "gpus_per_rack", "inter_node_bandwidth")
    kind = next((k for k in forms if isinstance(spec, dict) and k in spec), None)
    if kind is None or any(k not in forms[kind] for k in spec):
        raise ValueError(f'unknown cluster {spec!r}; a cluster is {{"tpu": "v5p:4x4x4", "slices": 1}}, '
                         f'{{"gpu": "h100", "nodes": 8, "gpus_per_node": 8}}, '
                         f'{{"gpu": "gb200", "racks": 2, "gpus_per_rack": 72}} or {{"cpu": 16}}')
    if kind == "tpu":
        return Cluster.tpu(spec["tpu"], slices=spec.get("slices", 1))
    if kind == "cpu":
        return Cluster.cpu(spec["cpu"])
    if spec["gpu"] == "gb200":
        rack = Cluster.gb200_nvl72(spec.get("racks", 1), gpus_per_rack=spec.get("gpus_per_rack", NVL72_GPUS))
        if "inter_node_bandwidth" not in spec:
            return rack
        return dataclasses.replace(Cluster.gpu(rack.chip, nodes=rack.nodes, gpus_per_node=rack.gpus_per_node,
                                               inter_node_bandwidth=spec["inter_node_bandwidth"]), name=rack.name)
    if spec["gpu"] not in GPU_CHIPS:
        raise ValueError(f"unknown GPU {spec['gpu']!r} in the cluster; use one of {[*GPU_CHIPS, 'gb200']}")
    chip = getattr(Cluster, spec["gpu"])().chip
    options = {k: spec[k] for k in ("nodes", "gpus_per_node", "inter_node_bandwidth") if k in spec}
    return Cluster.gpu(chip, **options)


def _cluster_code(spec: dict[str, tp.Any]) -> str:
    if "tpu" in spec:
        slices = f", slices={spec['slices']}" if spec.get("slices", 1) != 1 else ""
        return f"Cluster.tpu({spec['tpu']!r}{slices})"
    if "cpu" in spec:
        return f"Cluster.cpu({spec['cpu']})"
    if spec["gpu"] == "gb200":
        per_rack = f", gpus_per_rack={spec['gpus_per_rack']}" if spec["gpus_per_rack"] != NVL72_GPUS else ""
        if "inter_node_bandwidth" in spec:
            return (f"Cluster.gpu(Cluster.gb200_nvl72().chip, nodes={spec['racks']}, "
                    f"gpus_per_node={spec['gpus_per_rack']}, inter_node_bandwidth={spec['inter_node_bandwidth']!r})")
        return f"Cluster.gb200_nvl72(racks={spec['racks']}{per_rack})"
    per_node = f", gpus_per_node={spec['gpus_per_node']}" if spec["gpus_per_node"] != 8 else ""
    if "inter_node_bandwidth" in spec:
        return (f"Cluster.gpu(Cluster.{spec['gpu']}().chip, nodes={spec['nodes']}{per_node}, "
                f"inter_node_bandwidth={spec['inter_node_bandwidth']!r})")
    return f"Cluster.{spec['gpu']}(nodes={spec['nodes']}{per_node})"


# -- code --------------------------------------------------------------------------------------------
class _Names:
    """The names a snippet imports from workbench.core.axes, in first-use order."""

    def __init__(self):
        self.axes: dict[str, None] = {}

    def entry(self, value: tp.Any) -> str:
        """Python source for an axis entry: ``None``, ``EMPTY``, ``TP``, ``'dp'``, ``(FSDP, 'dp')``."""
        if value is None:
            return "None"
        if isinstance(value, tuple | list):
            items = [self.entry(v) for v in value]
            if isinstance(value, list):
                return "[" + ", ".join(items) + "]"
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if value == ax.EMPTY or value in ax.semantic_names():
            return self.use(ax.label(value))
        return repr(value)

    def mode(self, mode: tp.Any) -> str:
        return self.use(_MODE_NAMES[mode]) if mode in _MODE_NAMES else repr(mode)

    def rule_axes(self, axes: tp.Any) -> str:
        if isinstance(axes, DynamicShardingAxes):
            preset = next((name for name, value in _PRESETS.items() if value == axes), None)
            if preset is not None:
                return self.use(preset)
            return f"{self.use('DynamicShardingAxes')}({self.entry(tuple(axes.axes))}, {self.mode(axes.mode)})"
        return self.entry(axes)

    def use(self, name: str) -> str:
        self.axes[name] = None
        return name


def to_code(layout: LayoutFields, *, cluster: Cluster | None = None, model_expr: str = "model") -> str:
    """A Python snippet that rebuilds ``layout`` when pasted into a script (with the model ``model_expr`` names
    defined): the mesh (``wb.make_mesh``, or ``cluster_mesh`` on ``cluster``), the
    PartitionAxis fields that differ from the default, the rules, the remat policy, pipeline, ZeRO stage and
    gradient accumulation, and ``Layout.of(...)``; a comment shows how to place a live model by it."""
    names = _Names()
    imports = ["from workbench.core.views.explore import Layout"]
    body: list[str] = []
    sizes = dict(zip(layout.mesh.axis_names, map(int, layout.mesh.axis_sizes), strict=True))
    types = [t.name for t in layout.mesh.axis_types]
    if cluster is not None:
        spec = cluster_spec(cluster, layout.mesh)
        imports += ["from workbench.core.hardware.cluster import Cluster",
                    "from workbench.core.hardware.cluster import cluster_mesh"]
        body += [f"cluster = {_cluster_code(spec)}",
                 f"mesh = cluster_mesh(cluster, {tuple(sizes.values())!r}, {tuple(sizes)!r})"]
    elif tuple(sizes) == MESH_AXES and len(set(types)) == 1:
        args = [f"{a}={n}" for a, n in sizes.items() if n != 1 or a == "fsdp"]  # fsdp defaults to -1
        if types[0] != AxisType.Auto.name:
            imports.append("from jax.sharding import AxisType")
            args.append(f"axis_types=AxisType.{types[0]}")
        imports.insert(0, "import workbench as wb")
        body.append(f"mesh = wb.make_mesh({', '.join(args)})")
    else:
        imports += ["import jax", "from jax.sharding import AxisType"]
        axis_types = "(" + ", ".join(f"AxisType.{t}" for t in types) + ("," if len(types) == 1 else "") + ")"
        body.append(f"mesh = jax.make_mesh({tuple(sizes.values())!r}, {tuple(sizes)!r}, axis_types={axis_types})")
    call = ["model", "mesh"]
    pa = layout.partition_axis
    changed = {f.name: getattr(pa, f.name) for f in dataclasses.fields(pa)
               if pa.to_dict()[f.name] != _DEFAULT_PA[f.name]}
    if changed:
        names.use("PartitionAxis")
        fields = [f"{k}={names.entry(v)}" for k, v in changed.items()]
        body.append(_call("partition_axis = PartitionAxis", fields))
        call.append("partition_axis=partition_axis")
    if layout.rules:
        body.append("rules = (")
        body += [f"    ({pattern!r}, {names.rule_axes(axes)})," for pattern, axes in layout.rules]
        body.append(")")
        call.append("rules=rules")
    if layout.mode != MODE_TRAIN:
        call.append(f"mode={names.mode(layout.mode)}")
    if layout.remat is not None:
        body.append(f"model = model.with_options(remat={layout.remat!r})  # the remat policy the plan is sized for")
        call.append(f"remat={layout.remat!r}")
    if layout.zero_stage:
        call.append(f"zero_stage={layout.zero_stage}")
    if layout.pipeline is not None:
        p = layout.pipeline
        imports.append("from workbench.core.pipeline_schedule import PipelineConfig")
        virtual = f", virtual_stages={p.virtual_stages}" if p.schedule == "interleaved" else ""
        uneven = ", uneven=True" if p.uneven else ""
        body.append(f"pipeline = PipelineConfig(num_stages={p.num_stages}, num_microbatches={p.num_microbatches}, "
                    f"schedule={p.schedule!r}{virtual}{uneven})")
        call.append("pipeline=pipeline")
    if layout.grad_accumulation != 1:
        call.append(f"grad_accumulation={layout.grad_accumulation}")
    if names.axes:
        imports.insert(0, _call("from workbench.core.axes import ", sorted(names.axes), brackets=False))
    head = [f"model = {model_expr}"] if model_expr != "model" else []
    tail = [_call("layout = Layout.of", call),
            "# place a live model's arrays as the layout says (a NamedSharding per parameter):",
            "# from workbench.core.views.explore import apply; model, seconds = apply(model, layout)"]
    if layout.zero_stage:
        tail += ["# and train it with the optimizer state split over dp (ZeRO-1):",
                 "# from workbench.core.models.training import to_state; state = to_state(model, optimizer, "
                 f"zero_stage={layout.zero_stage})"]
    return "\n".join([f"# workbench layout ({describe(layout)}), from Layout.to_code", *imports, "", *head, *body,
                      *tail]) + "\n"


def _call(prefix: str, args: list[str], width: int = 110, brackets: bool = True) -> str:
    """``prefix(a, b)`` on one line when it fits, else one argument per line (an import: without brackets
    when it fits)."""
    one = f"{prefix}({', '.join(args)})" if brackets else prefix + ", ".join(args)
    if len(one) <= width:
        return one
    return f"{prefix}(\n" + "".join(f"    {a},\n" for a in args) + ")"


def describe(layout: LayoutFields) -> str:
    """One line: the mesh's axes of size > 1, the mode, remat, pipeline, ZeRO stage and accumulation."""
    axes = " × ".join(f"{a}={n}" for a, n in zip(layout.mesh.axis_names, layout.mesh.axis_sizes, strict=True)
                      if n > 1) or "1 device"
    parts = [axes, ax.label(layout.mode)]
    if layout.remat is not None:
        parts.append(f"remat {layout.remat}")
    if layout.pipeline is not None:
        parts.append(f"{layout.pipeline.schedule} pipeline, {layout.pipeline.num_microbatches} microbatches")
    if layout.zero_stage:
        parts.append(f"ZeRO-{layout.zero_stage} (optimizer state over dp)")
    if layout.grad_accumulation != 1:
        parts.append(f"{layout.grad_accumulation} accumulated microbatches")
    return ", ".join(parts)


__all__ = ["FORMAT", "KEYS", "VERSION", "cluster_from_spec", "cluster_spec", "describe", "plan_from_json", "read",
           "to_code", "to_json"]
