"""The collectives XLA inserted in a sharded program.

:func:`collectives` compiles a function and lists each collective of the optimised HLO with its result shape,
bytes per device, replica groups and the mesh axes those groups span; :func:`loop_collectives` says which of a
loop body's collectives overlap which computation; :func:`summarize` counts them by kind.

Device ids in HLO (``replica_groups``, ``source_target_pairs``) index the program's device assignment,
which for a program over a mesh is ``mesh.devices.flat``: id ``i`` has mesh coordinates
``np.unravel_index(i, mesh.devices.shape)``, whatever ``mesh.devices.flat[i].id`` is (checked on a mesh
with permuted devices). A ``jit`` program has one replica, so the global ids of ``use_global_device_ids``,
partition ids and these positions coincide.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing as tp

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from workbench.core.hlo.graph import computation_runs
from workbench.core.hlo.text import COLLECTIVE_KINDS, Instruction, dtype_name, element_bits, leaves, parse, shape_tree

Groups = tuple[tuple[int, ...], ...]
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of an optimised HLO module.

    ``shape`` is the result shape, or one shape per operand for a tuple result; ``bytes`` the result's
    bytes on each device; ``replica_groups`` and ``source_target_pairs`` hold HLO device ids (positions in
    ``mesh.devices.flat``); ``mesh_axes`` the mesh axes along which devices of one group differ (``None``
    without a mesh). ``asynchronous`` marks a ``*-start`` (its ``*-done`` is not listed). ``trips`` is
    how many times it runs per execution of the program: the trip counts XLA records
    (``known_trip_count``) of the while loops around it, multiplied; 1 outside loops.
    """

    kind: str
    name: str
    shape: Shape | tuple[Shape, ...]
    dtype: str
    bytes: int
    replica_groups: Groups = ()
    source_target_pairs: tuple[tuple[int, int], ...] | None = None
    mesh_axes: tuple[str, ...] | None = None
    asynchronous: bool = False
    trips: int = 1

    @property
    def group_size(self) -> int:
        """Devices per replica group (1 for a collective-permute)."""
        return len(self.replica_groups[0]) if self.replica_groups else 1

    def __str__(self) -> str:
        shapes = self.shape if self.shape and isinstance(self.shape[0], tuple) else (self.shape,)
        dims = ", ".join(f"[{','.join(map(str, s))}]" for s in shapes)
        shape = f"{self.dtype}{dims}" if len(shapes) == 1 else f"{self.dtype} ({dims})"
        where = f"pairs={_braces(self.source_target_pairs)}" if self.source_target_pairs is not None else \
            f"groups={_braces(self.replica_groups)}"
        axes = "" if self.mesh_axes is None else f" over {self.mesh_axes}"
        return f"{self.kind}{' (async)' * self.asynchronous} {shape} {self.bytes:,} B/device{axes} {where}"


def _braces(groups: tp.Sequence[tp.Sequence[int]]) -> str:
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


# -- replica groups ------------------------------------------------------------------------------
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^()]*(?:\([^()]*\))?[^()]*)\))?"
                   r"\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _iota(dims: str, reshape: str, perm: str | None) -> np.ndarray:
    reshape_dims = [int(d) for d in reshape.split(",")]
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids.reshape([int(d) for d in dims.split(",")])


def _mesh_groups(axes_text: str, ids_text: str | None, group_text: str) -> np.ndarray:
    """Expand ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}``: devices varying along the listed (sub-)axes."""
    names, sizes = zip(*((n, int(s)) for n, s in re.findall(r"'?([^',=]+)'?=(\d+)", axes_text)), strict=True)
    if ids_text is None:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    elif match := re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids_text):
        ids = _iota(",".join(map(str, sizes)), match.group(1), match.group(2))
    else:
        ids = np.array([int(i) for i in re.findall(r"\d+", ids_text)]).reshape(sizes)
    # Each grouped axis reference is a whole axis 'a' or a sub-axis 'a':(pre)size, the middle of the axis
    # split [pre, size, rest] (major to minor). Split the axes, move the grouped pieces last, read rows.
    refs = []  # (axis index, pre, size); size 0 for the whole axis
    for item in filter(None, (t.strip() for t in group_text.split(","))):
        if not (m := re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", item)):
            raise ValueError(f"collectives: cannot read the mesh axis {item!r} of replica groups {group_text!r}")
        refs.append((names.index(m.group(1)), int(m.group(2) or 1), int(m.group(3) or 0)))
    dims: list[int] = []
    grouped: dict[int, int] = {}
    for axis, n in enumerate(sizes):
        prefix = 1
        for ref in sorted((r for r in refs if r[0] == axis), key=lambda r: r[1]):
            pre, size = ref[1], ref[2] or n
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped[refs.index(ref)] = len(dims)
            dims.append(size)
            prefix *= size
        if prefix != n or not any(r[0] == axis for r in refs):
            dims.append(n // prefix)
    order = [grouped[i] for i in range(len(refs))]
    rest = [d for d in range(len(dims)) if d not in order]
    group_size = math.prod(dims[d] for d in order)
    return ids.reshape(dims).transpose(rest + order).reshape(-1, group_size)


def _replica_groups(rest: str, n_devices: int) -> Groups:
    if match := _MESH.search(rest):
        groups = _mesh_groups(*match.groups())
    elif match := _IOTA.search(rest):
        groups = _iota(*match.groups())
    elif match := _EXPLICIT.search(rest):
        groups = [[int(i) for i in g.split(",") if i.strip()] for g in re.findall(r"\{([^{}]*)\}", match.group(1))]
        groups = groups or [list(range(n_devices))]  # {} means every device in one group
    elif "replica_groups=" in rest:
        raise ValueError(f"collectives: cannot read the replica groups of: {rest[:200]!r}")
    else:
        groups = [list(range(n_devices))]
    return tuple(tuple(int(i) for i in g) for g in groups)


def _spanned_axes(groups: tp.Iterable[tp.Sequence[int]], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group have different coordinates."""
    varies = np.zeros(mesh.devices.ndim, bool)
    for group in groups:
        if max(group) >= mesh.size:
            raise ValueError(f"collectives: HLO device id {max(group)} is outside the mesh of {mesh.size} devices; "
                             f"pass the mesh the program was compiled for (mesh=...)")
        coords = np.array(np.unravel_index(list(group), mesh.devices.shape))
        varies |= (coords != coords[:, :1]).any(axis=1)
    return tuple(name for name, v in zip(mesh.axis_names, varies, strict=True) if v)


def collectives_in(hlo_text: str, mesh: Mesh | None = None) -> list[Collective]:
    """The collectives of an optimised HLO module's text (``compiled.as_text()``), in text order.

    With ``mesh`` (the one the program runs on), each record's ``mesh_axes`` names the axes its groups
    span. A collective inside a loop body appears once, with ``trips`` saying how often it runs.
    """
    module = parse(hlo_text)
    n_devices = int(module.attribute("num_partitions") or 1) * int(module.attribute("replica_count") or 1)
    if mesh is not None and n_devices not in (1, mesh.size):
        raise ValueError(f"collectives: the program runs on {n_devices} devices but the mesh has {mesh.size}; "
                         f"pass the mesh it was compiled for")
    trips = computation_runs(hlo_text)
    records = []
    for computation in module.computations.values():
        for op in computation.instructions:
            kind = op.opcode.removesuffix("-start")
            if kind not in COLLECTIVE_KINDS:
                continue
            asynchronous = op.opcode != kind
            result = shape_tree(op.shape)
            # the result arrays: all-gather-start returns (operands, results), collective-permute-start
            # (operand, result, contexts...); an all-reduce-start returns its result directly
            if asynchronous and kind in ("all-gather", "collective-permute") and isinstance(result, list):
                result = result[1]
            arrays = leaves(result)
            nbytes = sum(math.ceil(math.prod(a.dims) * element_bits(a.dtype) / 8) for a in arrays)
            shape = arrays[0].dims if len(arrays) == 1 else tuple(a.dims for a in arrays)
            pairs, groups = None, ()
            if kind == "collective-permute":
                text = m.group(1) if (m := _PAIRS.search(op.attributes)) else ""
                pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text))
            else:
                groups = _replica_groups(op.attributes, n_devices)
            axes = None if mesh is None else _spanned_axes(groups or pairs or (), mesh)
            records.append(Collective(kind, op.name, shape, ",".join(sorted({dtype_name(a.dtype) for a in arrays})),
                                      nbytes, groups, pairs, axes, asynchronous, trips.get(computation.name, 1)))
    return records


# -- data dependencies of collectives inside loops ---------------------------------------------------
_PASS_THROUGH = ("copy", "bitcast", "get-tuple-element", "collective-permute-done", "all-gather-done",
                 "all-reduce-done")  # forward a value without computing on it


@dataclasses.dataclass(frozen=True)
class LoopCollective:
    """A collective in a while loop's body and how it depends on the body's computation.

    ``from_carry``: its operand is an element of the loop's input tuple (through copies and bitcasts), so
    nothing computed in this trip feeds it. ``to_carry_only``: its result only reaches the loop's output
    tuple, so nothing in this trip waits for it. Both true: the transfer is independent of the trip's
    computation and may run during it. ``between``: for an asynchronous one (``*-start``/``*-done``), the
    operations the schedule puts between its start and done (empty when synchronous).
    """

    name: str
    kind: str
    body: str
    from_carry: bool
    to_carry_only: bool
    asynchronous: bool = False
    between: tuple[str, ...] = ()


def loop_collectives(hlo_text: str) -> list[LoopCollective]:
    """The collectives of every while-loop body of an optimised HLO module, with their data dependencies.

    Reads a scheduled module's text (``compiled.as_text()``): the instruction order is the schedule.
    """
    computations = parse(hlo_text).computations
    bodies = {op.attribute("body") for c in computations.values() for op in c.instructions if op.opcode == "while"}
    return [r for name, c in computations.items() if name in bodies for r in _body_collectives(name, c.instructions)]


def _body_collectives(body: str, ops: tp.Sequence[Instruction]) -> list[LoopCollective]:
    by_name = {op.name: op for op in ops}
    users: dict[str, list[str]] = {}
    for op in ops:
        for a in op.operands:
            users.setdefault(a, []).append(op.name)

    def source(name: str) -> Instruction | None:  # follow copies/bitcasts back to what computed it
        op = by_name.get(name)
        while op is not None and op.opcode in ("copy", "bitcast"):
            op = by_name.get(op.operands[0])
        return op

    def only_to_root(name: str) -> bool:  # every use, through copies/bitcasts/done, is the ROOT tuple
        return all((by_name[u].root and by_name[u].opcode == "tuple") or
                   (by_name[u].opcode in _PASS_THROUGH and only_to_root(u)) for u in users.get(name, []))

    order = [op.name for op in ops]
    records = []
    for op in ops:
        kind = op.opcode.removesuffix("-start")
        if kind not in COLLECTIVE_KINDS:
            continue
        src = source(op.operands[0]) if op.operands else None
        tuple_of = by_name.get(src.operands[0]) if src is not None and src.opcode == "get-tuple-element" else None
        from_carry = tuple_of is not None and tuple_of.opcode == "parameter"
        asynchronous = op.opcode != kind
        between: tuple[str, ...] = ()
        if asynchronous:
            done = next((u for u in users.get(op.name, []) if by_name[u].opcode == f"{kind}-done"), None)
            if done is not None:
                inside = order[order.index(op.name) + 1:order.index(done)]
                between = tuple(by_name[n].opcode for n in inside if by_name[n].opcode not in _PASS_THROUGH)
        records.append(LoopCollective(op.name, kind, body, from_carry, only_to_root(op.name), asynchronous, between))
    return records


def _compiled(fn: tp.Any, args: tp.Sequence[tp.Any], kwargs: dict[str, tp.Any]) -> jax.stages.Compiled:
    if isinstance(fn, jax.stages.Compiled):
        return fn
    if isinstance(fn, jax.stages.Lowered):
        return fn.compile()
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile()


def _find_mesh(compiled: jax.stages.Compiled, args: tp.Any) -> Mesh | None:
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    shardings += [getattr(x, "sharding", None) for x in jax.tree.leaves(args)]
    meshes = [s.mesh for s in shardings if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh)]
    return meshes[0] if meshes else None


def collectives(fn: tp.Any, *args: tp.Any, mesh: Mesh | None = None, **kwargs: tp.Any) -> list[Collective]:
    """The collectives XLA put in ``fn(*args, **kwargs)`` once compiled (``jax.jit`` unless already jitted).

    ``fn`` may also be a ``Lowered`` or ``Compiled`` stage. ``mesh`` is reserved (never passed to ``fn``):
    the mesh whose axes to name, found by default in the compiled program's or the arguments' shardings.
    """
    compiled = _compiled(fn, args, kwargs)
    return collectives_in(compiled.as_text(), mesh if mesh is not None else _find_mesh(compiled, (args, kwargs)))


def summarize(records: tp.Iterable[Collective], *, count_trips: bool = False) -> dict[str, dict[str, int]]:
    """Per kind: how many collective instructions (``count``) and their result bytes per device.

    With ``count_trips``, a collective in a loop counts once per trip: ``runs`` is added and ``bytes``
    is over one execution of the program (ring attention's 2 permutes run ``sp - 1`` times each).
    """
    out: dict[str, dict[str, int]] = {}
    for r in records:
        entry = out.setdefault(r.kind, {"count": 0, "runs": 0, "bytes": 0} if count_trips else {"count": 0, "bytes": 0})
        entry["count"] += 1
        if count_trips:
            entry["runs"] += r.trips
        entry["bytes"] += r.bytes * (r.trips if count_trips else 1)
    return out
