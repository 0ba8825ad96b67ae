"""ZeRO-1: the optimizer state split over dp. Where the split goes (hand cases), that a ZeRO-1 train step equals the
unsharded one (a single-device step is the reference), the ledger against XLA's TPU compiler and against the
ZeRO paper's memory formula, the step model's communication, and the export round trip."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from workbench.core.advisor import Constraints, advise
from workbench.core.compile.steps import full_mesh_shape
from workbench.core.compile.virtual import TPU_HBM_ONLY, compile_step
from workbench.core.cost.ledger import ledger, libtpu_version
from workbench.core.cost.predicted import predict_step
from workbench.core.hardware.cluster import Cluster, cluster_mesh
from workbench.core.mesh import MESH_AXES, make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny, tiny_config
from workbench.core.models.training import from_state, make_train_step, to_state
from workbench.core.views.explore import Layout
from workbench.core.zero import check_zero_stage, optimizer_spec

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')
SIZES = {"pp": 1, "dp": 8, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}


@pytest.mark.parametrize(("spec", "shape", "want"), [
    (P(None, "tp"), (4096, 1024), P("dp", "tp")),  # the larger block takes dp
    (P(("fsdp",), "tp"), (64, 4096), P(("fsdp",), ("tp", "dp"))),  # 16 rows per fsdp shard < 2048 per tp shard
    (P(), (8,), P("dp")),  # a norm scale of 8 splits 8 ways
    (P(), (6,), P()),  # 6 does not divide by 8: the state stays whole
    (P("dp", None), (64, 64), P("dp", None)),  # dp already splits the parameter: nothing to add
])
def test_the_state_takes_dp_on_its_largest_dimension_that_divides(spec, shape, want):
    assert optimizer_spec(spec, shape, SIZES) == want
    assert optimizer_spec(spec, shape, SIZES, zero_stage=0) == spec
    assert optimizer_spec(spec, shape, {**SIZES, "dp": 1}) == spec


def test_other_stages_say_what_each_is():
    with pytest.raises(ValueError, match="ZeRO-3 is the 'fsdp' axis"):
        check_zero_stage(3)
    with pytest.raises(ValueError, match="zero_stage must be 0"):
        Layout.of(tiny("llama"), make_mesh(dp=8, fsdp=1), zero_stage=2)


def _axes(sharding) -> set[str]:
    """The mesh axes a sharding's spec names (not a substring test: "fsdp" contains "dp")."""
    entries = getattr(sharding, "spec", ())
    return {a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))}


def _params(state):
    return [(path, np.asarray(v.get_value())) for path, v in nnx.to_flat_state(nnx.state(from_state(state), nnx.Param))]


@pytest.mark.parametrize(("optimizer", "reference", "atol"), [
    (optax.sgd(0.1, momentum=0.9), "one device", 1e-5),
    # Adam divides by the root of the second moment: a gradient summed in another order over dp moves a
    # near-zero coordinate by ~3e-5 against one device; against dp=8 without the split it is the same sum
    (optax.adamw(1e-2), "dp=8", 1e-6),
])
def test_a_zero_1_train_step_equals_the_unsplit_step(optimizer, reference, atol):
    """Two steps on dp=8 with the optimizer state split 8 ways: the parameters of the reference step."""
    model = tiny("llama")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 16)), jnp.int32)
    step = make_train_step()
    sharded = model.shard_model(make_mesh(dp=8, fsdp=1))
    split = lambda state: [x for x in jax.tree.leaves(state.opt_state) if "dp" in _axes(x.sharding)]
    with jax.default_matmul_precision("highest"):
        plain = to_state(model if reference == "one device" else sharded, optimizer)
        zero = to_state(sharded, optimizer, zero_stage=1)
        assert split(zero) and not split(plain)
        for _ in range(2):
            plain, _ = step(plain, {"input_ids": ids})
            zero, _ = step(zero, {"input_ids": ids})
    assert split(zero)  # the step kept the split
    for (path, a), (_, b) in zip(_params(plain), _params(zero), strict=True):
        np.testing.assert_allclose(b, a, atol=atol, err_msg=str(path))


@needs_libtpu
@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_ledger_matches_a_zero_1_step_compiled_for_a_tpu_slice(remat):
    """XLA's TPU compiler's HBM peak for a bfloat16 Llama on dp=8 with the optimizer state split over dp; the
    compiled step also holds the gradients split (measured -0.3 % / +4.9 %)."""
    cluster, mesh_shape, batch = Cluster.tpu("v5p:2x2x2", libtpu=libtpu_version()), {"dp": 8}, (32, 256)
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(
        "llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=4, vocab_size=1024)),
        dtype=jnp.bfloat16, param_dtype=jnp.bfloat16).with_options(remat=remat)
    compiled = compile_step(model, cluster, mesh_shape, batch=batch, zero_stage=1, compiler_options=TPU_HBM_ONLY)
    layout = Layout.of(model, cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES), zero_stage=1)
    predicted = ledger(model, layout, batch=batch, cluster=cluster)
    assert predicted.total == pytest.approx(compiled.memory.total, rel=0.10)
    plain = ledger(model, layout.replace(model, zero_stage=0), batch=batch, cluster=cluster)
    assert plain.optimizer == pytest.approx(8 * predicted.optimizer, rel=0.01)


def test_model_states_follow_the_zero_paper():
    """Rajbhandari et al., "ZeRO" (SC'20), section 5.1 / Figure 1: with Adam, model states take (2 + 2 + K) Psi
    bytes per device in data parallelism and 2 Psi + (2 + K) Psi / N_d with the optimizer state and gradients
    partitioned (P_os+g). Here bfloat16 parameters and gradients and optax's AdamW moments in bfloat16: K = 4.
    Llama-3-8B on 64 H100s, dp=64."""
    model = CausalLM.lazy_init(full_config("llama-3-8b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cluster = Cluster.h100(nodes=8)
    mesh = cluster_mesh(cluster, full_mesh_shape({"dp": 64}, cluster), MESH_AXES)
    psi = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    states = lambda led: led.params + led.grads + led.optimizer
    plain = ledger(model, Layout.of(model, mesh), batch=(64, 1024), cluster=cluster)
    zero = ledger(model, Layout.of(model, mesh, zero_stage=1), batch=(64, 1024), cluster=cluster)
    assert states(plain) == pytest.approx((2 + 2 + 4) * psi, rel=1e-3)
    assert states(zero) == pytest.approx(2 * psi + (2 + 4) * psi / 64, rel=1e-3)


def test_the_cluster_s_libtpu_release_decides_the_parameter_copy_not_the_one_installed_here(monkeypatch):
    """From libtpu 0.0.50 a ZeRO-1 step on XLA:TPU holds a working copy of the parameters beside their donated
    buffers (measured: the ledger module doc). On dp=8, with every array's optimizer state split over dp, the
    copy is the whole of the parameters per device; a cluster naming 0.0.42 has none, and a cluster naming no
    release is predicted as the newest measured, whatever libtpu this machine has installed."""
    model = CausalLM.lazy_init(full_config("llama-3-8b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    mesh = cluster_mesh(Cluster.h100(), full_mesh_shape({"dp": 8}, Cluster.h100()), MESH_AXES)
    layout = Layout.of(model, mesh, zero_stage=1)
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    total = {release: ledger(model, layout, batch=(8, 1024), cluster=Cluster.tpu("v5p:2x2x2", libtpu=release)).total
             for release in ((0, 0, 42, 1), (0, 0, 50, 1), None)}
    assert total[0, 0, 50, 1] - total[0, 0, 42, 1] == params
    for installed in ((0, 0, 42, 1), (0, 0, 50, 1), None):
        monkeypatch.setattr("workbench.core.cost.ledger.libtpu_version", lambda installed=installed: installed)
        assert ledger(model, layout, batch=(8, 1024), cluster=Cluster.tpu("v5p:2x2x2")).total == total[0, 0, 50, 1]
    assert total[None] == total[0, 0, 50, 1]
    with pytest.raises(ValueError, match="tuple of integers"):
        Cluster.tpu("v5p:2x2x2", libtpu="0.0.50")


def test_zero_1_moves_data_parallelism_s_bytes_and_a_dp_th_of_the_optimizer_traffic():
    """ZeRO (section 7): stages 1 and 2 communicate as data parallelism does (a reduce-scatter and an all-gather
    are an all-reduce); the update reads and writes 1 / N_d of the state."""
    config, cluster = full_config("llama-3-8b"), Cluster.h100(nodes=8)
    kw = dict(batch=(64, 1024), remat="full")
    plain = predict_step(config, cluster, {"dp": 64}, **kw)
    zero = predict_step(config, cluster, {"dp": 64}, zero_stage=1, **kw)
    dp_time = lambda st: sum(c.total_s for c in st.collectives if c.axes == ("dp",))
    assert dp_time(zero) == pytest.approx(dp_time(plain), rel=1e-6)
    assert {c.kind for c in zero.collectives if c.axes == ("dp",)} == {"reduce-scatter", "all-gather"}
    part = lambda st: next(p for p in st.parts if p.kind == "optimizer").hbm_bytes
    assert part(zero) == pytest.approx(part(plain) / 64)


def test_the_advisor_offers_zero_1_where_data_parallelism_would_not_fit():
    """Llama-3-8B on 64 H100s held to dp=64: 8 bytes a parameter of model states (64 GiB) and activations overflow
    80 GiB; ZeRO-1's 2.1 bytes a parameter fit. The exported layout keeps the stage."""
    model = CausalLM.lazy_init(full_config("llama-3-8b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cluster = Cluster.h100(nodes=8)
    advice = advise(model, cluster, batch_tokens=64 * 4096, seq_len=4096, remat="full",
                    constraints=Constraints(fixed={"dp": 64}))
    assert [c.zero_stage for c in advice.ranked] == [1] and advice.best.label.endswith(", ZeRO-1")
    assert [c.zero_stage for c in advice.rejected] == [0]
    assert advice.rejected[0].reason.endswith("with ZeRO-1 it fits (24.0 GiB)"), advice.rejected[0].reason
    without = advise(model, cluster, batch_tokens=64 * 4096, seq_len=4096, remat="full",
                     constraints=Constraints(fixed={"dp": 64}, zero=False))
    assert not without.ranked
    layout = advice.best.layout(model, cluster)
    again = Layout.from_json(layout.to_json(cluster=cluster), model)
    assert again.zero_stage == 1 and again == layout
    scope = {"model": model}
    exec(layout.to_code(cluster=cluster), scope)
    assert scope["layout"] == layout
