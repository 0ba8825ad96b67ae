"""BaseOperation dispatch, the registry, capabilities and OperationOutput."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core import axes as ax
from workbench.core.mesh import make_mesh
from workbench.core.operations import (
    AttentionOutput,
    BaseOperation,
    Capabilities,
    OperationImpl,
    OperationMetadata,
    OperationOutput,
    OperationRegistry,
    static_field,
)


class Recorder(BaseOperation):
    """Returns the name of the method that ran."""

    def forward_native(self, x):
        return "native"


class GpuRecorder(Recorder):
    def forward_gpu(self, x):
        return "gpu"


class CpuRecorder(Recorder):
    def forward_cpu(self, x):
        return "cpu"


@pytest.fixture
def registry():
    """An empty registry for the test; the global one is restored afterwards."""
    saved = dict(OperationRegistry._registry), dict(OperationRegistry._canonical)
    OperationRegistry._registry, OperationRegistry._canonical = {}, {}
    yield OperationRegistry
    OperationRegistry._registry, OperationRegistry._canonical = saved


def make_impl(names, caps=None):
    class Impl(OperationImpl):
        capabilities = caps or Capabilities()

        @classmethod
        def get_impl_name(cls):
            return names

        def forward_native(self, x):
            return x

    Impl.__name__ = f"Impl_{names if isinstance(names, str) else names[0]}"
    return Impl


# -- dispatch -------------------------------------------------------------------------------
def test_cpu_inputs_run_forward_cpu_override():
    x = jnp.ones(3)
    assert CpuRecorder()(x) == "cpu"
    assert Recorder()(x) == "native"  # forward_cpu defaults to forward_native


@pytest.mark.parametrize("backend, cls, expected", [
    ("cuda", GpuRecorder, "gpu"), ("rocm", GpuRecorder, "gpu"), ("cuda", Recorder, "native"),
    ("tpu", GpuRecorder, "native"), ("cpu", GpuRecorder, "native"),
])
def test_backend_chain_defaults(backend, cls, expected):
    op = cls(OperationMetadata(backend=backend))
    assert op.dispatch_target(jnp.ones(2)) == f"forward_{backend}"
    assert op(jnp.ones(2)) == expected


def test_forced_native_by_metadata_or_environment(monkeypatch):
    x = jnp.ones(2)
    assert CpuRecorder(OperationMetadata(force_native=True))(x) == "native"
    monkeypatch.setenv("WORKBENCH_FORCE_NATIVE", "1")
    assert CpuRecorder()(x) == "native"
    monkeypatch.setenv("WORKBENCH_FORCE_NATIVE", "0")
    assert CpuRecorder()(x) == "cpu"


def test_dispatch_reads_the_platform_of_sharded_inputs_and_inside_jit():
    mesh = make_mesh(dp=2, tp=4)
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp", "tp")))

    class Doubler(BaseOperation):
        def forward_native(self, x):
            return x * 3

        def forward_cpu(self, x):
            return x * 2

    np.testing.assert_array_equal(Doubler()(x), 2 * np.ones((8, 4)))
    np.testing.assert_array_equal(jax.jit(Doubler())(x), 2 * np.ones((8, 4)))  # traced: default backend


def test_unknown_backend_in_metadata():
    with pytest.raises(ValueError, match="backend='gpu'"):
        OperationMetadata(backend="gpu")


# -- registry ---------------------------------------------------------------------------------
def test_register_with_aliases_get_create_list(registry):
    impl = registry.register(make_impl(("blocky", "chunky")))
    assert registry.get("blocky") is impl and registry.get("chunky") is impl
    assert registry.canonical_name("chunky") == "blocky"
    assert "blocky" in registry.list_implementations()
    assert "chunky" not in registry.list_implementations()
    assert "chunky" in registry.list_implementations(include_aliases=True)
    meta = OperationMetadata(softmax_scale=0.5)
    op = registry.create("chunky", meta)
    assert isinstance(op, impl) and op.get_impl_metadata() is meta


def test_duplicate_names_need_override(registry):
    registry.register(make_impl("dup"))
    with pytest.raises(ValueError, match=r"'dup' by Impl_dup already registered.*override=True"):
        registry.register(make_impl("dup"))
    newer = make_impl(("dup", "dup2"))
    assert registry.register(override=True)(newer) is newer
    assert registry.get("dup") is newer and registry.get("dup2") is newer


def test_override_removes_the_old_owners_aliases(registry):
    registry.register(make_impl(("orig", "orig_alias")))
    registry.register(make_impl("orig"), override=True)
    with pytest.raises(ValueError):
        registry.get("orig_alias")


def test_override_of_a_class_registered_under_two_taken_names(registry):
    """Re-running a notebook cell that registers ``("streaming", "sink")`` again: both names are taken by the
    same old class, which is dropped once (it raised KeyError on the second name)."""
    registry.register(make_impl(("streaming", "sink")))
    newer = registry.register(make_impl(("streaming", "sink")), override=True)
    assert registry.get("streaming") is newer and registry.get("sink") is newer


def test_unknown_name_lists_registered_and_closest(registry):
    registry.register(make_impl("flashy"))
    with pytest.raises(ValueError, match=r"named 'flashi'\. Did you mean 'flashy'\? Registered: \[.*'flashy'"):
        registry.get("flashi")


def test_register_rejects_non_impls(registry):
    with pytest.raises(TypeError, match="OperationImpl subclass"):
        registry.register(Recorder)


def test_capabilities_are_listed_and_queried(registry):
    caps = Capabilities(features={"causal", "gqa"}, dtypes=("float32",), backends=("cpu",), mesh_axes=("sp",))
    registry.register(make_impl("ringish", caps))
    registry.register(make_impl("plain"))
    assert registry.capabilities("ringish") == caps
    assert registry.capabilities("ringish").mesh_axes == ("sp",)
    assert "ringish" in registry.supporting("gqa") and "plain" not in registry.supporting("gqa")


# -- helpers on OperationImpl ---------------------------------------------------------------------
def test_get_mode_and_repeat_kv_heads_against_numpy():
    q = jnp.zeros((2, 1, 4, 8))
    assert OperationImpl.get_mode(q) == ax.MODE_DECODE
    assert OperationImpl.get_mode(jnp.zeros((2, 5, 4, 8))) == ax.MODE_TRAIN
    assert OperationImpl.get_mode(jnp.zeros((2, 4, 1, 8)), BTHD=False) == ax.MODE_DECODE
    k = np.random.default_rng(0).normal(size=(2, 3, 2, 4)).astype(np.float32)
    rk, rv = OperationImpl.repeat_kv_heads(jnp.asarray(k), jnp.asarray(k + 1), 3)
    np.testing.assert_array_equal(rk, np.repeat(k, 3, axis=2))  # head h of q uses kv head h // 3
    np.testing.assert_array_equal(rv, np.repeat(k + 1, 3, axis=2))


def test_create_stable_sharding():
    mesh = make_mesh(dp=2, tp=4)
    op = make_impl("stable")(OperationMetadata(mesh=mesh))
    spec = P("dp", None, "tp", None)
    assert op.create_stable_sharding(spec, [0]) == P("dp", None, None, None)
    assert op.create_stable_sharding(spec, [2], clone_ps=P(None, None, "dp", None)) == P(None, None, "dp", None)
    assert op.create_stable_sharding(spec, dep=None) is None
    # tp (4) does not divide 6 heads: dropped, the spec stays valid
    assert op.create_stable_sharding(spec, tensor=jnp.zeros((2, 3, 6, 8))) == P("dp", None, None, None)


# -- outputs -----------------------------------------------------------------------------------------
def test_attention_output_is_a_pytree_that_crosses_jit():
    out = jax.jit(lambda x: AttentionOutput(x * 2, None, kernel_path="vanilla/native"))(jnp.ones((1, 2, 3, 4)))
    assert out.kernel_path == "vanilla/native"
    np.testing.assert_array_equal(out.attention_outputs, 2 * np.ones((1, 2, 3, 4)))
    assert len(jax.tree_util.tree_leaves(out)) == 1  # the static kernel path is metadata, not a leaf


def test_output_dict_json_replace_round_trip():
    w = jax.random.uniform(jax.random.key(0), (1, 2, 3, 3))
    out = AttentionOutput(jnp.arange(6.0).reshape(1, 1, 2, 3), w, kernel_path="sdpa/xla")
    back = AttentionOutput.from_json(out.to_json())
    np.testing.assert_array_equal(back.attention_weights, w)
    assert back.attention_weights.dtype == jnp.float32 and back.kernel_path == "sdpa/xla"
    assert AttentionOutput.from_dict(out.to_dict()).kernel_path == "sdpa/xla"
    replaced = out.replace(kernel_path="flash/native")
    assert replaced.kernel_path == "flash/native" and out.kernel_path == "sdpa/xla"
    with pytest.raises(ValueError, match="no field"):
        AttentionOutput.from_dict({"outputs": 1})


def test_custom_output_subclass_with_static_fields():
    @dataclasses.dataclass(frozen=True)
    class Stats(OperationOutput):
        total: jax.Array
        name: str = static_field(default="sum")

    out = jax.jit(lambda x: Stats(x.sum(), name="s"))(jnp.ones(4))
    assert out.name == "s" and float(out.total) == 4.0
    assert Stats.from_json(out.to_json()).name == "s"
