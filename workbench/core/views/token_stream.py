"""``TokenStream``: a streamer for ``generate`` that records tokens, can be stopped from another thread,
and tells a listener (throttled) as tokens arrive.

``generate`` hands a streamer the prompt ``(B, P)`` first, then each step's tokens ``(B,)`` from a host
callback inside the compiled decode loop, and stops after a step when ``should_stop()`` is True. So
``stream.stop()`` from any thread (a widget's stop button) ends decoding after the current step, and
the partial result is still returned.

>>> stream = TokenStream()
>>> stream.put(np.array([[5, 6]])); stream.put(np.array([7])); stream.put(np.array([8])); stream.end()
>>> stream.prompt_BP.tolist(), stream.new_BN.tolist(), stream.num_steps, stream.finished
([[5, 6]], [[7, 8]], 2, True)

With a ``tokenizer`` (ours or a Hugging Face one), ``text()`` is each row's new text and ``new_text()``
what was added since the last call, ready to print. Each is decoded from the row's whole id list, never
token by token, so a character split over several tokens (byte-level BPE, UTF-8 bytes) is never
garbled: until the stream ends, an unfinished character at the end is held back.

>>> from workbench.core.models.tokenizer import ByteTokenizer
>>> stream = TokenStream(tokenizer=ByteTokenizer())
>>> stream.put(np.array([[104]])); stream.put(np.array([0xC3]))
>>> stream.new_text()  # "é" is 0xC3 0xA9: its first byte alone is held back
['']
>>> stream.put(np.array([0xA9])); stream.new_text()
['é']
"""

from __future__ import annotations

import threading
import time
import typing as tp

import numpy as np

from workbench.core.models.tokenizer import Tokenizer, as_tokenizer

__all__ = ["TokenStream", "stable_text"]

_INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of a character that later tokens finish


def stable_text(tokenizer: tp.Any, ids: tp.Iterable[int], *, final: bool = False) -> str:
    """``tokenizer.decode(ids)`` (the whole list at once), without a trailing unfinished character unless
    ``final``: the part of the text that more tokens will not change. The ``final`` text shows bytes that are
    not UTF-8 as escapes (``\\xe2``) where the tokenizer can say which bytes they were (ours can)."""
    ids = [int(i) for i in ids]
    if not final:
        return tokenizer.decode(ids).rstrip(_INCOMPLETE)
    ours = isinstance(tokenizer, Tokenizer)  # a tokenizer of any other kind may not take errors=
    return tokenizer.decode(ids, errors="backslashreplace") if ours else tokenizer.decode(ids)


class TokenStream:
    """Collects what ``generate`` streams; ``stop()`` asks it to end after the current step.

    ``on_update(stream)`` runs after the prompt and the first step, then at most every ``min_interval_s``
    seconds as steps arrive, and once at ``end()``; it runs on the thread that calls ``put`` (inside
    ``generate``, a host-callback thread), so the compiled loop waits for it. With ``background=True`` it
    runs on the stream's own thread instead: ``put`` only records the tokens and wakes that thread, which
    renders the newest state (skipping states it had no time for); ``join()`` waits for its last call,
    after ``end()``. An exception it raises is kept in ``callback_error`` (decoding goes on).

    ``tokenizer`` (anything :func:`~workbench.core.models.tokenizer.as_tokenizer` takes) enables ``text()``
    and ``new_text()``; e.g. print as it generates::

        stream = TokenStream(lambda s: print(s.new_text()[0], end=""), tokenizer=tok, min_interval_s=0)
    """

    def __init__(self, on_update: tp.Callable[[TokenStream], tp.Any] | None = None, *, min_interval_s: float = 0.1,
                 tokenizer: tp.Any = None, background: bool = False):
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0; got {min_interval_s}")
        if tokenizer is not None:
            tokenizer = as_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self._emitted: list[int] = []
        self._on_update = on_update
        self._min_interval_s = float(min_interval_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._prompt: np.ndarray | None = None
        self._steps: list[np.ndarray] = []
        self._last_update = -np.inf
        self.finished = False
        self.callback_error: BaseException | None = None
        self._background = bool(background) and on_update is not None
        self._wake = threading.Event()
        self._renderer: threading.Thread | None = None

    # -- the streamer protocol ------------------------------------------------------------------------
    def put(self, tokens: tp.Any) -> None:
        tokens = np.asarray(tokens)
        with self._lock:
            if self._prompt is None and not self._steps and tokens.ndim == 2:
                self._prompt = tokens.copy()
                force = True
            else:
                self._steps.append(tokens.reshape(-1).copy())
                force = len(self._steps) == 1  # the first token shows at once (it ends the compile wait)
        if self._background:
            self._wake_renderer()
        else:
            self._notify(force)

    def end(self) -> None:
        self.finished = True
        if self._background:
            self._wake_renderer()
        else:
            self._notify(True)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for a background listener's last call (after ``end()``); True when it is done."""
        if self._renderer is not None:
            self._renderer.join(timeout)
            return not self._renderer.is_alive()
        return True

    def _wake_renderer(self) -> None:
        with self._lock:
            if self._renderer is None:
                self._renderer = threading.Thread(target=self._render_loop, daemon=True, name="workbench-stream")
                self._renderer.start()
        self._wake.set()

    def _render_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            done = self.finished
            try:
                self._on_update(self)
            except Exception as e:  # a listener's bug must not stop the stream
                self.callback_error = e
            if done:
                return
            time.sleep(self._min_interval_s)

    def should_stop(self) -> bool:
        return self._stop.is_set()

    # -- control and results --------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask ``generate`` to stop after the current step (safe from any thread)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def prompt_BP(self) -> np.ndarray | None:
        """The prompt as ``generate`` got it (left padding included), or None before it arrived."""
        return self._prompt

    @property
    def num_steps(self) -> int:
        """Steps streamed so far (new tokens per row)."""
        return len(self._steps)

    @property
    def new_BN(self) -> np.ndarray:
        """The new tokens ``(B, num_steps)`` int32 (after a row's EOS: pad tokens, as in ``sequences``)."""
        with self._lock:
            steps = list(self._steps)
        if not steps:
            rows = 0 if self._prompt is None else self._prompt.shape[0]
            return np.zeros((rows, 0), np.int32)
        return np.stack(steps, axis=1).astype(np.int32)

    def text(self) -> list[str]:
        """Each row's new text so far, decoded from its whole id list; an unfinished character at the end
        is held back until the stream ends (special tokens, e.g. EOS and padding after it, are dropped)."""
        if self.tokenizer is None:
            raise ValueError("this TokenStream has no tokenizer: build it with TokenStream(..., tokenizer=tok)")
        return [stable_text(self.tokenizer, row, final=self.finished) for row in self.new_BN]

    def new_text(self) -> list[str]:
        """Per row, the text added since the previous call (all of it on the first call): print these
        pieces one after the other and the result is ``text()``."""
        texts = self.text()
        self._emitted += [0] * (len(texts) - len(self._emitted))  # a 0 for each row new since the last call
        out = []
        for i, text in enumerate(texts):
            out.append(text[self._emitted[i]:])
            self._emitted[i] = max(self._emitted[i], len(text))
        return out

    def _notify(self, force: bool) -> None:
        if self._on_update is None:
            return
        now = time.perf_counter()
        if not force and now - self._last_update < self._min_interval_s:
            return
        self._last_update = now
        try:
            self._on_update(self)
        except Exception as e:  # a listener's bug must not abort the compiled loop
            self.callback_error = e
