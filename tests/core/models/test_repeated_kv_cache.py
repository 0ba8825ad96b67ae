"""A model laid on a mesh whose tp outnumbers its KV heads (2 KV heads, tp=4) keeps its cache as serving engines do:
each KV head repeated to one per tp device. The cache's layout and contents against ``jnp.repeat`` of the unsharded
model's cache, and greedy generation against the unsharded model and the Hugging Face reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from workbench.core.mesh import explicit_mesh_of, make_mesh
from workbench.core.models import ModelConfig, from_hf_state_dict
from workbench.core.models.generation_config import GenerationConfig
from workbench.core.models.presets import tiny

MESHES = {"explicit": make_mesh(fsdp=2, tp=4, axis_types=AxisType.Explicit), "auto": make_mesh(fsdp=2, tp=4)}
EOS, PAD = 2, 0
IDS = np.random.default_rng(0).integers(3, 120, (2, 7))
MASK = np.ones((2, 7), np.int32)
MASK[1, :3] = 0  # row 1 left-padded


@pytest.fixture(scope="module", params=[4, 8], ids=["4-query-heads", "8-query-heads"])
def base(request):
    """A tiny Llama with 2 KV heads and 4 or 8 query heads (groups of 2 or 4), on one device."""
    heads = request.param
    return tiny("llama", vocab_size=128, num_attention_heads=heads)


@pytest.mark.parametrize("kind", list(MESHES))
def test_the_cache_holds_each_kv_head_repeated_one_per_tp_device(base, kind):
    mesh = MESHES[kind]
    model = base.shard_model(mesh)
    hd, layers = base.config.head_dim, base.config.num_hidden_layers
    cache = model.init_cache(2, 12)
    assert cache.keys.shape == cache.values.shape == (layers, 2, 12, 4, hd)  # 2 KV heads stored as 4
    spec = P(None, ("fsdp", "dp"), "sp", "tp", None)
    assert cache.keys.sharding.spec == cache.values.sharding.spec == spec
    assert {s.data.shape for s in cache.keys.addressable_shards} == {(layers, 1, 12, 1, hd)}  # one head a device
    assert (explicit_mesh_of(cache.keys) is mesh) == (kind == "explicit")
    with jax.default_matmul_precision("highest"):
        out = model(IDS, MASK, cache=cache)
        want = base(IDS, MASK, cache=base.init_cache(2, 12))
    assert want.cache.keys.shape[3] == 2  # without a mesh: the model's own 2 KV heads
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(want.logits), atol=2e-5)
    for got, ref in ((out.cache.keys, want.cache.keys), (out.cache.values, want.cache.values)):
        # stored head s holds KV head s // 2: query head h reads stored head h // (H / 4) = KV head h // (H / 2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.repeat(ref, 2, axis=3)), atol=2e-5)
    if kind == "explicit":  # a step's cache comes back typed as it went in
        assert [jax.typeof(x) for x in jax.tree.leaves(out.cache)] == [jax.typeof(x) for x in jax.tree.leaves(cache)]
    with jax.default_matmul_precision("highest"):  # a decode step on the repeated cache
        step = model(IDS[:, :1], cache=out.cache)
        ref = base(IDS[:, :1], cache=want.cache)
    np.testing.assert_allclose(np.asarray(step.logits), np.asarray(ref.logits), atol=2e-5)


@pytest.mark.parametrize("kind", list(MESHES))
def test_greedy_generation_on_the_repeated_cache_equals_the_unsharded_model(base, kind):
    model = base.shard_model(MESHES[kind])
    config = GenerationConfig(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    with jax.default_matmul_precision("highest"):
        want = base.generate(IDS, config, MASK).sequences
        got = model.generate(IDS, config, MASK, cache=model.init_cache(2, 15)).sequences
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("heads", [4, 8])
def test_greedy_generation_on_the_repeated_cache_matches_hf(heads):
    hf_reference = pytest.importorskip("tests.core.models.hf_reference")
    hf = hf_reference.hf_model("llama", num_attention_heads=heads, head_dim=64 // heads)
    ours = from_hf_state_dict(ModelConfig.from_hf(hf.config.to_dict()), hf_reference.state_dict(hf))
    model = ours.shard_model(MESHES["explicit"])
    ids, mask = hf_reference.batch()
    config = GenerationConfig(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    cache = model.init_cache(ids.shape[0], ids.shape[1] + 10)
    assert cache.keys.shape[3] == 4 and cache.keys.sharding.spec[3] == "tp"
    with jax.default_matmul_precision("highest"):
        got = model.generate(ids, config, mask, cache=cache).sequences
    with hf_reference.torch.no_grad():
        want = hf.generate(hf_reference.torch.tensor(ids), attention_mask=hf_reference.torch.tensor(mask),
                           do_sample=False, **config.to_hf()).numpy()
    np.testing.assert_array_equal(np.asarray(got), want)
