"""Specs and semantic axes as text: one grammar, two readers.

The grammar: entries separated by commas, one per dimension. An entry is a name (bare, an identifier such
as ``fsdp`` or ``KV_HEAD``; or quoted, any text), a group of names for one dimension, ``(a, b)`` or
``[a, b]``, or ``None`` / ``_`` / ``-`` / ``EMPTY`` for a dimension left whole. The readers differ only in
what a name resolves to: :func:`parse_spec` reads mesh axes into a ``PartitionSpec``, :func:`parse_axes`
semantic axes (``FSDP``, ``KV_HEAD``, ...) one entry per dimension, :func:`parse_entry` one
:class:`~workbench.core.axes.PartitionAxis` field (mesh axes or roles). ``format_*`` write what they read.

>>> parse_spec("(fsdp, sp), None")
P(('fsdp', 'sp'), None)
>>> parse_axes("[FSDP, SP], TP") == ((ax.FSDP, ax.SP), ax.TP)
True
"""

from __future__ import annotations

import dataclasses
import typing as tp

from jax.sharding import PartitionSpec

from workbench.core import axes as ax

__all__ = ["EMPTY_WORDS", "format_axes", "format_entry", "format_spec", "parse_axes", "parse_entry", "parse_spec"]

Entry = str | tuple[str, ...] | None
EMPTY_WORDS = ("None", "_", "-", "EMPTY")  # a dimension left whole


# -- the grammar --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Reader:
    """How errors name what is read: ``cannot read 'x' as {what}: ...; {hint}``."""

    what: str  # "a PartitionSpec"
    names: str  # "mesh axis names", in "a group holds ... only"
    identifiers: str  # "mesh axis names are identifiers such as fsdp or tp"
    hint: str  # what to write instead


_MESH = _Reader("a PartitionSpec", "mesh axis names", "mesh axis names are identifiers such as fsdp or tp",
                "write mesh axes separated by commas, a group of axes for one dimension as (a, b), None for an "
                "unsharded dimension, e.g. '(fsdp, sp), tp'")
_SEMANTIC = _Reader("semantic axes", "semantic axis names", "semantic axis names are identifiers such as FSDP or "
                    "KV_HEAD", "write one semantic axis per dimension separated by commas, a group for one "
                    "dimension as [a, b], EMPTY for an unsharded dimension, e.g. '[FSDP, SP], TP'")
_FIELD = _Reader("a PartitionAxis field", "mesh axis or role names", "mesh axes and roles are identifiers such "
                 "as dp or FSDP", "write mesh axes or roles separated by commas, e.g. 'FSDP, dp', or None")


def _entries(text: str, body: str, reader: _Reader) -> list[Entry]:
    """The entries of ``body`` (``text`` less any wrapper): a name, a tuple of names, or None per dimension."""
    tokens = _tokens(text, body, reader)
    entries: list[Entry] = []
    pos = 0

    def fail(why: str) -> tp.NoReturn:
        raise ValueError(f"cannot read {text!r} as {reader.what}: {why}; {reader.hint}")

    while pos < len(tokens):
        kind, value = tokens[pos]
        if kind == "name":
            entries.append(None if value in EMPTY_WORDS else value)
            pos += 1
        elif kind == "open":
            group: list[str] = []
            pos += 1
            while pos < len(tokens) and tokens[pos][0] != "close":
                if tokens[pos][0] != "name" or tokens[pos][1] in EMPTY_WORDS:
                    fail(f"a group holds {reader.names} only, found {tokens[pos][1]!r}")
                group.append(tokens[pos][1])
                pos += 1
                if pos < len(tokens) and tokens[pos][0] == "comma":
                    pos += 1
                elif pos < len(tokens) and tokens[pos][0] != "close":
                    fail(f"expected ',' or ')' after {group[-1]!r}")
            if pos == len(tokens):
                fail("a group is not closed")
            pos += 1
            entries.append(None if not group else group[0] if len(group) == 1 else tuple(group))
        else:
            fail(f"unexpected {value!r}")
        if pos < len(tokens):
            if tokens[pos][0] != "comma":
                fail(f"expected ',' before {tokens[pos][1]!r}")
            pos += 1
    return entries


def _tokens(text: str, body: str, reader: _Reader) -> list[tuple[str, str]]:
    """('name' | 'open' | 'close' | 'comma', text) tokens; bare names are identifiers, quoted ones anything."""
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch.isspace():
            i += 1
        elif ch in "([":
            out.append(("open", ch))
            i += 1
        elif ch in ")]":
            out.append(("close", ch))
            i += 1
        elif ch == ",":
            out.append(("comma", ch))
            i += 1
        elif ch in "'\"":
            end = body.find(ch, i + 1)
            if end < 0:
                raise ValueError(f"cannot read {text!r} as {reader.what}: unclosed quote")
            out.append(("name", body[i + 1:end]))
            i = end + 1
        elif ch.isalpha() or ch in "_-":
            j = i + 1
            while j < len(body) and (body[j].isalnum() or body[j] in "_-."):
                j += 1
            out.append(("name", body[i:j]))
            i = j
        else:
            raise ValueError(f"cannot read {text!r} as {reader.what}: unexpected {ch!r} at position {i}; "
                             f"{reader.identifiers} (quote any other name)")
    return out


def _names(entry: Entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


# -- mesh axes: a PartitionSpec -------------------------------------------------------------------------
def format_spec(spec: PartitionSpec) -> str:
    """A spec as the text :func:`parse_spec` reads: ``P(('fsdp', 'sp'), None)`` -> ``"(fsdp, sp), None"``."""
    parts = []
    for entry in spec:
        names = _names(entry)
        parts.append("None" if not names else names[0] if isinstance(entry, str) else f"({', '.join(names)})")
    return ", ".join(parts)


def parse_spec(text: str) -> PartitionSpec:
    """A PartitionSpec from text: ``"fsdp, tp"``, ``"(fsdp, sp), None"``, ``"P('dp', None)"``, ``""``.

    Names may be quoted or bare; a group of axes for one dimension is ``(a, b)`` or ``[a, b]``;
    ``None`` (or ``_``, ``-``) leaves a dimension unsharded. Raises ``ValueError`` saying what to fix.

    >>> parse_spec("(fsdp, sp), None")
    P(('fsdp', 'sp'), None)
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_spec needs a str such as 'fsdp, tp'; got {type(text).__name__}")
    body = text.strip()
    for prefix in ("PartitionSpec(", "P("):
        if body.startswith(prefix) and body.endswith(")"):
            body = body[len(prefix):-1]
            break
    return PartitionSpec(*_entries(text, body, _MESH))


# -- semantic axes and PartitionAxis fields (what the explorer's rules editor reads and writes) ----------
_LABELS = {ax.label(name): name for name in ax.semantic_names()}  # "FSDP" -> "__FULLY_SHARDED...__"
_ROLES = (ax.DP, ax.FSDP, ax.EP, ax.TP, ax.SP)


def format_axes(axes: tp.Any) -> str:
    """Semantic axes (a preset or a list) as text: ``[FSDP, SP], TP``."""
    entries = axes.axes if hasattr(axes, "axes") else axes
    return ", ".join(ax.label(e) if isinstance(e, str) or e is None else
                     "[" + ", ".join(ax.label(n) for n in e) + "]" for e in entries)


def parse_axes(text: str) -> tuple[ax.AxisEntry, ...]:
    """Semantic axes from text, one entry per dimension: ``"[FSDP, SP], TP"``, ``"EMPTY, VOCAB"``."""
    entries = _entries(text, text, _SEMANTIC)
    if not entries:
        raise ValueError("give one semantic axis per dimension, e.g. '[FSDP, SP], TP' or 'EMPTY, VOCAB'")
    resolved = [tuple(_semantic_name(n) for n in _names(e)) for e in entries]
    return tuple(names[0] if len(names) == 1 else names or None for names in resolved)


def _semantic_name(token: str) -> str:
    if token in _LABELS:
        return _LABELS[token]
    ax._check_name(token)  # raises with a close match
    return token


def format_entry(value: ax.AxisEntry) -> str:
    """A PartitionAxis field value as text: ``None``, ``tp``, ``FSDP, dp`` (roles by their label)."""
    if value is None:
        return "None"
    values = (value,) if isinstance(value, str) else value
    return ", ".join(ax.label(v) if v in _LABELS.values() else v for v in values)


def parse_entry(text: str) -> ax.AxisEntry:
    """The inverse of :func:`format_entry`: ``"None"``/empty -> None, ``"FSDP, dp"`` -> ``(FSDP, "dp")``
    (one field: the names, bare or as one group, are that field's mesh axes and roles)."""
    entries = _entries(text, text, _FIELD)
    if len(entries) == 1 and not isinstance(entries[0], str):
        tokens = _names(entries[0])
    elif all(isinstance(e, str) for e in entries):
        tokens = tuple(entries)
    else:
        raise ValueError(f"cannot read {text!r} as {_FIELD.what}: one field holds names, not several "
                         f"dimensions; {_FIELD.hint}")
    out = []
    for token in tokens:
        if token in _LABELS and _LABELS[token] not in _ROLES:
            raise ValueError(f"{token} is a semantic axis; a field maps to mesh axes (e.g. tp) or roles "
                             f"(DP, FSDP, EP, TP, SP)")
        out.append(_LABELS.get(token, token))
    return None if not out else out[0] if len(out) == 1 else tuple(out)
