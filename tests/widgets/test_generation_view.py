"""GenerationView, driven through its callbacks: tokens streamed equal model.generate's, stop from the button
while the loop runs in its thread, the cache picture against the returned cache, and inline errors.

Every run uses the shapes of tests/core/views/test_cache_fill.py (1-layer tiny Llama, "Hello" left padded to 16,
8 new tokens, 32 slots, greedy, no EOS), so each compiled program is built once per test session.
"""

import html
import re
import threading

import numpy as np
import pytest
from flax import nnx

from workbench.core.models.causal_lm import CausalLM
from workbench.core.models.config import ModelConfig
from workbench.core.models.generation import GenerationConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.sharding import lazy_init
from workbench.core.models.tokenizer import ByteTokenizer, HFTokenizer
from workbench.core.programs import PROGRAMS
from workbench.core.views.cache_fill import ContiguousFill, cache_fill
from workbench.core.views.token_stream import TokenStream
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
    PROGRAMS.clear("generate")  # another test file may have compiled these shapes for an equal model
    view = make_view(model)
    statuses, texts, caches = record(view._status), record(view._text), record(view._cache)
    thread = view.generate()
    assert isinstance(thread, threading.Thread) and view.generate_button.disabled
    assert view.wait(TIMEOUT_S) and view.error == ""
    expected = reference(model)
    np.testing.assert_array_equal(view.new_tokens, expected)
    np.testing.assert_array_equal(np.asarray(view.output.sequences)[:, 16:], expected)
    # random weights make bytes that are not UTF-8: the view shows them escaped, as Python decodes them
    assert view.text == [ByteTokenizer().decode(expected[0], errors="backslashreplace")]
    if (expected[0] < 256).all():
        assert view.text[0] == bytes(expected[0].tolist()).decode("utf-8", errors="backslashreplace")
    assert html.escape(view.text[0]) in view._text.value and ">Hello</span>" in view._text.value
    # rendered on the stream's own thread, newest state first: some steps may be skipped, none goes back
    assert len(texts) >= 2  # streamed pictures, then the final text
    assert "compiling the prefill and the decode loop" in statuses[0]
    assert any("generating…" in s for s in statuses)
    assert "done: 8 new tokens per row" in statuses[-1]
    live = [index_of(c) for c in caches if "live, from streamed tokens" in c]
    assert live == sorted(set(live)) and set(live) <= set(range(16, 24))  # one slot more per streamed token
    assert "after the run: output.cache" in caches[-1] and index_of(caches[-1]) == 23 == live[-1]
    assert caches[-1] == cache_html(cache_fill(view.output.cache), prompt_len=16, source="after the run: output.cache",
                                    nbytes=view.output.cache.nbytes)
    assert not view.generate_button.disabled and view.stop_button.disabled
    # a second run reuses the compiled program and says so
    statuses.clear()
    view.generate()
    assert view.wait(TIMEOUT_S)
    assert statuses[0].count("generating…") == 1 and "no compile (program reused)" in statuses[-1]


def test_compiling_flag_follows_the_core_cache_after_switching_the_model(model):
    view = make_view(model)
    view.generate()
    assert view.wait(TIMEOUT_S) and view.error == ""
    statuses = record(view._status)

    def run():
        start = len(statuses)
        view._on_generate(None)
        assert view.wait(TIMEOUT_S) and view.error == ""
        return statuses[start], statuses[-1]

    view.model = model.with_attention("sdpa")  # another graphdef: its programs are not compiled yet
    first, last = run()
    assert "compiling the prefill and the decode loop" in first and "compiled in" in last
    first, last = run()  # the same model again: reused
    assert "generating…" in first and "compiling" not in first and "no compile (program reused)" in last
    view.model = model  # back to the first model: still compiled
    first, last = run()
    assert "generating…" in first and "compiling" not in first and "no compile (program reused)" in last


def test_stop_button_while_the_loop_runs_then_generate_again(model, monkeypatch):
    from workbench.core.views.token_stream import TokenStream
    from workbench.widgets import generation_view

    view = make_view(model)
    at_step_three, release = threading.Event(), threading.Event()

    class Held(TokenStream):  # hold the decode loop (its host callback) right after step 3
        def put(self, tokens):
            super().put(tokens)
            if self.num_steps == 3 and not release.is_set():
                at_step_three.set()
                release.wait(TIMEOUT_S)

    monkeypatch.setattr(generation_view, "TokenStream", Held)
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
    # the core's input checks (run by is_compiled, asked whether this run compiles) refuse before a thread starts
    assert view.generate() is None
    assert view.error.startswith("beam search reorders the cache") and 'class="wb-error"' in view._error.value
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


# -- a Hugging Face tokenizer (the real SmolLM2 one): chat template, BPE text -------------------------------------
@pytest.fixture(scope="module")
def hf(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def bpe_model():
    """A random 1-layer tiny Llama with SmolLM2's vocab: its tokens are arbitrary BPE pieces."""
    return tiny("llama", num_hidden_layers=1, vocab_size=49152)


def chat_ids(hf, text):
    return hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_dict=False)


def test_hf_tokenizer_chat_checkbox_and_prompt_ids(bpe_model, hf, smollm2_dir):
    view = GenerationView(bpe_model, tokenizer=hf, prompt="Hi")
    assert isinstance(view.tokenizer, HFTokenizer) and view.tokenizer.hf is hf
    assert view.chat.value and not view.chat.disabled and view.chat.layout.display != "none"
    assert view.chat in view.children[3].children
    ids, mask = view.prompt_inputs()
    ref = chat_ids(hf, "Hi")
    assert ids.shape == (1, 32) and ids[0, 32 - len(ref):].tolist() == ref  # left padded to a multiple of 16
    assert ids[0, :32 - len(ref)].tolist() == [hf.pad_token_id] * (32 - len(ref))
    assert mask.sum() == len(ref) and mask[0, -1] == 1
    config = view.generation_config()
    assert (config.eos_token_id, config.pad_token_id) == ((hf.eos_token_id,), hf.pad_token_id) == ((2,), 2)

    view.chat.value = False  # the text as is, no special tokens added
    ids, mask = view.prompt_inputs()
    plain = hf("Hi", add_special_tokens=False)["input_ids"]
    assert ids[0, 16 - len(plain):].tolist() == plain and mask.sum() == len(plain)

    view.chat.value, view.batch.value = True, True
    view.prompt.value = "Hi\nWhat is 2+2?"
    ids, mask = view.prompt_inputs()
    rows = [chat_ids(hf, "Hi"), chat_ids(hf, "What is 2+2?")]
    assert [r[m.astype(bool)].tolist() for r, m in zip(ids, mask, strict=True)] == rows

    from_dir = GenerationView(bpe_model, tokenizer=smollm2_dir, chat=False)  # a local directory works too
    assert isinstance(from_dir.tokenizer, HFTokenizer) and not from_dir.chat.value


def test_byte_tokenizer_has_no_chat_checkbox(model):
    view = make_view(model)
    assert view.chat.layout.display == "none" and view.chat.disabled and not view.chat.value
    with pytest.raises(ValueError, match="chat=True needs a tokenizer with a chat template"):
        GenerationView(model, chat=True)


def test_hf_streamed_text_is_decoded_whole_and_never_garbled(bpe_model, hf):
    view = GenerationView(bpe_model, tokenizer=hf, prompt="Hi", cache_length=64, refresh_s=0)
    view.max_new_tokens.value, view.stop_at_eos.value = 12, False
    texts = record(view._text)
    view.generate()
    assert view.wait(TIMEOUT_S) and view.error == ""
    new = view.new_tokens[0].tolist()
    assert len(new) == 12 and view.text == [hf.decode(new, skip_special_tokens=True)]
    shown = {}
    for value in texts:  # what the view showed after n streamed tokens
        steps = int(re.search(r'data-steps="(\d+)"', value).group(1))
        shown[steps] = html.unescape(re.search(r'class="wb-gen-new"[^>]*>(.*?)</span>', value, re.S).group(1))
        prompt = html.unescape(re.search(r'class="wb-gen-prompt-text"[^>]*>(.*?)</span>', value, re.S).group(1))
        assert prompt == hf.decode(chat_ids(hf, "Hi"))  # a chat prompt shows its template's markers
    assert 12 in shown and set(shown) <= set(range(13))  # skipped states are fine (rendered off the loop)
    for n, text in shown.items():
        expected = hf.decode(new[:n], skip_special_tokens=True)
        assert text == (expected if n == 12 else expected.rstrip("\ufffd")), n


@pytest.mark.reference
def test_real_smollm2_answers_in_chat_like_transformers(smollm2_dir, hf):
    """The packaged model, loaded by the workbench, greedy in the view: the tokens transformers generates."""
    import torch
    import transformers

    from workbench.core.models.auto import from_pretrained

    question = "What is the capital of France?"
    ids = chat_ids(hf, question)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32,
                                                                        local_files_only=True)
    expected = reference_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert expected[-1] == hf.eos_token_id and "Paris" in hf.decode(expected)

    view = GenerationView(from_pretrained(smollm2_dir), tokenizer=smollm2_dir, prompt=question, cache_length=64)
    view.max_new_tokens.value = 12
    assert view.chat.value  # on by default: the tokenizer has a chat template
    view.generate()
    assert view.wait(TIMEOUT_S) and view.error == ""
    assert view.new_tokens[0, :len(expected)].tolist() == expected
    assert view.text[0] == hf.decode(expected, skip_special_tokens=True) and "Paris" in view.text[0]
