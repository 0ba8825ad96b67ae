"""Semantic sharding axes, runtime modes, and their resolution into PartitionSpecs.

A parameter or activation names what each of its dimensions *means* (``BATCH``,
``HEAD``, ``EMBED`` ...) or which parallelism *role* shards it (``TP``, ``FSDP`` ...).
A :class:`PartitionAxis` maps those names to mesh axes, with separate entries for
decoding. :meth:`PartitionAxis.resolve` turns a list of names into a
``PartitionSpec`` that is valid for a given shape and mesh, and
:meth:`PartitionAxis.explain` says, dimension by dimension, why.

>>> pa = PartitionAxis()
>>> pa.resolve([BATCH, QUERY_LENGTH, EMBED])
P(('fsdp', 'dp'), 'sp', 'tp')
>>> pa.resolve(HiddenStateSharding, shape=(4, 1, 64))   # mode 1: dim 1 has size 1 -> decode
P(('fsdp', 'dp'), None, 'tp')
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import typing as tp

from jax.sharding import PartitionSpec

# Semantic dimension names. The string values are EasyDeL/eformer's, so specs written
# for that library read the same here; the dunder form also keeps them apart from
# mesh axis names ("tp", "dp" ...), which are plain strings.
EMPTY = "_"
BATCH = "__BATCH__"
LENGTH = "__LENGTH__"
QUERY_LENGTH = "__QUERY_LENGTH__"
KV_LENGTH = "__KV_LENGTH__"
EMBED = "__EMBED__"
HEAD = "__HEAD__"
KV_HEAD = "__KV_HEAD__"
HEAD_DIM = "__HEAD_DIM__"
KV_HEAD_DIM = "__KV_HEAD_DIM__"
MLP_INTERMEDIATE = "__MLP_INTERMEDIATE__"
VOCAB = "__VOCAB__"
EXPERT = "__EXPERT__"
EXPERT_GATE = "__EXPERT_GATE__"
BIAS_HEAD_SEQ = "__BIAS_HEAD_SEQ__"
BIAS_KV_SEQ = "__BIAS_KV_SEQ__"
# The leading axis of a model's stacked decoder blocks (scanned layers); pipeline stages split it.
LAYERS = "__LAYERS__"

# Parallelism roles: a spec may name the role directly (``ColumnWise = [[FSDP, SP], TP]``).
DATA_PARALLEL = "__DATA_PARALLEL__"
FULLY_SHARDED_DATA_PARALLEL = "__FULLY_SHARDED_DATA_PARALLEL__"
EXPERT_PARALLEL = "__EXPERT_PARALLEL__"
TENSOR_PARALLEL = "__TENSOR_PARALLEL__"
SEQUENCE_PARALLEL = "__SEQUENCE_PARALLEL__"
DP = DATA_PARALLEL
FSDP = FULLY_SHARDED_DATA_PARALLEL
EP = EXPERT_PARALLEL
TP = TENSOR_PARALLEL
SP = SEQUENCE_PARALLEL

# Runtime modes.
MODE_TRAIN = "__train__"
MODE_PREFILL = "__prefill__"
MODE_DECODE = "__autoregressive__"
MODE_INSERT = "__insert__"
RUNTIME_MODES = (MODE_TRAIN, MODE_PREFILL, MODE_DECODE, MODE_INSERT)
GENERATION_MODES = frozenset({MODE_DECODE, MODE_INSERT})

# -0.7 * float32 max: far below any real logit, yet adding two of them stays finite.
DEFAULT_MASK_VALUE = -0.7 * 3.4028234663852886e38

AxisEntry = str | None | tuple[str, ...]
MeshAxes = tuple[str, ...]

_ROLE_FIELDS = {
    DATA_PARALLEL: "data_parallel_axis",
    FULLY_SHARDED_DATA_PARALLEL: "fully_sharded_data_parallel_axis",
    EXPERT_PARALLEL: "expert_parallel_axis",
    TENSOR_PARALLEL: "tensor_parallel_axis",
    SEQUENCE_PARALLEL: "sequence_parallel_axis",
}
# semantic name -> (field used in train/prefill, field used in decode/insert)
_SEMANTIC_FIELDS = {
    BATCH: ("batch_axis", "decode_batch_axis"),
    LENGTH: ("sequence_axis", "sequence_axis"),
    QUERY_LENGTH: ("query_sequence_axis", "decode_query_sequence_axis"),
    KV_LENGTH: ("key_sequence_axis", "decode_key_sequence_axis"),
    EMBED: ("hidden_state_axis", "hidden_state_axis"),
    HEAD: ("head_axis", "decode_head_axis"),
    KV_HEAD: ("kv_head_axis", "decode_kv_head_axis"),
    HEAD_DIM: ("attention_dim_axis", "decode_attention_dim_axis"),
    KV_HEAD_DIM: ("attention_kv_dim_axis", "decode_attention_kv_dim_axis"),
    MLP_INTERMEDIATE: ("mlp_intermediate_axis", "mlp_intermediate_axis"),
    VOCAB: ("vocab_axis", "vocab_axis"),
    EXPERT: ("expert_axis", "expert_axis"),
    EXPERT_GATE: ("expert_gate_axis", "expert_gate_axis"),
    BIAS_HEAD_SEQ: ("bias_head_sequence_axis", "bias_head_sequence_axis"),
    BIAS_KV_SEQ: ("bias_key_sequence_axis", "bias_key_sequence_axis"),
    LAYERS: ("layer_axis", "layer_axis"),
}
# Python names users type, for messages and tables.
_LABELS = {
    value: name
    for name, value in list(globals().items())
    if isinstance(value, str) and value.startswith("__") and name.isupper() and len(name) > 2
    and value not in RUNTIME_MODES
}
_LABELS.update({DP: "DP", FSDP: "FSDP", EP: "EP", TP: "TP", SP: "SP"})


@functools.lru_cache(maxsize=65536)  # a layout search resolves the same dimensions on the same mesh many times
def _explained(pa: PartitionAxis, entries: tuple, runtime_mode: str, mesh_items: tuple | None,
               shape: tuple[int, ...] | None, strict: bool) -> tuple[DimDecision, ...]:
    return pa._explain(entries, runtime_mode, mesh_items, shape, strict)


def label(name: AxisEntry) -> str:
    """The Python name of a semantic axis, role or mode (``"__BATCH__"`` -> ``"BATCH"``)."""
    if name is None or name == EMPTY:
        return "EMPTY"
    if isinstance(name, tuple | list):
        return "[" + ", ".join(label(n) for n in name) + "]"
    return _LABELS.get(name, {MODE_TRAIN: "MODE_TRAIN", MODE_PREFILL: "MODE_PREFILL",
                              MODE_DECODE: "MODE_DECODE", MODE_INSERT: "MODE_INSERT"}.get(name, repr(name)))


def semantic_names() -> tuple[str, ...]:
    """Every name a sharding spec may use: semantic axes, then parallelism roles."""
    return (*_SEMANTIC_FIELDS, *_ROLE_FIELDS)


class DynamicShardingAxes(tp.NamedTuple):
    """Semantic axes plus the runtime mode they are resolved in.

    ``mode`` is a runtime mode, or an int: the index of a dimension whose size 1 means
    decoding (a hidden state ``(batch, 1, embed)`` is a decode step).
    """

    axes: tuple[AxisEntry | list[str], ...]
    mode: str | int


# Presets, with the axes EasyDeL/eformer give them. Tuples, not lists: a preset is shared
# by every parameter that uses it, so it must not be mutable.
HiddenStateSharding = DynamicShardingAxes((BATCH, QUERY_LENGTH, EMBED), 1)
AttnQSharding = DynamicShardingAxes((BATCH, QUERY_LENGTH, HEAD, HEAD_DIM), 1)
AttnKVSharding = DynamicShardingAxes((BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM), 1)
ColumnWise = DynamicShardingAxes(((FSDP, SP), TP), MODE_TRAIN)
RowWise = DynamicShardingAxes((TP, (FSDP, SP)), MODE_TRAIN)
SColumnWise = DynamicShardingAxes(((FSDP, SP),), MODE_TRAIN)
SRowWise = DynamicShardingAxes((TP,), MODE_TRAIN)
Replicated = DynamicShardingAxes((EMPTY,), MODE_TRAIN)
ExpertColumnWise = DynamicShardingAxes((EP, FSDP, TP), MODE_TRAIN)
ExpertRowWise = DynamicShardingAxes((EP, TP, FSDP), MODE_TRAIN)
ExpertColumnWiseAlt = DynamicShardingAxes((EP, (FSDP, SP), TP), MODE_TRAIN)
ExpertRowWiseAlt = DynamicShardingAxes((EP, TP, (FSDP, SP)), MODE_TRAIN)
UnifiedExpertColumnWise = DynamicShardingAxes(((FSDP, SP, EP), EMPTY, TP), MODE_TRAIN)
UnifiedExpertRowWise = DynamicShardingAxes(((FSDP, SP, EP), TP, EMPTY), MODE_TRAIN)
ExpertActivations = DynamicShardingAxes((DP, SP, EP, TP), MODE_TRAIN)
ExpertActivationsAlt = DynamicShardingAxes((DP, SP, (TP, FSDP)), MODE_TRAIN)


@dataclasses.dataclass(frozen=True)
class DimDecision:
    """How one dimension was resolved: what was asked, what was kept, and why."""

    dim: int
    semantic: str
    size: int | None
    field: str | None
    candidates: MeshAxes
    chosen: MeshAxes
    reason: str

    @property
    def spec_entry(self) -> str | tuple[str, ...] | None:
        if not self.chosen:
            return None
        return self.chosen[0] if len(self.chosen) == 1 else self.chosen


def _is_role_or_semantic(value: str) -> bool:
    return value in _ROLE_FIELDS or value in _SEMANTIC_FIELDS


def _field_value(value: tp.Any, name: str) -> AxisEntry:
    """Normalise a PartitionAxis field value: None, a string, or a tuple of strings."""
    if value is None or isinstance(value, str):
        return None if value == EMPTY else value
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value) if value else None
    raise TypeError(f"PartitionAxis.{name} must be None, a mesh axis name, a role (TP, FSDP ...) "
                    f"or a list of those; got {value!r}")


@dataclasses.dataclass(frozen=True)
class PartitionAxis:
    """Maps semantic axis names to mesh axes, for training and for decoding.

    The first five fields name the mesh axis of each parallelism role. Every other field
    maps one semantic dimension to mesh axes: ``None`` (replicated), a mesh axis name, a
    role (``TP`` ...), or a tuple of those. Roles are looked up when resolving, so
    ``pa.replace(tensor_parallel_axis="model")`` moves every tp-sharded dimension at once.

    The ``decode_*`` fields apply in ``MODE_DECODE`` and ``MODE_INSERT``. By default a
    decode step never shards the query length (it is 1), while the KV length stays
    sharded over ``sp`` so a long cache can be split across devices.
    """

    data_parallel_axis: str = "dp"
    fully_sharded_data_parallel_axis: str = "fsdp"
    expert_parallel_axis: str = "ep"
    tensor_parallel_axis: str = "tp"
    sequence_parallel_axis: str = "sp"

    batch_axis: AxisEntry = (FSDP, DP)
    sequence_axis: AxisEntry = SP
    query_sequence_axis: AxisEntry = SP
    key_sequence_axis: AxisEntry = SP
    hidden_state_axis: AxisEntry = TP
    head_axis: AxisEntry = TP
    kv_head_axis: AxisEntry = TP
    attention_dim_axis: AxisEntry = None
    attention_kv_dim_axis: AxisEntry = None
    mlp_intermediate_axis: AxisEntry = TP
    vocab_axis: AxisEntry = TP
    expert_axis: AxisEntry = EP
    expert_gate_axis: AxisEntry = None
    bias_head_sequence_axis: AxisEntry = None
    bias_key_sequence_axis: AxisEntry = None
    layer_axis: AxisEntry = None

    decode_batch_axis: AxisEntry = (FSDP, DP)
    decode_query_sequence_axis: AxisEntry = None
    decode_key_sequence_axis: AxisEntry = SP
    decode_head_axis: AxisEntry = TP
    decode_kv_head_axis: AxisEntry = TP
    decode_attention_dim_axis: AxisEntry = None
    decode_attention_kv_dim_axis: AxisEntry = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _ROLE_FIELDS.values():
                if not isinstance(value, str) or not value or _is_role_or_semantic(value):
                    raise TypeError(f"PartitionAxis.{f.name} must be a mesh axis name such as "
                                    f"{f.default!r}; got {value!r}")
                continue
            value = _field_value(value, f.name)
            for v in (value,) if isinstance(value, str) else value or ():
                if v in _SEMANTIC_FIELDS:
                    raise ValueError(f"PartitionAxis.{f.name} = {label(v)}: a field maps to mesh axes or "
                                     f"roles (DP, FSDP, EP, TP, SP), not to another semantic axis")
            object.__setattr__(self, f.name, value)

    # -- editing and serialisation -------------------------------------------------
    def replace(self, **changes: tp.Any) -> PartitionAxis:
        """A new PartitionAxis with some fields changed (unknown field names raise)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"PartitionAxis has no field {unknown}; fields are {sorted(known)}")
        return dataclasses.replace(self, **changes)

    def field_for(self, semantic: str, mode: str = MODE_TRAIN) -> str:
        """The field that maps ``semantic`` in ``mode`` (e.g. ``decode_batch_axis``)."""
        _check_name(semantic)
        if semantic in _ROLE_FIELDS:
            return _ROLE_FIELDS[semantic]
        train, decode = _SEMANTIC_FIELDS[semantic]
        return decode if _check_mode(mode) in GENERATION_MODES else train

    def with_rule(self, semantic: str, mesh_axes: AxisEntry | list[str], mode: str = MODE_TRAIN
                  ) -> PartitionAxis:
        """A new PartitionAxis mapping ``semantic`` to ``mesh_axes`` in ``mode``."""
        return self.replace(**{self.field_for(semantic, mode): mesh_axes})

    def mesh_axes_for(self, semantic: str, mode: str = MODE_TRAIN) -> MeshAxes:
        """The mesh axes ``semantic`` maps to in ``mode``, roles looked up."""
        value = getattr(self, self.field_for(semantic, mode))
        out: list[str] = []
        for v in (value,) if isinstance(value, str) else value or ():
            out.append(getattr(self, _ROLE_FIELDS[v]) if v in _ROLE_FIELDS else v)
        return tuple(out)

    def to_dict(self) -> dict[str, tp.Any]:
        """Plain data (tuples as lists), ready for JSON; roles stay roles."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: tp.Mapping[str, tp.Any]) -> PartitionAxis:
        return cls().replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def to_json(self, **kwargs: tp.Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> PartitionAxis:
        return cls.from_dict(json.loads(text))

    # -- resolution ------------------------------------------------------------------
    def resolve(self, axes: tp.Any, mode: str | int | None = None, *, shape: tp.Sequence[int] | None = None,
                mesh: tp.Any = None, strict: bool = False) -> PartitionSpec:
        """The PartitionSpec for ``axes`` (a preset or a list of names), valid for shape and mesh.

        A mesh axis is used at most once. With a shape and a mesh, a mesh axis whose size
        does not divide the dimension (times the axes already kept for it) is dropped, so
        that dimension is replicated over it; ``strict=True`` raises instead. ``explain``
        gives the reason for each dimension.
        """
        return PartitionSpec(*(d.spec_entry for d in self.explain(axes, mode, shape=shape, mesh=mesh,
                                                                   strict=strict)))

    def explain(self, axes: tp.Any, mode: str | int | None = None, *, shape: tp.Sequence[int] | None = None,
                mesh: tp.Any = None, strict: bool = False) -> list[DimDecision]:
        """One :class:`DimDecision` per dimension: semantic name, candidates, chosen axes, reason."""
        entries, mode = _entries_and_mode(axes, mode)
        if shape is not None:
            shape = tuple(int(s) for s in shape)
            if len(shape) != len(entries):
                raise ValueError(f"axes {label(tuple(entries))} name {len(entries)} dimensions but shape "
                                 f"{shape} has {len(shape)}; give one semantic name (or EMPTY) per dimension")
        runtime_mode = _runtime_mode(mode, shape)
        mesh_items = None if mesh is None else tuple(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        frozen = tuple(tuple(e) if isinstance(e, list) else e for e in entries)
        return list(_explained(self, frozen, runtime_mode, mesh_items, shape, strict))

    def _explain(self, entries: tuple, runtime_mode: str, mesh_items: tuple | None, shape: tuple[int, ...] | None,
                 strict: bool) -> tuple[DimDecision, ...]:
        mesh_sizes = None if mesh_items is None else dict(mesh_items)
        used: dict[str, int] = {}
        decisions = []
        for dim, entry in enumerate(entries):
            size = None if shape is None else shape[dim]
            decisions.append(self._decide(dim, entry, size, runtime_mode, mesh_sizes, used, strict))
        return tuple(decisions)

    def _decide(self, dim: int, entry: AxisEntry, size: int | None, mode: str,
                mesh_sizes: dict[str, int] | None, used: dict[str, int], strict: bool) -> DimDecision:
        names = () if entry is None or entry == EMPTY else (entry,) if isinstance(entry, str) else entry
        semantic = label(entry) if not isinstance(entry, tuple) else label(names)
        if not names:
            return DimDecision(dim, semantic, size, None, (), (), "not sharded (EMPTY)")
        candidates: list[str] = []
        fields = []
        for name in names:
            fields.append(self.field_for(name, mode))
            candidates.extend(self.mesh_axes_for(name, mode))
        field = ", ".join(fields)
        if not candidates:
            why = "decode mode: " if mode in GENERATION_MODES and field.startswith("decode_") else ""
            return DimDecision(dim, semantic, size, field, (), (), f"{why}{field} = None: replicated")
        if mesh_sizes is not None:
            for axis in candidates:
                if axis not in mesh_sizes:
                    raise ValueError(
                        f"dim {dim} ({semantic}) maps to mesh axis {axis!r} through PartitionAxis.{field}, "
                        f"but the mesh has axes {tuple(mesh_sizes)}; build the mesh with that axis "
                        f"(make_mesh names pp, dp, fsdp, ep, tp, sp) or change PartitionAxis.{field}")
        chosen, notes = _fit_axes(size, candidates, mesh_sizes, used)
        if notes and strict:
            raise ValueError(f"dim {dim} ({semantic}, size {size}): {'; '.join(notes)}; change the shape, "
                             f"the mesh or PartitionAxis.{field}, or resolve with strict=False to replicate")
        for axis in chosen:
            used[axis] = dim
        if mesh_sizes is not None and chosen:
            ways = math.prod(mesh_sizes[a] for a in chosen)
            per = f", {size // ways} per shard" if size is not None else ""
            kept = (f"sharded {ways} ways over {'×'.join(chosen)}{per}" if ways > 1 else
                    f"mapped to {'×'.join(chosen)}, of size 1 on this mesh: not split")
        elif chosen:
            kept = f"sharded over {'×'.join(chosen)} (no mesh given: sizes not checked)"
        else:
            kept = "replicated"
        return DimDecision(dim, semantic, size, field, tuple(candidates), tuple(chosen),
                           "; ".join([*notes, kept]))


def _fit_axes(size: int | None, candidates: tp.Sequence[str], mesh_sizes: dict[str, int] | None,
              used: dict[str, int]) -> tuple[list[str], list[str]]:
    """Keep each candidate mesh axis that is unused and divides ``size``; notes say why not."""
    chosen: list[str] = []
    notes: list[str] = []
    for axis in candidates:
        if axis in chosen:
            continue
        if axis in used:
            notes.append(f"{axis} dropped: already shards dim {used[axis]}")
            continue
        if mesh_sizes is not None and size is not None:
            ways = math.prod(mesh_sizes[a] for a in chosen) * mesh_sizes[axis]
            if size % ways:
                with_kept = f" ({'×'.join(chosen)} already kept)" if chosen else ""
                notes.append(f"{axis} dropped: {size} not divisible by {ways}{with_kept}")
                continue
        chosen.append(axis)
    return chosen, notes


def fit_spec(spec: PartitionSpec, shape: tp.Sequence[int], mesh: tp.Any) -> PartitionSpec:
    """``spec`` made valid for ``shape`` on ``mesh`` by the rules of :meth:`PartitionAxis.resolve`.

    >>> import jax
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ("dp", "tp"))
    >>> fit_spec(PartitionSpec(("dp", "tp"), "tp"), (6, 8), mesh)  # 6 % (2*4) != 0: tp dropped
    P('dp', 'tp')
    """
    sizes = dict(mesh.shape)
    used: dict[str, int] = {}
    out = []
    for dim, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        chosen, _ = _fit_axes(shape[dim], (entry,) if isinstance(entry, str) else entry or (), sizes, used)
        used.update(dict.fromkeys(chosen, dim))
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*out)


def explain_table(decisions: tp.Sequence[DimDecision]) -> str:
    """A plain-text table of :meth:`PartitionAxis.explain` records."""
    rows = [("dim", "semantic", "size", "candidates", "chosen", "reason")]
    for d in decisions:
        rows.append((str(d.dim), d.semantic, "?" if d.size is None else str(d.size),
                     ",".join(d.candidates) or "-", ",".join(d.chosen) or "-", d.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5]
                     for r in rows)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _is_role_or_semantic(name):
        known = [label(n) for n in semantic_names()]
        close = difflib.get_close_matches(str(name).strip("_").upper(), known, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise ValueError(f"unknown semantic axis name {name!r}.{hint} Known names (workbench.core.axes): "
                         f"{', '.join(known)}, or EMPTY / None for an unsharded dimension")


def _check_mode(mode: str) -> str:
    if mode not in RUNTIME_MODES:
        raise ValueError(f"unknown runtime mode {mode!r}; use one of MODE_TRAIN, MODE_PREFILL, "
                         f"MODE_DECODE, MODE_INSERT, or an int dimension index")
    return mode


def _entries_and_mode(axes: tp.Any, mode: str | int | None) -> tuple[list[AxisEntry], str | int]:
    preset_mode = None
    if isinstance(axes, DynamicShardingAxes) or (hasattr(axes, "axes") and hasattr(axes, "mode")):
        axes, preset_mode = axes.axes, axes.mode
    if isinstance(axes, str) or not isinstance(axes, tp.Sequence):
        raise TypeError(f"axes must be a list of semantic names or a DynamicShardingAxes preset; got {axes!r}")
    entries: list[AxisEntry] = []
    for entry in axes:
        if entry is None or entry == EMPTY:
            entries.append(None)
        elif isinstance(entry, str):
            _check_name(entry)
            entries.append(entry)
        elif isinstance(entry, list | tuple):
            for name in entry:
                _check_name(name)
            entries.append(tuple(entry) if entry else None)
        else:
            raise TypeError(f"axis entry {entry!r} must be a semantic name, None, or a list of names")
    chosen = mode if mode is not None else preset_mode if preset_mode is not None else MODE_TRAIN
    return entries, chosen


def _runtime_mode(mode: str | int, shape: tuple[int, ...] | None) -> str:
    if isinstance(mode, bool) or not isinstance(mode, int):
        return _check_mode(mode)
    if shape is None:
        raise ValueError(f"mode={mode} is a dimension index (decode when that dimension has size 1), "
                         f"so pass shape=..., or pass a runtime mode such as MODE_TRAIN")
    if not -len(shape) <= mode < len(shape):
        raise ValueError(f"mode={mode} is a dimension index but shape {shape} has {len(shape)} dimensions")
    return MODE_DECODE if shape[mode] == 1 else MODE_TRAIN


def shard_shape(decisions: tp.Sequence[DimDecision], sizes: tp.Mapping[str, int]) -> tuple[int, ...]:
    """The block each device holds: each dimension divided by the sizes of the mesh axes it was split over."""
    return tuple(d.size // math.prod(sizes[a] for a in d.chosen) for d in decisions)
