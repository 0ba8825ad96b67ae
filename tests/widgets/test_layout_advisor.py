"""LayoutAdvisor driven through its controls: inputs re-rank, a chosen row confirms, opens in the explorer and
exports; bad input shows an inline error and keeps the last ranking."""

import html
import re

import jax.numpy as jnp
import pytest

from workbench.core.advisor import Constraints, advise
from workbench.core.cluster import Cluster
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config
from workbench.widgets.layout_advisor import LayoutAdvisor


@pytest.fixture(scope="module")
def llama_70b():
    return CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _first_row(advisor):
    return html.unescape(re.search(r'data-rank="1"[^>]*><td[^>]*>1</td><td[^>]*>([^<]*)<',
                                   advisor._table.value).group(1))


def test_the_inputs_re_rank_and_the_table_is_the_advice(llama_70b):
    """Llama-3-70B on 1024 v5p chips, without pipelines (the scaling book's Part 6 lays it out without): 4M tokens
    put 4096 tokens on each chip, enough for pure FSDP; at 512k (512 per chip, below the book's 850 for FSDP over
    three torus axes) FSDP alone no longer hides its gathers and tensor parallelism joins in."""
    cluster = Cluster.tpu("v5p:8x8x16")
    no_pipeline = Constraints(pipeline=False)
    advisor = LayoutAdvisor(llama_70b, cluster, batch_tokens=4 * 2**20, seq_len=4096, constraints=no_pipeline)
    expected = advise(llama_70b, cluster, batch_tokens=4 * 2**20, seq_len=4096, constraints=no_pipeline)
    assert _first_row(advisor) == expected.ranked[0].label == "fsdp=1024, remat full"
    assert advisor._table.value.count('class="wb-advice-row"') == min(10, len(expected.ranked))
    advisor._tokens.value = 2**19
    assert not advisor.error
    assert _first_row(advisor) == advise(llama_70b, cluster, batch_tokens=2**19, seq_len=4096,
                                         constraints=no_pipeline).ranked[0].label
    assert "tp=" in _first_row(advisor)
    pure = next(c for c in advisor.advice.ranked if c.mesh_shape["fsdp"] * c.mesh_shape["sp"] == 1024)
    assert "needed to hide FSDP's all-gathers" in pure.reason
    # the pipeline checkbox re-ranks with pipelines in
    advisor._pipeline.value = True
    assert not advisor.error
    assert _first_row(advisor) == advise(llama_70b, cluster, batch_tokens=2**19, seq_len=4096).ranked[0].label
    assert any(c.zero_stage for c in advisor.advice.ranked)
    advisor._zero.value = False  # and the ZeRO-1 checkbox
    assert not advisor.error and not any(c.zero_stage for c in advisor.advice.ranked)


def test_bad_input_shows_why_and_keeps_the_last_ranking(llama_70b):
    advisor = LayoutAdvisor(llama_70b, Cluster.h100(nodes=8), batch_tokens=16 * 2048, seq_len=2048)
    before = advisor._table.value
    advisor._seq.value = 3000  # 32768 tokens are not whole sequences of 3000
    assert "not a whole number of sequences" in advisor.error and advisor._table.value == before
    advisor._seq.value = 2048
    assert not advisor.error


def test_a_row_exports_opens_in_the_explorer_and_confirms_with_the_compiler():
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", hidden_size=256, intermediate_size=512,
                                                               num_hidden_layers=4)))
    cluster = Cluster.h100(nodes=1)
    advisor = LayoutAdvisor(model, cluster, batch_tokens=16 * 128, seq_len=128)
    advisor._pipeline.value = False
    advisor._row.value = 2
    chosen = advisor.selected()
    assert chosen is advisor.advice.ranked[1]
    code, _ = advisor.export()
    scope = {"model": model}
    exec(code, scope)
    assert scope["layout"].specs == chosen.layout(model, cluster).specs
    assert "wb-export" in advisor._out.value
    assert advisor.open_in_explorer()
    assert dict(advisor.explorer.mesh.shape) == chosen.mesh_shape
    assert advisor._explorer_box.children == (advisor.explorer.widget,)
    assert advisor.confirm(), advisor._out.value
    assert chosen.compiled is not None and "predicted vs compiled" in advisor._out.value
    assert chosen.ledger.total == pytest.approx(chosen.compiled.memory.total, rel=0.10)


def test_the_static_picture_is_the_ranked_table(llama_70b):
    advisor = LayoutAdvisor(llama_70b, Cluster.h100(nodes=8), batch_tokens=16 * 2048, seq_len=2048)
    static = advisor._repr_html_()
    assert "wb-advice-table" in static and "wb-advice-bar" in static and "LayoutAdvisor" in repr(advisor)
