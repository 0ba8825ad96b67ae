"""GenerationView, driven through its callbacks: tokens streamed equal model.generate's, stop from the button
while the loop runs in its thread, the cache picture against the returned cache, and inline errors.

Every run uses the shapes of tests/core/test_cache_view.py (1-layer tiny Llama, "Hello" left padded to 16,
8 new tokens, 32 slots, greedy, no EOS), so each compiled program is built once per test session.
"""

import html
import re
import threading

import numpy as np
import pytest
from flax import nnx

from workbench.core.cache_view import ContiguousFill, cache_fill
from workbench.core.models.causal_lm import CausalLM
from workbench.core.models.config import ModelConfig
from workbench.core.models.generation import GenerationConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.sharding import lazy_init
from workbench.core.models.tokenizer import ByteTokenizer
from workbench.core.token_stream import TokenStream
from workbench.widgets._cache_html import cache_html
from workbench.widgets.generation_view import GenerationView, default_tokenizer

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model():
    return tiny("llama", num_hidden_layers=1)


def make_view(model, **kwargs):
    view = GenerationView(model, prompt="Hello", cache_length=32, refresh_s=0, **kwargs)
    view.max_new_tokens.value = 8
    view.stop_at_eos.value = False  # a random model may emit EOS: keep the length fixed
    return view


def record(widget):
    seen = []
    widget.observe(lambda change: seen.append(change["new"]), names="value")
    return seen


def reference(model, text="Hello"):
    """What model.generate gives for the prompt, encoded here without the widget."""
    row = ByteTokenizer().encode(text)
    ids = np.full((1, 16), ByteTokenizer.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    ids[0, 16 - len(row):], mask[0, 16 - len(row):] = row, 1
    out = model.generate(ids, GenerationConfig(max_new_tokens=8, pad_token_id=ByteTokenizer.pad_token_id), mask,
                         streamer=TokenStream(), cache=model.init_cache(1, 32))
    return np.asarray(out.sequences)[:, 16:]


def index_of(cache_value):
    return int(re.search(r'data-index="(\d+)"', cache_value).group(1))


def test_streamed_tokens_equal_generate_and_the_cache_fills(model):
    view = make_view(model)
    statuses, texts, caches = record(view._status), record(view._text), record(view._cache)
    thread = view.generate()
    assert isinstance(thread, threading.Thread) and view.generate_button.disabled
    assert view.wait(TIMEOUT_S) and view.error == ""
    expected = reference(model)
    np.testing.assert_array_equal(view.new_tokens, expected)
    np.testing.assert_array_equal(np.asarray(view.output.sequences)[:, 16:], expected)
    assert view.text == [ByteTokenizer().decode(expected[0])]
    assert html.escape(view.text[0]) in view._text.value and ">Hello</span>" in view._text.value
    assert len(texts) >= 9  # the prompt, then every token (refresh_s=0), then the final text
    assert "compiling the prefill and the decode loop" in statuses[0]
    assert any(">generating… 1 token<" in s for s in statuses)
    assert "done: 8 new tokens per row" in statuses[-1]
    live = [index_of(c) for c in caches if "live, from streamed tokens" in c]
    assert live == list(range(16, 24))  # one slot more per streamed token
    assert "after the run: output.cache" in caches[-1] and index_of(caches[-1]) == 23 == live[-1]
    assert caches[-1] == cache_html(cache_fill(view.output.cache), prompt_len=16, source="after the run: output.cache",
                                    nbytes=view.output.cache.nbytes)
    assert not view.generate_button.disabled and view.stop_button.disabled
    # a second run reuses the compiled program and says so
    statuses.clear()
    view.generate()
    assert view.wait(TIMEOUT_S)
    assert statuses[0].count("generating…") == 1 and "no compile (program reused)" in statuses[-1]


def test_stop_button_while_the_loop_runs_then_generate_again(model):
    view = make_view(model)
    at_step_three, release = threading.Event(), threading.Event()

    def hold(_change):  # runs on generate's callback thread: hold the loop at step 3
        if view._stream.num_steps == 3 and not release.is_set():
            at_step_three.set()
            release.wait(TIMEOUT_S)

    view._text.observe(hold, names="value")
    view._on_generate(None)
    assert at_step_three.wait(TIMEOUT_S)
    # the loop is mid-run in its thread; this (the kernel's) thread is free to handle widget messages
    assert view.running and view.generate_button.disabled and not view.stop_button.disabled
    view._on_generate(None)
    assert view.error == "a generation is running: press stop first"
    view._on_stop(None)  # the stop button
    release.set()
    assert view.wait(TIMEOUT_S)
    assert view.output.num_new_tokens == 3 and view.new_tokens.shape == (1, 3)
    assert "stopped: 3 new tokens per row" in view._status.value
    assert index_of(view._cache.value) == 16 + 3 - 1
    assert not view.generate_button.disabled and view.stop_button.disabled
    view._on_generate(None)  # usable again
    assert view.wait(TIMEOUT_S) and view.error == ""
    assert view.output.num_new_tokens == 8 and "done: 8 new tokens" in view._status.value
    np.testing.assert_array_equal(view.new_tokens, reference(model))


def test_paged_cache_page_table(model):
    view = make_view(model, cache="paged", page_size=4)
    caches = record(view._cache)
    view.generate()
    assert view.wait(TIMEOUT_S) and view.error == ""
    np.testing.assert_array_equal(view.new_tokens, reference(model))  # same tokens as the contiguous cache
    live = [c for c in caches if "live, from streamed tokens" in c]
    assert re.findall(r'data-length="(\d+)"', live[-1]) == ["12"] and "physical ids are known when" in live[-1]
    final = caches[-1]
    fill = cache_fill(view.output.cache)
    assert 'data-in-use="3" data-free="5"' in final and 'data-length="12"' in final  # padding is not stored
    assert [int(p) for p in re.findall(r'title="row 0, logical page \d: \d/4 tokens"[^>]*>(\d+)<', final)] == \
        fill.page_table_BP[0, :3].tolist()


def test_inline_errors_keep_the_last_good_state(model):
    view = make_view(model)
    view.generate()
    assert view.wait(TIMEOUT_S)
    good_text, good_cache = view._text.value, view._cache.value

    view.prompt.value = "   "
    assert view.generate() is None and view.error == "the prompt is empty: type a prompt"
    view.prompt.value = "x" * 30  # 32 after padding, + 8 new > 32 slots
    assert view.generate() is None
    assert view.error.startswith("the prompt (32 tokens, left padded to a multiple of 16) plus max_new_tokens (8) "
                                 "needs 40 positions per row but the cache holds 32: raise cache length")
    view.prompt.value, view.do_sample.value, view.temperature.value = "Hello", True, 0.0
    assert view.generate() is None and "temperature must be > 0 when sampling" in view.error
    view.do_sample.value, view.temperature.value = False, 1.0
    view.num_beams.value, view.cache_kind.value = 2, "paged"
    view.generate()  # the core refuses up front, inside the thread
    assert view.wait(TIMEOUT_S)
    assert "generation failed: ValueError: beam search reorders the cache" in view.error
    assert 'class="wb-error"' in view._error.value and "failed" in view._status.value
    assert (view._text.value, view._cache.value) == (good_text, good_cache)
    assert not view.generate_button.disabled
    view.num_beams.value, view.cache_kind.value = 1, "contiguous"
    view.generate()
    assert view.wait(TIMEOUT_S) and view.error == "" and view.output.num_new_tokens == 8


def test_token_ids_without_a_tokenizer_and_batches(model):
    config = ModelConfig.from_hf(tiny_config("llama", vocab_size=100, num_hidden_layers=1))
    small = lazy_init(lambda: CausalLM(config, rngs=nnx.Rngs(0)))  # abstract: nothing to compile or allocate
    assert default_tokenizer(small) is None and isinstance(default_tokenizer(model), ByteTokenizer)
    view = GenerationView(small, pad_to=1)
    assert "token ids" in view.prompt.placeholder
    view.prompt.value = "1, 2 3"
    ids, mask = view.prompt_inputs()
    assert ids.tolist() == [[1, 2, 3]] and mask.tolist() == [[1, 1, 1]]
    assert view._decode([4, 5]) == "4 5"
    view.prompt.value = "1 x"
    assert view.generate() is None and "'x' is not a token id" in view.error
    view.prompt.value = "150"
    assert view.generate() is None and "token id 150 is outside the vocab (0 .. 99)" in view.error

    batch = GenerationView(model, prompt="Hi\n\nHello there", pad_to=8)
    batch.batch.value = True
    ids, mask = batch.prompt_inputs()
    assert ids.shape == (2, 16) and mask.sum(1).tolist() == [2, 11]
    assert ids[0, :14].tolist() == [ByteTokenizer.pad_token_id] * 14 and mask[0, -2:].tolist() == [1, 1]


def test_static_html_and_long_caches(model):
    view = make_view(model)
    assert repr(view) == "GenerationView(CausalLM, tokenizer=ByteTokenizer(vocab_size=259))"
    static = view._repr_html_()
    assert "<b>prompt</b>: Hello" in static and "<script" not in static
    fill = ContiguousFill(np.ones((1, 1024), bool), 1024)
    picture = cache_html(fill, prompt_len=16, source="test")
    assert picture.count('class="wb-slot') == 256 and "one cell = 4 slots" in picture
    with pytest.raises(ValueError, match="cache must be 'contiguous' or 'paged'"):
        GenerationView(model, cache="ring")
    with pytest.raises(TypeError, match="generate"):
        GenerationView(object())
