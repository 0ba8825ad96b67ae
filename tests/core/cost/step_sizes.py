"""A :class:`~workbench.core.cost.step_counts.StepSizes` written by hand for the tests of the step model's pieces:
every field given, none derived by the code under test."""

from workbench.core.cost.step_counts import StepSizes
from workbench.core.mesh import MESH_AXES


def hand_step(mesh: dict[str, int] | None = None, **fields) -> StepSizes:
    """A bf16 train step of one device's ``tokens`` (default 8 sequences of 16) with no remat; ``fields`` override."""
    sizes = {axis: 1 for axis in MESH_AXES} | (mesh or {})
    base = dict(sizes=sizes, task="train", train=True, decode=False, batch_axes=("fsdp", "dp"),
                token_axes=frozenset({"fsdp", "dp", "sp"}), zero=False, pipelined=False, sequences=8, length=16,
                tokens=128, kv_span=16, head_tokens=128, microbatches=1, virtual_stages=1, stacked_layers=2,
                bubble=0.0, remat_passes=0, recompute=0, recompute_any=False, item_bytes=2, weight_item_bytes=2,
                kv_item_bytes=2, rate="bf16",
                causal=True, attention="flash", vocab_tiles=1, capacity_factor=None, experts_fsdp=True,
                layers_attention=2, layers_dense=2, layers_moe=0)
    return StepSizes(**(base | fields))
