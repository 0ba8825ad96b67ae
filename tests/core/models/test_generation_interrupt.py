"""A kernel interrupt (KeyboardInterrupt) during a compiled decode loop, from the streamer's callback or as a
signal to the main thread, leaves the model and its cache usable: the next call gives the reference tokens."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from workbench.core.models.generation_config import GenerationConfig
from workbench.core.models.presets import tiny
from workbench.core.views.token_stream import TokenStream

IDS = np.array([[1, 2, 3, 4]], np.int32)
CONFIG = GenerationConfig(max_new_tokens=24, do_sample=False)


@pytest.fixture(scope="module")
def model_and_reference():
    model = tiny("llama")
    return model, np.asarray(model.generate(IDS, CONFIG).sequences)


class Interrupting(TokenStream):
    """Raises ``error`` from its callback at step 3 (what an interrupt delivered on that thread does)."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def put(self, tokens):
        super().put(tokens)
        if self.num_steps == 3:
            raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError("a streamer's own bug")])
def test_an_error_in_the_streamer_ends_the_loop_and_is_raised_as_it_was(model_and_reference, error):
    model, reference = model_and_reference
    cache = model.init_cache(1, 64)
    with pytest.raises(type(error)) as raised:
        model.generate(IDS, CONFIG, cache=model.init_cache(1, 64), streamer=Interrupting(error))
    assert raised.value is error  # not XLA's "CpuCallback error": the streamer's own exception
    np.testing.assert_array_equal(np.asarray(model.generate(IDS, CONFIG, cache=cache).sequences), reference)
    np.testing.assert_array_equal(np.asarray(model.generate(IDS, CONFIG, streamer=TokenStream()).sequences),
                                  reference)  # the streaming program (its slot) works again


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals go to the main thread")
def test_sigint_during_the_loop_then_the_next_call_works(model_and_reference):
    model, reference = model_and_reference

    class Slow(TokenStream):
        def put(self, tokens):
            super().put(tokens)
            time.sleep(0.02)

    long = GenerationConfig(max_new_tokens=200, do_sample=False)
    model.generate(IDS, long, streamer=Slow())  # compiled first, so the signal lands inside the loop
    # a kernel's SIGINT handler raises KeyboardInterrupt; a pytest-xdist worker ignores SIGINT, so install it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            model.generate(IDS, long, streamer=Slow())
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    np.testing.assert_array_equal(np.asarray(model.generate(IDS, CONFIG).sequences), reference)


def test_an_interrupt_that_lands_in_jax_s_callback_code_is_raised_as_it_was():
    """The signal may land in JAX's wrapper around the streamer's callback, outside the streamer: XLA then reports
    "CpuCallback error ... KeyboardInterrupt", which generate raises as the KeyboardInterrupt it was (seen once in
    CI); other runtime errors pass through."""
    import jax

    from workbench.core.models.generation import _interrupt_as_raised

    with pytest.raises(KeyboardInterrupt), _interrupt_as_raised():
        raise jax.errors.JaxRuntimeError("INTERNAL: CpuCallback error calling callback: ...\nKeyboardInterrupt: ")
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"), _interrupt_as_raised():
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
