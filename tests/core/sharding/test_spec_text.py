"""spec_text: one grammar for mesh specs, semantic axes and PartitionAxis fields; each reader resolves its names."""

import pytest
from jax.sharding import PartitionSpec as P

from workbench.core.axes import EMBED, FSDP, SP, TP, VOCAB
from workbench.core.sharding.spec_text import format_axes, format_entry, parse_axes, parse_entry, parse_spec


@pytest.mark.parametrize("text, axes", [
    ("[FSDP, SP], TP", ((FSDP, SP), TP)),
    ("(FSDP, SP), TP", ((FSDP, SP), TP)),  # the same groups as a spec's
    ("'FSDP', \"TP\"", (FSDP, TP)),  # quoted names
    ("EMPTY, None, _, VOCAB", (None, None, None, VOCAB)),
    ("[], [EMBED]", (None, EMBED)),
])
def test_semantic_axes_read_like_a_spec(text, axes):
    assert parse_axes(text) == axes
    assert parse_axes(format_axes(axes)) == axes


def test_the_same_text_reads_as_mesh_axes_or_semantic_axes():
    assert parse_spec("(fsdp, sp), None") == P(("fsdp", "sp"), None)
    assert parse_axes("(FSDP, SP), None") == ((FSDP, SP), None)


@pytest.mark.parametrize("text, message", [
    ("FSDP TP", "expected ',' before 'TP'"),
    ("[[FSDP], TP]", "a group holds semantic axis names only"),
    ("[FSDP, EMPTY]", "a group holds semantic axis names only, found 'EMPTY'"),
    ("(FSDP, SP", "a group is not closed"),
    ("FSDP; TP", "unexpected ';' at position 4; semantic axis names are identifiers"),
    ("'FSDP", "unclosed quote"),
])
def test_semantic_axes_errors_say_what_was_read(text, message):
    with pytest.raises(ValueError, match=f"cannot read .* as semantic axes: {message}"):
        parse_axes(text)


def test_a_field_is_one_entry():
    assert parse_entry("FSDP, dp") == parse_entry("(FSDP, dp)") == (FSDP, "dp")
    assert parse_entry("") is parse_entry("None") is parse_entry("()") is None
    assert format_entry((FSDP, "dp")) == "FSDP, dp" and parse_entry("'tp'") == "tp"
    with pytest.raises(ValueError, match="one field holds names, not several dimensions"):
        parse_entry("(FSDP, dp), tp")
    with pytest.raises(ValueError, match="semantic axis; a field maps to mesh axes"):
        parse_entry("EMBED")
