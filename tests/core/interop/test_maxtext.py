"""MaxText YAML <-> TrainingRecipe: published recipes (tests/core/interop/recipes/maxtext_*.yml, each citing its
source) parse to the numbers they state, price on a matching cluster, and survive a round trip; bad input says
what to change."""

import dataclasses
import pathlib
import types

import pytest

from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.maxtext import from_maxtext, to_maxtext
from workbench.core.interop.recipe import TrainingRecipe, recipe_of
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config
from workbench.core.pipeline_schedule import PipelineConfig

RECIPES = pathlib.Path(__file__).parent / "recipes"


# -- published recipes: the numbers their files state ------------------------------------------------------------
def test_gpu_llama3_8b():
    r = from_maxtext(RECIPES / "maxtext_gpu_llama3_8b.yml", num_devices=8)
    assert r.mesh_shape == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}  # base.yml ici_fsdp -1 fills
    assert r.batch == (12 * 8, 8192)  # per_device_batch_size 12, max_target_length 8192
    assert (r.remat, r.source_remat, r.model, r.zero_stage) == ("dots_saveable", "minimal_with_context", "llama3-8b", 3)
    assert any("minimal_with_context" in n for n in r.notes)
    assert r.price(full_config("llama-3-8b"), Cluster.h100(nodes=1)).time_s > 0


def test_v6e_llama3_1_405b_two_slices():
    r = from_maxtext(RECIPES / "maxtext_v6e_llama3_1_405b_pure_fsdp_2slices.yml")
    assert r.mesh_shape["fsdp"] == 256 * 2 and r.devices == 512  # ici_fsdp 256 x dcn_fsdp 2
    assert r.dcn_shape["fsdp"] == 2 and r.slices == 2
    assert r.batch == (512, 8192)  # per_device_batch_size 1
    assert (r.source_remat, r.remat, r.offload) == ("custom", "full", True)  # only the layer's input kept: offloaded
    assert (r.attention, r.sequence_parallel) == ("flash", False)  # no tensor parallelism
    assert r.price(cluster=Cluster.tpu("v6e:16x16", slices=2)).time_s > 0  # model_name llama3.1-405b's preset
    with pytest.raises(ValueError, match=r"slices=2"):
        r.price(full_config("llama-3.1-405b"), Cluster.tpu("v5p:8x8x8"))


def test_v6e_llama3_1_70b_long_context_fractional_batch():
    r = from_maxtext(RECIPES / "maxtext_v6e_llama3_1_70b_129024.yml", num_devices=256)
    assert (r.mesh_shape["fsdp"], r.mesh_shape["sp"]) == (32, 8)  # ici_sequence 8, ici_fsdp -1 -> 256 / 8
    assert r.batch == (32, 129024)  # per_device_batch_size 0.125 x 256 devices
    assert r.price(full_config("llama-3-70b"), Cluster.tpu("v6e:16x16")).time_s > 0


def test_v6e_deepseek_v3_expert_parallel():
    r = from_maxtext(RECIPES / "maxtext_v6e_deepseek_v3_ep16.yml")
    assert (r.mesh_shape["fsdp"], r.mesh_shape["ep"], r.dcn_shape["fsdp"]) == (32, 16, 2)
    assert r.batch == (512, 8192)
    assert set(r.batch_axes) == {"fsdp", "ep"}  # base.yml's activation_batch splits over 'expert' too
    assert r.model == "deepseek3-671b"
    assert r.price(full_config("deepseek-v3"), Cluster.tpu("v6e:16x16", slices=2)).time_s > 0


def test_circular_pipeline_test_config_resolves_on_a_model():
    r = from_maxtext(RECIPES / "maxtext_circular_pipeline_test.yml", num_devices=4)
    # 4 stages x 2 layers per stage over 32 layers: 4 repeats; 8 microbatches
    assert r.pipeline == PipelineConfig(4, 8, "interleaved", 4)
    assert (r.mesh_shape["pp"], r.num_layers, r.batch) == (4, 32, (8, 1024))
    assert any("circular" in n for n in r.notes)
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=32)))
    layout = r.layout(model, Cluster.tpu("v5e:2x2"))
    assert layout.pipeline == r.pipeline and dict(layout.mesh.shape)["pp"] == 4
    assert TrainingRecipe.from_layout(layout, batch=r.batch, program=r.program).same_run(r)  # a Layout has none


@pytest.mark.parametrize("name, devices", [("maxtext_gpu_llama3_8b.yml", 8),
                                           ("maxtext_v6e_llama3_1_405b_pure_fsdp_2slices.yml", None),
                                           ("maxtext_v6e_llama3_1_70b_129024.yml", 256),
                                           ("maxtext_v6e_deepseek_v3_ep16.yml", None),
                                           ("maxtext_circular_pipeline_test.yml", 4)])
def test_published_recipes_round_trip(name, devices):
    r = from_maxtext(RECIPES / name, num_devices=devices)
    text = to_maxtext(r)
    assert text.startswith("# Written by workbench")
    assert from_maxtext(text) == r  # the source's remat name kept, its notes too


# -- round trips of workbench recipes ---------------------------------------------------------------------------
ROUND_TRIP = [  # each in a program MaxText runs: its embed activations split over tensor (sequence parallel)
    TrainingRecipe({"fsdp": 8, "tp": 4}, (64, 4096), "full", zero_stage=3, sequence_parallel=True),
    TrainingRecipe({"dp": 2, "fsdp": 4}, (16, 2048), "dots_saveable", zero_stage=1),
    TrainingRecipe({"fsdp": 4, "sp": 4}, (12, 32768), "none", grad_accumulation=3, zero_stage=3),
    TrainingRecipe({"pp": 4, "fsdp": 2}, (32, 2048), "full", zero_stage=3, pipeline=PipelineConfig(4, 8, "gpipe")),
    TrainingRecipe({"pp": 2, "tp": 4}, (16, 2048), "full", pipeline=PipelineConfig(2, 4, "interleaved", 2),
                   num_layers=8, sequence_parallel=True, attention="flash", vocab_tiles=4),
    TrainingRecipe({"fsdp": 8}, (64, 8192), "full", zero_stage=3, attention="flash", offload=True),
    TrainingRecipe({"fsdp": 8}, (64, 8192), "dots_saveable", zero_stage=3, offload=True),
    TrainingRecipe({"fsdp": 4, "ep": 4}, (32, 4096), "full", zero_stage=3, axis_rules=(("batch_axis", ("fsdp",)),)),
    TrainingRecipe({"dp": 4, "fsdp": 64}, (512, 8192), "full", zero_stage=3, dcn_shape={"dp": 4}),
    TrainingRecipe({"fsdp": 256}, (32, 8192), "full", zero_stage=3),  # per_device_batch_size 0.125
]


@pytest.mark.parametrize("recipe", ROUND_TRIP, ids=lambda r: r._shape_text())
def test_round_trip(recipe):
    assert from_maxtext(to_maxtext(recipe)).same_run(recipe)


def test_export_says_what_maxtext_cannot_express():
    r = TrainingRecipe({"pp": 4}, (8, 1024), pipeline=PipelineConfig(4, 8, "1f1b"))
    text = to_maxtext(r)
    assert "1F1B" in text.splitlines()[1]
    assert from_maxtext(text).pipeline == PipelineConfig(4, 8, "gpipe")  # MaxText's own order


def test_candidate_exports():
    candidate = types.SimpleNamespace(mesh_shape={"pp": 1, "dp": 2, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1},
                                      remat="dots_saveable", pipeline=None, zero_stage=1)
    r = recipe_of(candidate, (64, 4096))
    assert (r.zero_stage, r.devices) == (1, 16)
    text = to_maxtext(r)
    assert "ici_tensor_parallelism: 2" in text and "shard_optimizer_over_data: true" in text
    # the workbench's own program keeps the residual stream whole over tp; MaxText's splits it, and says so
    assert "the residual stream whole over tp" in text.splitlines()[1]
    assert from_maxtext(text).same_run(dataclasses.replace(r, sequence_parallel=True))


def test_logical_axis_rules():
    text = ("ici_fsdp_parallelism: 4\nici_expert_parallelism: 2\ndcn_data_parallelism: 1\n"
            "logical_axis_rules: [['activation_batch', ['data', 'fsdp']], ['embed', ['fsdp']], ['mystery', []]]\n"
            "unknown_key_maxtext_has: 7\n")
    r = from_maxtext(text)
    assert "ep" not in r.batch_axes  # the file keeps the batch off 'expert'
    assert any("'embed'" in n for n in r.notes) and any("mystery" in n for n in r.notes)
    assert "['activation_batch', ['fsdp']]" in to_maxtext(r)


# -- bad input: each error says what to change --------------------------------------------------------------------
@pytest.mark.parametrize("text, match", [
    ("ici_tensor_parallelism: four\nici_fsdp_parallelism: 1", r"ici_tensor_parallelism must be a positive integer"),
    ("ici_tensor_parallelism: 0\nici_fsdp_parallelism: 1", r"ici_tensor_parallelism"),
    ("ici_tensor_parallelism: 4", r"ici_fsdp_parallelism = -1 .* needs num_devices="),
    ("ici_tensor_parallelism: -1", r"at most one axis may fill the rest"),
    ("ici_fsdp_parallelism: 8\nper_device_batch_size: 0", r"per_device_batch_size must be a positive number"),
    ("ici_fsdp_parallelism: 8\nper_device_batch_size: 0.1", r"not a whole positive number; change per_device"),
    ("ici_fsdp_parallelism: 8\nremat_policy: sometimes", r"remat_policy 'sometimes' .* use one of"),
    ("ici_pipeline_parallelism: 4\nici_fsdp_parallelism: 1", r"pass num_layers="),
    ("ici_pipeline_parallelism: 4\nici_fsdp_parallelism: 1\nnum_pipeline_repeats: 1\nnum_pipeline_microbatches: 6",
     r"num_pipeline_microbatches=6 must be a multiple of the 4 pipeline stages"),
    ("- just\n- a list", r"YAML mapping"),
])
def test_bad_input(text, match):
    with pytest.raises(ValueError, match=match):
        from_maxtext(text)


def test_device_count_mismatch():
    with pytest.raises(ValueError, match=r"does not divide num_devices=12"):
        from_maxtext("ici_fsdp_parallelism: 8", num_devices=12)
    r = from_maxtext("ici_fsdp_parallelism: 8")
    with pytest.raises(ValueError, match=r"8 devices; .* has 16. Pick a cluster of 8 devices"):
        r.price(full_config("llama-3-8b"), Cluster.h100(nodes=2))
