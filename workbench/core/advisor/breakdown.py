"""A predicted step as the sum a row's why writes (:func:`step_sum`): "step 23.8 s = matmuls 12.3 s + memory-bound
fusions 5.69 s + tp collectives 4.2 s + attention 1.59 s + other 8 ms", the largest parts named and the rest as
"other", so the parts named add up to the whole step.

A step of the measured model is the sum of its terms (:class:`~workbench.core.cost.step.Term`); a step on the
ideal roofline takes the longest of compute, HBM traffic and communication (or their sum, without overlap), plus
the pipeline's bubble."""

from __future__ import annotations

import typing as tp

from workbench.core.units import format_seconds

NAMED = 6  # at most so many parts named before the rest is "other"
_SMALL = 0.01  # a part under 1 % of the step goes into "other" (unless it is the only one left)

# the measured model's terms (step_pricing), as a row's why names them; the collectives' name their mesh axes
_LABELS = {"matmuls": "matmuls", "matmuls bound by HBM": "HBM-bound matmuls", "attention kernels": "attention",
           "attention bound by HBM": "KV-cache reads", "memory-bound fusions": "memory-bound fusions",
           "optimizer update": "optimizer", "pipeline bubble": "pipeline bubble"}
_DATA_TERM, _CRITICAL_TERM = "FSDP and gradient communication, exposed", "TP, EP and PP collectives"
_DATA_AXES, _CRITICAL_AXES = ("dp", "fsdp", "sp"), ("tp", "ep", "pp", "dp", "sp")


def step_sum(st: tp.Any) -> str:
    """``"step 23.8 s = matmuls 12.3 s + ... + other 8 ms"``: :func:`step_parts` written out, and on the ideal
    roofline what overlaps the longest part."""
    text = f"step {format_seconds(st.time_s)} = " + " + ".join(f"{name} {format_seconds(s)}"
                                                               for name, s in step_parts(st))
    hidden = _overlapped(st)
    return text + (f" ({' and '.join(hidden)} overlapped)" if hidden else "")


def step_parts(st: tp.Any) -> list[tuple[str, float]]:
    """``(name, seconds)`` of the step's parts of 1 % of it or more, largest first (at most :data:`NAMED`), then
    ``("other", seconds)`` for the rest (or its name, where one part is left): their sum is the step's time."""
    parts = sorted(((n, s) for n, s in _parts(st) if s > 0), key=lambda p: -p[1])
    named = [p for p in parts if p[1] >= _SMALL * st.time_s][:NAMED]
    rest = parts[len(named):]
    if len(rest) == 1:
        return named + rest
    return named + ([("other", sum(s for _, s in rest))] if rest else [])


def _parts(st: tp.Any) -> list[tuple[str, float]]:
    if st.terms:
        return [(_term_label(st, t.name), t.seconds) for t in st.terms]
    r = st.roofline
    work = (r.bound, r.time_s)
    bubble = ("pipeline bubble", st.bubble_s)
    if not st.overlap:
        return [work, ("collectives", st.comm_s), bubble]
    return [max(work, ("collectives", st.comm_s), key=lambda p: p[1]), bubble]


def _overlapped(st: tp.Any) -> list[str]:
    """On the ideal roofline with overlap: the parts the longest hides, with their seconds."""
    if st.terms or not st.overlap:
        return []
    r = st.roofline
    longest = _parts(st)[0][0]
    alone = (("compute", r.compute_s), ("memory", r.memory_s), ("collectives", st.comm_s))
    return [f"{name} {format_seconds(s)}" for name, s in alone if name != longest and s > 0]


def _term_label(st: tp.Any, name: str) -> str:
    """A term's name in a row's why; the collectives' with the mesh axes they run over (their roles say which)."""
    if name not in (_DATA_TERM, _CRITICAL_TERM):
        return _LABELS.get(name, name)
    critical = name == _CRITICAL_TERM
    roles = ("tp", "critical") if critical else ("gather", "grad", "ring")
    used = {a for c in st.collectives if c.role in roles for a in c.axes}
    axes = "/".join(a for a in (_CRITICAL_AXES if critical else _DATA_AXES) if a in used)
    if critical:
        return f"{axes} collectives" if axes else "critical-path collectives"
    return f"exposed {axes} collectives" if axes else "exposed data-parallel collectives"
