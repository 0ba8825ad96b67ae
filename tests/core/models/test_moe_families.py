"""DeepSeek-V3's MoE layer as switches of the one MoE (sigmoid scores, a correction bias that only picks
experts, group-limited top-k, routed scaling, a shared expert) against transformers' ``DeepseekV3MoE`` with
the same weights (float32, both strategies). GPT-OSS's and Qwen3-MoE's routings are tested through their
whole models (test_families.py and the other family tests)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import torch, transformers
from workbench.core.models.hf_moe import from_hf_experts
from workbench.core.models.moe import MoE

D, F, E, K = 16, 24, 8, 2


def deepseek_pair(norm_topk_prob: bool):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E,
                                           num_experts_per_tok=K, n_group=4, topk_group=2, n_shared_experts=1,
                                           routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    hf = DeepseekV3MoE(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn_like(p))
        hf.gate.e_score_correction_bias.copy_(0.5 * torch.randn(E))  # changes the experts of 9 tokens in 10
    ours = MoE(D, F, E, K, routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
               norm_topk_prob=norm_topk_prob, shared_intermediate_size=F, rngs=nnx.Rngs(0))
    t = lambda x: jnp.asarray(x.detach().numpy())
    gate, up, down = from_hf_experts(hf.experts.gate_up_proj.detach().numpy(), hf.experts.down_proj.detach().numpy())
    values = {"router_kernel": t(hf.gate.weight).T, "correction_bias": t(hf.gate.e_score_correction_bias),
              "gate_proj": gate, "up_proj": up, "down_proj": down,
              "shared_gate": t(hf.shared_experts.gate_proj.weight).T,
              "shared_up": t(hf.shared_experts.up_proj.weight).T,
              "shared_down": t(hf.shared_experts.down_proj.weight).T}
    for name, value in values.items():
        getattr(ours, name).set_value(jnp.asarray(value))
    return hf, ours


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("strategy", ["dense", "ragged", "alltoall"])
def test_deepseek_v3_moe_matches_hugging_face(strategy, norm_topk_prob):
    hf, ours = deepseek_pair(norm_topk_prob)
    x = np.random.default_rng(1).standard_normal((2, 5, D)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.tensor(x)).numpy()
        _, hf_weights, hf_experts = hf.gate(torch.tensor(x))
    with jax.default_matmul_precision("highest"):
        got, _ = ours(jnp.asarray(x), strategy=strategy)
        logits = jnp.asarray(x).reshape(-1, D) @ ours.router_kernel[...]
        weights, experts = ours._grouped(logits)
    assert sorted(map(tuple, np.sort(np.asarray(experts), 1))) == sorted(map(tuple, np.sort(hf_experts.numpy(), 1)))
    order = np.argsort(np.asarray(experts), 1), np.argsort(hf_experts.numpy(), 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order[0], 1),
                               np.take_along_axis(hf_weights.numpy(), order[1], 1), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_grouped_routing_checks_its_sizes():
    with pytest.raises(ValueError, match="n_group=3 equal groups"):
        MoE(D, F, E, K, routing="sigmoid_grouped", n_group=3, topk_group=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="topk_group=5"):
        MoE(D, F, E, K, routing="sigmoid_grouped", n_group=4, topk_group=5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="routing='top1'"):
        MoE(D, F, E, K, routing="top1", rngs=nnx.Rngs(0))
