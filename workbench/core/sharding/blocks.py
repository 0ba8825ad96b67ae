"""Where an array's blocks live on a mesh, and how a mesh is laid out for drawing. No allocation.

- :func:`sharding_layout` computes, from a shape, a dtype, a ``PartitionSpec`` and a mesh, which
  block of the array each device holds, the shard shape, the bytes per device and the groups of
  devices that hold the same block (replicas), plus the spec in the scaling book's notation
  (``A[I_fsdp, J_tp]``: dimension ``I`` split over ``fsdp``, ``J`` over ``tp``). It reproduces
  ``NamedSharding.devices_indices_map`` without calling it (tests compare the two).
- :func:`mesh_grid` arranges a mesh's devices as 2-D grids (rows and columns from two axes, the
  other axes as facets), and :func:`~workbench.core.mesh.mesh_factorizations` / :func:`axis_size_choices` /
  :func:`set_axis_size` / :func:`reshape_mesh` say which mesh shapes a device count allows.
- :func:`parse_spec` / :func:`format_spec` read and write a spec as text (``"(fsdp, sp), tp"``; they live in
  :mod:`workbench.core.sharding.spec_text`, with the semantic axes' reader).
- :func:`typed_notation` writes the same array as JAX types it on Explicit axes: ``float32[8@fsdp,16@tp]``,
  what ``str(jax.typeof(x))`` prints (tests compare the two).

>>> import jax
>>> mesh = jax.sharding.AbstractMesh((2, 4), ("fsdp", "tp"))
>>> lay = sharding_layout((8, 16), "float32", parse_spec("fsdp, tp"), mesh)
>>> lay.notation(), lay.shard_shape, lay.bytes_per_device
('A[I_fsdp, J_tp]', (4, 4), 64)
>>> lay.typed_notation()  # an Explicit mesh types it so; this one is Auto, so jax.typeof would show float32[8,16]
'float32[8@fsdp,16@tp]'
>>> sharding_layout((8, 16), "float32", jax.P("tp"), mesh).replica_groups[0]  # block 0 of dim I: 2 copies
(0, 4)
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import typing as tp

import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from workbench.core.axes import fit_spec
from workbench.core.mesh import MESH_AXES, divisors, explicit_spec, make_mesh
from workbench.core.sharding.spec_text import format_spec, parse_spec

__all__ = ["BlockCell", "MeshCell", "MeshFacet", "MeshGrid", "ShardingLayout", "ShardingPanel", "axis_size_choices",
           "format_spec", "mesh_grid", "parse_spec", "reshape_mesh",
           "set_axis_size", "sharding_layout", "typed_notation"]

MeshLike = Mesh | AbstractMesh
Entry = str | tuple[str, ...] | None
_LETTERS = "IJKLMNOPQRSTUVWXYZ"


def _device_ids(mesh: MeshLike) -> np.ndarray:
    """Device ids in the mesh's shape; an AbstractMesh has none, so positions stand in for them."""
    if isinstance(mesh, Mesh):
        return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    return np.arange(math.prod(mesh.axis_sizes), dtype=int).reshape(tuple(mesh.axis_sizes))


def _axes(entry: Entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _dim_letter(dim: int) -> str:
    return _LETTERS[dim] if dim < len(_LETTERS) else f"D{dim}"


# -- sharding layout ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class BlockCell:
    """One block of an array: its coordinates (block index per dimension), index slices, holders."""

    block: tuple[int, ...]
    index: tuple[slice, ...]
    device_ids: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.device_ids)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingPanel:
    """A 2-D picture of the last two dimensions for one block of each leading dimension.

    ``title`` names the leading dimensions' ranges (``(("I", "0:4"),)``); ``cells[r][c]`` is the
    block in row ``r`` (blocks of dim -2) and column ``c`` (blocks of dim -1).
    """

    title: tuple[tuple[str, str], ...]
    cells: tuple[tuple[BlockCell, ...], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingLayout:
    """Which block of an array of ``shape`` each device of ``mesh`` holds under ``spec``.

    ``spec`` has one entry per dimension. ``device_blocks[id]`` gives the block coordinates of
    device ``id`` (one block index per dimension); devices of an AbstractMesh are numbered by
    their position in the mesh.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    spec: PartitionSpec
    mesh: MeshLike
    blocks_per_dim: tuple[int, ...]
    shard_shape: tuple[int, ...]
    device_blocks: dict[int, tuple[int, ...]]

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * self.dtype.itemsize

    @property
    def logical_bytes(self) -> int:
        """Bytes of the whole (unsharded) array."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def replication(self) -> int:
        """How many devices hold each block (the product of the mesh axes the spec does not use)."""
        return len(self.device_blocks) // math.prod(self.blocks_per_dim)

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """Mesh axes of size > 1 that no dimension is split over: blocks are copied along them."""
        used = {a for entry in self.spec for a in _axes(entry)}
        return tuple(a for a, n in dict(self.mesh.shape).items() if n > 1 and a not in used)

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes dimension ``dim`` is split over, major to minor."""
        return _axes(self.spec[dim])

    def index(self, block: tp.Sequence[int]) -> tuple[slice, ...]:
        """The index slices of the block with coordinates ``block``."""
        return tuple(slice(b * s, (b + 1) * s) for b, s in zip(block, self.shard_shape, strict=True))

    def devices_indices_map(self) -> dict[int, tuple[slice, ...]]:
        """Device id -> index slices, as ``NamedSharding.devices_indices_map`` (keyed by id, not Device)."""
        return {d: self.index(b) for d, b in self.device_blocks.items()}

    @property
    def block_devices(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Block coordinates -> the ids of the devices holding it, in mesh order; blocks sorted."""
        out: dict[tuple[int, ...], list[int]] = {}
        for d, b in self.device_blocks.items():
            out.setdefault(b, []).append(d)
        return {b: tuple(out[b]) for b in sorted(out)}

    @property
    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Groups of device ids that hold the same block, one per block, in block order."""
        return tuple(self.block_devices.values())

    def notation(self, name: str = "A") -> str:
        """The spec in the scaling book's notation: ``A[I_fsdp, J_tp]``, ``A[I_{fsdp,sp}, J]``, ``A[I_XY, J]``."""
        parts = [f"{letter}_{sub}" if sub else letter for letter, sub in self.notation_parts()]
        return f"{name}[{', '.join(parts)}]"

    def notation_parts(self) -> list[tuple[str, str]]:
        """(dimension letter, subscript) per dimension; the subscript is '' for an unsplit dimension."""
        out = []
        for dim in range(len(self.shape)):
            axes = self.dim_axes(dim)
            if len(axes) <= 1:
                sub = "".join(axes)
            elif all(len(a) == 1 for a in axes):
                sub = "".join(axes)  # the book's own style: I_XY
            else:
                sub = "{" + ",".join(axes) + "}"
            out.append((_dim_letter(dim), sub))
        return out

    def typed_notation(self, *, on_mesh: bool = False, short_dtypes: bool = False) -> str:
        """The type JAX gives this array on Explicit axes: ``float32[8@fsdp,16@tp]`` (:func:`typed_notation`).

        ``on_mesh=True``: as ``jax.typeof`` prints it on this very mesh, where Auto axes stay out of the
        type (an all-Auto mesh gives ``float32[8,16]``).
        """
        return typed_notation(self.shape, self.dtype, self.spec, self.mesh if on_mesh else None,
                              short_dtypes=short_dtypes)

    def panels(self) -> list[ShardingPanel]:
        """2-D pictures: the last two dimensions as a grid of blocks, one panel per leading block.

        A 1-D array is one row of blocks, a scalar one cell; leading dimensions that are not
        split give a single panel.
        """
        rank = len(self.shape)
        lead = max(rank - 2, 0)
        row_dim, col_dim = (rank - 2, rank - 1) if rank >= 2 else (None, 0 if rank == 1 else None)
        n_rows = self.blocks_per_dim[row_dim] if row_dim is not None else 1
        n_cols = self.blocks_per_dim[col_dim] if col_dim is not None else 1
        holders = self.block_devices
        panels = []
        for lead_block in itertools.product(*(range(self.blocks_per_dim[d]) for d in range(lead))):
            title = tuple((_dim_letter(d), _range_text(self.index((*lead_block, *([0] * (rank - lead))))[d]))
                          for d in range(lead) if self.blocks_per_dim[d] > 1)
            rows = []
            for r in range(n_rows):
                row = []
                for c in range(n_cols):
                    block = (*lead_block, *((r,) if row_dim is not None else ()),
                             *((c,) if col_dim is not None else ()))
                    row.append(BlockCell(block, self.index(block), holders[block]))
                rows.append(tuple(row))
            panels.append(ShardingPanel(title, tuple(rows)))
        return panels

    def named_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec)


def _range_text(s: slice) -> str:
    return f"{s.start}:{s.stop}"


def _check_spec(spec: PartitionSpec, shape: tuple[int, ...], sizes: dict[str, int], allow_reuse: bool = False
                ) -> tuple[Entry, ...]:
    """The spec's entries padded to the rank, after checking names, reuse (unless allowed) and types."""
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise ValueError(f"{spec} has unreduced/reduced axes; a layout shows stored blocks only, so drop them")
    entries = tuple(spec)
    if len(entries) > len(shape):
        raise ValueError(f"{spec} has {len(entries)} entries but the array has {len(shape)} dimension(s) "
                         f"{shape}; give at most one entry per dimension")
    seen: dict[str, int] = {}
    for dim, entry in enumerate(entries):
        if entry is PartitionSpec.UNCONSTRAINED:
            raise ValueError(f"dim {dim} is P.UNCONSTRAINED: a layout needs a decided spec; name mesh axes or None")
        if not (entry is None or isinstance(entry, str)
                or (isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry))):
            raise TypeError(f"dim {dim}: spec entry {entry!r} must be a mesh axis name, a tuple of names, or None")
        for axis in _axes(entry):
            if axis not in sizes:
                close = difflib.get_close_matches(axis, list(sizes), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"dim {dim}: unknown mesh axis {axis!r}{hint}; the mesh has axes "
                                 f"{', '.join(sizes)}")
            if axis in seen and not allow_reuse:
                raise ValueError(f"mesh axis {axis!r} shards both dim {seen[axis]} and dim {dim}; a mesh axis "
                                 f"may split one dimension only")
            seen[axis] = dim
    return entries + (None,) * (len(shape) - len(entries))


def _spec_and_mesh(spec: tp.Any, mesh: MeshLike | None) -> tuple[PartitionSpec, MeshLike]:
    if isinstance(spec, NamedSharding):
        if mesh is not None and mesh != spec.mesh:
            raise ValueError("a NamedSharding brings its own mesh; pass its PartitionSpec (sharding.spec) to "
                             "lay it out on another mesh")
        return spec.spec, spec.mesh
    if isinstance(spec, str):
        spec = parse_spec(spec)
    if spec is None:
        spec = PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"expected a PartitionSpec, a NamedSharding or spec text like 'fsdp, tp'; got "
                        f"{type(spec).__name__}")
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(f"a PartitionSpec needs a mesh (jax.sharding.Mesh or AbstractMesh); got {mesh!r}")
    return spec, mesh


def sharding_layout(shape: tp.Any, dtype: tp.Any = None, spec: tp.Any = None, mesh: MeshLike | None = None,
                    *, fit: bool = False) -> ShardingLayout:
    """The layout of an array of ``shape``/``dtype`` under ``spec`` on ``mesh``, computed, not allocated.

    ``spec`` is a PartitionSpec (then ``mesh`` is needed), spec text (``"fsdp, tp"``), or a
    NamedSharding (its mesh is used). ``shape`` may instead be a ``jax.Array`` or a
    ``ShapeDtypeStruct`` with a NamedSharding: ``sharding_layout(x)``.

    The check is strict, as ``NamedSharding``'s: every mesh axis must exist, split one dimension
    only, and divide it. ``fit=True`` first drops the axes that do not divide a dimension, as
    ``PartitionAxis.resolve`` does (``workbench.core.axes.fit_spec``).
    """
    if hasattr(shape, "shape") and hasattr(shape, "dtype"):
        array = shape
        shape, dtype = array.shape, array.dtype if dtype is None else dtype
        if spec is None:
            spec = getattr(array, "sharding", None)
            if not isinstance(spec, NamedSharding):
                raise TypeError(f"this array's sharding is {type(spec).__name__}, not a NamedSharding; pass a "
                                f"spec and a mesh, or jax.device_put the array with a NamedSharding first")
    if dtype is None:
        raise TypeError("sharding_layout needs a dtype (e.g. 'float32') to count bytes")
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    dtype = np.dtype(_jnp_dtype(dtype))
    spec, mesh = _spec_and_mesh(spec, mesh)
    sizes = dict(mesh.shape)
    entries = _check_spec(spec, shape, sizes, allow_reuse=fit)
    if fit:
        entries = tuple(fit_spec(PartitionSpec(*entries), shape, mesh))
    ways = [math.prod(sizes[a] for a in _axes(e)) for e in entries]
    for dim, (n, w) in enumerate(zip(shape, ways, strict=True)):
        if n % w:
            axes = _axes(entries[dim])
            fitted = fit_spec(PartitionSpec(*entries), shape, mesh)
            raise ValueError(f"dim {dim} has size {n}, not divisible by {'×'.join(axes)} = {w} (strict check, as "
                             f"NamedSharding); change the shape, the spec or the mesh, or fit it: fit_spec (what "
                             f"PartitionAxis.resolve does) gives {fitted}")
    ids = _device_ids(mesh)
    names = list(sizes)
    device_blocks = {}
    for coords in itertools.product(*(range(n) for n in sizes.values())):
        block = []
        for entry in entries:
            b = 0
            for axis in _axes(entry):
                b = b * sizes[axis] + coords[names.index(axis)]
            block.append(b)
        device_blocks[int(ids[coords])] = tuple(block)
    shard_shape = tuple(n // w for n, w in zip(shape, ways, strict=True))
    return ShardingLayout(shape, dtype, PartitionSpec(*entries), mesh, tuple(ways), shard_shape, device_blocks)


def typed_notation(shape: tp.Sequence[int], dtype: tp.Any, spec: tp.Any = None, mesh: MeshLike | None = None, *,
                   short_dtypes: bool = False) -> str:
    """An array's type with its sharding, as ``str(jax.typeof(x))`` prints it on a mesh of Explicit axes.

    A dimension split over a mesh axis reads ``size@axis``, over several ``size@(a,b)`` (major axis
    first), an unsplit one its size alone; sizes are global, not per shard. ``spec`` is a
    PartitionSpec, spec text (``"fsdp, tp"``) or None (unsharded).

    Without ``mesh`` every axis the spec names shows: the type on Explicit axes. With ``mesh``, as JAX
    types it there: only Explicit axes enter a type, Auto and Manual ones are left out (an all-Auto mesh
    gives ``float32[8,4]``), and the names and divisibility are checked. ``P.UNCONSTRAINED`` (Auto axes
    only) leaves its dimension out of the type. ``short_dtypes=True`` writes jaxpr's names (``f32``, ``bf16``).

    >>> typed_notation((8, 4), "float32", PartitionSpec("dp", "tp"))
    'float32[8@dp,4@tp]'
    >>> typed_notation((8, 4, 2), "bfloat16", PartitionSpec(("fsdp", "dp"), None), short_dtypes=True)
    'bf16[8@(fsdp,dp),4,2]'
    """
    shape = tuple(int(n) for n in shape)
    name = np.dtype(_jnp_dtype(dtype)).name
    if short_dtypes:  # jax's short_dtype_name
        name = name.replace("float", "f").replace("uint", "u").replace("int", "i").replace("complex", "c")
    spec = parse_spec(spec) if isinstance(spec, str) else PartitionSpec() if spec is None else spec
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"typed_notation takes a PartitionSpec, spec text like 'fsdp, tp' or None; got "
                        f"{type(spec).__name__}")
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise ValueError(f"{spec} has unreduced/reduced axes; typed_notation writes split dimensions only")
    if len(spec) > len(shape):
        raise ValueError(f"{spec} has {len(spec)} entries but the array has {len(shape)} dimension(s) {shape}; "
                         f"give at most one entry per dimension")
    decided = PartitionSpec(*(None if e is PartitionSpec.UNCONSTRAINED else e for e in spec))  # XLA's choice
    for dim, entry in enumerate(decided):
        if not (entry is None or isinstance(entry, str)
                or (isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry))):
            raise TypeError(f"dim {dim}: spec entry {entry!r} must be a mesh axis name, a tuple of names, or None")
    if mesh is not None:
        if not isinstance(mesh, Mesh | AbstractMesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or AbstractMesh; got {type(mesh).__name__}")
        _check_spec(decided, shape, dict(mesh.shape))
        if PartitionSpec.UNCONSTRAINED in tuple(spec) and not mesh.auto_axes:
            raise ValueError(f"{spec}: P.UNCONSTRAINED lets XLA choose, which only Auto axes allow; this mesh has "
                             f"none, so name mesh axes or None")
        decided = explicit_spec(decided, mesh)
        for dim, (n, entry) in enumerate(zip(shape, decided, strict=False)):
            ways = math.prod(mesh.shape[a] for a in _axes(entry))
            if n % ways:
                raise ValueError(f"dim {dim} has size {n}, not divisible by {'×'.join(_axes(entry))} = {ways}; JAX "
                                 f"refuses such a type (change the shape, the spec or the mesh)")
    parts = []
    for dim, n in enumerate(shape):
        axes = _axes(decided[dim]) if dim < len(decided) else ()
        parts.append(f"{n}@{axes[0]}" if len(axes) == 1 else f"{n}@({','.join(axes)})" if axes else str(n))
    return f"{name}[{','.join(parts)}]"


def _jnp_dtype(dtype: tp.Any) -> tp.Any:
    import jax.numpy as jnp  # knows bfloat16, float8 ... by name

    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"unknown dtype {dtype!r}: {e}") from None


# -- mesh grid ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MeshCell:
    """One device of a mesh: id, position in ``mesh.devices.flat``, platform, process, coordinates."""

    device_id: int
    position: int
    platform: str
    process_index: int
    coords: tuple[tuple[str, int], ...]

    def coord(self, axis: str) -> int:
        return dict(self.coords)[axis]


@dataclasses.dataclass(frozen=True)
class MeshFacet:
    """One 2-D grid of a mesh: ``label`` gives the facet axes' values, ``cells[row][col]`` the devices."""

    label: tuple[tuple[str, int], ...]
    cells: tuple[tuple[MeshCell, ...], ...]

    @property
    def title(self) -> str:
        return ", ".join(f"{a}={v}" for a, v in self.label)


@dataclasses.dataclass(frozen=True)
class MeshGrid:
    """A mesh laid out for drawing: ``rows`` and ``cols`` axes (None: one row / column), facets for the rest.

    Axes of size 1 are collapsed (they appear in each cell's coordinates only).
    """

    axis_sizes: tuple[tuple[str, int], ...]
    rows: str | None
    cols: str | None
    facet_axes: tuple[str, ...]
    facets: tuple[MeshFacet, ...]

    @property
    def cells(self) -> tuple[MeshCell, ...]:
        return tuple(c for f in self.facets for row in f.cells for c in row)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(facets, rows, columns)."""
        return len(self.facets), len(self.facets[0].cells), len(self.facets[0].cells[0])


def mesh_grid(mesh: Mesh | AbstractMesh, rows: str | None = None, cols: str | None = None) -> MeshGrid:
    """The devices of ``mesh`` as 2-D grids: ``cols`` / ``rows`` default to the last two axes of size > 1.

    The other axes of size > 1 become facets (one grid per combination of their values, in mesh
    order). Any number of axes works; a one-device mesh is a single cell.
    """
    sizes = dict(mesh.shape)
    for name, axis in (("rows", rows), ("cols", cols)):
        if axis is not None and axis not in sizes:
            raise ValueError(f"mesh_grid({name}={axis!r}): the mesh has axes {', '.join(sizes)}")
    if rows is not None and rows == cols:
        raise ValueError(f"mesh_grid: rows and cols are both {rows!r}; pick two different axes")
    big = [a for a, n in sizes.items() if n > 1]
    if cols is None:
        rest = [a for a in big if a != rows]
        cols = rest[-1] if rest else None
    if rows is None:
        rest = [a for a in big if a != cols]
        rows = rest[-1] if rest else None
    facet_axes = tuple(a for a in big if a not in (rows, cols))
    names = list(sizes)
    ids = _device_ids(mesh)
    devices = mesh.devices if isinstance(mesh, Mesh) else None
    positions = np.arange(ids.size).reshape(ids.shape)

    def cell(coords: dict[str, int]) -> MeshCell:
        index = tuple(coords.get(a, 0) for a in names)
        d = devices[index] if devices is not None else None
        return MeshCell(int(ids[index]), int(positions[index]), d.platform if d is not None else "abstract",
                        int(d.process_index) if d is not None else 0,
                        tuple((a, coords.get(a, 0)) for a in names))

    facets = []
    for values in itertools.product(*(range(sizes[a]) for a in facet_axes)):
        label = tuple(zip(facet_axes, values, strict=True))
        grid = tuple(tuple(cell({**dict(label), **({rows: r} if rows else {}), **({cols: c} if cols else {})})
                           for c in range(sizes[cols] if cols else 1))
                     for r in range(sizes[rows] if rows else 1))
        facets.append(MeshFacet(label, grid))
    return MeshGrid(tuple(sizes.items()), rows, cols, facet_axes, tuple(facets))


# -- mesh shapes ------------------------------------------------------------------------------------------
def axis_size_choices(n_devices: int, sizes: tp.Mapping[str, int], axis: str, rest_axis: str) -> list[int]:
    """Sizes ``axis`` may take, the other axes fixed, when ``rest_axis`` absorbs the rest of the devices.

    These are the divisors of ``n_devices / (product of the other fixed axes)``; for ``rest_axis``
    itself, the one size that completes the product.
    """
    for name in (axis, rest_axis):
        if name not in sizes:
            raise ValueError(f"unknown axis {name!r}; the axes are {', '.join(sizes)}")
    fixed = math.prod(n for a, n in sizes.items() if a not in (axis, rest_axis))
    if n_devices % fixed:
        return []
    if axis == rest_axis:
        return [n_devices // fixed]
    return divisors(n_devices // fixed)


def set_axis_size(n_devices: int, sizes: tp.Mapping[str, int], axis: str, size: int, rest_axis: str
                  ) -> dict[str, int]:
    """New sizes with ``axis = size`` and ``rest_axis`` set so the product is ``n_devices``.

    >>> set_axis_size(8, {"dp": 1, "fsdp": 8, "tp": 1}, "tp", 4, rest_axis="fsdp")
    {'dp': 1, 'fsdp': 2, 'tp': 4}
    """
    if axis == rest_axis:
        raise ValueError(f"{axis} takes the rest of the devices, so its size follows from the others; pick "
                         f"another axis to take the rest first")
    choices = axis_size_choices(n_devices, sizes, axis, rest_axis)
    if size not in choices:
        raise ValueError(f"{axis}={size} leaves no valid mesh over {n_devices} devices with the other sizes "
                         f"({', '.join(f'{a}={n}' for a, n in sizes.items() if a not in (axis, rest_axis))}); "
                         f"{axis} may be {', '.join(map(str, choices)) or 'nothing'}")
    out = dict(sizes)
    out[axis] = size
    out[rest_axis] = 1
    out[rest_axis] = n_devices // math.prod(out.values())
    return out


def reshape_mesh(mesh: Mesh, sizes: tp.Mapping[str, int]) -> Mesh:
    """A new mesh over the same devices and axis names (and types) with the given axis sizes.

    A mesh over the workbench axes (pp, dp, fsdp, ep, tp, sp) is built by ``make_mesh``; any other by
    ``jax.make_mesh``. Devices are taken in id order, as ``jax.devices()`` lists them.
    """
    import jax

    names = tuple(mesh.axis_names)
    unknown = sorted(set(sizes) - set(names))
    if unknown:
        raise ValueError(f"reshape_mesh: unknown axes {unknown}; the mesh has axes {', '.join(names)}")
    full = {a: int(sizes.get(a, 1)) for a in names}
    if math.prod(full.values()) != mesh.size or any(n < 1 for n in full.values()):
        raise ValueError(f"reshape_mesh: {' × '.join(f'{a}={n}' for a, n in full.items())} = "
                         f"{math.prod(full.values())}, but the mesh has {mesh.size} devices; the sizes must "
                         f"multiply to the device count")
    devices = sorted(mesh.devices.flat, key=lambda d: d.id)
    types = tuple(mesh.axis_types)
    if names == MESH_AXES and len(set(types)) == 1:
        return make_mesh(**full, devices=devices, axis_types=types[0])
    return jax.make_mesh(tuple(full.values()), names, axis_types=types, devices=devices)
