"""LayoutAdvisor driven through its controls: inputs re-rank, a chosen row confirms, opens in the explorer (which
shows the row's step time and MFU) and exports; the inputs' labels and values follow the task, and only its controls
show; bad input or a failing callback shows an inline error and keeps the last ranking."""

import html
import re

import jax.numpy as jnp
import pytest

from workbench.core.advisor import Constraints, advise
from workbench.core.hardware.cluster import Cluster
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config
from workbench.core.units import format_bytes, format_flops, format_seconds
from workbench.widgets import layout_advisor as layout_advisor_module
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


def _row_cells(advisor, rank=1):
    row = re.search(rf'<tr class="wb-advice-row" data-rank="{rank}".*?</tr>', advisor._table.value).group(0)
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def _shown(control):
    return control.layout.display != "none"


def test_the_inputs_mean_what_the_task_takes(llama_70b):
    """Train -> decode: 16 x 2048 tokens become 16 sequences decoding against a 2048-position KV cache (not 32768
    sequences, which fit nowhere); the labels say so; decode -> train converts back; each switch ranks once."""
    cluster = Cluster.h100(nodes=8)
    advisor = LayoutAdvisor(llama_70b, cluster, batch_tokens=16 * 2048, seq_len=2048)
    assert (advisor._tokens.description, advisor._seq.description) == ("tokens per step", "sequence length")
    assert all(_shown(c) for c in (advisor._optimizer, advisor._pipeline, advisor._zero))
    ranks = []
    rank = advisor.rank
    advisor.rank = lambda: ranks.append(1) or rank()
    advisor._task.value = "decode"
    assert not advisor.error and len(ranks) == 1
    assert advisor._tokens.value == 16
    assert (advisor._tokens.description, advisor._seq.description) == ("sequences (batch)", "KV cache length")
    assert advisor.advice.task == "decode" and advisor.advice.batch == (16, 2048)
    expected = advise(llama_70b, cluster, batch_tokens=16, seq_len=2048, task="decode")
    assert expected.ranked and len(advisor.advice.ranked) == len(expected.ranked)
    # decode has no optimizer, pipelines, ZeRO or remat: neither the controls nor the table offer them
    assert not any(_shown(c) for c in (advisor._optimizer, advisor._pipeline, advisor._zero))
    assert _shown(advisor._across) and _shown(advisor._headroom) and _shown(advisor._max_axes)
    assert _first_row(advisor) == expected.ranked[0].mesh_label
    table = html.unescape(advisor._table.value)
    assert "remat" not in table and "ZeRO" not in table and "bubble" not in table
    assert all("remat" not in label for label, _ in advisor._row.options)
    advisor._tokens.value = 8  # a decode batch of 8 sequences
    advisor._task.value = "prefill"
    assert not advisor.error and len(ranks) == 3 and advisor._tokens.value == 8 * 2048
    assert (advisor._tokens.description, advisor._seq.description) == ("tokens per step", "sequence length")
    assert not any(_shown(c) for c in (advisor._optimizer, advisor._pipeline, advisor._zero))
    advisor._task.value = "train"  # train <-> prefill: the same meaning, the value stays
    assert not advisor.error and advisor._tokens.value == 8 * 2048
    assert all(_shown(c) for c in (advisor._optimizer, advisor._pipeline, advisor._zero))
    assert "remat" in _first_row(advisor)
    # a short batch still decodes one sequence; a decode advisor starts with decode's labels
    advisor._seq.value = 4 * 8 * 2048
    advisor._task.value = "decode"
    assert advisor._tokens.value == 1
    decode = LayoutAdvisor(llama_70b, cluster, batch_tokens=16, seq_len=2048, task="decode")
    assert (decode._tokens.description, decode._seq.description) == ("sequences (batch)", "KV cache length")
    assert not _shown(decode._optimizer) and _first_row(decode) == expected.ranked[0].mesh_label


@pytest.mark.parametrize("task, tokens", [("train", 16 * 2048), ("decode", 16)])
def test_the_explorer_shows_the_step_time_and_mfu_of_the_row_it_was_opened_from(llama_70b, task, tokens):
    """Llama-3-70B on 8 x 8 H100: the top train layout is pipelined (interleaved), the top decode layout reads a
    2048-position KV cache; opened in the explorer, each is priced by the same measured step model."""
    cluster = Cluster.h100(nodes=8)
    advisor = LayoutAdvisor(llama_70b, cluster, batch_tokens=tokens, seq_len=2048, task=task)
    top = advisor.advice.ranked[0]
    if task == "train":
        assert top.pipeline is not None  # the case a default 1F1B in the explorer priced differently
    cells = _row_cells(advisor)
    assert (cells[3], cells[5]) == (format_seconds(top.step.time_s), top.step.mfu_text())
    assert advisor.open_in_explorer() and not advisor.error
    explorer = advisor.explorer
    assert explorer._task.value == task and explorer.layout.pipeline == top.pipeline
    assert explorer.layout.zero_stage == top.zero_stage and explorer._remat.value == top.remat
    total = re.search(r'class="wb-step-total"[^>]*>([^<]*)<', explorer._predicted_out.value).group(1)
    shown = re.match(r"predicted step: (.+?), \S+-bound · MFU (\S+),", html.unescape(total))
    assert shown is not None, total
    assert shown.groups() == (cells[3], cells[5])
    step = explorer.predicted_step()
    assert step.time_s == pytest.approx(top.step.time_s, rel=1e-9) and step.mfu == pytest.approx(top.step.mfu)
    assert step.measured_model
    assert explorer.ledger().total == top.ledger.total


def test_an_error_in_any_callback_is_shown_and_the_widget_keeps_working(llama_70b, monkeypatch):
    advisor = LayoutAdvisor(llama_70b, Cluster.h100(nodes=8), batch_tokens=16 * 2048, seq_len=2048)
    before = advisor._table.value

    def fail(*args, **kwargs):
        raise RuntimeError("ranker <gone>")

    monkeypatch.setattr(layout_advisor_module, "advise", fail)
    advisor._headroom.value = 0.2  # no exception escapes the callback
    assert advisor.error == "RuntimeError: ranker <gone>" and "ranker &lt;gone&gt;" in advisor._status.value
    assert advisor._table.value == before
    monkeypatch.setattr(layout_advisor_module, "convert_batch", fail)
    advisor._task.value = "decode"  # the switch fails: the task, its batch and labels stay as they were
    assert advisor.error == "task: RuntimeError: ranker <gone>"
    assert (advisor._task.value, advisor._tokens.value) == ("train", 16 * 2048)
    assert advisor._tokens.description == "tokens per step" and _shown(advisor._optimizer)
    monkeypatch.undo()
    advisor._task.value = "decode"
    assert not advisor.error and advisor._tokens.value == 16 and advisor.advice.task == "decode"
    monkeypatch.setattr(layout_advisor_module, "advice_html", fail)
    advisor._row.value = 2  # a row change re-draws the table: its error shows, the last table stays
    assert advisor.error == "table: RuntimeError: ranker <gone>"
    monkeypatch.undo()
    advisor._row.value = 1
    assert not advisor.error


# -- the confirm panel: like compared with like (issue 48) --------------------------------------------------------
def _tiny_f32():
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", hidden_size=256, intermediate_size=512,
                                                              num_hidden_layers=4)))


def _panel(advisor):
    """The confirm panel's main table: its header, and per quantity its cells and the why beneath it."""
    out = advisor._out.value
    main = out.split("<details>")[0]
    header = [html.unescape(h) for h in re.findall(r"<th\b[^>]*>(.*?)</th>", main)]
    rows = re.findall(r'<tr class="wb-confirm-row" data-quantity="[^"]*">(.*?)</tr><tr>(.*?)</tr>', main)
    cells = {}
    for row, why in rows:
        values = [html.unescape(v) for v in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        cells[values[0]] = (values[1:], html.unescape(re.sub(r"<[^>]+>", "", why)))
    text = html.unescape(re.sub(r"<[^>]+>", " ", out))
    return header, cells, text


def _reads_as_a_person_does(text, cells):
    assert not re.search(r"\d[eE][+-]?\d", text), text  # no "4.07e+03 ms"
    for values, _ in cells.values():
        assert not {"0 ns", "0 s"} & set(values), values  # no zero shown for work that exists


def test_the_confirm_panel_shows_a_step_and_its_microbatches_side_by_side():
    """A row of 4 accumulated microbatches: the panel says the compiled program is one of them and shows the
    predicted step and microbatch beside the compiled microbatch and the compiled step (the microbatch x 4 plus
    what the accumulation adds), each main quantity with cost.reconcile's reason beneath it."""
    model, cluster = _tiny_f32(), Cluster.h100(nodes=1)
    advisor = LayoutAdvisor(model, cluster, batch_tokens=32 * 128, seq_len=128,
                            constraints=Constraints(pipeline=False, fixed={"fsdp": 8}, grad_accumulation=(4,)))
    assert advisor.confirm(), advisor._out.value
    c = advisor.advice.ranked[0]
    assert c.grad_accumulation == 4
    header, cells, text = _panel(advisor)
    assert header == ["", "predicted step", "predicted microbatch", "compiled microbatch", "accumulation adds",
                      "compiled step (4 x microbatch + accumulation)"]
    assert "The compiled program: one train step of one microbatch: 8 of the step's 32 sequences" in text
    assert list(cells) == ["step time", "compute time", "memory time", "communication", "memory: total"]
    rows = {r.quantity: r for r in c.reconciled}
    for quantity, (values, why) in cells.items():
        assert why == f"for one microbatch: {rows[quantity].why}"  # cost.reconcile's sentence, for the program
        assert values[1:3] == [rows[quantity].predicted_text, rows[quantity].compiled_text]
    # the compiled microbatch's memory is XLA's buffer assignment; the step adds the ledger's gradient sum
    memory = cells["memory: total"][0]
    assert memory[2] == format_bytes(c.compiled.memory.total)
    assert memory[4] == format_bytes(c.compiled.memory.total + c.ledger.grads)
    assert cells["step time"][0][0] == format_seconds(c.step.time_s)
    step = c.confirmation["step time"]
    assert cells["step time"][0][4] == format_seconds(4 * c.compiled_step.time_s + step.accumulation)
    assert "every other quantity reconciled" in text and format_flops(4 * c.compiled.matmul_flops) in text
    _reads_as_a_person_does(text, cells)


def test_the_confirm_panel_compiles_a_decode_row_with_its_kv_cache():
    """A decode row: the compiled program is the decode step with its 512-position cache (the panel says so);
    the arguments the compiled program holds are the ledger's weights, cache and token ids."""
    model, cluster = _tiny_f32(), Cluster.h100(nodes=1)
    advisor = LayoutAdvisor(model, cluster, batch_tokens=8, seq_len=512, task="decode",
                            constraints=Constraints(fixed={"tp": 4, "dp": 2}))
    assert advisor.confirm(), advisor._out.value
    c = advisor.advice.ranked[0]
    header, cells, text = _panel(advisor)
    assert header == ["", "predicted", "compiled"]
    assert "one decode step: 8 sequences each write one new token into a KV cache of 512 positions" in text
    assert "without a cache" not in text
    rows = {r.quantity: r for r in c.reconciled}
    for quantity, (values, why) in cells.items():
        assert values == [rows[quantity].predicted_text, rows[quantity].compiled_text] and why == rows[quantity].why
    assert cells["memory: total"][0][1] == format_bytes(c.compiled.memory.total)
    arguments = rows["memory: arguments"]
    assert arguments.compiled == c.compiled.memory.argument
    assert arguments.compiled == pytest.approx(c.ledger.params + c.ledger.kv_cache + c.ledger.inputs, rel=0.02)
    _reads_as_a_person_does(text, cells)
