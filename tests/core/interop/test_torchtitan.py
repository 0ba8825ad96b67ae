"""torchtitan TOML <-> TrainingRecipe: published train configs (tests/core/interop/recipes/torchtitan_*.toml, each
citing its source) parse to the numbers they state, price on a matching cluster, and survive a round trip; bad
input says what to change."""

import dataclasses
import pathlib

import pytest

from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.recipe import TrainingRecipe
from workbench.core.interop.torchtitan import from_torchtitan, to_torchtitan
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, full_config_dict, tiny_config
from workbench.core.pipeline_schedule import PipelineConfig

RECIPES = pathlib.Path(__file__).parent / "recipes"


def _llama(**shape):
    return ModelConfig.from_hf({**full_config_dict("llama-3-70b"), **shape})


# -- published train configs: the numbers their files state ------------------------------------------------------
def test_llama3_8b():
    r = from_torchtitan(RECIPES / "torchtitan_llama3_8b.toml", num_devices=8)
    assert r.mesh_shape == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}  # data_parallel_shard_degree -1
    assert r.batch == (1 * 8, 8192)  # local_batch_size 1 on 8 ranks, seq_len 8192
    assert (r.remat, r.source_remat, r.model, r.zero_stage) == ("dots_saveable", "selective:op", "llama3/8B", 3)
    assert r.price(full_config("llama-3-8b"), Cluster.h100(nodes=1)).time_s > 0


def test_llama3_405b_on_its_128_gpus():
    r = from_torchtitan(RECIPES / "torchtitan_llama3_405b.toml", num_devices=128)  # "a preset for 128 H100 GPUs"
    assert (r.mesh_shape["tp"], r.mesh_shape["fsdp"], r.mesh_shape["pp"]) == (8, 16, 1)
    assert r.batch == (2 * 16, 8192) and r.remat == "full"
    assert r.price(cluster=Cluster.h100(nodes=16)).time_s > 0  # [model] llama3/405B: Llama-3.1-405B's preset


def test_older_batch_size_key_reads_the_same():
    new = from_torchtitan(RECIPES / "torchtitan_llama3_405b.toml", num_devices=128)
    old = from_torchtitan(RECIPES / "torchtitan_llama3_405b_2025_04.toml", num_devices=128)  # [training] batch_size
    assert old.same_run(new)


def test_llama4_pipeline():
    r = from_torchtitan(RECIPES / "torchtitan_llama4_17bx128e.toml", num_devices=64)
    assert (r.mesh_shape["pp"], r.mesh_shape["tp"], r.mesh_shape["fsdp"]) == (4, 8, 2)
    # the default 1F1B schedule; local_batch_size 1 in microbatches of the default size 1
    assert r.pipeline == PipelineConfig(4, 1, "1f1b", uneven=True)
    assert r.batch == (2, 8192) and r.model == "llama4/17bx128e"
    # a dense stand-in of Llama 4's 48 layers and width: the step model runs the pipeline
    config = _llama(hidden_size=5120, intermediate_size=16384, num_hidden_layers=48, num_attention_heads=40)
    assert r.price(config, Cluster.h100(nodes=8)).time_s > 0


def test_deepseek_v3_16b_expert_parallel():
    r = from_torchtitan(RECIPES / "torchtitan_deepseek_v3_16b.toml", num_devices=8)
    assert (r.mesh_shape["ep"], r.mesh_shape["fsdp"]) == (8, 1)  # EP 8 taken out of dp_shard 8
    assert r.batch == (4 * 8, 4096) and "ep" in r.batch_axes
    assert r.pipeline is None  # its Interleaved1F1B schedule is moot at pipeline_parallel_degree 1
    assert any("EP 8" in n for n in r.notes)
    # DeepSeek-MoE 16B's width, depth and experts on DeepSeek-V3's config.json (MLA kept)
    config = ModelConfig.from_hf({**full_config_dict("deepseek-v3"), "num_hidden_layers": 28, "hidden_size": 2048,
                                  "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
                                  "intermediate_size": 10944, "num_attention_heads": 16, "num_key_value_heads": 16,
                                  "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 2})
    assert r.price(config, Cluster.h100(nodes=1)).time_s > 0


@pytest.mark.parametrize("name, devices", [("torchtitan_llama3_8b.toml", 8), ("torchtitan_llama3_405b.toml", 128),
                                           ("torchtitan_llama3_405b_2025_04.toml", 128),
                                           ("torchtitan_llama4_17bx128e.toml", 64),
                                           ("torchtitan_deepseek_v3_16b.toml", 8)])
def test_published_configs_round_trip(name, devices):
    r = from_torchtitan(RECIPES / name, num_devices=devices)
    text = to_torchtitan(r)
    assert text.startswith("# Written by workbench")
    assert from_torchtitan(text).same_run(r)


def test_layout_resolves():
    r = from_torchtitan("[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 4\n"
                        "[training]\nlocal_batch_size = 2\nseq_len = 512\n")
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    layout = r.layout(model, Cluster.h100(nodes=1))
    assert dict(layout.mesh.shape)["tp"] == 4 and layout.remat == "dots_saveable"  # torchtitan's default SAC


# -- round trips of workbench recipes ---------------------------------------------------------------------------
# its program: SDPA's flash kernels, PyTorch's autograd, sequence parallel with tp (below)
TORCHTITAN = {"attention": "flash", "autograd": "pytorch"}
ROUND_TRIP = [
    TrainingRecipe({"fsdp": 8, "tp": 4}, (64, 4096), "full", zero_stage=3, sequence_parallel=True, **TORCHTITAN),
    TrainingRecipe({"dp": 2, "fsdp": 4}, (64, 2048), "none", grad_accumulation=4, zero_stage=3, **TORCHTITAN),
    TrainingRecipe({"fsdp": 4, "sp": 4}, (4, 131072), "dots_saveable", zero_stage=3, **TORCHTITAN),
    TrainingRecipe({"pp": 4, "fsdp": 2}, (32, 2048), "full", zero_stage=3,
                   pipeline=PipelineConfig(4, 16, "gpipe", uneven=True), **TORCHTITAN),
    TrainingRecipe({"pp": 8, "fsdp": 2, "tp": 8}, (64, 8192), "full", zero_stage=3,
                   pipeline=PipelineConfig(8, 32, "interleaved", 2, uneven=True), sequence_parallel=True,
                   **TORCHTITAN),
    TrainingRecipe({"pp": 4, "fsdp": 2}, (32, 2048), "full", zero_stage=3,
                   pipeline=PipelineConfig(4, 16, "interleaved", 4, uneven=True), num_layers=30, **TORCHTITAN),
    TrainingRecipe({"fsdp": 2, "ep": 4}, (32, 4096), "full", zero_stage=3,
                   axis_rules=(("batch_axis", ("fsdp", "ep")),), **TORCHTITAN),
]


def test_the_workbench_s_own_program_exports_with_what_torchtitan_runs_instead():
    r = TrainingRecipe({"fsdp": 8, "tp": 4}, (64, 4096), "full", zero_stage=3)  # XLA attention, no SP
    text = to_torchtitan(r)
    assert "XLA attention" in text.splitlines()[1] and "the residual stream whole over tp" in text.splitlines()[1]
    back = from_torchtitan(text)
    assert (back.attention, back.sequence_parallel, back.autograd) == ("flash", True, "pytorch")
    assert back.same_run(dataclasses.replace(r, attention="flash", sequence_parallel=True, autograd="pytorch"))
    # without remat the saved set differs too: the export says torchtitan keeps PyTorch's
    assert "PyTorch's autograd" in to_torchtitan(dataclasses.replace(r, remat="none")).splitlines()[1]


@pytest.mark.parametrize("recipe", ROUND_TRIP, ids=lambda r: r._shape_text())
def test_round_trip(recipe):
    assert from_torchtitan(to_torchtitan(recipe), num_layers=recipe.num_layers).same_run(recipe)


def test_export_says_what_torchtitan_cannot_express():
    r = TrainingRecipe({"dp": 2, "fsdp": 64}, (256, 4096), dcn_shape={"dp": 2}, zero_stage=3)
    assert "DCN" in to_torchtitan(r).splitlines()[1]


@pytest.mark.parametrize("name, schedule, virtual, note", [
    ("1F1B", "1f1b", 1, False), ("GPipe", "gpipe", 1, False), ("Interleaved1F1B", "interleaved", 2, False),
    ("interleaved1f1b", "interleaved", 2, False), ("InterleavedZeroBubble", "interleaved", 2, True),
    ("ZBVZeroBubble", "interleaved", 2, True), ("LoopedBFS", "interleaved", 2, True)])
def test_schedules(name, schedule, virtual, note):
    r = from_torchtitan(f'[parallelism]\npipeline_parallel_degree = 4\ndata_parallel_shard_degree = 2\n'
                        f'pipeline_parallel_schedule = "{name}"\n[training]\nlocal_batch_size = 8\n')
    assert (r.pipeline.schedule, r.pipeline.virtual_stages, r.pipeline.num_microbatches) == (schedule, virtual, 8)
    assert any(name in n for n in r.notes) == note


def test_gradient_accumulation_and_old_microbatch_count():
    r = from_torchtitan("[parallelism]\ndata_parallel_shard_degree = 8\n[training]\nlocal_batch_size = 2\n"
                        "global_batch_size = 64\n")
    assert (r.batch[0], r.grad_accumulation) == (64, 4)
    r = from_torchtitan("[parallelism]\npipeline_parallel_degree = 2\ndata_parallel_shard_degree = 1\n"
                        "pipeline_parallel_microbatches = 4\n[training]\nbatch_size = 8\n")
    assert r.pipeline.num_microbatches == 4


# -- bad input: each error says what to change --------------------------------------------------------------------
@pytest.mark.parametrize("text, match", [
    ("[parallelism]\ntensor_parallel_degree = 8\n", r"data_parallel_shard_degree = -1 .* needs num_devices="),
    ('[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = "8"\n',
     r"tensor_parallel_degree must be a positive integer"),
    ("[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 0\n", r"tensor_parallel_degree"),
    ("[parallelism]\ndata_parallel_shard_degree = 2\npipeline_parallel_degree = 2\n"
     'pipeline_parallel_schedule = "Sideways"\n', r"'Sideways' is not one .* use one of .*Interleaved1F1B"),
    ("[parallelism]\ndata_parallel_shard_degree = 4\nexpert_parallel_degree = 3\n",
     r"expert_parallel_degree=3 must divide data_parallel_shard_degree=4"),
    ("[parallelism]\ndata_parallel_shard_degree = 2\n[training]\nlocal_batch_size = 3\nglobal_batch_size = 8\n",
     r"global_batch_size=8 is not a multiple"),
    ('[parallelism]\ndata_parallel_shard_degree = 2\n[activation_checkpoint]\nmode = "sometimes"\n', r"mode must be"),
    ("[parallelism\n", r"not a torchtitan TOML"),
])
def test_bad_input(text, match):
    with pytest.raises(ValueError, match=match):
        from_torchtitan(text)


def test_device_count_mismatch():
    text = "[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n"
    with pytest.raises(ValueError, match=r"multiply to 8 devices, not 16"):
        from_torchtitan(text, num_devices=16)
    with pytest.raises(ValueError, match=r"8 devices; .* has 16"):
        from_torchtitan(text).price(full_config("llama-3-8b"), Cluster.h100(nodes=2))
