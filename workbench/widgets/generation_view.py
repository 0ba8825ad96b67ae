"""GenerationView: a prompt, the GenerationConfig controls, tokens streamed as they are produced, a stop
button, and the KV cache filling (contiguous slots) or its page table (paged).

``generate`` runs in a background thread, so the kernel keeps handling widget messages while it
decodes: the stop button sets a flag that the streamer (:class:`~workbench.core.views.token_stream.TokenStream`)
returns from ``should_stop()``, and the compiled loop ends after the current step. The cache picture
is predicted from the streamed step count while decoding (:func:`~workbench.core.views.cache_fill.streamed_fill`)
and read from the returned cache at the end (:func:`~workbench.core.views.cache_fill.cache_fill`).
"""

from __future__ import annotations

import math
import re
import threading
import typing as tp

import ipywidgets as widgets
import numpy as np

from workbench.core.models.generation import GenerationConfig, is_compiled
from workbench.core.models.presets import TINY_VOCAB
from workbench.core.models.tokenizer import ByteTokenizer, as_tokenizer
from workbench.core.views.cache_fill import cache_fill, streamed_fill
from workbench.core.views.token_stream import TokenStream, stable_text
from workbench.widgets._cache_html import cache_html
from workbench.widgets._errors import InlineError
from workbench.widgets._html import escape

__all__ = ["GenerationView", "default_tokenizer"]

_MONO = "font-family:var(--jp-code-font-family,monospace);font-size:12px"


def default_tokenizer(model: tp.Any) -> tp.Any:
    """``ByteTokenizer`` for a model whose vocab is the byte vocab (259 ids, or 264 as the tiny presets
    round it); None otherwise (then the prompt is typed as token ids)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return ByteTokenizer() if vocab is not None and ByteTokenizer.vocab_size <= vocab <= TINY_VOCAB else None


class GenerationView(InlineError, widgets.VBox):
    """Generate from a prompt with every GenerationConfig control, watching tokens and the KV cache.

    ``tokenizer`` encodes the prompt and decodes the tokens: ours, a Hugging Face tokenizer, or a local
    directory holding one (e.g. ``local_checkpoint()``), through ``as_tokenizer``; by default a
    ``ByteTokenizer`` for the tiny presets' byte vocab, else the prompt is token ids (``12 7 99``). When
    the tokenizer has a chat template, a "chat" checkbox (``chat``: on by default) formats the prompt as
    a user message and the assistant's turn, as an instruct model expects. With "one prompt per line"
    each line is a row of the batch (left padded). "pad to a multiple of" left-pads the prompt so
    prompts of similar length share one compiled program: the loop compiles once per
    (config, prompt length, cache shape), and the first run of each says so on screen.
    ``view.model = other`` (e.g. ``model.with_attention("sdpa")``) switches the model for the next run.
    """

    def __init__(self, model: tp.Any, tokenizer: tp.Any = None, *, prompt: str = "", generation_config: tp.Any = None,
                 cache: str = "contiguous", cache_length: int | None = None, page_size: int = 16, pad_to: int = 16,
                 refresh_s: float = 0.1, chat: bool | None = None, **kwargs: tp.Any):
        if not callable(getattr(model, "generate", None)):
            raise TypeError(f"GenerationView needs a model with generate() (a CausalLM); got {type(model).__name__}")
        if cache not in ("contiguous", "paged"):
            raise ValueError(f"cache must be 'contiguous' or 'paged'; got {cache!r}")
        self.model = model
        self.tokenizer = as_tokenizer(tokenizer) if tokenizer is not None else default_tokenizer(model)
        has_template = bool(getattr(self.tokenizer, "has_chat_template", False))
        if chat and not has_template:
            raise ValueError(f"chat=True needs a tokenizer with a chat template; {self.tokenizer!r} has none")
        self._refresh_s = refresh_s
        cfg = generation_config or GenerationConfig()
        max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", 256)
        self._thread: threading.Thread | None = None
        self._busy = False
        self._stream: TokenStream | None = None
        self._run_info: dict[str, tp.Any] = {}
        self.output: tp.Any = None  # the last GenerationOutput
        small = lambda w: widgets.Layout(width=w)
        style = {"description_width": "initial"}
        hint = "text" if self.tokenizer is not None else "token ids, e.g. 12 7 99"
        self.prompt = widgets.Textarea(value=prompt, placeholder=f"prompt ({hint})", rows=2,
                                       layout=widgets.Layout(width="98%"))
        self.prompt.add_class("wb-gen-prompt")
        self.batch = widgets.Checkbox(value=False, description="one prompt per line", indent=False,
                                      layout=small("150px"))
        self.chat = widgets.Checkbox(value=has_template if chat is None else chat, disabled=not has_template,
                                     description="chat", indent=False, layout=small("70px"),
                                     tooltip="format the prompt with the tokenizer's chat template (a user message, "
                                             "then the assistant's turn)")
        self.chat.add_class("wb-gen-chat")
        if not has_template:
            self.chat.layout.display = "none"
        self.max_new_tokens = widgets.BoundedIntText(value=cfg.max_new_tokens, min=1, max=1_000_000,
                                                     description="max_new_tokens", style=style, layout=small("175px"))
        self.do_sample = widgets.Checkbox(value=cfg.do_sample, description="do_sample", indent=False,
                                          layout=small("95px"))
        self.temperature = widgets.FloatText(value=cfg.temperature, description="temperature", style=style,
                                             layout=small("150px"))
        self.top_k = widgets.IntText(value=cfg.top_k or 0, description="top_k (0 off)", style=style,
                                     layout=small("140px"))
        self.top_p = widgets.FloatText(value=1.0 if cfg.top_p is None else cfg.top_p, description="top_p (1 off)",
                                       style=style, layout=small("150px"))
        self.min_p = widgets.FloatText(value=cfg.min_p or 0.0, description="min_p (0 off)", style=style,
                                       layout=small("150px"))
        self.repetition_penalty = widgets.FloatText(value=cfg.repetition_penalty or 1.0,
                                                    description="repetition_penalty (1 off)", style=style,
                                                    layout=small("230px"))
        self.num_beams = widgets.BoundedIntText(value=cfg.num_beams, min=1, max=64, description="num_beams",
                                                style=style, layout=small("130px"))
        self.seed = widgets.IntText(value=0, description="seed", style=style, layout=small("110px"))
        self.stop_at_eos = widgets.Checkbox(value=True, description="stop at EOS", indent=False, layout=small("105px"))
        self.cache_kind = widgets.ToggleButtons(options=["contiguous", "paged"], value=cache,
                                                style={"button_width": "100px"})
        self.cache_kind.add_class("wb-gen-cache-kind")
        self.cache_length = widgets.BoundedIntText(value=cache_length or min(int(max_pos), 512), min=1,
                                                   max=10_000_000, description="cache length", style=style,
                                                   layout=small("165px"))
        self.page_size = widgets.BoundedIntText(value=page_size, min=1, max=4096, description="page_size",
                                                style=style, layout=small("135px"))
        self.pad_to = widgets.BoundedIntText(value=pad_to, min=1, max=4096, description="pad prompt to a multiple of",
                                             style=style, layout=small("235px"))
        self.generate_button = widgets.Button(description="generate", button_style="primary", icon="play")
        self.generate_button.add_class("wb-gen-generate")
        self.stop_button = widgets.Button(description="stop", button_style="danger", icon="stop", disabled=True)
        self.stop_button.add_class("wb-gen-stop")
        self._status = widgets.HTML("")
        self._status.add_class("wb-gen-status")
        self._text = widgets.HTML("")
        self._text.add_class("wb-gen-text")
        self._cache = widgets.HTML("")
        self._cache.add_class("wb-gen-cache")
        wrap = widgets.Layout(flex_flow="row wrap", align_items="center")
        controls = [
            widgets.HBox([self.max_new_tokens, self.do_sample, self.temperature, self.top_k, self.top_p, self.min_p],
                         layout=wrap),
            widgets.HBox([self.repetition_penalty, self.num_beams, self.seed, self.stop_at_eos], layout=wrap),
            widgets.HBox([self.cache_kind, self.cache_length, self.page_size, self.pad_to, self.batch, self.chat],
                         layout=wrap),
        ]
        super().__init__([self.prompt, *controls, widgets.HBox([self.generate_button, self.stop_button]),
                          self._status, self._error_area(), self._text, self._cache], **kwargs)
        self.add_class("wb-generation-view")
        self.generate_button.on_click(self._on_generate)
        self.stop_button.on_click(self._on_stop)

    # -- public --------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True from ``generate()`` until the run's results are on screen."""
        return self._busy

    @property
    def new_tokens(self) -> np.ndarray:
        """The last run's new tokens ``(B, steps)``: as streamed (so far, while it runs), or, for beam search
        (which does not stream), from ``output.sequences`` once it ended."""
        if self._stream is not None and self._stream.num_steps:
            return self._stream.new_BN
        if self.output is not None and not self.running:
            return np.asarray(self.output.sequences)[:, self._run_info["mask"].shape[1]:]
        return np.zeros((0, 0), np.int32)

    @property
    def text(self) -> list[str]:
        """The last run's new text per row (token ids joined by spaces without a tokenizer)."""
        return [self._decode(row) for row in self.new_tokens]

    def generation_config(self) -> tp.Any:
        """The GenerationConfig the controls describe (raises ValueError/TypeError saying what to change)."""
        tok, cfg = self.tokenizer, getattr(self.model, "config", None)
        eos = getattr(tok, "eos_token_id", None) if tok is not None else getattr(cfg, "eos_token_id", None)
        pad = getattr(tok, "pad_token_id", None) if tok is not None else getattr(cfg, "pad_token_id", None)
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens.value, do_sample=self.do_sample.value,
            temperature=self.temperature.value, top_k=self.top_k.value or None,
            top_p=None if self.top_p.value == 1.0 else self.top_p.value,
            min_p=None if self.min_p.value == 0.0 else self.min_p.value,
            repetition_penalty=None if self.repetition_penalty.value == 1.0 else self.repetition_penalty.value,
            num_beams=self.num_beams.value, eos_token_id=eos if self.stop_at_eos.value else None, pad_token_id=pad)

    def prompt_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, attention_mask)`` int32 ``(B, P)`` from the prompt box, left padded to a multiple of
        "pad to"; raises ValueError for an empty prompt or ids outside the vocab."""
        text = self.prompt.value
        texts = [t for t in text.splitlines() if t.strip()] if self.batch.value else [text]
        if not texts or not any(t.strip() for t in texts):
            raise ValueError("the prompt is empty: type a prompt" + (" (one per line)" if self.batch.value else ""))
        chat = self.chat.value
        if chat and not getattr(self.tokenizer, "has_chat_template", False):
            raise ValueError("chat is on but the tokenizer has no chat template: untick chat")
        rows = [self.tokenizer.apply_chat_template(t) if chat else self._encode(t) for t in texts]
        if any(not r for r in rows):
            raise ValueError("a prompt encodes to no tokens: type at least one character")
        pad_id = self._pad_id()
        width = max(len(r) for r in rows)
        width = -(-width // self.pad_to.value) * self.pad_to.value
        ids = np.full((len(rows), width), pad_id, np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
        return ids, mask

    def generate(self) -> threading.Thread | None:
        """Start generating from the controls (what the button does), in a background thread; None, with an
        inline error, when the inputs are invalid or a run is going."""
        if self.running:
            self._show_error("a generation is running: press stop first")
            return None
        with self._guard(catch=(ValueError, TypeError), clear=True) as failed:
            config = self.generation_config()
            ids, mask = self.prompt_inputs()
            self._check_length(ids.shape[1], config.max_new_tokens)
            cache, cache_desc = self._make_cache(ids.shape[0] * config.num_beams, config)
        if failed:
            return None
        streaming = config.num_beams == 1
        # the core's compile cache says whether this run compiles (a new model, config or shape)
        with self._guard(catch=(ValueError, TypeError)) as failed:
            compiling = not is_compiled(self.model, ids, config, mask, cache, streamer=streaming)
        if failed:
            return None
        # rendered on the stream's own thread: the compiled decode loop never waits for the widget
        stream = TokenStream(self._on_stream if streaming else None, min_interval_s=self._refresh_s,
                             tokenizer=self.tokenizer, background=True)
        self._stream = stream
        self._run_info = {"config": config, "mask": mask, "cache_desc": cache_desc, "chat": self.chat.value}
        what = "the prefill and the decode loop" if streaming else "beam search"
        self._set_status(
            f"⏳ compiling {what} for this config, prompt length ({ids.shape[1]}) and cache (first run; later runs "
            f"with the same ones reuse it)…" if compiling else "generating…",
            css="wb-gen-compiling" if compiling else "wb-gen-running")
        if not streaming:
            self._set_status(self._status_text + " Beam search does not stream (as in Hugging Face): the text "
                             "appears when it ends, and stop cannot interrupt it.", css=self._status_css)
        self.generate_button.disabled, self.stop_button.disabled = True, not streaming
        self._busy = True
        self._thread = threading.Thread(target=self._run, args=(ids, mask, config, cache, stream), daemon=True,
                                        name="workbench-generate")
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop after the current step (what the stop button does); the tokens so far stay."""
        if self._stream is not None and self.running:
            self._stream.stop()
            self._set_status(self._status_text + " stopping…", css=self._status_css)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current run ends (True) or ``timeout`` seconds pass (False)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def _repr_html_(self) -> str:
        return (f'<div class="wb-generation-view-static"><div style="{_MONO}"><b>prompt</b>: '
                f"{escape(self.prompt.value)}</div>{self._status.value}{self._error_html()}{self._text.value}"
                f"{self._cache.value}</div>")

    def __repr__(self) -> str:
        return f"GenerationView({type(self.model).__name__}, tokenizer={self.tokenizer!r})"

    # -- callbacks --------------------------------------------------------------------------------------------
    def _on_generate(self, _button: tp.Any = None) -> None:
        self.generate()

    def _on_stop(self, _button: tp.Any = None) -> None:
        self.stop()

    def _on_stream(self, stream: TokenStream) -> None:
        """Runs on the stream's render thread (not inside the decode loop): redraw the text and the predicted
        cache."""
        if stream.prompt_BP is None:
            return
        info = self._run_info
        if stream.num_steps:
            kind, desc = info["cache_desc"][0], info["cache_desc"]
            fill = streamed_fill(kind, info["mask"], stream.num_steps, max_length=desc[1],
                                 page_size=desc[2] if kind == "paged" else None,
                                 num_pages=desc[3] if kind == "paged" else None)
            self._cache.value = cache_html(fill, prompt_len=info["mask"].shape[1], source="live, from streamed tokens")
            if not stream.stop_requested:
                n = stream.num_steps
                self._set_status(f"generating… {n} token{'s' * (n != 1)}", css="wb-gen-running")
        self._text.value = self._text_html(stream.prompt_BP, info["mask"], stream.new_BN, final=stream.finished)

    # -- internals ----------------------------------------------------------------------------------------------
    def _run(self, ids: np.ndarray, mask: np.ndarray, config: tp.Any, cache: tp.Any, stream: TokenStream) -> None:
        import jax

        status, css = "failed", "wb-gen-failed"
        try:
            with self._guard("generation failed"):  # shown inline; the kernel and the last good picture stay
                out = self.model.generate(ids, config, mask, prng_key=jax.random.key(self.seed.value),
                                          streamer=stream if config.num_beams == 1 else None, cache=cache)
                self.output = out
                stream.join(timeout=10)  # its last live picture first, then the final one below
                new_BN = np.asarray(out.sequences)[:, ids.shape[1]:]
                self._text.value = self._text_html(ids, mask, new_BN)
                fill = cache_fill(out.cache)
                self._cache.value = cache_html(fill, prompt_len=ids.shape[1], source="after the run: output.cache",
                                               nbytes=getattr(out.cache, "nbytes", None))
                t = out.timings
                rate = out.num_new_tokens * ids.shape[0] / t["decode"] if t.get("decode") else float("nan")
                how = "stopped" if stream.stop_requested and out.num_new_tokens < config.max_new_tokens else "done"
                compile_note = (f"compiled in {t['compile']:.2f} s (first run of this config and prompt length)"
                                if t.get("compile") else "no compile (program reused)")
                tokens = f"{out.num_new_tokens} new token{'s' * (out.num_new_tokens != 1)} per row"
                status = (f"{how}: {tokens} · {compile_note} · prefill {1e3 * t['prefill']:.0f} ms · decode "
                          f"{1e3 * t['decode']:.0f} ms ({rate:,.0f} tokens/s)")
                css = f"wb-gen-{how}"
        finally:
            # ready for the next run before the final status shows, so a client that sees it can press generate
            self._busy = False
            self.generate_button.disabled, self.stop_button.disabled = False, True
            self._set_status(status, css=css)

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        length = self.cache_length.value
        if self.cache_kind.value == "paged":
            length = -(-length // self.page_size.value) * self.page_size.value
        if prompt_len + max_new_tokens > length:
            padded = f", left padded to a multiple of {self.pad_to.value}" if self.pad_to.value > 1 else ""
            raise ValueError(f"the prompt ({prompt_len} tokens{padded}) plus max_new_tokens ({max_new_tokens}) needs "
                             f"{prompt_len + max_new_tokens} positions per row but the cache holds {length}: raise "
                             f"cache length or lower max_new_tokens")

    def _make_cache(self, rows: int, config: tp.Any) -> tuple[tp.Any, tuple]:
        length = self.cache_length.value
        if self.cache_kind.value == "contiguous":
            return self.model.init_cache(rows, length), ("contiguous", length)
        page = self.page_size.value
        num_pages = rows * math.ceil(length / page)
        cache = self.model.init_ragged_pages(batch_size=rows, page_size=page, num_pages=num_pages,
                                             max_model_length=length)
        return cache, ("paged", cache.max_length, page, num_pages)

    def _pad_id(self) -> int:
        for source in (self.tokenizer, getattr(self.model, "config", None)):
            pad = getattr(source, "pad_token_id", None)
            if isinstance(pad, int):
                return pad
        return 0

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text))
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        ids = []
        for item in re.split(r"[\s,]+", text.strip()):
            if not item:
                continue
            if not re.fullmatch(r"\d+", item):
                raise ValueError(f"{item!r} is not a token id: without a tokenizer the prompt is token ids "
                                 f"separated by spaces, e.g. 12 7 99 (or pass GenerationView(model, tokenizer))")
            if vocab is not None and int(item) >= vocab:
                raise ValueError(f"token id {item} is outside the vocab (0 .. {vocab - 1})")
            ids.append(int(item))
        return ids

    def _decode(self, ids: tp.Iterable[int], *, final: bool = True, specials: bool = False) -> str:
        """Text of ``ids`` (decoded whole: a multi-token character stays whole); while streaming
        (``final=False``) without an unfinished last character; ``specials`` keeps special tokens (a chat
        prompt's template markers). Without a tokenizer: the ids joined by spaces."""
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        ids = [int(i) for i in ids]
        if specials:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return stable_text(self.tokenizer, ids, final=final)

    def _text_html(self, ids_BP: np.ndarray, mask_BP: np.ndarray, new_BN: np.ndarray, *, final: bool = True) -> str:
        rows = []
        chat = bool(self._run_info.get("chat"))
        for b in range(ids_BP.shape[0]):
            prompt = self._decode(np.asarray(ids_BP[b])[np.asarray(mask_BP[b]).astype(bool)], specials=chat)
            new = self._decode(new_BN[b], final=final) if b < new_BN.shape[0] else ""
            rows.append(f'<div class="wb-gen-row" data-row="{b}" style="white-space:pre-wrap;margin:2px 0">'
                        f'<span class="wb-gen-prompt-text" style="color:#777">{escape(prompt)}</span>'
                        f'<span class="wb-gen-new" style="color:#0b5394;font-weight:600">{escape(new)}</span></div>')
        # data-steps changes with every streamed step, even while a held-back character leaves the text as it was
        return (f'<div class="wb-gen-output" data-steps="{new_BN.shape[1]}" style="{_MONO};border-left:3px solid #ccc;'
                f'padding-left:6px;'
                f'overflow-wrap:anywhere;max-height:240px;overflow-y:auto">'
                f'{"".join(rows)}</div>')

    _status_text = ""
    _status_css = ""

    def _set_status(self, text: str, css: str = "") -> None:
        self._status_text, self._status_css = text, css
        self._status.value = f'<div class="wb-gen-state {css}" style="font-size:12px;color:#333">{escape(text)}</div>'
