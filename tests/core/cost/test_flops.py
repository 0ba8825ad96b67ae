"""train_flops against XLA: the formula's FLOPs equal the compiled step's dots, and XLA's own
``cost_analysis()['flops']`` (which also counts elementwise work) is at most 10 % above them."""

import jax
import pytest
from flax import nnx

import workbench as wb
from workbench.core.cluster import Cluster
from workbench.core.compile import steps
from workbench.core.cost.flops import train_flops
from workbench.core.cost.predicted import predict_step
from workbench.core.hlo.graph import matmul_flops


def compiled_train_step(family, batch, remat, **overrides):
    model = nnx.eval_shape(lambda: wb.models.tiny(family, **overrides))
    # unrolled: cost_analysis() counts a while loop's body (a scanned layer) once
    model = model.with_options(scan_layers=False, remat=remat)
    step = steps.abstract_step(model, wb.make_mesh(fsdp=1, devices=jax.devices()[:1]), batch=batch)
    return model, jax.jit(step.fn, donate_argnums=step.donate_argnums).lower(*step.args).compile()


@pytest.mark.parametrize("family, batch, remat, overrides", [
    ("llama", (4, 64), "none", {}),
    ("llama", (2, 128), "full", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3)),
    ("gpt2", (4, 64), "none", {}),  # GELU MLP, tied head
])
def test_train_flops_match_xla(family, batch, remat, overrides):
    model, compiled = compiled_train_step(family, batch, remat, **overrides)
    f = train_flops(model, batch, remat=remat)
    assert matmul_flops(compiled.as_text()) == f.hardware  # every dot of the program, to the FLOP
    xla = compiled.cost_analysis()["flops"]
    assert f.hardware <= xla <= 1.10 * f.hardware  # XLA adds norms, softmax, loss, AdamW: a few per cent here


def test_remat_full_adds_about_a_forward():
    model = nnx.eval_shape(lambda: wb.models.tiny("llama"))
    none, full = train_flops(model, (4, 64)), train_flops(model, (4, 64), remat="full")
    assert none.hardware == none.model and full.model == none.model
    c = model.config
    down = c.num_hidden_layers * c.hidden_size * c.intermediate_size  # not recomputed: nothing reads it
    layer_weights = none.matmul_params - c.hidden_size * c.vocab_size
    assert full.recompute_per_token == 2 * (layer_weights - down) + none.attention_per_token / 3
    assert train_flops(model, (4, 64), remat="dots_saveable").recompute_per_token == 0


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "deepseek_v3", "gemma3"])
def test_same_count_as_predict_step(family):
    config = nnx.eval_shape(lambda: wb.models.tiny(family)).config
    for remat in ("none", "full"):
        predicted = predict_step(config, Cluster.h100(gpus_per_node=1), {}, batch=(2, 32), remat=remat)
        assert train_flops(config, (2, 32), remat=remat).hardware == predicted.roofline.flops


def test_mfu_and_errors():
    f = train_flops(nnx.eval_shape(lambda: wb.models.tiny("llama")).config, (4, 64), remat="full")
    assert f.mfu(1.0, f.model) == 1.0 and f.hfu(1.0, f.model) == f.hardware / f.model > 1
    with pytest.raises(ValueError, match="remat"):
        train_flops(f, (4, 64), remat="some")
    with pytest.raises(ValueError, match="batch"):
        train_flops(nnx.eval_shape(lambda: wb.models.tiny("llama")), (4,))
