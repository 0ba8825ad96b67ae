"""Issue 48, a planner pricing their own layout from the LayoutAdvisor: axes pinned in the widget rank what
``advise(constraints=Constraints(fixed=...))`` ranks; a torchtitan TOML or MaxText YAML imported sets the batch and
pins and finds its own plan among the rows (or says why it is not one); a row exported as either file and imported
again is the same row. Nothing is compiled."""

import dataclasses
import html
import pathlib

import jax.numpy as jnp
import pytest

from workbench.core.advisor import Constraints, advise
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.maxtext import from_maxtext
from workbench.core.interop.torchtitan import from_torchtitan
from workbench.core.models import CausalLM
from workbench.core.models.presets import full_config
from workbench.core.plan import PRODUCTION
from workbench.core.units import format_seconds
from workbench.widgets._advisor_recipe import RECIPE_FORMATS, parse_pins, pins_text, same_plan
from workbench.widgets.layout_advisor import LayoutAdvisor

RECIPES = pathlib.Path(__file__).parents[1] / "core" / "interop" / "recipes"


def _bf16(name):
    return CausalLM.lazy_init(full_config(name), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


@pytest.fixture(scope="module")
def llama_70b():
    return _bf16("llama-3-70b")


@pytest.fixture(scope="module")
def llama_8b():
    return _bf16("llama-3-8b")


def _labels(advice):
    return [c.label for c in advice.ranked]


def test_pins_are_read_and_written_as_the_mesh_is_labelled():
    assert parse_pins("tp=8 x pp=2") == {"tp": 8, "pp": 2} == parse_pins(" pp=2 × tp=8 ")
    assert parse_pins("") == {} and parse_pins("pp=1") == {"pp": 1}
    assert pins_text({"tp": 8, "pp": 1}) == "pp=1 x tp=8" and parse_pins(pins_text({"tp": 8, "pp": 1})) == \
        {"tp": 8, "pp": 1}
    for bad in ("tq=8", "tp=8 x tp=4", "tp=eight", "tp=0", "tp=8, pp=2"):
        with pytest.raises(ValueError, match=r"write the pins as 'tp=8 x pp=2'|sizes are 1 or more"):
            parse_pins(bad)


def test_pinned_axes_rank_what_the_advisor_ranks_with_them_fixed(llama_70b):
    """Llama-3-70B on 8 x 8 H100: pinned at tp=8 (and pp=1) every row keeps them, as ``advise`` with
    ``Constraints(fixed=...)`` ranks them; a bad pin shows its error, stays in the box and changes nothing; an empty
    box unpins."""
    cluster = Cluster.h100(nodes=8)
    advisor = LayoutAdvisor(llama_70b, cluster, batch_tokens=32 * 2048, seq_len=2048)
    free = _labels(advisor.advice)
    assert advisor.pin("tp=8 x pp=1") and not advisor.error
    assert advisor._pins.value == "tp=8 x pp=1" and dict(advisor.constraints.fixed) == {"tp": 8, "pp": 1}
    expected = advise(llama_70b, cluster, batch_tokens=32 * 2048, seq_len=2048,
                      constraints=Constraints(fixed={"tp": 8, "pp": 1}))
    assert _labels(advisor.advice) == _labels(expected) and _labels(expected)
    assert all(c.mesh_shape["tp"] == 8 and c.mesh_shape["pp"] == 1 for c in advisor.advice.ranked)
    advisor._pins.value = "tq=8"  # typed in the box
    assert "write the pins as 'tp=8 x pp=2'" in advisor.error and advisor._pins.value == "tq=8"
    assert dict(advisor.constraints.fixed) == {"tp": 8, "pp": 1} and _labels(advisor.advice) == _labels(expected)
    advisor._pins.value = ""
    assert not advisor.error and _labels(advisor.advice) == free


@pytest.mark.parametrize("cluster, tokens, seq_len", [
    (Cluster.h100(nodes=32), 4 * 2**20, 8192),  # the top rows pipeline, interleaved v=4: stages per rank
    (Cluster.tpu("v5p:8x8x16"), 8 * 2**20, 4096),  # the top rows accumulate microbatches
], ids=["32 x 8 H100, 8k", "v5p 8x8x16, 4k"])
def test_an_exported_row_imported_again_is_the_same_row(llama_70b, cluster, tokens, seq_len):
    """Llama-3-70B, where the top rows pipeline interleaved at v=4 (H100, 4M tokens a step: the torchtitan file
    says the stages per rank in the model's layers) or accumulate microbatches (v5p, 8M tokens). Each of the top
    three, written as a torchtitan TOML and as a MaxText YAML and read back, is the same plan, sets the same batch,
    pins its mesh and is the chosen row, at the same memory and step time. The advisor plans the program both
    frameworks run (flash attention, sequence parallelism inside tp), the one each import sets."""
    advisor = LayoutAdvisor(llama_70b, cluster, batch_tokens=tokens, seq_len=seq_len,
                            constraints=Constraints(**PRODUCTION))
    top = advisor.advice.ranked[:3]
    assert any(c.grad_accumulation > 1 for c in top) or any(c.pipeline is not None for c in top)
    for rank in (1, 2, 3):
        for fmt, (read, _) in RECIPE_FORMATS.items():
            advisor._pins.value = ""
            advisor._row.value = rank
            row = advisor.selected()
            text = advisor.export_recipe(fmt)
            assert text is not None and not advisor.error and advisor._recipe_text.value == text, advisor.error
            written = read(text, num_devices=cluster.num_devices, num_layers=80)
            advisor._format.value = fmt
            assert advisor.import_recipe() and not advisor.error, advisor.error
            assert (advisor._tokens.value, advisor._seq.value) == (tokens, seq_len)
            assert parse_pins(advisor._pins.value) == {a: n for a, n in row.mesh_shape.items() if n > 1}
            if fmt == "torchtitan TOML" and row.pipeline is not None and not row.pipeline.uneven:
                # torchtitan's first and last stages hold a layer less: the file says it, the import reads it so
                # and the panel names the uneven stages the advisor did not weigh
                lost = next(line for line in text.splitlines() if line.startswith("# No torchtitan equivalent:"))
                assert "even pipeline stages" in lost  # beside ZeRO-1's note where the row has both
                assert written.pipeline == dataclasses.replace(row.pipeline, uneven=True)
                assert "does not weigh" in advisor._out.value and "uneven stages" in advisor._out.value
                continue
            if fmt == "torchtitan TOML" and row.zero_stage:
                # torchtitan shards with FSDP (HSDP over dp x fsdp), not ZeRO-1 over dp: the file says it is lost
                assert f"ZeRO-{row.zero_stage} over dp" in text and written.zero_stage != row.zero_stage
                assert written.mesh_shape == row.mesh_shape and written.remat == row.remat
                continue
            if fmt == "MaxText YAML" and row.pipeline is not None and row.pipeline.schedule == "1f1b":
                # MaxText's pipeline runs GPipe order: the file says the schedule is lost, the import reads GPipe
                assert "the 1F1B pipeline schedule" in text
                assert written.pipeline == dataclasses.replace(row.pipeline, schedule="gpipe")
                assert "does not weigh" in advisor._out.value and "gpipe" in advisor._out.value, advisor._out.value
                continue
            assert same_plan(row, written), (fmt, row.label)
            chosen = advisor.selected()
            assert chosen.label == row.label, (fmt, rank)
            # each file's framework runs its own autodiff (torchtitan PyTorch's, MaxText JAX's): without remat a row
            # keeps what that one saves, counted by the row's own ledger for that program
            same_set = row.remat != "none" or written.autograd == row.plan.autograd
            held = row.ledger if same_set else row.reledger(**{**row.plan.program(), "autograd": written.autograd})
            assert (chosen.ledger.total, chosen.time_s) == (held.total, row.time_s)
            assert f"ranks {advisor._row.value} of {len(advisor.advice.ranked)}" in advisor._out.value


def test_torchtitan_s_own_recipe_ranks_with_its_own_program(llama_8b):
    """torchtitan's llama3_8b.toml (verbatim) on one 8-GPU H100 node: 8 sequences of 8,192 on fsdp=8 under
    selective 'op' checkpointing, priced as dots_saveable. With the workbench's own program (XLA attention, its
    scores and probabilities saved) that plan does not fit, 304.7 GiB; torchtitan runs SDPA's flash kernels and
    PyTorch's autograd, and the import re-ranks every row with the recipe's program. With what PyTorch saves,
    fsdp=8 fits without remat (56 GiB a GPU, as Megatron-Bridge's Llama-3-8B ran on 8 H100s without recompute:
    published_runs.json), so the advisor ranks that first and does not weigh the recipe's costlier 'op' policy:
    the panel says so and prices the recipe alone. It names the program and the source's approximations."""
    cluster = Cluster.h100(nodes=1)
    advisor = LayoutAdvisor(llama_8b, cluster, batch_tokens=2**16, seq_len=4096, task="decode")
    advisor._recipe_text.value = (RECIPES / "torchtitan_llama3_8b.toml").read_text()
    assert advisor.import_recipe(fmt="torchtitan TOML") and not advisor.error
    recipe = from_torchtitan(advisor._recipe_text.value, num_devices=8)
    assert advisor._task.value == "train" and advisor._optimizer.layout.display is None  # train controls back
    assert (advisor._tokens.value, advisor._seq.value) == (recipe.batch[0] * recipe.batch[1], recipe.batch[1])
    tokens = recipe.batch[0] * recipe.batch[1]
    own = advise(llama_8b, cluster, batch_tokens=tokens, seq_len=recipe.batch[1],
                 constraints=Constraints(fixed={"fsdp": 8}))
    miss = next(c for c in own.rejected if same_plan(c, recipe))
    assert "does not fit" in miss.reason and "it fits" in miss.reason
    assert (recipe.attention, recipe.autograd) == ("flash", "pytorch")
    assert (advisor.constraints.attention, advisor.constraints.autograd) == ("flash", "pytorch")
    top = advisor.advice.ranked[0]
    assert (top.mesh_shape["fsdp"], top.remat) == (8, "none") and top.ledger.total < 0.9 * cluster.hbm_per_device
    assert not any(same_plan(c, recipe) for c in advisor.advice.ranked + advisor.advice.rejected)
    found = html.unescape(advisor._out.value)
    assert "the advisor does not weigh the recipe's plan" in found and "Priced alone by the same step model" in found
    assert "flash attention" in found and "PyTorch autograd's saved set" in found
    assert "priced as dots_saveable" in found and "llama3/8B" in found


def test_a_recipe_that_does_not_fit_says_what_would(llama_8b):
    """MaxText's gpu/models/llama3_8b.yml (verbatim) on 8 H100: 96 sequences of 8,192, 12 a GPU, under
    'minimal_with_context' (priced as dots_saveable) with flash attention: its saved projections alone are about
    12 x 8,192 rows x 32 layers x 51k bfloat16 values a row, 300 GiB. The panel gives the advisor's reason: it does
    not fit, and names the change that makes it fit."""
    cluster = Cluster.h100(nodes=1)
    advisor = LayoutAdvisor(llama_8b, cluster, batch_tokens=2**16, seq_len=4096)
    text = (RECIPES / "maxtext_gpu_llama3_8b.yml").read_text()
    assert advisor.import_recipe(text, "MaxText YAML") and not advisor.error
    recipe = from_maxtext(text, num_devices=8)
    expected = advise(llama_8b, cluster, batch_tokens=recipe.batch[0] * recipe.batch[1], seq_len=recipe.batch[1],
                      constraints=Constraints(fixed={"fsdp": 8}, **recipe.program))
    miss = next(c for c in expected.rejected if same_plan(c, recipe))
    assert "does not fit" in miss.reason and "it fits" in miss.reason
    assert miss.reason.replace("'", "&#x27;").replace(">", "&gt;") in advisor._out.value


def test_a_recipe_the_advisor_does_not_weigh_is_priced_alone(llama_8b):
    """torchtitan's llama3_8b.toml with full checkpointing: with flash attention a plan that saves every matmul's
    output fits, and the advisor stops at the least recompute that fits, so this plan is not among its rows; the
    panel says so and gives its step from the same step model (the recipe's ``price``)."""
    cluster = Cluster.h100(nodes=1)
    advisor = LayoutAdvisor(llama_8b, cluster, batch_tokens=2**16, seq_len=4096)
    text = (RECIPES / "torchtitan_llama3_8b.toml").read_text().replace('mode = "selective"', 'mode = "full"')
    assert advisor.import_recipe(text, "torchtitan TOML") and not advisor.error
    recipe = from_torchtitan(text, num_devices=8)
    assert recipe.remat == "full"
    assert not any(same_plan(c, recipe) for c in (*advisor.advice.ranked, *advisor.advice.rejected))
    step = recipe.price(llama_8b.config, cluster)
    assert "does not weigh" in advisor._out.value
    assert f"Priced alone by the same step model: {format_seconds(step.time_s)} a step" in advisor._out.value


@pytest.mark.parametrize("text, fmt, needle", [
    ("", "torchtitan TOML", "the recipe box is empty"),
    ("[parallelism]\ntensor_parallel_degree = 3\n", "torchtitan TOML", "num_devices"),
    ("ici_fsdp_parallelism: 16\nici_tensor_parallelism: 8\n", "MaxText YAML", "128"),
    ("x", "JSON", "the recipe format is one of"),
])
def test_a_bad_recipe_says_what_to_change_and_changes_nothing(llama_8b, text, fmt, needle):
    advisor = LayoutAdvisor(llama_8b, Cluster.h100(nodes=1), batch_tokens=2**16, seq_len=4096)
    before = (_labels(advisor.advice), advisor._tokens.value, advisor._pins.value)
    assert not advisor.import_recipe(text, fmt)
    assert advisor.error.startswith("import recipe:") and needle in advisor.error, advisor.error
    assert (_labels(advisor.advice), advisor._tokens.value, advisor._pins.value) == before


def test_a_decode_row_is_not_exported_as_a_training_recipe(llama_70b):
    advisor = LayoutAdvisor(llama_70b, Cluster.h100(nodes=8), batch_tokens=16, seq_len=2048, task="decode")
    assert advisor._export_recipe.layout.display == "none"  # hidden for decode
    assert advisor.export_recipe("torchtitan TOML") is None
    assert "a recipe file is a training run's" in advisor.error and advisor._recipe_text.value == ""
