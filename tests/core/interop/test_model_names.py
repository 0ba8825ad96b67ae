"""A recipe's model name -> the full-size preset (workbench.core.interop.model_names): every name maps to a preset with
the shapes the framework's own model file gives, the test recipes' models resolve to the checkpoint their files
name, and a recipe prices and lays out its model without being handed a config."""

import pathlib

import pytest

from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.maxtext import from_maxtext
from workbench.core.interop.model_names import MAXTEXT_MODELS, TORCHTITAN_MODELS, preset_name
from workbench.core.interop.recipe import TrainingRecipe
from workbench.core.interop.torchtitan import from_torchtitan
from workbench.core.models.presets import full_config
from workbench.core.pipeline_schedule import PipelineConfig

RECIPES = pathlib.Path(__file__).parent / "recipes"

# AI-Hypercomputer/maxtext src/maxtext/configs/models/<model_name>.yml at commit e591f30c (the recipes' base.yml
# commit), the shape keys as the files state them (llama3-405b.yml is llama3.1-405b.yml's text).
MAXTEXT_YML = {
    "llama2-70b": dict(base_emb_dim=8192, base_num_query_heads=64, base_num_kv_heads=8, base_mlp_dim=28672,
                       base_num_decoder_layers=80, head_dim=128, vocab_size=32000),
    "llama3-8b": dict(base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8, base_num_decoder_layers=32,
                      base_mlp_dim=14336, head_dim=128, vocab_size=128256),
    "llama3-70b": dict(base_emb_dim=8192, base_num_query_heads=64, base_num_kv_heads=8, base_num_decoder_layers=80,
                       base_mlp_dim=28672, head_dim=128, vocab_size=128256),
    "llama3-405b": dict(base_emb_dim=16384, base_num_query_heads=128, base_num_kv_heads=8, base_num_decoder_layers=126,
                        base_mlp_dim=53248, head_dim=128, vocab_size=128256),
    "llama3.1-8b": dict(base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8, base_num_decoder_layers=32,
                        base_mlp_dim=14336, head_dim=128, vocab_size=128256),
    "llama3.1-70b": dict(base_emb_dim=8192, base_num_query_heads=64, base_num_kv_heads=8, base_num_decoder_layers=80,
                         base_mlp_dim=28672, head_dim=128, vocab_size=128256),
    "llama3.1-405b": dict(base_emb_dim=16384, base_num_query_heads=128, base_num_kv_heads=8,
                          base_num_decoder_layers=126, base_mlp_dim=53248, head_dim=128, vocab_size=128256),
    "mixtral-8x7b": dict(base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8, base_moe_mlp_dim=14336,
                         base_num_decoder_layers=32, head_dim=128, vocab_size=32000, num_experts=8,
                         num_experts_per_tok=2),
    "mixtral-8x22b": dict(base_emb_dim=6144, base_num_query_heads=48, base_num_kv_heads=8, base_moe_mlp_dim=16384,
                          base_num_decoder_layers=56, head_dim=128, vocab_size=32768, num_experts=8,
                          num_experts_per_tok=2),
    "qwen3-8b": dict(base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8, base_mlp_dim=12288,
                     base_num_decoder_layers=36, head_dim=128, vocab_size=151936),
    "qwen3-32b": dict(base_emb_dim=5120, base_num_query_heads=64, base_num_kv_heads=8, base_mlp_dim=25600,
                      base_num_decoder_layers=64, head_dim=128, vocab_size=151936),
    "qwen3-30b-a3b": dict(base_emb_dim=2048, base_num_query_heads=32, base_num_kv_heads=4, base_num_decoder_layers=48,
                          head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                          base_moe_mlp_dim=768),
    "qwen3-235b-a22b": dict(base_emb_dim=4096, base_num_query_heads=64, base_num_kv_heads=4,
                            base_num_decoder_layers=94, head_dim=128, vocab_size=151936, num_experts=128,
                            num_experts_per_tok=8, base_moe_mlp_dim=1536),
    "deepseek3-671b": dict(base_emb_dim=7168, base_num_query_heads=128, base_num_kv_heads=128, base_mlp_dim=18432,
                           base_moe_mlp_dim=2048, base_num_decoder_layers=61, first_num_dense_layers=3,
                           vocab_size=129280, num_experts=256, num_experts_per_tok=8),
}
_MAXTEXT_FIELDS = dict(base_emb_dim="hidden_size", base_num_query_heads="num_attention_heads",
                       base_num_kv_heads="num_key_value_heads", base_mlp_dim="intermediate_size",
                       base_moe_mlp_dim="expert_intermediate_size", base_num_decoder_layers="num_hidden_layers",
                       head_dim="head_dim", vocab_size="vocab_size", num_experts="num_local_experts",
                       num_experts_per_tok="num_experts_per_tok", first_num_dense_layers="first_dense_layers")


def _ffn(dim, multiple_of, multiplier):
    """torchtitan/models/common/feed_forward.py compute_ffn_hidden_dim (Meta's Llama formula)."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# pytorch/torchtitan torchtitan/models/<name>/__init__.py at commit b5bcd76c: each flavor's numbers as it sets them.
TORCHTITAN_FLAVORS = {
    "llama3/8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      hidden_dim=_ffn(4096, 1024, 1.3)),
    "llama3/70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       hidden_dim=_ffn(8192, 4096, 1.3)),
    "llama3/405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                        hidden_dim=_ffn(16384, 4096, 1.2)),
    "qwen3/8B": dict(dim=4096, head_dim=128, n_layers=36, n_heads=32, n_kv_heads=8, vocab_size=151936,
                     hidden_dim=12288),
    "qwen3/32B": dict(dim=5120, head_dim=128, n_layers=64, n_heads=64, n_kv_heads=8, vocab_size=151936,
                      hidden_dim=25600),
    "qwen3/30B-A3B": dict(dim=2048, head_dim=128, n_layers=48, n_heads=32, n_kv_heads=4, vocab_size=151936,
                          moe_hidden_dim=768, num_experts=128, top_k=8),
    "qwen3/235B-A22B": dict(dim=4096, head_dim=128, n_layers=94, n_heads=64, n_kv_heads=4, vocab_size=151936,
                            moe_hidden_dim=1536, num_experts=128, top_k=8),
    "deepseek_v3/671B": dict(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, dense_hidden_dim=18432,
                             moe_hidden_dim=2048, num_experts=256, top_k=8, n_dense_layers=3),
}
_TORCHTITAN_FIELDS = dict(dim="hidden_size", head_dim="head_dim", n_layers="num_hidden_layers",
                          n_heads="num_attention_heads", n_kv_heads="num_key_value_heads", vocab_size="vocab_size",
                          hidden_dim="intermediate_size", dense_hidden_dim="intermediate_size",
                          moe_hidden_dim="expert_intermediate_size", num_experts="num_local_experts",
                          top_k="num_experts_per_tok", n_dense_layers="first_dense_layers")


@pytest.mark.parametrize("name", sorted(MAXTEXT_MODELS))
def test_each_maxtext_model_name_maps_to_a_preset_of_its_shapes(name):
    config = full_config(preset_name(name))
    want = {_MAXTEXT_FIELDS[k]: v for k, v in MAXTEXT_YML[name].items()}
    assert {f: getattr(config, f) for f in want} == want


@pytest.mark.parametrize("name", sorted(TORCHTITAN_MODELS))
def test_each_torchtitan_flavor_maps_to_a_preset_of_its_shapes(name):
    config = full_config(preset_name(name))
    want = {_TORCHTITAN_FIELDS[k]: v for k, v in TORCHTITAN_FLAVORS[name].items()}
    assert {f: getattr(config, f) for f in want} == want


def test_torchtitan_llama3_flavors_are_llama_3_1():
    """torchtitan's llama3 flavors scale their rope ("llama" scaling, theta 500000): Llama 3.1's, not Llama 3's."""
    for flavor in ("8B", "70B", "405B"):
        config = full_config(preset_name(f"llama3/{flavor}"))
        assert config.rope_theta == 500000.0 and config.rope_scaling is not None
        assert config.rope_scaling.factor == 8.0 and config.max_position_embeddings == 131072


def test_names_resolve_in_any_case_and_presets_name_themselves():
    assert preset_name("LLAMA3.1-70B") == preset_name("llama3/70b") == "llama-3.1-70b"
    assert preset_name("qwen3-30b-a3b") == preset_name("qwen3/30B-A3B") == "qwen3-30b-a3b"
    assert preset_name("mixtral-8x22b") == "mixtral-8x22b" and preset_name(" deepseek3-671b ") == "deepseek-v3"


def test_an_unknown_name_says_which_are_known():
    for name in ("deepseek_v3/16B", "llama4/17bx128e", "llama3.1-7b"):
        with pytest.raises(ValueError, match=r"no full-size preset for the model .*llama3\.1-70b.*llama3/405B.*"
                                             r"qwen3-235b-a22b.*ModelConfig\.from_hf"):
            preset_name(name)
    with pytest.raises(TypeError, match="string"):
        preset_name(None)


# -- the test recipes: their model names resolve to the checkpoint their own files name -----------------------------
@pytest.mark.parametrize("name, devices, checkpoint", [
    ("torchtitan_llama3_8b.toml", 8, "Llama-3.1-8B"),  # hf_assets_path = "./assets/hf/Llama-3.1-8B"
    ("torchtitan_llama3_405b.toml", 128, "Llama-3.1-405B"),  # hf_assets_path = "./assets/hf/Llama-3.1-405B"
])
def test_torchtitan_recipes_resolve_to_the_checkpoint_they_load(name, devices, checkpoint):
    assert f'hf_assets_path = "./assets/hf/{checkpoint}"' in (RECIPES / name).read_text()
    recipe = from_torchtitan(RECIPES / name, num_devices=devices)
    assert preset_name(recipe.model) == checkpoint.lower()


@pytest.mark.parametrize("name, devices, model_type", [
    ("maxtext_v6e_llama3_1_70b_129024.yml", 256, "llama3.1-70b"),
    ("maxtext_v6e_llama3_1_405b_pure_fsdp_2slices.yml", None, "llama3.1-405b"),
    ("maxtext_gpu_llama3_8b.yml", 8, "llama3-8b"), ("maxtext_v6e_deepseek_v3_ep16.yml", None, "deepseek3-671b"),
])
def test_maxtext_recipes_resolve_to_the_model_file_they_name(name, devices, model_type):
    text = (RECIPES / name).read_text()
    assert f'model_name: "{model_type}"' in text
    recipe = from_maxtext(text, num_devices=devices)
    assert recipe.model == model_type
    config = recipe.model_config()
    want = {_MAXTEXT_FIELDS[k]: v for k, v in MAXTEXT_YML[model_type].items()}
    assert {f: getattr(config, f) for f in want} == want


def test_a_recipe_prices_and_lays_out_the_model_it_names():
    recipe = from_torchtitan(RECIPES / "torchtitan_llama3_405b.toml", num_devices=128)
    cluster = Cluster.h100(nodes=16)
    named = recipe.price(cluster=cluster)
    assert named.time_s == recipe.price(full_config("llama-3.1-405b"), cluster).time_s > 0
    assert recipe.price("llama3.1-405b", cluster).time_s == named.time_s  # a name resolves the same way
    layout = recipe.layout(cluster=cluster)  # built abstractly: Llama-3.1-405B's 126 layers stacked
    assert dict(layout.mesh.shape)["tp"] == 8 and layout.config.num_hidden_layers == 126


def test_a_recipe_without_a_model_or_a_cluster_says_what_to_pass():
    recipe = TrainingRecipe({"fsdp": 8}, batch=(8, 1024))
    with pytest.raises(ValueError, match="names no model"):
        recipe.price(cluster=Cluster.h100(nodes=1))
    with pytest.raises(TypeError, match="needs the cluster"):
        recipe.price(Cluster.h100(nodes=1))
    unknown = from_torchtitan(RECIPES / "torchtitan_deepseek_v3_16b.toml", num_devices=8)
    with pytest.raises(ValueError, match="'deepseek_v3/16B'"):
        unknown.price(cluster=Cluster.h100(nodes=1))


# -- the layers a pipeline splits, from the named model when the config leaves them out -----------------------------
def test_a_maxtext_pipeline_takes_its_layers_from_the_named_model():
    """llama3.1-70b.yml: base_num_decoder_layers 80, so 4 stages of 1 layer repeat 20 times (MaxText's circular
    pipeline: num_decoder_layers / (stages x num_layers_per_pipeline_stage))."""
    text = "model_name: llama3.1-70b\nici_pipeline_parallelism: 4\nici_fsdp_parallelism: 1"
    recipe = from_maxtext(text, num_devices=4)
    assert recipe.num_layers == 80 and recipe.pipeline == PipelineConfig(4, 4, "interleaved", 20)
    with pytest.raises(ValueError, match="pass num_layers="):  # a model it has no preset for: still asks
        from_maxtext(text.replace("llama3.1-70b", "llama3.3-70b"), num_devices=4)


def test_a_torchtitan_pipeline_takes_its_layers_from_the_named_model():
    """pipeline_parallel_layers_per_stage counts the embedding and the output as a layer each: Llama-3.1-8B's 32
    layers + 2 in stages of 9 make 4 stages, 2 per rank of pipeline_parallel_degree 2."""
    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\npipeline_parallel_degree = 2\n'
            'pipeline_parallel_schedule = "Interleaved1F1B"\npipeline_parallel_layers_per_stage = 9\n')
    recipe = from_torchtitan(text, num_devices=4)
    assert recipe.num_layers == 32 and recipe.pipeline.virtual_stages == 2
    with pytest.raises(ValueError, match=r"'llama4/17bx128e' names no preset.*pass num_layers="):
        from_torchtitan(text.replace('"llama3"', '"llama4"').replace('"8B"', '"17bx128e"'), num_devices=4)
