"""Checkpoint directories both ways against ``transformers`` (float32 logits within 1e-5), sharded
indexes, placement on a mesh, bfloat16, classifiers, error messages, push_to_hub without network."""

import json
import pickle
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import NamedSharding

from tests.core.models.hf_reference import MAIN_FAMILIES, batch, hf_forward, hf_model, torch, transformers
from workbench.core.mesh import make_mesh
from workbench.core.models.auto import from_pretrained
from workbench.core.models.causal_lm import CausalLM, SequenceClassifier
from workbench.core.models.checkpoint import hf_tensor_plan, save_pretrained, to_torch
from workbench.core.models.hf_convert import hf_state_dict, ignorable
from workbench.core.models.sharding import param_specs, path_str

TOL = 1e-5


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def ours_logits(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits)


def max_diff(got, want, mask=None):
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    return (diff if mask is None else diff[mask.astype(bool)]).max()  # padded queries' logits mean nothing


def safetensors_keys(directory):
    from safetensors import safe_open

    keys = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="np") as f:
            keys |= set(f.keys())
    return keys


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_round_trip_with_transformers(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf", progress=False)
    ids, mask = batch()
    want = hf_forward(hf, ids, mask).logits.numpy()
    got = ours_logits(ours, ids, mask)
    assert got.shape == want.shape and max_diff(got, want, mask) <= TOL

    save_pretrained(ours, tmp_path / "ours", progress=False)
    assert safetensors_keys(tmp_path / "ours") == safetensors_keys(tmp_path / "hf")  # the names transformers writes
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32" and config["architectures"] == [type(hf).__name__]
    has_ids = any(getattr(ours.config, k) is not None for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    assert (tmp_path / "ours" / "generation_config.json").exists() == has_ids
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert max_diff(hf_forward(back, ids, mask).logits, want, mask) <= TOL

    torch_model = to_torch(ours)
    assert type(torch_model) is type(hf) and not torch_model.training
    assert next(torch_model.parameters()).dtype == torch.float32
    assert max_diff(hf_forward(torch_model, ids, mask).logits, want, mask) <= TOL


@pytest.mark.parametrize("family", ["gpt2", "mixtral", "gpt_oss"])
def test_streamed_tensors_equal_what_transformers_saved(family, tmp_path):
    """The save plan (and hf_state_dict, built on it) names and computes every tensor as transformers wrote it:
    GPT-2's fused c_attn, Mixtral's per-expert w1/w3/w2, GPT-OSS's interleaved gate_up_proj."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path, progress=False)
    saved = {name: value for name, value in safetensors.numpy.load_file(tmp_path / "model.safetensors").items()
             if not ignorable(ours.config, name)}
    plan = {t.name: t.read() for t in hf_tensor_plan(ours)}
    assert set(plan) == set(saved) == set(hf_state_dict(ours))
    for name, value in saved.items():
        np.testing.assert_array_equal(plan[name], value, err_msg=name)


def test_sharded_index_both_ways(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids, mask = batch()
    want = hf_forward(hf, ids, mask).logits.numpy()
    ours = CausalLM.from_pretrained(tmp_path / "hf", progress=False)  # the method delegates here
    assert max_diff(ours_logits(ours, ids, mask), want, mask) <= TOL

    limit = 20_000
    ours.save_pretrained(tmp_path / "ours", max_shard_size=limit, progress=False)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "ours" / "model.safetensors").exists()
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    for file in files:  # at most the limit, unless one tensor alone is bigger
        held = [n for n, f in index["weight_map"].items() if f == file]
        assert len(held) == 1 or (tmp_path / "ours" / file).stat().st_size <= limit + 4096
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert max_diff(hf_forward(back, ids, mask).logits, want, mask) <= TOL


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_mesh_places_each_param_on_its_sharding(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    ours = from_pretrained(tmp_path / "hf", mesh=mesh, progress=False)
    specs = param_specs(ours, mesh)
    sharded = 0
    for path, var in nnx.to_flat_state(nnx.state(ours, nnx.Param)):
        value = var.get_value()
        assert value.sharding == NamedSharding(mesh, specs[path_str(path)]), path_str(path)
        sharded += not value.sharding.is_fully_replicated
    assert sharded > 0
    ids, mask = batch()
    want = hf_forward(hf, ids, mask).logits.numpy()
    assert max_diff(ours_logits(ours, ids, mask), want, mask) <= TOL
    save_pretrained(ours, tmp_path / "ours", progress=False)  # gathers the sharded params
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert max_diff(hf_forward(back, ids, mask).logits, want, mask) <= TOL


def test_bfloat16_checkpoint(tmp_path):
    hf = hf_model("llama").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf", dtype=jnp.bfloat16, progress=False)
    params = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param)))
    assert {v.get_value().dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}
    q = params[("layers", "self_attn", "q_proj", "kernel")].get_value()[0]  # bf16 -> bf16: bit for bit
    hf_q = hf.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(q, np.float32), hf_q.T)
    ids, mask = batch()
    want = hf_forward(hf, ids, mask).logits.float().numpy()
    got = ours_logits(ours, ids, mask)
    # Both models compute in bfloat16 and round the logits to it, so they differ by whole bf16 ulps
    # (8-bit significand: ulp = 2**(exponent - 7)). Rounding at different points upstream (<= 2**-9
    # relative per op) moves a logit by an ulp or two over 2 layers; allow 4 ulps of the largest logit
    # (about 2 % of it; a wrong mapping or a float32/bfloat16 mix-up errs by the logit scale itself).
    scale = np.abs(want[mask.astype(bool)]).max()
    ulp = 2.0 ** (np.floor(np.log2(scale)) - 7)
    assert max_diff(got, want, mask) <= 4 * ulp

    save_pretrained(ours, tmp_path / "ours", progress=False)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16).eval()
    torch.testing.assert_close(back.model.layers[0].self_attn.q_proj.weight, hf.model.layers[0].self_attn.q_proj.weight,
                               rtol=0, atol=0)


def test_save_casts_to_dtype(tmp_path):
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf", progress=False)
    save_pretrained(ours, tmp_path / "bf16", dtype=jnp.bfloat16, progress=False)
    back = from_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16, progress=False)
    np.testing.assert_array_equal(np.asarray(back.embed_tokens.get_value()),
                                  np.asarray(ours.embed_tokens.get_value().astype(jnp.bfloat16)))


def test_sequence_classifier_round_trip(tmp_path):
    hf = hf_model("llama", cls=transformers.AutoModelForSequenceClassification, num_labels=3, pad_token_id=0)
    hf.save_pretrained(tmp_path / "hf")
    ids, mask = batch()
    ids = np.where(mask, np.maximum(ids, 1), 0)  # pads are pad_token_id, real tokens are not
    want = hf_forward(hf, ids, mask).logits.numpy()
    ours = from_pretrained(tmp_path / "hf", model_cls=SequenceClassifier, progress=False)
    assert ours.num_labels == 3
    assert max_diff(ours_logits(ours, ids, mask), want) <= TOL
    save_pretrained(ours, tmp_path / "ours", progress=False)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == "LlamaForSequenceClassification"
    assert max_diff(hf_forward(back, ids, mask).logits, want) <= TOL
    assert max_diff(hf_forward(to_torch(ours), ids, mask).logits, want) <= TOL
    with pytest.raises(ValueError, match="num_labels is for model_cls=SequenceClassifier"):
        from_pretrained(tmp_path / "hf", num_labels=3, progress=False)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    hf_model("llama").save_pretrained(directory)
    return directory


def copy_without_weights(src, dst):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_path_errors_name_what_is_missing(tmp_path, llama_dir):
    with pytest.raises(ValueError, match=r"no local directory .*nothing is downloaded.*snapshot_download"):
        from_pretrained("meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match="no local directory"):
        from_pretrained(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        from_pretrained(tmp_path / "file")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        from_pretrained(tmp_path)
    empty = copy_without_weights(llama_dir, tmp_path / "empty")
    with pytest.raises(ValueError, match=r"has no model\.safetensors or model\.safetensors\.index\.json"):
        from_pretrained(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ValueError, match=r"'bert' is not supported.*llama.*mistral.*qwen2.*qwen3.*gpt2.*mixtral"):
        from_pretrained(empty)


def test_pickle_checkpoint_is_refused_without_unpickling(tmp_path, llama_dir, monkeypatch):
    directory = copy_without_weights(llama_dir, tmp_path / "pickled")
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04garbage that is no pickle at all")

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    with pytest.raises(ValueError, match=r"only pickle checkpoints \['pytorch_model.bin'\].*never unpickles.*"
                                         r"save_pretrained\(path, safe_serialization=True\)") as info:
        from_pretrained(directory)
    assert info.value.__cause__ is None and info.value.__context__ is None


def test_checkpoint_errors_name_the_tensor(tmp_path, llama_dir):
    wrong = tmp_path / "wrong"
    shutil.copytree(llama_dir, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight gives shape \(128, 64\) for parameter "
                                         r"embed_tokens; expected \(100, 64\)"):
        from_pretrained(wrong, progress=False)

    extra = tmp_path / "extra"
    shutil.copytree(llama_dir, extra)
    tensors = safetensors.numpy.load_file(extra / "model.safetensors")
    safetensors.numpy.save_file(tensors | {"model.extra.weight": np.ones(3, np.float32)}, extra / "model.safetensors",
                                metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no matching parameter: \['model\.extra\.weight'\].*strict=False"):
        from_pretrained(extra, progress=False)
    assert isinstance(from_pretrained(extra, strict=False, progress=False), CausalLM)

    sharded = tmp_path / "sharded"
    hf_model("llama").save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[1]
    (sharded / missing).unlink()
    with pytest.raises(ValueError, match=f"names the shard {missing}, which is missing"):
        from_pretrained(sharded, progress=False)


def test_save_failure_leaves_nothing_and_resave_replaces_only_its_files(tmp_path, llama_dir, monkeypatch):
    from workbench.core.models import checkpoint

    model = from_pretrained(llama_dir, progress=False)
    real = checkpoint._write_safetensors
    calls = []

    def fail_on_second(file, tensors, advance):
        calls.append(file)
        if len(calls) == 2:
            raise OSError("disk full")
        real(file, tensors, advance)

    monkeypatch.setattr(checkpoint, "_write_safetensors", fail_on_second)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "out", max_shard_size="20KB", progress=False)
    assert list(tmp_path.iterdir()) == []  # no half-written directory, no temporary left behind
    monkeypatch.undo()

    out = tmp_path / "out"
    save_pretrained(model, out, max_shard_size="20KB", progress=False)
    (out / "tokenizer.json").write_text("{}")
    save_pretrained(model, out, progress=False)  # unsharded now: the old shards and index go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(ValueError, match="max_shard_size must be a positive int"):
        save_pretrained(model, out, max_shard_size="2 potatoes")
    with pytest.raises(ValueError, match="is a file"):
        save_pretrained(model, out / "config.json")


def test_push_to_hub_without_network_keeps_the_local_copy(llama_dir, monkeypatch):
    from huggingface_hub import constants

    model = from_pretrained(llama_dir, progress=False)
    for offline, endpoint in ((True, constants.ENDPOINT), (False, "http://127.0.0.1:9")):  # offline; unreachable
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        with pytest.raises(RuntimeError, match=r"push_to_hub: uploading to 'me/tiny' failed.*Nothing is lost") as info:
            model.push_to_hub("me/tiny", token="hf_not_a_real_token")
        local = re.search(r"saved at (\S+);", str(info.value)).group(1)
        try:
            back = from_pretrained(local, progress=False)
            ids, mask = batch()
            assert max_diff(ours_logits(back, ids, mask), ours_logits(model, ids, mask)) == 0
        finally:
            shutil.rmtree(local)


def test_workbench_models_is_a_lazy_face():
    code = ("import sys, workbench.models as m; assert 'from_pretrained' in dir(m); "
            "print(','.join(k for k in ('jax', 'flax', 'torch', 'transformers') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
    import workbench.models as models

    assert models.from_pretrained is from_pretrained and models.SequenceClassifier is SequenceClassifier
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        models.nope  # noqa: B018


@pytest.mark.parametrize("on_mesh", [False, True], ids=["default-device", "mesh"])
def test_loaded_model_owns_its_memory(tmp_path, llama_dir, on_mesh):
    """A CPU device adopts aligned host memory without a copy, a memory-mapped file's pages included: the
    loaded parameters must not be views of the checkpoint, which a user may overwrite in place."""
    directory = shutil.copytree(llama_dir, tmp_path / "ckpt")
    model = from_pretrained(directory, mesh=make_mesh(dp=2, fsdp=2, tp=2) if on_mesh else None, progress=False)
    ids, mask = batch()
    before = ours_logits(model, ids, mask)
    file = directory / "model.safetensors"
    header_end = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    with open(file, "r+b") as f:  # the same inode, so any mapping of it sees the new bytes
        f.seek(header_end)
        f.write(b"\0" * (file.stat().st_size - header_end))
    assert not np.any(safetensors.numpy.load_file(str(file))["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours_logits(model, ids, mask), before)
