"""``generate`` from several threads at once: every result equals the same call made alone, and a streamer's
slot leaves the shared compile cache with its program."""

import gc
import threading
import weakref

import jax
import numpy as np
import pytest

from workbench.core.models.generation import GenerationConfig, generate, is_compiled
from workbench.core.models.presets import tiny
from workbench.core.programs import PROGRAMS

TIMEOUT_S = 300


@pytest.fixture(scope="module")
def models():
    return {name: tiny(name, num_hidden_layers=1) for name in ("llama", "qwen3")}


class Recorder:
    def __init__(self):
        self.steps = []

    def put(self, tokens):
        self.steps.append(np.asarray(tokens))

    def end(self):
        pass


# (model, max_new_tokens, do_sample, seed, streams): two calls share a key, so one waits for the other's compile
CASES = [("llama", 6, False, 0, False), ("llama", 5, True, 1, False), ("qwen3", 7, False, 0, False),
         ("qwen3", 6, True, 2, False), ("llama", 6, False, 0, False), ("qwen3", 4, False, 0, True)]


def run(models, case):
    name, n, sample, seed, streams = case
    ids = np.arange(1, 9, dtype=np.int32).reshape(2, 4) + 10 * seed
    config = GenerationConfig(max_new_tokens=n, do_sample=sample, eos_token_id=None, pad_token_id=0)
    rec = Recorder() if streams else None
    out = generate(models[name], ids, config, prng_key=jax.random.key(seed), streamer=rec)
    sequences = np.asarray(out.sequences)
    if streams:  # the streamer got this call's tokens, not another thread's
        np.testing.assert_array_equal(np.stack(rec.steps[1:], 1), sequences[:, 4:])
    return sequences


def in_threads(fn, items):
    results, errors = [None] * len(items), []
    barrier = threading.Barrier(len(items))

    def work(i):
        try:
            barrier.wait(TIMEOUT_S)
            results[i] = fn(items[i])
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    return results


def test_threads_generating_different_models_and_configs_equal_sequential_calls(models):
    PROGRAMS.clear("generate")
    sequential = [run(models, case) for case in CASES]
    PROGRAMS.clear("generate")  # the threads compile too, at once
    concurrent = in_threads(lambda case: run(models, case), CASES)
    for case, alone, together in zip(CASES, sequential, concurrent, strict=True):
        np.testing.assert_array_equal(together, alone, err_msg=str(case))


def test_a_streaming_generation_beside_another_thread_generating(models):
    stream_case, other_case = ("llama", 8, False, 3, True), ("qwen3", 8, True, 4, False)
    alone = [run(models, stream_case), run(models, other_case)]
    together = in_threads(lambda case: run(models, case), [stream_case, other_case])
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(b, a)


def test_is_compiled_says_whether_generate_would_compile(models):
    ids = np.full((1, 4), 5, np.int32)
    config = GenerationConfig(max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    PROGRAMS.clear("generate")
    assert not is_compiled(models["llama"], ids, config, streamer=True)
    out = generate(models["llama"], ids, config, streamer=Recorder())
    assert out.timings["compile"] > 0
    assert is_compiled(models["llama"], ids, config, streamer=True)
    assert not is_compiled(models["llama"], ids, config)  # without a streamer: another program
    assert not is_compiled(models["qwen3"], ids, config, streamer=True)  # another model
    assert generate(models["llama"], ids, config, streamer=Recorder()).timings["compile"] == 0.0


def test_a_stream_slot_is_evicted_with_its_program(models, monkeypatch):
    ids = np.full((1, 4), 7, np.int32)
    PROGRAMS.clear("generate")
    generate(models["llama"], ids, GenerationConfig(max_new_tokens=2, pad_token_id=0), streamer=Recorder())
    slots = [weakref.ref(v[1]) for k, v in PROGRAMS.items() if k[0] == "generate" and k[-2] == "decode"]
    assert len(slots) == 1 and slots[0]() is not None
    monkeypatch.setattr(PROGRAMS, "maxsize", len(PROGRAMS))
    for i in range(len(PROGRAMS)):  # push every earlier program out
        PROGRAMS.get(("test", i), lambda: None)
    PROGRAMS.clear("test")
    gc.collect()
    assert slots[0]() is None
