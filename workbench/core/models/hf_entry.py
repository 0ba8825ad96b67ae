"""Where one of our parameters comes from in a Hugging Face checkpoint: the tensor's name and how it converts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where a parameter comes from: tensor ``name`` (with ``{i}`` for the layer when ``layered``),
    converted by ``kind``; ``part`` picks q/k/v from GPT-2's fused tensor ("qkv"), or gate/up from GPT-OSS's
    interleaved one ("interleave": columns ``part::2``)."""

    name: str
    kind: str = "copy"
    part: int = 0
    layered: bool = False
    first: int = 0  # the checkpoint's layer number of the stack's layer 0 (a MoE model's dense layers come first)
    rope: str = ""  # "q" / "kv": the rope columns of MLA's query / kv_a projection are interleaved on disk

    def at(self, layer: int | None) -> Entry:
        """This entry for layer ``layer`` of its stack (``name`` formatted, no longer layered)."""
        if not self.layered:
            return self
        return dataclasses.replace(self, name=self.name.format(i=self.first + layer), layered=False, first=0)
