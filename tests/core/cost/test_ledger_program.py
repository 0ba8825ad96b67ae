"""The program as production runs it, in the ledger (workbench/core/cost/ledger.py): a flash attention kernel, the
loss in vocabulary tiles, saved activations offloaded to the host, sequence parallelism inside tensor parallelism.
Each held against a hand count of the arrays it adds or removes."""

import re

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

from workbench.core.compile.virtual import compile_step
from workbench.core.cost.activations import SCORE_BYTES, activation_bytes, layer_set
from workbench.core.cost.ledger import LOGITS_COPIES, ledger
from workbench.core.hardware.cluster import Cluster
from workbench.core.mesh import MESH_AXES
from workbench.core.plan import PRODUCTION, Plan
from workbench.core.views.explore import Layout
from workbench.models import CausalLM, ModelConfig, tiny_config

HEADS, HIDDEN, LAYERS = 4, 128, 2


def _mesh(**sizes):
    shape = tuple(sizes.get(name, 1) for name in MESH_AXES)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def _model(**overrides):
    config = ModelConfig.from_hf(tiny_config("llama", hidden_size=HIDDEN, num_attention_heads=HEADS,
                                             num_key_value_heads=HEADS, num_hidden_layers=LAYERS, **overrides))
    return CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def test_flash_keeps_no_scores_only_a_float32_log_sum_exp_per_head():
    """Without remat the XLA program keeps the probabilities once in bfloat16 and once in float32 (6 bytes a score:
    the layer scan's stacked score arrays XLA:TPU compiles, one bf16 and one f32); dots_saveable keeps QK^T in
    float32 (4); a flash kernel keeps its log-sum-exp, 4 bytes per query and head."""
    model, t = _model(), 256
    layout = Layout.of(model, _mesh(fsdp=2))
    xla = layer_set(layout, t_kv=t)
    flash = layer_set(layout, t_kv=t, attention="flash")
    per_row = lambda s, remat: s.bytes_per_row(remat, 2)
    assert per_row(xla, "none") - per_row(flash, "none") == HEADS * t * (2 + 4) - HEADS * 4
    assert per_row(xla, "dots_saveable") - per_row(flash, "dots_saveable") == HEADS * (t - 1) * 4
    assert per_row(xla, "full") == per_row(flash, "full")


def test_the_compiled_layer_scan_stacks_two_score_sized_arrays_without_remat():
    """XLA:CPU's own compile of the train step is the reference: the forward layer scan's stacked outputs of one
    score per (layer, row, head, query, key) are two (float32 here: XLA:CPU computes bfloat16 in float32), as
    many as the ledger's ``"none"`` set counts a score. The softmax's shift is a ``stop_gradient``; with the gradient
    through the max it stacked a third, the mask of the row maxima."""
    t = 96  # not the hidden size, so no weight matches the score's shape
    model = _model().with_options(remat="none")
    compiled = compile_step(model, Cluster.cpu(2), {"fsdp": 2}, batch=(2, t))
    stacked = [re.findall(rf"\w+\[{LAYERS},[0-9,]+,{t},{t}\]", line.split(" while(")[0])
               for line in compiled.hlo_text.splitlines() if " while(" in line]
    forward = max(stacked, key=len)
    assert len(forward) == 2
    xla, flash = (layer_set(Layout.of(model, _mesh(fsdp=2)), t_kv=t, attention=a) for a in ("xla", "flash"))
    per_score = (sum(xla.none) - sum(flash.none) + HEADS) / (HEADS * t)  # elements a score, the flash lse aside
    assert per_score == len(forward)


def test_flash_has_no_score_sized_backward_phase():
    """On XLA:TPU the XLA attention's backward holds SCORE_BYTES a score (b t H t of them); flash holds none, so a
    long sequence's working set falls to the layer's backward."""
    model, batch = _model(), (2, 4096)
    layout = Layout.of(model, _mesh(fsdp=2))
    xla = activation_bytes(layout, batch, "full", jnp.bfloat16)
    flash = activation_bytes(layout, batch, "full", jnp.bfloat16, attention="flash")
    scores = 1 * 4096 * HEADS * 4096  # one sequence a device
    assert xla.working >= SCORE_BYTES["tpu"]["full"] * scores
    assert flash.working < scores  # not a byte a score
    assert flash.kept == xla.kept


def test_vocab_tiles_divide_the_loss_phase():
    """The loss's logits, LOGITS_COPIES float32 copies of b t V, held one tile at a time."""
    model, batch = _model(vocab_size=32768), (8, 64)
    layout = Layout.of(model, _mesh(fsdp=2))
    vocab = model.config.vocab_size
    loss = LOGITS_COPIES["tpu"] * 4 * 64 * vocab * 4  # 4 sequences a device
    whole = ledger(model, layout, batch=batch, remat="full", attention="flash")
    tiled = ledger(model, layout, batch=batch, remat="full", attention="flash", vocab_tiles=4)
    assert whole.temporaries == pytest.approx(loss, rel=0.01)  # the loss is this step's largest phase
    layer = activation_bytes(layout, batch, "full", jnp.bfloat16, attention="flash").working  # the other phase
    assert tiled.temporaries == pytest.approx(max(loss / 4, layer), rel=0.01)
    assert loss / 4 > layer / 2  # the tiles still weigh: the assertion above is not the layer's alone


def test_offload_moves_the_saved_activations_to_the_host_and_keeps_two_layers():
    model, batch = _model(), (8, 64)
    layout = Layout.of(model, _mesh(fsdp=2))
    on_device = ledger(model, layout, batch=batch, remat="full")
    offloaded = ledger(model, layout, batch=batch, remat="full", offload=True)
    one_layer = 4 * 64 * HIDDEN * 2  # remat="full": each layer's bfloat16 input, 4 sequences a device
    assert on_device.activations == LAYERS * one_layer
    assert offloaded.host == LAYERS * one_layer
    assert offloaded.activations == min(2, LAYERS) * one_layer
    assert offloaded.total == on_device.total - on_device.activations + offloaded.activations
    with pytest.raises(ValueError, match="offload=False"):
        ledger(model, layout, kind="prefill", batch=batch, offload=True)


def test_sequence_parallel_splits_the_layer_input_over_tp():
    """remat="full" keeps each layer's input, (b, t, D): with sequence parallelism each tp device keeps t / tp of
    its positions (Megatron-LM's --sequence-parallel, Korthikanti et al. 2022, section 4.2.2)."""
    model, batch = _model(), (8, 64)
    layout = Layout.of(model, _mesh(fsdp=2, tp=4))
    whole = ledger(model, layout, batch=batch, remat="full")
    split = ledger(model, layout, batch=batch, remat="full", sequence_parallel=True)
    assert whole.activations == LAYERS * 4 * 64 * HIDDEN * 2
    assert split.activations == whole.activations // 4
    no_tp = Layout.of(model, _mesh(fsdp=8))
    assert ledger(model, no_tp, batch=batch, remat="full", sequence_parallel=True).activations == \
        ledger(model, no_tp, batch=batch, remat="full").activations


def test_a_plan_names_the_program_and_refuses_what_is_not_one():
    assert Plan({"fsdp": 8}).program() == {"attention": "xla", "vocab_tiles": 1, "offload": False,
                                           "sequence_parallel": False, "autograd": "jax"}  # as ledger's defaults
    assert Plan({"fsdp": 8}, **PRODUCTION).program() == PRODUCTION
    with pytest.raises(ValueError, match="attention must be one of"):
        Plan({"fsdp": 8}, attention="splash")
    with pytest.raises(ValueError, match="vocab_tiles"):
        Plan({"fsdp": 8}, vocab_tiles=0)
    with pytest.raises(ValueError, match="autograd must be one of"):
        Plan({"fsdp": 8}, autograd="torch")
    with pytest.raises(TypeError, match="offload is True or False"):
        Plan({"fsdp": 8}, offload="yes")


# GPT-3 175B as Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), Table 3
# lays it out: hidden h = 12288, a = 96 heads, s = 2048, tensor parallelism t = 8; a LayerNorm and GELU MLP of 4h.
GPT3 = dict(hidden_size=12288, intermediate_size=4 * 12288, num_hidden_layers=2, num_attention_heads=96,
            num_key_value_heads=96, head_dim=128, vocab_size=50304, tie_word_embeddings=True, mlp_type="gelu",
            hidden_act="gelu", norm_type="layer", position_embedding="learned")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pytorch_autograd_keeps_korthikanti_s_count(sequence_parallel):
    """Without remat a PyTorch layer keeps, in bytes a token, ``(10 + 24 / t) h`` (their eq. 2, with flash attention
    no ``5 a s / (h t)`` term) or ``34 h / t`` with sequence parallelism (eq. 4), less their two dropout masks (``h``
    each, split like the rest): ``(8 + 24 / t) h`` and ``32 h / t``; plus the flash kernel's float32 log-sum-exp per
    local head, which their count predates. JAX's residuals keep more (float32 norm arrays, GELU's five)."""
    h, a, t, s = 12288, 96, 8, 2048
    model = CausalLM.lazy_init(ModelConfig(**GPT3), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    layout = Layout.of(model, _mesh(fsdp=1, tp=t))
    torch = layer_set(layout, t_kv=s, attention="flash", sequence_parallel=sequence_parallel, autograd="pytorch")
    want = (32 * h / t if sequence_parallel else (8 + 24 / t) * h) + 4 * a / t
    assert torch.bytes_per_row("none", 2) == want
    jax_set = layer_set(layout, t_kv=s, attention="flash", sequence_parallel=sequence_parallel)
    assert jax_set.bytes_per_row("none", 2) > 1.5 * want
    # the other policies keep the same either way
    assert (torch.full, torch.dots_saveable) == (jax_set.full, jax_set.dots_saveable)


def test_pytorch_autograd_counts_a_gated_mlp_s_four_arrays_and_the_probabilities_of_plain_attention():
    """SwiGLU keeps gate, up, silu(gate) and the product (4F), not JAX's six; without a flash kernel the
    probabilities, one per score in the model's dtype, and no float32 copies; the ledger and a Plan carry it."""
    model = _model(intermediate_size=256)
    layout = Layout.of(model, _mesh(fsdp=8))
    s, d, f = 64, HIDDEN, 256
    torch = layer_set(layout, t_kv=s, attention="xla", autograd="pytorch")
    assert torch.none == (4 * d + 3 * d + d + HEADS * s + 4 * f, 0)  # norms in/out, q k v, output, probs, MLP
    batch = (8, s)
    kept = ledger(model, layout, batch=batch, remat="none", attention="xla", autograd="pytorch").activations
    assert kept == LAYERS * torch.bytes_per_row("none", 2) * s
    assert Plan({"fsdp": 8}, autograd="pytorch").program()["autograd"] == "pytorch"
    with pytest.raises(ValueError, match="autograd must be one of"):
        ledger(model, layout, batch=batch, autograd="torch")
