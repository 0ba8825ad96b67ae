"""The dispatch report (what the views show of expert parallelism) against the alltoall strategy itself
on a mesh, and against a hand count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workbench.core.mesh import make_mesh
from workbench.core.models.moe import MoE
from workbench.core.models.sharding import shard_model
from workbench.core.views.expert_dispatch import dispatch_report, dropped_copies, expert_parallel_summary, token_groups

D, F, E, K = 16, 24, 8, 2


@pytest.mark.parametrize("b, t", [(4, 6), (2, 7)])  # 7 tokens a shard: ep=4 shares of 2, 2, 2, 1
def test_dropped_copies_equal_what_alltoall_drops_on_a_mesh(b, t):
    mesh = make_mesh(dp=2, fsdp=1, ep=4)
    layer = MoE(D, F, E, K, strategy="alltoall", capacity_factor=1.0, rngs=nnx.Rngs(0))
    layer.router_kernel.set_value(layer.router_kernel[...] * 40)  # uneven loads: drops happen
    x = jnp.asarray(np.random.default_rng(1).standard_normal((b, t, D)), jnp.float32)
    _, dispatch = jax.jit(lambda m, x: m.dispatch(x))(shard_model(layer, mesh), x)
    shards, split, share = token_groups(b, t, mesh)
    assert (shards, split, share) == (2, 4, -(-(b * t // 2) // 4))
    _, _, experts_NK = layer.route(x.reshape(-1, D), layer.router_kernel[...])
    slots = max(1, min(share, int(np.ceil(1.0 * share * K / E))))
    assert int(dispatch.dropped) > 0
    assert dropped_copies(np.asarray(experts_NK), shards, share, slots, E) == int(dispatch.dropped)


def test_report_counts_every_layer_by_hand():
    from workbench.models import tiny

    model = tiny("mixtral")
    ids = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (4, 8)), jnp.int32)
    report = dispatch_report(model, ids, mesh=make_mesh(dp=2, fsdp=1, ep=4), capacity_factor=1.0)
    assert (report.groups, report.share, report.slots) == (8, 4, 2)  # 16 tokens a dp shard, 4 per ep device
    logits = np.asarray(model(ids).router_logits)
    for layer in range(model.config.num_hidden_layers):
        top = np.argsort(-logits[layer], axis=1, kind="stable")[:, :K]  # softmax keeps the logits' order
        lost = 0
        for g in range(8):  # 4 tokens each, 2 slots per expert, copies in token order
            used = np.zeros(4, int)
            for n in range(4 * g, 4 * g + 4):
                for e in top[n]:
                    used[e] += 1
                    lost += used[e] > 2
        assert report.dropped_L[layer] == lost
        np.testing.assert_array_equal(report.tokens_per_expert_LE[layer], np.bincount(top.ravel(), minlength=4))
    assert dispatch_report(model, ids, capacity_factor=None).dropped_fraction == 0
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        dispatch_report(tiny("llama"), ids)


def test_expert_parallel_summary_of_live_and_abstract_models():
    from workbench.core.models import CausalLM
    from workbench.core.views import explore
    from workbench.models import tiny

    model = tiny("mixtral")
    layout = explore.Layout.of(model, make_mesh(dp=2, fsdp=1, ep=4))
    summary = expert_parallel_summary(model, layout, batch=(8, 32), capacity_factor=1.25)
    assert len(summary.all_to_alls) == 2 and all(r.trips == model.config.num_hidden_layers for r in summary.all_to_alls)
    assert {r.kind for r in summary.dense.records} >= {"all-reduce"} and "all-to-all" not in {
        r.kind for r in summary.dense.records}
    assert 0 < summary.flops_vs_dense < 1
    assert summary.dispatch is not None and summary.dispatch.slots == 20  # 32 tokens a device, 2 of 4 experts
    abstract = CausalLM.lazy_init(model.config)
    abstract_layout = explore.Layout.of(abstract, make_mesh(dp=2, fsdp=1, ep=4))
    assert expert_parallel_summary(abstract, abstract_layout, batch=(8, 32)).dispatch is None
