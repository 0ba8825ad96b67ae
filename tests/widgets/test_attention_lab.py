"""AttentionLab: its callbacks called directly, as the browser would call them."""

import base64
import json
import re
import types

import jax
import numpy as np
import pytest
from IPython.core.events import EventManager, available_events

from workbench.core.operations import AttentionOutput, Capabilities, OperationImpl, OperationRegistry
from workbench.core.operations.attention.common import CAUSAL, GQA, AttentionImplMixin, dense_attention
from workbench.core.views.attention_lab import ModelComparison, ModelRun, attention_weights, make_inputs
from workbench.widgets import attention_lab as view
from workbench.widgets.attention_lab import AttentionLab

SMALL = dict(seq_len=64, gqa_ratio=4, runs=1)


def make_impl(name: str, kernel_path: str):
    """A dense implementation registered under ``name`` whose outputs say ``kernel_path``."""

    class Late(AttentionImplMixin, OperationImpl):
        capabilities = Capabilities(features={CAUSAL, GQA}, description=f"{name}: registered late")

        @classmethod
        def get_impl_name(cls):
            return name

        def forward_native(self, query, key, value, **kwargs):
            return AttentionOutput(dense_attention(self.prepare(query, key, value, **kwargs))[0], None, kernel_path)

    return OperationRegistry.register(Late, override=True)


@pytest.fixture
def late_impl():
    names = []

    def register(name: str, kernel_path: str = "late/native"):
        names.append(name)
        return make_impl(name, kernel_path)

    yield register
    for name in names:
        if name in OperationRegistry.list_implementations():
            OperationRegistry.unregister(name)


class FakeShell:
    """What the lab's refresh hook needs of IPython: ``events``."""

    def __init__(self):
        self.events = EventManager(self, available_events)


def plotted_z(out) -> np.ndarray:
    """The heatmap an Output shows, decoded from plotly's typed-array JSON."""
    z = out.outputs[0]["data"]["application/vnd.plotly.v1+json"]["data"][0]["z"]
    shape = [int(n) for n in str(z["shape"]).split(",")]  # plotly writes "64, 64"
    return np.frombuffer(base64.b64decode(z["bdata"]), np.dtype(z["dtype"])).reshape(shape)


def test_the_lab_shows_every_implementation_and_the_comparison():
    lab = AttentionLab(**SMALL)
    assert lab.implementations == OperationRegistry.list_implementations()
    labels = {v: k for k, v in lab._impl.options}
    assert labels["sdpa"] == "sdpa · no logits_soft_cap, return_weights, sinks, value_head_dim"
    assert (lab.impl, lab.reference, lab.error) == ("flash", "vanilla", "")
    assert "flash/native" in lab._results.value and "vanilla/native" in lab._results.value
    assert "blockwise online softmax" in lab._capabilities.value
    # heatmaps: vanilla's weights (flash returns none) and |flash - vanilla| of head 0
    q, k, _ = lab.inputs()
    np.testing.assert_array_equal(plotted_z(lab._weights_out), attention_weights(q, k, head=0))
    np.testing.assert_array_equal(plotted_z(lab._diff_out), lab.comparison.output_difference(0))
    assert "(vanilla)" in lab.weights_figure.layout.title.text
    assert repr(lab) == "AttentionLab(impl='flash', reference='vanilla', T=64, H=8, KV=2, D=64, float32)"


def test_choosing_implementations_and_head_re_renders():
    lab = AttentionLab(**SMALL)
    lab._impl.value = "sdpa"  # what the menu does
    assert lab.comparison.impl.kernel_path == "sdpa/xla" and "sdpa/xla" in lab._results.value
    assert lab.comparison.max_abs_diff < 2e-5
    lab._reference.value = "flash"
    assert lab.comparison.reference.kernel_path == "flash/native"
    lab._head.value = 5
    q, k, _ = lab.inputs()
    np.testing.assert_array_equal(plotted_z(lab._weights_out), attention_weights(q, k, head=5))
    np.testing.assert_array_equal(plotted_z(lab._diff_out), lab.comparison.output_difference(5))
    assert lab.difference_figure.layout.title.text.startswith("|sdpa − flash|, head 5")
    lab._impl.value = "vanilla"  # vanilla returns weights: the heatmap shows its own
    assert "(vanilla)" in lab.weights_figure.layout.title.text


def test_an_implementation_registered_later_appears_without_rebuilding(monkeypatch, late_impl):
    import IPython

    shell = FakeShell()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    lab = AttentionLab(**SMALL)
    late_impl("late_after_cell")
    assert "late_after_cell" not in lab.implementations
    before = lab.comparison
    shell.events.trigger("post_run_cell", None)  # IPython runs this after every cell
    assert "late_after_cell" in lab.implementations and "late_after_cell" in [n for _, n in lab._reference.options]
    assert lab.comparison is before  # the implementations on show did not change: no recomputation

    late_impl("late_after_click")
    lab._refresh_button.click()
    assert "late_after_click" in lab.implementations
    late_impl("late_after_edit")
    lab._head.value = 1  # any interaction re-reads the registry
    assert "late_after_edit" in lab.implementations

    lab._impl.value = "late_after_cell"
    assert lab.comparison.impl.kernel_path == "late/native" and lab.comparison.max_abs_diff < 2e-5
    late_impl("late_after_cell", "late/v2")  # the cell re-run with a changed class: re-rendered
    shell.events.trigger("post_run_cell", None)
    assert lab.comparison.impl.kernel_path == "late/v2"
    OperationRegistry.unregister("late_after_cell")  # gone: the menu falls back to vanilla, nothing raises
    shell.events.trigger("post_run_cell", None)
    assert "late_after_cell" not in lab.implementations and lab.impl == "vanilla"
    assert lab.error == "'late_after_cell' is no longer registered; the menu shows 'vanilla' instead"
    assert lab.comparison.impl.name == "vanilla"
    lab._head.value = 2
    assert lab.update() and lab.error == ""  # said once
    lab.close()
    assert not shell.events.callbacks["post_run_cell"]  # closing the lab removes its hook


def test_an_unsupported_option_is_a_row_not_an_error():
    lab = AttentionLab(impl="sdpa", **SMALL)
    lab._soft_cap.value = 5.0
    assert lab.error == "" and lab.comparison.impl.unsupported.startswith("unsupported: logits_soft_cap")
    assert re.search(r"unsupported: logits_soft_cap; supported by: [^<]*\bflash\b", lab._results.value)
    assert lab.difference_figure is None  # no heatmap of nothing: the reason instead
    assert lab._diff_out.outputs[0]["data"]["text/plain"].startswith("no difference to draw: unsupported")
    assert lab.comparison.reference.ok  # vanilla has the soft cap


def test_a_recompute_says_it_is_working_and_marks_the_old_results_stale(monkeypatch):
    lab = AttentionLab(**SMALL)
    table, seen = lab._results.value, []
    real = view.compare

    def compare(*args, **kwargs):  # what the browser shows while the comparison compiles and runs
        seen.append((lab._busy.value, lab._results.value))
        return real(*args, **kwargs)

    monkeypatch.setattr(view, "compare", compare)
    lab._impl.value = "sdpa"
    ((busy, results),) = seen
    assert "computing" in busy and "sdpa" in busy and "vanilla" in busy
    assert 'class="wb-attention-stale"' in results and table in results
    assert lab._busy.value == "" and "wb-attention-stale" not in lab._results.value and "sdpa/xla" in lab._results.value


def test_the_difference_heatmap_starts_at_zero_and_says_identical():
    lab = AttentionLab(impl="vanilla", reference="vanilla", **SMALL)
    assert lab.comparison.max_abs_diff == 0
    title = lab.difference_figure.layout.title
    assert title.text == "|vanilla − vanilla|, head 0: identical" and title.x == 0 and title.xanchor == "left"
    trace = lab.difference_figure.data[0]
    assert (trace.zmin, trace.zmax) == (0, 1.0) and not plotted_z(lab._diff_out).any()
    lab._impl.value = "flash"
    trace = lab.difference_figure.data[0]
    assert trace.zmin == 0 and trace.zmax is None  # plotly's scale: 0 up to this head's largest difference
    config = lab._diff_out.outputs[0]["data"]["application/vnd.plotly.v1+json"]["config"]
    assert "zoom2d" not in config["modeBarButtonsToRemove"] and "lasso2d" in config["modeBarButtonsToRemove"]


def test_a_bad_edit_shows_inline_and_keeps_the_last_valid_results():
    lab = AttentionLab(**SMALL)
    before, table = lab.comparison, lab._results.value
    lab._window.value = -2
    assert "sliding_window must be a positive int; got -2" in lab.error and "wb-error" in lab._error.value
    # the last valid results stay, marked as not the controls' own
    assert lab.comparison is before and table in lab._results.value and table != lab._results.value
    assert 'class="wb-attention-stale"' in lab._results.value and "these controls failed" in lab._results.value
    lab._head.value = 1  # the heatmaps still follow the last valid results; the error stays said
    own = float(np.max(before.output_difference(1)))  # the shown head's own largest difference
    assert own < before.max_abs_diff and lab.difference_figure.layout.title.text.endswith(f"head 1: max {own:.2e}")
    assert "sliding_window must be a positive int" in lab.error
    lab._window.value = 8
    assert lab.error == "" and lab.comparison.options.sliding_window == 8
    assert "wb-attention-stale" not in lab._results.value and lab._busy.value == ""
    assert not lab.set_options(causal=False, dtype="float64")  # nothing set when one value is refused
    assert lab.error == "dtype must be one of float32, bfloat16, float16; got 'float64'"
    assert lab._causal.value and lab.comparison.options.sliding_window == 8
    assert lab.set_options(sliding_window=0, causal=True)  # 0 = off
    assert lab.comparison.options.sliding_window is None and lab.error == ""


def test_given_inputs_fix_the_shapes():
    q, k, v = make_inputs(seq_len=48, heads=4, kv_heads=4, head_dim=16)
    lab = AttentionLab(query=q, key=k, value=v, impl="vanilla", runs=1)
    assert lab._seq_len.disabled and lab._gqa.disabled
    assert lab.inputs()[0].shape == (1, 48, 4, 16) and [v for _, v in lab._head.options] == [0, 1, 2, 3]
    assert "T=48, H=4, KV=4, D=16" in lab._repr_html_()
    lab._dtype.value = "bfloat16"
    assert lab.comparison.impl.output.dtype == np.dtype("bfloat16") and lab.error == ""
    with pytest.raises(ValueError, match="pass query, key and value together"):
        AttentionLab(query=q)


def test_use_in_model_shows_logits_and_generations_side_by_side(monkeypatch):
    """The button's wiring, with ``model_comparison`` (tested in tests/core) replaced by a recorder."""
    calls = []

    def fake_model_comparison(model, impl, ids, mask, **kwargs):
        calls.append((model, impl, np.asarray(ids).tolist(), np.asarray(mask).tolist(), kwargs))
        if impl == "paged":
            raise ValueError("paged reads a paged KV cache: ...")
        logits = np.zeros((1, 3, 4), np.float32)
        runs = [ModelRun(name, f"<{name} model>", logits + d, [[7, 8]], ["ab"]) for name, d in ((impl, 1e-3), (kwargs[
            "reference"], 0.0))]
        return ModelComparison(*runs, 1e-3, np.full(3, 1e-3))

    monkeypatch.setattr(view, "model_comparison", fake_model_comparison)
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=264))  # all the lab reads of it
    lab = AttentionLab(model, max_new_tokens=3, **SMALL)
    lab._prompt.value = "Hi!"
    lab._use_button.click()
    assert calls == [(model, "flash", [[72, 105, 33]], [[1, 1, 1]],
                      {"reference": "vanilla", "max_new_tokens": 3, "tokenizer": lab.tokenizer})]
    assert lab.error == "" and lab.model_with_attention == "<flash model>"
    html = lab._model_html.value
    assert "logits max |Δ| 1.00e-03" in html and "vanilla (reference)" in html and "7 8" in html
    assert "wb-attention-model" in lab._repr_html_()

    result = lab.model_result
    lab._impl.value = "paged"
    assert not lab.use_in_model("another prompt")
    assert lab.error == "use in model: ValueError: paged reads a paged KV cache: ..." and lab.model_result is result
    assert lab._prompt.value == "another prompt"
    assert not AttentionLab(**SMALL).use_in_model()  # no model: said inline


def test_static_html_escapes_and_reports_the_state(late_impl):
    late_impl("<b>late</b>", "<i>path</i>")
    lab = AttentionLab(impl="<b>late</b>", **SMALL)
    static = lab._repr_html_()
    assert "&lt;b&gt;late&lt;/b&gt;" in static and "&lt;i&gt;path&lt;/i&gt;" in static and "<b>late</b>" not in static
    assert "causal=True" in static and "wb-attention-results" in static
    bundle = lab._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    json.dumps(lab.difference_figure.to_plotly_json(), default=str)  # the figure is plain data
    assert view.comparison_html(lab.comparison).count("<tr>") == 3


def test_use_in_model_encodes_with_a_hugging_face_tokenizer(monkeypatch, smollm2_hf_tokenizer, smollm2_dir):
    from workbench.core.models.tokenizer import HFTokenizer

    hf = smollm2_hf_tokenizer
    calls = []

    def fake_model_comparison(model, impl, ids, mask, **kwargs):
        calls.append((np.asarray(ids).tolist(), np.asarray(mask).tolist(), kwargs["tokenizer"]))
        new = hf.encode(" Paris.", add_special_tokens=False)
        runs = [ModelRun(name, None, np.zeros((1, 2, 4), np.float32), [new], [kwargs["tokenizer"].decode(new)])
                for name in (impl, kwargs["reference"])]
        return ModelComparison(*runs, 0.0, np.zeros(2))

    monkeypatch.setattr(view, "model_comparison", fake_model_comparison)
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=49152))  # SmolLM2's vocab
    for tokenizer in (hf, smollm2_dir):
        lab = AttentionLab(model, tokenizer=tokenizer, **SMALL)
        assert isinstance(lab.tokenizer, HFTokenizer)
        assert lab.use_in_model("Hello world, 日本語") and lab.error == ""
        ids = hf("Hello world, 日本語", add_special_tokens=False)["input_ids"]
        assert calls[-1][:2] == ([ids], [[1] * len(ids)]) and calls[-1][2] is lab.tokenizer
        assert "&#x27; Paris.&#x27;" in lab._model_html.value  # the decoded continuation, as repr, escaped
    # a real vocab gets no byte tokenizer by default: byte ids would mean nothing to it
    lab = AttentionLab(model, **SMALL)
    assert lab.tokenizer is None and not lab.use_in_model("Hi")
    assert "no tokenizer: pass AttentionLab(model, tokenizer=...)" in lab.error


def test_a_flex_variant_defined_in_two_lines_appears_with_its_block_mask():
    """``flex_variant`` registers mods as an implementation: the lab's menu lists it, draws its block mask with its
    sparsity, and compares it with vanilla given the same mask."""
    import workbench as wb
    from workbench.core.operations.attention import block_mask as mods

    lab = AttentionLab(**{**SMALL, "seq_len": 128})
    try:
        wb.flex_variant("window_32", mask_mod=mods.sliding_window(32), block_q=16, block_k=16)
        lab._refresh_button.click()
        assert "window_32" in lab.implementations
        lab._impl.value = "window_32"
        lab._window.value = 32  # the reference sees the same window
        assert not lab.error, lab.error
        assert lab.comparison.impl.kernel_path == "flex/native" and lab.comparison.max_abs_diff < 2e-5
        html = lab._capabilities.value
        # 8 x 8 tiles of 16: row i sees its diagonal tile (partial), tile i - 1 whole (full) and i - 2 in part:
        # 1 + 2 + 6 x 3 = 21 of 64 visited, 43 empty
        assert 'class="wb-attention-block-mask"' in html and 'class="wb-block-mask"' in html
        assert "sparsity 67.2%" in html
        wb.flex_variant("window_32", mask_mod=mods.sliding_window(16), block_q=16, block_k=16)  # the cell re-run
        lab._refresh_button.click()
        assert "sliding_window(16)" in lab._capabilities.value
        with pytest.raises(ValueError, match="built-in implementation"):
            wb.flex_variant("flash", mask_mod=mods.causal)
    finally:
        OperationRegistry.unregister("window_32")
        lab.close()


def test_recorded_one_device_inputs_run_on_the_simulated_mesh_or_say_why_not():
    """The tour's case: inputs recorded from a model live on one device; a sequence-parallel implementation runs
    on the lab's sp mesh when the length splits over it, and otherwise says why, with no heatmap."""
    for t, runs in ((16, True), (17, False)):
        q, k, v = (jax.device_put(x, jax.devices()[0]) for x in make_inputs(t, 8, 2, 16))
        lab = AttentionLab(query=q, key=k, value=v, impl="ring")
        assert lab.error == ""
        if runs:
            assert lab.comparison.impl.ok and lab.comparison.max_abs_diff < 1e-5
            assert any("over sp" in c for c in lab.comparison.impl.collectives)
        else:
            assert "divide over no group of more than one of the 8 devices" in lab.comparison.impl.unsupported
            assert lab.difference_figure is None
        lab.close()
