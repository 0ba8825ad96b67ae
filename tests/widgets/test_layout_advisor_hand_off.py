"""Issue 48, rows that survive every hand-off: a row of the layout advisor opened in the explorer, exported as code
and JSON and read back, and made a TrainingRecipe, is the row's plan (mesh, remat, pipeline, ZeRO stage, gradient
accumulation, batch axes, expert placement) with the row's ledger total and predicted step time.

The answers: Llama-3-70B trained on 32 x 8 H100 at 8k (4M tokens a step: its best rows accumulate 2 microbatches, the
review's 63.6 GiB row the explorer showed at 121 GiB), Llama-3-8B on v5p:2x2x4 at 8k (1M tokens: 4 microbatches, the
review's 61.1 GiB row shown at 228 GiB), a tiny Mixtral on 2 x 8 H100 (expert parallelism: batch over ep, experts
whole over fsdp) and Llama-3-70B decoding on 8 x 8 H100. Nothing is compiled."""

import html
import re

import jax.numpy as jnp
import pytest

from workbench.core.cost.ledger import ledger
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.recipe import TrainingRecipe
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config
from workbench.core.plan import microbatch
from workbench.core.units import format_bytes, format_seconds
from workbench.core.views.explore import Layout
from workbench.core.views.explore_step import predicted_step, step_ledger, step_plan
from workbench.widgets.layout_advisor import LayoutAdvisor
from workbench.widgets.sharding_explorer import ShardingExplorer


def _bf16(config):
    return CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


# name -> (model, cluster, batch_tokens, seq_len, task)
CASES = {
    "llama-3-70b train, 32 x 8 H100, 8k": (lambda: _bf16(full_config("llama-3-70b")), lambda: Cluster.h100(nodes=32),
                                           4 * 2**20, 8192, "train"),
    "llama-3-8b train, v5p:2x2x4, 8k": (lambda: _bf16(full_config("llama-3-8b")), lambda: Cluster.tpu("v5p:2x2x4"),
                                        2**20, 8192, "train"),
    "tiny mixtral train, 2 x 8 H100": (lambda: CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(
        "mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=4))), lambda: Cluster.h100(nodes=2),
                                       64 * 1024, 1024, "train"),
    "llama-3-70b decode, 8 x 8 H100": (lambda: _bf16(full_config("llama-3-70b")), lambda: Cluster.h100(nodes=8),
                                       16, 2048, "decode"),
}


@pytest.fixture(scope="module", params=list(CASES))
def advisor(request):
    model, cluster, tokens, seq_len, task = CASES[request.param]
    return LayoutAdvisor(model(), cluster(), batch_tokens=tokens, seq_len=seq_len, task=task)


def _row_model(advisor, c):
    return advisor.model.with_options(remat=c.remat)


def _same_row(layout, c, advisor):
    """``layout`` (read back from an export) runs ``c``'s plan, with its ledger total and predicted step time."""
    advice, cluster = advisor.advice, c.cluster or advisor.cluster
    assert step_plan(layout, task=advice.task, batch=advice.batch) == c.plan, c.label
    got = step_ledger(_row_model(advisor, c), layout, cluster, task=advice.task, batch=advice.batch,
                      optimizer=advice.optimizer)
    assert got.total == c.ledger.total, c.label
    if c.fits:
        assert predicted_step(layout, cluster, task=advice.task, batch=advice.batch).time_s == c.time_s, c.label


def test_every_row_the_widget_lists_opens_exports_and_reads_back_as_the_row(advisor):
    advice = advisor.advice
    assert len(advisor._row.options) == min(10, len(advice.ranked)) > 0
    for i, _ in enumerate(advisor._row.options, 1):
        advisor._row.value = i
        c = advisor.selected()
        assert advisor.open_in_explorer() and not advisor.error, advisor.error
        explorer = advisor.explorer
        assert explorer.plan() == c.plan, c.label
        assert explorer.ledger().total == c.ledger.total, c.label
        assert explorer.predicted_step().time_s == c.time_s, c.label
        verdict = html.unescape(re.search(r"wb-ledger-verdict[^>]*>([^<]*)<", explorer._ledger_out.value).group(1))
        assert verdict.startswith(f"fits: {format_bytes(c.ledger.total)} of "), (c.label, verdict)
        assert f"predicted step: {format_seconds(c.time_s)}" in html.unescape(explorer._predicted_out.value)
        assert explorer._accumulation.value == c.grad_accumulation and explorer._zero.value == bool(c.zero_stage)

        code, text = advisor.export()
        loaded = Layout.from_json(text, advisor.model)
        _same_row(loaded, c, advisor)
        scope = {"model": advisor.model}
        exec(code, scope)
        assert scope["layout"] == loaded, c.label  # the snippet rebuilds what the JSON reads back
        again = ShardingExplorer(advisor.model, cluster=c.cluster or advisor.cluster, batch=advice.batch,
                                 task=advice.task)
        assert again.load(text), again.error  # pasted into another explorer: the controls follow
        assert again.plan() == c.plan and again.ledger().total == c.ledger.total, c.label

        recipe = TrainingRecipe.from_layout(loaded, batch=advice.batch)
        if advice.task == "train":
            assert (recipe.remat, recipe.pipeline, recipe.workbench_zero_stage, recipe.grad_accumulation,
                    recipe.batch_axes) == (c.remat, c.pipeline, c.zero_stage, c.grad_accumulation, c.plan.batch_axes)
            if c.experts_fsdp:  # a recipe's axis rules cannot keep experts whole over fsdp: those rows not priced
                assert recipe.price(advisor.model.config, advisor.cluster).time_s == c.time_s, c.label


def test_every_row_the_advisor_weighs_reads_back_from_its_export_as_the_row(advisor):
    """At the core, beyond the ten rows the widget lists: every ranked row and the closest that do not fit."""
    advice = advisor.advice
    for c in advice.ranked + advice.rejected[:5]:
        cluster = c.cluster or advisor.cluster
        text = c.layout(advisor.model, cluster).to_json(cluster=cluster)
        _same_row(Layout.from_json(text, advisor.model), c, advisor)


ACCUMULATING = ("llama-3-70b train, 32 x 8 H100, 8k", "llama-3-8b train, v5p:2x2x4, 8k")


@pytest.mark.parametrize("advisor", ACCUMULATING, indirect=True)
def test_an_accumulated_row_holds_one_microbatch_and_the_sum_of_its_gradients(advisor):
    """The explorer's figure against the ledger called by hand: a step of B / k sequences, one more set of gradients
    beside it (the sum)."""
    advice = advisor.advice
    c = next(c for c in advice.ranked[:10] if c.grad_accumulation > 1)
    advisor._row.value = advice.ranked.index(c) + 1
    assert advisor.open_in_explorer()
    layout = c.layout(_row_model(advisor, c), advisor.cluster).replace(_row_model(advisor, c), grad_accumulation=1)
    one = ledger(_row_model(advisor, c), layout, batch=microbatch(advice.batch, c.grad_accumulation),
                 remat=c.remat, cluster=advisor.cluster)
    assert advisor.explorer.ledger().total == one.total + one.grads == c.ledger.total


@pytest.mark.parametrize("advisor, label, gib", [
    (ACCUMULATING[0], "fsdp=256, remat full, 2 microbatches accumulated", 63.6),
    # listed at 61.1 GiB in the review; 41.1 since the softmax's shift is a stop_gradient (8 bytes a score in the
    # attention backward's phase, 13 before: Llama-3-8B's 32 heads x 8,192^2 scores a sequence)
    (ACCUMULATING[1], "fsdp=16, remat full, 4 microbatches accumulated", 41.1),
], indirect=["advisor"])
def test_the_review_s_rows_open_at_the_memory_the_advisor_listed(advisor, label, gib):
    """The two rows the review opened: listed as fitting, they opened as "does not fit: 121 GiB" and at 228 GiB."""
    advisor._row.value = next(i for i, c in enumerate(advisor.advice.ranked, 1) if c.label == label)
    assert advisor.open_in_explorer()
    assert advisor.explorer.ledger().total / 2**30 == pytest.approx(gib, abs=0.05)
    assert advisor.explorer.ledger().fits


def test_a_row_of_production_s_program_opens_counted_for_that_program():
    """Planned with the program production runs (flash attention, sequence parallelism inside tp), a row opens in
    the explorer with that program: its ledger is the row's (not the workbench's own, whose scores and unsplit
    residual stream the advisor did not count), and the panel says which program it counts."""
    from workbench.core.advisor import Constraints
    from workbench.core.plan import PRODUCTION, program_text

    advisor = LayoutAdvisor(_bf16(full_config("llama-3-70b")), Cluster.h100(nodes=32), batch_tokens=4 * 2**20,
                            seq_len=8192, constraints=Constraints(fixed={"fsdp": 32, "tp": 8}, **PRODUCTION))
    c = advisor.selected()
    assert c.plan.program() == PRODUCTION
    assert advisor.open_in_explorer() and not advisor.error, advisor.error
    explorer = advisor.explorer
    assert explorer.program == PRODUCTION and explorer.ledger().total == c.ledger.total
    own = ShardingExplorer(explorer.model, explorer.exported_layout(), cluster=advisor.cluster,
                           batch=advisor.advice.batch).ledger()
    assert own.total > c.ledger.total  # the workbench's own program keeps more
    assert html.escape(program_text(PRODUCTION), quote=False) in explorer._ledger_out.value
