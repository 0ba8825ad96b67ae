"""The Mixtral MoE layer against Hugging Face ``MixtralSparseMoeBlock`` (float32, random weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from workbench.core.axes import HiddenStateSharding, PartitionAxis
from workbench.core.hlo.collectives import collectives
from workbench.core.mesh import make_mesh
from workbench.core.models.hf_moe import (
    from_hf_experts,
    from_hf_moe,
    from_legacy_experts,
    load_hf_moe,
    to_hf_experts,
    to_hf_moe,
    to_legacy_experts,
)
from workbench.core.models.moe import MoE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402

D, F, B, T = 32, 48, 2, 5
STRATEGIES = ("dense", "ragged", "alltoall")


def hf_block(E, k):
    torch.manual_seed(E * 10 + k)
    config = transformers.MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                        num_experts_per_tok=k)
    config._experts_implementation = "eager"  # HF's per-expert loop, the plainest reference
    block = MixtralSparseMoeBlock(config).float().eval()
    with torch.no_grad():  # std 0.5 for the router so the routing is far from uniform
        for name, p in block.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if name.startswith("gate") else 0.1))
    return block


def hf_tensors(block):
    return {k: v.detach().numpy() for k, v in block.state_dict().items()}


def ours(block, E, k, strategy="dense"):
    return load_hf_moe(MoE(D, F, E, k, strategy=strategy, rngs=nnx.Rngs(0)), hf_tensors(block))


def inputs(seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)


@pytest.mark.parametrize("E,k", [(4, 2), (8, 2), (4, 1), (4, 4)])
def test_matches_hugging_face(E, k):
    block, x = hf_block(E, k), inputs()
    with torch.no_grad():
        want_y = block(torch.tensor(x)).numpy()
        want_logits = block.gate(torch.tensor(x).reshape(-1, D))[0].numpy()
    moe = ours(block, E, k)
    with jax.default_matmul_precision("highest"):
        for strategy in STRATEGIES:
            y_BTD, logits_NE = moe(jnp.asarray(x), strategy=strategy)
            assert y_BTD.shape == (B, T, D) and logits_NE.shape == (B * T, E)
            np.testing.assert_allclose(y_BTD, want_y, atol=1e-5, rtol=0, err_msg=strategy)
            np.testing.assert_allclose(logits_NE, want_logits, atol=1e-5, rtol=0, err_msg=strategy)


def test_fused_weight_round_trip():
    block = hf_block(4, 2)
    t = hf_tensors(block)
    gate, up, down = from_hf_experts(t["experts.gate_up_proj"], t["experts.down_proj"])
    assert gate.shape == up.shape == (4, D, F) and down.shape == (4, F, D)
    # gate rows come first in gate_up_proj (HF chunks them gate, up)
    np.testing.assert_array_equal(gate[1], t["experts.gate_up_proj"][1, :F].T)
    for back, want in zip(to_hf_experts(gate, up, down), (t["experts.gate_up_proj"], t["experts.down_proj"]),
                          strict=True):
        np.testing.assert_array_equal(back, want)
    jax_back = to_hf_experts(*from_hf_experts(jnp.asarray(t["experts.gate_up_proj"]),
                                              jnp.asarray(t["experts.down_proj"])))
    assert isinstance(jax_back[0], jax.Array)
    np.testing.assert_array_equal(jax_back[0], t["experts.gate_up_proj"])
    params = from_hf_moe(t)
    assert {k: v.shape for k, v in params.items()} == {"router_kernel": (D, 4), "gate_proj": (4, D, F),
                                                       "up_proj": (4, D, F), "down_proj": (4, F, D)}
    assert to_hf_moe(params).keys() == t.keys()
    for name, value in to_hf_moe(params).items():
        np.testing.assert_array_equal(value, t[name])


def test_legacy_weight_round_trip():
    t = hf_tensors(hf_block(4, 2))
    prefix = "model.layers.0.block_sparse_moe."
    # The on-disk form, built as transformers' conversion mapping reads it: gate_up = cat(w1, w3).
    legacy = {f"{prefix}gate.weight": t["gate.weight"]}
    for j in range(4):
        legacy[f"{prefix}experts.{j}.w1.weight"] = t["experts.gate_up_proj"][j, :F]
        legacy[f"{prefix}experts.{j}.w3.weight"] = t["experts.gate_up_proj"][j, F:]
        legacy[f"{prefix}experts.{j}.w2.weight"] = t["experts.down_proj"][j]
    from_fused, from_legacy = from_hf_moe(t), from_hf_moe(legacy, prefix)
    for name in from_fused:
        np.testing.assert_array_equal(from_legacy[name], from_fused[name])
    back = to_hf_moe(from_legacy, prefix, legacy=True)
    assert back.keys() == legacy.keys()
    for name, value in back.items():
        np.testing.assert_array_equal(value, legacy[name])
    experts = from_legacy_experts(legacy, f"{prefix}experts.")
    assert to_legacy_experts(*experts, prefix="e.").keys() == {f"e.{j}.{w}.weight" for j in range(4)
                                                               for w in ("w1", "w2", "w3")}


def place(state, mesh):
    pa = PartitionAxis()
    put = lambda v: v.replace(jax.device_put(v[...], NamedSharding(mesh, pa.resolve(v.semantic_axes, shape=v.shape,
                                                                                      mesh=mesh))))
    return jax.tree.map(put, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


@pytest.mark.parametrize("mesh_sizes", [dict(ep=4, fsdp=2), dict(ep=2, tp=2, fsdp=2)])
def test_sharded_over_experts(mesh_sizes):
    mesh = make_mesh(**mesh_sizes)
    moe, x = ours(hf_block(8, 2), 8, 2), jnp.asarray(inputs(1))
    graphdef, state = nnx.split(moe)
    state_sharded = place(state, mesh)
    assert state_sharded["gate_proj"][...].sharding.spec[0] == "ep"
    x_sharded = jax.device_put(x, NamedSharding(mesh, PartitionAxis().resolve(HiddenStateSharding, shape=x.shape,
                                                                              mesh=mesh)))
    expert_bytes = D * F * 4 // mesh_sizes.get("tp", 1)  # one expert's gate matrix on one device
    with jax.default_matmul_precision("highest"):
        for strategy in STRATEGIES:
            fn = jax.jit(lambda s, x, strategy=strategy: nnx.merge(graphdef, s)(x, strategy=strategy))
            want_y, want_logits = moe(x, strategy=strategy)
            y, logits = fn(state_sharded, x_sharded)
            np.testing.assert_allclose(y, want_y, atol=1e-5, rtol=0, err_msg=strategy)
            np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0, err_msg=strategy)
            records = collectives(fn, state_sharded, x_sharded)
            # The expert outputs are partial sums over the ep-sharded expert axis: an all-reduce over ep ...
            assert any(r.kind == "all-reduce" and "ep" in r.mesh_axes for r in records), (strategy, records)
            # ... and no device ever gathers another device's experts.
            assert all(r.bytes < expert_bytes for r in records if r.kind == "all-gather" and "ep" in r.mesh_axes)
            if "tp" in mesh_sizes and strategy == "dense":  # the down projection contracts the tp-sharded F
                assert any(r.kind == "all-reduce" and "tp" in r.mesh_axes for r in records), records


def test_gradients_match_between_strategies():
    moe, x = ours(hf_block(4, 2), 4, 2), jnp.asarray(inputs(2))
    graphdef, state = nnx.split(moe)

    def loss(state, strategy):
        y, logits = nnx.merge(graphdef, state)(x, strategy=strategy)
        return jnp.sum(jnp.sin(y)) + 0.1 * jnp.sum(logits ** 2)

    with jax.default_matmul_precision("highest"):
        grads = {s: jax.jit(jax.grad(loss), static_argnums=1)(state, s) for s in STRATEGIES}
    for name in ("router_kernel", "gate_proj", "up_proj", "down_proj"):
        dense, ragged = grads["dense"][name][...], grads["ragged"][name][...]
        assert np.isfinite(dense).all() and np.abs(dense).max() > 0, name
        np.testing.assert_allclose(ragged, dense, atol=1e-5, rtol=0, err_msg=name)


def test_bad_inputs():
    moe = MoE(D, F, 4, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden_size=32"):
        moe(jnp.ones((B, T, D + 1)))
    with pytest.raises(ValueError, match="hidden_size=32"):
        moe(jnp.ones((B * T, D)))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        MoE(D, F, 4, 5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="router_jitter_noise"):
        MoE(D, F, 4, 2, router_jitter_noise=0.01, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="strategy"):
        moe(jnp.ones((B, T, D)), strategy="sparse")
    with pytest.raises(ValueError, match="build MoE with the checkpoint's sizes"):
        load_hf_moe(MoE(D, F, 8, 2, rngs=nnx.Rngs(0)), hf_tensors(hf_block(4, 2)))
    with pytest.raises(ValueError, match="no router weight"):
        from_hf_moe(hf_tensors(hf_block(4, 2)), "model.layers.0.mlp.")


def test_load_returns_a_new_module():
    moe = MoE(D, F, 4, 2, rngs=nnx.Rngs(0))
    before = np.asarray(moe.gate_proj[...])
    loaded = load_hf_moe(moe, hf_tensors(hf_block(4, 2)))
    np.testing.assert_array_equal(moe.gate_proj[...], before)
    assert not np.array_equal(loaded.gate_proj[...], before)
    assert loaded.gate_proj.semantic_axes == moe.gate_proj.semantic_axes
