"""Pipeline schedules as data: who runs which microbatch's forward or backward at each time step.

A model's stacked layers split into ``V = num_stages * virtual_stages`` contiguous stages; device ``d`` of
the ``pp`` axis holds stages ``d, d + p, d + 2p, ...`` (one stage each for GPipe and 1F1B, ``v`` non-adjacent
ones for the interleaved / circular schedule). Each device runs an ordered program of actions
``F(microbatch, stage)`` / ``B(microbatch, stage)``; :func:`pipeline_schedule` plays the programs out on a
clock where every action takes one tick and a result reaches the next device one tick later, so the table
is what the compiled pipeline executes (``pipeline.py`` reads its actions from it), not a drawing of it.

The programs:

- **GPipe** (Huang et al. 2019): all forwards, then all backwards. Every microbatch's stage input stays alive
  until its backward: ``m`` per device.
- **1F1B** (PipeDream-Flush, Narayanan et al. 2021): device ``d`` runs ``p - d - 1`` warm-up forwards, then
  alternates one forward, one backward, then drains. Same ticks as GPipe, at most ``p - d`` inputs alive.
- **Interleaved** (Megatron-LM, Narayanan et al. 2021, section 2.2): ``v`` stages per device visited in groups
  of ``p`` microbatches; the fill and drain shrink by ``v``. Needs ``m`` a multiple of ``p``.

Bubble fraction = idle ticks / all ticks: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B and
``(p - 1) / (v m + p - 1)`` interleaved (ticks are one stage's forward or backward, taken equal here).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing as tp

import numpy as np

from workbench.core.checks import positive_int

SCHEDULES = ("gpipe", "1f1b", "interleaved")
_ALIASES = {"circular": "interleaved", "gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved",
            "afab": "gpipe", "all-forward-all-backward": "gpipe"}
IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """``num_stages`` pipeline devices (the ``pp`` axis size), ``num_microbatches`` per step, a ``schedule``
    ("gpipe", "1f1b", "interleaved" / "circular") and, for interleaved, ``virtual_stages`` per device
    (default 2). ``uneven=True`` lets the layers split into stages of unequal depth, as real runs do when the
    stages do not divide them (Llama 3 405B: 126 layers on 16 stages, the first and last one layer short):
    :func:`~workbench.core.cost.predicted.predict_step` prices the deepest stage (:meth:`stage_layers`); the
    compiled pipeline (:mod:`workbench.core.pipeline`) runs equal stages only."""

    num_stages: int
    num_microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int | None = None
    uneven: bool = False

    def __post_init__(self):
        for name in ("num_stages", "num_microbatches"):
            object.__setattr__(self, name, positive_int(f"PipelineConfig.{name}", getattr(self, name)))
        schedule = _ALIASES.get(str(self.schedule).lower())
        if schedule is None:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; use one of {SCHEDULES} "
                             f"('circular' is another name for 'interleaved')")
        object.__setattr__(self, "schedule", schedule)
        v = self.virtual_stages
        if v is None:
            v = 2 if schedule == "interleaved" else 1
        v = positive_int("PipelineConfig.virtual_stages", v)
        if schedule == "interleaved" and v < 2:
            raise ValueError("the interleaved schedule holds several stages per device: virtual_stages >= 2 "
                             "(with one stage per device use schedule='1f1b')")
        if schedule != "interleaved" and v != 1:
            raise ValueError(f"virtual_stages={v} needs schedule='interleaved'; {schedule} holds one stage per "
                             f"device")
        if schedule == "interleaved" and self.num_microbatches % self.num_stages:
            raise ValueError(f"the interleaved schedule runs microbatches in groups of num_stages: "
                             f"num_microbatches={self.num_microbatches} must be a multiple of "
                             f"num_stages={self.num_stages} (e.g. {self.num_stages * 2})")
        object.__setattr__(self, "virtual_stages", v)

    @property
    def bubble_fraction(self) -> float:
        """The closed form of the idle share of a step: ``(p - 1) / (v m + p - 1)`` (v = 1 for GPipe and 1F1B),
        what :func:`pipeline_schedule`'s table measures when forward and backward ticks take equal time."""
        p, m, v = self.num_stages, self.num_microbatches, self.virtual_stages
        return (p - 1) / (v * m + p - 1)

    @property
    def total_stages(self) -> int:
        """``V = num_stages * virtual_stages``: how many pieces the layers are cut into."""
        return self.num_stages * self.virtual_stages

    def stage_layers(self, num_layers: int) -> int:
        """Layers of the deepest stage: :meth:`check_layers`, or with ``uneven`` the layers split as evenly as
        they go (``ceil(num_layers / total_stages)``)."""
        if self.uneven:
            if num_layers < self.total_stages:
                raise ValueError(f"{num_layers} layers cannot fill {self.total_stages} stages; use fewer stages")
            return math.ceil(num_layers / self.total_stages)
        return self.check_layers(num_layers)

    def padded_layers(self, num_layers: int) -> int:
        """The layers of equal stages as deep as the deepest (:meth:`stage_layers` x :attr:`total_stages`): what a
        step's memory is held against, the deepest stage on every device; ``num_layers`` where they split evenly.

        >>> PipelineConfig(16, 32, uneven=True).padded_layers(126), PipelineConfig(4, 8).padded_layers(80)
        (128, 80)
        """
        return self.stage_layers(num_layers) * self.total_stages

    def check_layers(self, num_layers: int) -> int:
        """Layers per stage; a ValueError that says what would divide when ``num_layers`` does not."""
        v_total = self.total_stages
        if num_layers % v_total:
            fits = [s for s in range(1, num_layers + 1) if num_layers % (s * self.virtual_stages) == 0]
            raise ValueError(f"{num_layers} layers do not split into {v_total} equal stages "
                             f"({self.num_stages} devices x {self.virtual_stages} stages each); num_stages may "
                             f"be {', '.join(map(str, fits))} for this model"
                             + (" (uneven=True is priced by predict_step; the compiled pipeline runs equal stages)"
                                if self.uneven else " (or uneven=True, priced by predict_step)"))
        return num_layers // v_total

    def check_batch(self, batch_size: int, data_ways: int = 1) -> int:
        """Rows per microbatch; a ValueError when ``num_microbatches`` (times the data-parallel ways) does not
        divide ``batch_size``."""
        need = self.num_microbatches * data_ways
        if batch_size % need:
            per = f" x {data_ways} data-parallel ways" if data_ways > 1 else ""
            fits = [m for m in range(1, batch_size + 1) if batch_size % (m * data_ways) == 0]
            raise ValueError(f"a batch of {batch_size} rows does not split into {self.num_microbatches} "
                             f"microbatches{per}; num_microbatches may be {', '.join(map(str, fits))}")
        return batch_size // self.num_microbatches


class Action(tp.NamedTuple):
    """One cell of the table: at ``tick``, ``device`` runs ``kind`` (FORWARD / BACKWARD) of ``microbatch``
    through ``stage`` (0 .. V-1)."""

    tick: int
    device: int
    stage: int
    microbatch: int
    kind: str  # "forward" | "backward"


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """The table of a schedule. ``actions`` lists every busy cell; ``grid`` is ``(ticks, devices)`` with
    IDLE / FORWARD / BACKWARD, ``microbatch`` and ``stage`` the same shape (-1 when idle)."""

    config: PipelineConfig
    actions: tuple[Action, ...]
    grid: np.ndarray
    microbatch: np.ndarray
    stage: np.ndarray

    @property
    def ticks(self) -> int:
        return self.grid.shape[0]

    @property
    def bubble_fraction(self) -> float:
        """Idle cells / all cells of the table."""
        return float(np.mean(self.grid == IDLE))

    @property
    def formula_bubble(self) -> float:
        """The closed form: ``(p - 1) / (v m + p - 1)`` (v = 1 for GPipe and 1F1B)."""
        return self.config.bubble_fraction

    def in_flight(self) -> np.ndarray:
        """Per device, the most (microbatch, stage) pairs whose forward ran and backward has not: the stage
        inputs it keeps alive for the backward (GPipe: ``v m``; 1F1B: ``p - d``)."""
        alive = np.cumsum((self.grid == FORWARD).astype(int) - (self.grid == BACKWARD), axis=0)
        return np.maximum(alive.max(axis=0), 0)

    def rows(self) -> list[dict[str, tp.Any]]:
        """The table as records (time step, device, stage, microbatch, forward|backward), for pandas."""
        return [a._asdict() for a in self.actions]


def device_program(config: PipelineConfig, device: int) -> list[tuple[int, int, int]]:
    """The ordered actions ``(FORWARD | BACKWARD, microbatch, stage)`` device ``device`` runs."""
    p, m, v = config.num_stages, config.num_microbatches, config.virtual_stages
    if config.schedule == "gpipe":
        return [(FORWARD, i, device) for i in range(m)] + [(BACKWARD, i, device) for i in range(m)]
    if config.schedule == "1f1b":
        warmup = min(p - device - 1, m)
        program = [(FORWARD, i, device) for i in range(warmup)]
        for i in range(m - warmup):
            program += [(FORWARD, warmup + i, device), (BACKWARD, i, device)]
        return program + [(BACKWARD, i, device) for i in range(m - warmup, m)]
    # Interleaved, as Megatron-LM's forward_backward_pipelining_with_interleaving orders it: the k-th
    # forward of a device is microbatch (k // pv) p + k % p on its local stage (k // p) % v; backwards
    # visit the local stages in reverse.
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int, int]:
        chunk = (k % (p * v)) // p
        chunk = chunk if forward else v - 1 - chunk
        return (FORWARD if forward else BACKWARD, (k // (p * v)) * p + k % p, chunk * p + device)

    warmup = min((p - device - 1) * 2 + (v - 1) * p, total)
    program = [unit(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        program += [unit(warmup + k, True), unit(k, False)]
    return program + [unit(k, False) for k in range(total - warmup, total)]


def pipeline_schedule(config: PipelineConfig) -> PipelineSchedule:
    """Play every device's program on a one-tick-per-action clock: a device runs its next action as soon as
    its input arrived (the previous stage's forward, the next stage's backward, both one tick earlier)."""
    if not isinstance(config, PipelineConfig):
        raise TypeError(f"pipeline_schedule takes a PipelineConfig; got {type(config).__name__}")
    p, last = config.num_stages, config.total_stages - 1
    programs = [device_program(config, d) for d in range(p)]
    cursor = [0] * p
    done: dict[tuple[int, int, int], int] = {}  # (kind, microbatch, stage) -> tick it ran
    ticks: list[list[tuple[int, int, int] | None]] = []
    limit = 4 * sum(len(prog) for prog in programs) + 4
    while any(cursor[d] < len(programs[d]) for d in range(p)):
        if len(ticks) > limit:
            raise RuntimeError(f"internal: the {config.schedule} programs deadlock")
        t = len(ticks)
        row: list[tuple[int, int, int] | None] = []
        for d in range(p):
            if cursor[d] == len(programs[d]):
                row.append(None)
                continue
            kind, i, k = programs[d][cursor[d]]
            if kind == FORWARD:
                needs = [] if k == 0 else [(FORWARD, i, k - 1)]
            else:
                needs = [(FORWARD, i, k)] + ([] if k == last else [(BACKWARD, i, k + 1)])
            row.append((kind, i, k) if all(done.get(n, t) < t for n in needs) else None)
        for d, cell in enumerate(row):
            if cell is not None:
                done[cell] = t
                cursor[d] += 1
        ticks.append(row)
    grid = np.array([[IDLE if c is None else c[0] for c in row] for row in ticks], np.int32)
    mb = np.array([[-1 if c is None else c[1] for c in row] for row in ticks], np.int32)
    stage = np.array([[-1 if c is None else c[2] for c in row] for row in ticks], np.int32)
    actions = tuple(Action(t, d, c[2], c[1], "forward" if c[0] == FORWARD else "backward")
                    for t, row in enumerate(ticks) for d, c in enumerate(row) if c is not None)
    return PipelineSchedule(config, actions, grid, mb, stage)


# -- the executor's tables and buffers (pipeline.py runs them; the ledger counts their bytes) --
# One action code per tick and device in the executor's tables.
EXECUTOR_ACTIONS = EXECUTOR_IDLE, EXECUTOR_FORWARD, EXECUTOR_FORWARD_LAST, EXECUTOR_BACKWARD = 0, 1, 2, 3


def _allocate(intervals: list[tuple[int, int, tp.Hashable]]) -> tuple[dict[tp.Hashable, int], int]:
    """Greedy slots for ``(start, end, key)`` lifetimes: a slot is reused once its last holder's end <= start."""
    ends: list[int] = []
    slot_of: dict[tp.Hashable, int] = {}
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        free = next((s for s, e in enumerate(ends) if e <= start), None)
        if free is None:
            free = len(ends)
            ends.append(end)
        ends[free] = end
        slot_of[key] = free
    return slot_of, len(ends)


def executor_tables(schedule: PipelineSchedule) -> tuple[np.ndarray, int, int]:
    """``(tables (ticks, 8, p) int32, forward slots, gradient slots)``. Per tick and device: action, microbatch,
    local stage index, stage, the input slot F and B read, the gradient slot B reads (the last stage's F
    writes it), and where this tick's incoming activation and gradient go (-1: nothing arrives)."""
    c = schedule.config
    p, last = c.num_stages, c.total_stages - 1
    when = {(a.kind, a.microbatch, a.stage): a.tick for a in schedule.actions}
    f_life, b_life = [[] for _ in range(p)], [[] for _ in range(p)]
    for a in schedule.actions:
        d, i, k = a.device, a.microbatch, a.stage
        if a.kind == "forward" and k > 0:  # arrived from stage k-1 the tick it ran; alive until its backward
            f_life[d].append((when["forward", i, k - 1], when.get(("backward", i, k), a.tick), (i, k)))
        if a.kind == "backward":
            start = when["forward", i, k] if k == last else when["backward", i, k + 1]
            b_life[d].append((start, a.tick, (i, k)))
    f_slots, b_slots = [_allocate(f) for f in f_life], [_allocate(b) for b in b_life]
    n_f, n_b = max(1, max(n for _, n in f_slots)), max(1, max(n for _, n in b_slots))
    tables = np.full((schedule.ticks, 8, p), -1, np.int32)
    tables[:, 0] = EXECUTOR_IDLE
    for a in schedule.actions:
        t, d, i, k = a.tick, a.device, a.microbatch, a.stage
        action = EXECUTOR_BACKWARD if a.kind == "backward" else EXECUTOR_FORWARD_LAST if k == last else EXECUTOR_FORWARD
        tables[t, :6, d] = (action, i, k // p, k, f_slots[d][0].get((i, k), 0), b_slots[d][0].get((i, k), 0))
        if a.kind == "forward" and k < last:  # the next stage's device stores it at the end of this tick
            tables[t, 6, (d + 1) % p] = f_slots[(d + 1) % p][0][(i, k + 1)]
        if a.kind == "backward" and k > 0:
            tables[t, 7, (d - 1) % p] = b_slots[(d - 1) % p][0][(i, k - 1)]
    tables[:, 1:6][tables[:, 1:6] < 0] = 0  # idle cells read slot 0 and ignore it
    return tables, n_f, n_b


# -- the executor --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _buffer_slots(config: PipelineConfig) -> tuple[int, int]:
    """The executor's forward and gradient buffer slots for ``config`` (memoised: the layout advisor asks for the
    same few schedules hundreds of times)."""
    return executor_tables(pipeline_schedule(config))[1:]


def activation_stash_bytes(config: PipelineConfig, *, batch_size: int, seq_len: int, hidden_size: int,
                           dtype: tp.Any = np.float32, data_ways: int = 1) -> int:
    """Bytes per device of the stage inputs (kept for the backward) and incoming gradients the schedule holds
    at its peak: the executor's buffer rows times one microbatch's ``(B / m / data_ways, T, D)`` slice.
    GPipe's grow with ``m`` (every microbatch's input waits for the backward); 1F1B's stop at ``p``."""
    n_f, n_b = _buffer_slots(config)
    rows = batch_size // config.num_microbatches // data_ways
    return (n_f + n_b) * rows * seq_len * hidden_size * np.dtype(dtype).itemsize
