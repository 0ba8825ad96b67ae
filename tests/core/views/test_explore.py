"""The explorer's view model, checked against independent references: PartitionAxis.resolve,
NamedSharding.shard_shape, sharding.memory.memory_per_device on abstract trees, and the collectives XLA puts
in the same step compiled from real sharded arrays."""

import collections

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tests.core.stderr_file import stderr_into
from workbench.core.axes import EMPTY, FSDP, MODE_DECODE, SP, TP, VOCAB
from workbench.core.cost.ledger import Ledger
from workbench.core.hlo.collectives import collectives
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.sharding import path_str
from workbench.core.models.training import make_optimizer
from workbench.core.sharding.memory import memory_per_device
from workbench.core.views import explore

EMBED_RULE = [("embed_tokens", (TP, EMPTY))]  # the token table split over vocab only (see notebook 05)


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


@pytest.fixture(scope="module")
def llama1():
    """One layer: the collectives of a layer are the same, compiling takes half the time."""
    return tiny("llama", num_hidden_layers=1)


def abstract(family="llama", **overrides):
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(family, **overrides)))


def test_format_and_parse_are_inverse():
    for value in (None, "tp", (FSDP, "dp"), (FSDP, SP), TP):
        assert explore.parse_entry(explore.format_entry(value)) == value
    assert explore.format_entry((FSDP, "dp")) == "FSDP, dp"
    assert explore.parse_axes("[FSDP, SP], TP") == ((FSDP, SP), TP)
    assert explore.parse_axes("EMPTY, VOCAB") == (None, VOCAB)
    assert explore.format_axes(((FSDP, SP), TP)) == "[FSDP, SP], TP"
    with pytest.raises(ValueError, match="Did you mean EMBED"):
        explore.parse_axes("EMBD, TP")
    with pytest.raises(ValueError, match="semantic axis"):
        explore.parse_entry("EMBED")


def test_abstract_model_gives_the_same_layout_and_allocates_nothing(llama):
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    model = abstract()
    before = {id(x) for x in jax.live_arrays()}
    layout = explore.Layout.of(model, mesh)
    memory = explore.layout_memory(layout, kv_cache=(8, 256, jnp.float32))
    explore.step_collectives(model, layout, batch=(8, 16))
    assert {id(x) for x in jax.live_arrays()} <= before
    live = explore.Layout.of(llama, mesh)
    assert layout.specs == live.specs and memory.params == live.param_bytes
    # lazy_init with a mesh places ShapeDtypeStructs by the same specs
    placed = CausalLM.lazy_init(llama.config, mesh=mesh)
    assert memory_per_device(nnx.state(placed, nnx.Param)).max == layout.param_bytes


def test_layout_memory_against_abstract_trees(llama):
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    layout = explore.Layout.of(llama, mesh)
    memory = explore.layout_memory(layout, kv_cache=(8, 128, jnp.bfloat16))
    assert isinstance(memory, Ledger) and memory.kind == "state"  # the ledger's record, a step's parts left out
    assert memory.total == memory.params + memory.optimizer + memory.kv_cache
    # optimizer: optax's own AdamW state (float32 model: float32 moments), placed as to_state places it
    shardings = layout.shardings()
    params = nnx.map_state(lambda p, v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[
        path_str(p)])), nnx.state(llama, nnx.Param))
    optimizer = make_optimizer()
    opt_state = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(optimizer, lambda s, p: p.sharding, opt_state, params,
                                          transform_non_params=lambda s: replicated)
    reference = memory_per_device(opt_state, opt_shardings)
    assert set(reference.per_device.values()) == {memory.optimizer}
    # KV cache: the model's own cache, batch over (fsdp, dp) and kv heads over tp
    cache = jax.eval_shape(lambda: llama.init_cache(8, 128, dtype=jnp.bfloat16))
    shape, spec, reason = explore.kv_cache_spec(layout, 8, 128)
    assert shape == cache.keys.shape[1:] and spec == PartitionSpec(("fsdp", "dp"), "sp", "tp", None)
    assert "dim0 BATCH: sharded 4 ways over fsdp×dp" in reason and "dim2 KV_HEAD: sharded 2 ways over tp" in reason
    kv_tree = (cache.keys, cache.values)  # (L, B, S, KV, D): every layer's slice laid out as one layer's
    reference = memory_per_device(kv_tree, NamedSharding(mesh, PartitionSpec(None, *spec)))
    assert set(reference.per_device.values()) == {memory.kv_cache}
    assert reference.logical == cache.keys.size * cache.keys.dtype.itemsize * 2
    assert explore.layout_memory(layout, optimizer=None).total == layout.param_bytes


def test_diff_lists_changed_specs_and_the_memory_delta(llama):
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    old = explore.Layout.of(llama, mesh)
    new = old.replace(llama, partition_axis=old.partition_axis.replace(tensor_parallel_axis="dp"))
    d = explore.diff(old, new, optimizer="adamw")
    want = [p.path for p, q in zip(old.params, new.params, strict=True) if p.spec != q.spec]
    assert [c.path for c in d.changed] == want and want
    assert all(c.new_spec == new[c.path].spec and c.old_spec == old[c.path].spec for c in d.changed)
    assert d.delta == (explore.layout_memory(new).total - explore.layout_memory(old).total)
    assert explore.diff(old, old).changed == () and explore.diff(old, old).delta == 0
    with pytest.raises(ValueError, match="same model"):
        explore.diff(old, explore.Layout.of(abstract("mixtral"), mesh))


def _reference_collectives(model, layout, batch):
    """The same forward compiled the ordinary way (default compiler options) from real placed arrays."""
    placed = nnx.state(explore.apply(model, layout)[0], nnx.Param)
    graphdef, _, other = nnx.split(model, nnx.Param, ...)
    spec = layout.partition_axis.resolve(explore.INPUT_AXES, shape=batch, mesh=layout.mesh)
    ids = jax.device_put(jnp.zeros(batch, jnp.int32), NamedSharding(layout.mesh, spec))
    return collectives(lambda p, ids: nnx.merge(graphdef, p, other)(ids).logits, placed, ids)


def _multiset(records):
    return collections.Counter((r.kind, r.mesh_axes, r.bytes) for r in records)


def test_tensor_parallel_forward_all_reduces_over_tp_as_xla_compiles_it(llama1):
    llama = llama1
    layout = explore.Layout.of(llama, make_mesh(dp=4, fsdp=1, tp=2))
    sc = explore.step_collectives(abstract(num_hidden_layers=1), layout, kind="forward", batch=(8, 16))
    assert sc.input_spec == PartitionSpec(("fsdp", "dp"), "sp")
    assert {(r.kind, r.mesh_axes) for r in sc.records} == {("all-reduce", ("tp",))}
    # per layer: attention output and MLP output partial sums; plus the vocab-split head
    assert sc.summary["all-reduce"]["count"] >= 2 * llama.config.num_hidden_layers
    assert sc.warnings == ()
    assert _multiset(sc.records) == _multiset(_reference_collectives(llama, layout, (8, 16)))


def test_fsdp_gathers_weights_in_the_forward_and_all_reduces_gradients(llama1):
    llama = llama1
    layout = explore.Layout.of(llama, make_mesh(fsdp=8), rules=EMBED_RULE)
    forward = explore.step_collectives(llama, layout, kind="forward", batch=(8, 16))
    assert {(r.kind, r.mesh_axes) for r in forward.records} == {("all-gather", ("fsdp",))}
    # each fsdp-split kernel gathered whole, once; a stacked one a layer at a time, inside the layer scan
    n = llama.config.num_hidden_layers
    kernels = sorted((p.shape[1:], n) if p.path.startswith("layers/") else (p.shape, 1)
                     for p in layout.params if p.shard_shape != p.shape)
    assert sorted((r.shape, r.trips) for r in forward.records) == kernels
    train = explore.step_collectives(llama, layout, kind="train", batch=(8, 16))
    kinds = {(r.kind, r.mesh_axes) for r in train.records}
    assert ("all-gather", ("fsdp",)) in kinds
    # XLA:CPU all-reduces the gradients (then keeps each device's slice); GPU/TPU rewrite it to a reduce-scatter
    assert kinds & {("all-reduce", ("fsdp",)), ("reduce-scatter", ("fsdp",))}
    reduced = sum(r.bytes for r in train.records if r.kind in ("all-reduce", "reduce-scatter"))
    assert reduced >= sum(p.nbytes for p in layout.params if p.shard_shape != p.shape)  # every split gradient


def test_xla_warnings_are_captured_without_their_log_prefix():
    line = ("W1122 12:57:02.022634   11999 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. "
            "The compiler cannot go from sharding A to B")
    assert list(explore._xla_warnings([line, "plain text"])) == [
        "[SPMD] Involuntary full rematerialization. The compiler cannot go from sharding A to B"]


def test_apply_places_params_as_the_layout_says_and_leaves_the_model(llama):
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    layout = explore.Layout.of(llama, mesh, rules=EMBED_RULE, mode=MODE_DECODE)
    placed, seconds = explore.apply(llama, layout)
    assert seconds > 0
    for path, var in nnx.to_flat_state(nnx.state(placed, nnx.Param)):
        assert var.get_value().sharding == NamedSharding(mesh, layout[path_str(path)].spec)
    for _, var in nnx.to_flat_state(nnx.state(llama, nnx.Param)):
        assert len(var.get_value().sharding.device_set) == 1
    with pytest.raises(ValueError, match="live model"):
        explore.apply(abstract(), layout)


def test_step_matmul_flops_count_every_layer():
    """Matmul FLOPs of a forward on dp=8 against a hand count: 2 x tokens per device x every matmul weight
    (q, k, v, o, gate, up, down in each layer, and the LM head) plus the attention's two T x T products
    per head and sequence. XLA's cost_analysis() counts the layer scan's body once; this counts each layer."""
    model = abstract("llama", num_hidden_layers=4)
    c = model.config
    b, t = 8, 64
    step = explore.step_collectives(model, explore.Layout.of(model, make_mesh(dp=8, fsdp=1)), batch=(b, t))
    d, f, h, kv, hd = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * f
    tokens = b * t // 8
    matmuls = 2 * tokens * (c.num_hidden_layers * per_layer + d * c.vocab_size)
    attention = c.num_hidden_layers * (b // 8) * 2 * 2 * t * t * h * hd
    assert step.matmul_flops == matmuls + attention


def test_other_threads_stderr_is_not_lost_while_a_step_compiles(llama1, tmp_path, monkeypatch):
    """step_collectives points fd 2 at XLA's log reader: a line another thread writes meanwhile reaches stderr
    while the compile runs (not held until it ends), and XLA's warnings still reach the result."""
    import contextlib
    import os
    import threading
    import time

    layout = explore.Layout.of(llama1, make_mesh(dp=2, fsdp=2, tp=2))
    target = tmp_path / "stderr.txt"
    real, live = explore._xla_log_lines, []

    @contextlib.contextmanager
    def probed():  # inside the capture: another thread writes a line; does the terminal get it now?
        with real() as log:
            writer = threading.Thread(target=os.write, args=(2, b"from another thread\n"))
            writer.start()
            writer.join()
            deadline = time.monotonic() + 5
            while "from another thread" not in target.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
            live.append("from another thread" in target.read_text())
            yield log

    monkeypatch.setattr(explore, "_xla_log_lines", probed)
    stop = threading.Event()

    def chatter():
        i = 0
        while not stop.is_set():
            os.write(2, f"other thread line {i}\n".encode())
            i += 1
            stop.wait(0.005)

    with stderr_into(target):  # this test's stand-in for the terminal
        thread = threading.Thread(target=chatter)
        thread.start()
        try:
            sc = explore.step_collectives(llama1, layout, kind="forward", batch=(8, 64))
        finally:
            stop.set()
            thread.join(10)
        os.write(2, b"after\n")
    written = target.read_text().splitlines()
    assert live == [True]
    numbers = [int(line.rsplit(" ", 1)[1]) for line in written if line.startswith("other thread line")]
    assert numbers == list(range(len(numbers))) and len(numbers) > 1  # every line, in order
    assert written[-1] == "after"
    assert not any(explore._xla_warnings(written))  # XLA's log was kept from the terminal
    assert sc.warnings and "Involuntary full rematerialization" in sc.warnings[0]
