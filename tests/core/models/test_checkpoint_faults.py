"""Damaged checkpoints and failed saves: each gives an error that says what to change, and nothing is lost or
left half-done. Checkpoints are damaged with the ``safetensors`` library and raw bytes (independent of the
loader); "nothing lost" is checked byte for byte and against the saved model's own parameters."""

import errno
import json
import os
import pathlib
import shutil
import struct
import tempfile

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from tests.core.models.tiny_llama import tiny_model
from workbench.core.models import checkpoint
from workbench.core.models.auto import from_pretrained
from workbench.core.models.checkpoint import save_pretrained
from workbench.core.models.config import SUPPORTED_MODEL_TYPES

SMALL_SHARDS = 20_000  # bytes: the tiny Llama (~160 KB in float32) in several shards


def params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(got, want):
    got, want = params(got), params(want)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def snapshot(directory) -> dict[str, bytes]:
    """Every file of ``directory`` (hidden ones included) by name, with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def header(file) -> tuple[int, dict]:
    """The safetensors header (size, JSON), parsed by hand."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


@pytest.fixture(scope="module")
def model_a():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, model_a):
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    return save_pretrained(model_a, directory, progress=False)


@pytest.fixture
def ckpt(tmp_path, saved):
    return shutil.copytree(saved, tmp_path / "ckpt")


def truncate(file, size):
    file.write_bytes(file.read_bytes()[:size])


# ------------------------------------------------------------------------------------------------ truncated files
def test_truncated_in_the_data(ckpt):
    file = ckpt / "model.safetensors"
    n, entries = header(file)
    data = max(e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__")
    cut = 8 + n + data // 2
    truncate(file, cut)
    before = snapshot(ckpt)
    with pytest.raises(ValueError) as info:
        from_pretrained(ckpt, progress=False)
    message = str(info.value)
    assert f"{file} is truncated: its header describes {data} bytes of tensor data, the file holds {data // 2}" \
        in message
    assert "download or copy it again, or re-save the checkpoint" in message
    assert snapshot(ckpt) == before  # loading never writes
    with pytest.raises(Exception):  # noqa: B017 (the safetensors library agrees that the file is damaged)
        safetensors.numpy.load_file(file)


def test_truncated_in_the_header(ckpt):
    file = ckpt / "model.safetensors"
    n, _ = header(file)
    truncate(file, 8 + n // 2)
    with pytest.raises(ValueError, match=rf"truncated in its header: the header needs {n} bytes after its 8-byte "
                                         rf"size, the file has {n // 2}; download or copy it again"):
        from_pretrained(ckpt, progress=False)
    truncate(file, 5)
    with pytest.raises(ValueError, match=r"truncated or not a safetensors file: it has 5 bytes, fewer than the 8"):
        from_pretrained(ckpt, progress=False)
    file.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 163840\n")
    with pytest.raises(ValueError, match=r"not a safetensors file \(its first 8 bytes b'version ' .*Git LFS pointer"):
        from_pretrained(ckpt, progress=False)


def test_truncated_shard_is_named(tmp_path, model_a):
    directory = save_pretrained(model_a, tmp_path / "sharded", max_shard_size=SMALL_SHARDS, progress=False)
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(ValueError, match=rf"{shard.name} is truncated: .* the file holds"):
        from_pretrained(directory, progress=False)


# ------------------------------------------------------------------------------------------------ wrong tensors
def rewrite(file, **changes):
    """The checkpoint file with some tensors replaced (written by the safetensors library)."""
    tensors = safetensors.numpy.load_file(file)
    safetensors.numpy.save_file(tensors | changes, file, metadata={"format": "pt"})


def test_tensor_of_the_wrong_shape_is_named(ckpt):
    name = "model.layers.1.self_attn.k_proj.weight"  # (kv heads 2 x head_dim 16, hidden 64) as stored
    assert safetensors.numpy.load_file(ckpt / "model.safetensors")[name].shape == (32, 64)
    rewrite(ckpt / "model.safetensors", **{name: np.ones((32, 48), np.float32)})
    with pytest.raises(ValueError, match=rf"{name} gives shape \(32, 48\) for parameter layers\.self_attn\.k_proj\."
                                         rf"kernel \(layer 1 of the stacked \(2, 64, 32\)\); expected \(32, 64\) for "
                                         rf"this llama config \(check that config\.json matches"):
        from_pretrained(ckpt, progress=False)


def test_fused_tensor_that_does_not_split_is_named(tmp_path):
    gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 32}
    from workbench.core.models import CausalLM, ModelConfig

    directory = save_pretrained(CausalLM(ModelConfig.from_hf(gpt2), rngs=nnx.Rngs(0)), tmp_path / "gpt2",
                                progress=False)
    name = "transformer.h.0.attn.c_attn.weight"  # q, k, v side by side: (32, 96); 95 columns do not split in 3
    rewrite(directory / "model.safetensors", **{name: np.ones((32, 95), np.float32)})
    with pytest.raises(ValueError, match=rf"{name} does not fit parameter layers\.self_attn\.q_proj\.kernel "
                                         rf"\(1, 32, 32\) of this gpt2 config .*check that config\.json matches"):
        from_pretrained(directory, progress=False)


def test_tensor_of_a_wrong_dtype_is_named(ckpt):
    rewrite(ckpt / "model.safetensors", **{"model.norm.weight": np.ones(64, np.int32)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has dtype int32 for parameter norm\.weight; expected a "
                                         r"floating dtype .*cast to the parameter's float32"):
        from_pretrained(ckpt, progress=False)


def test_other_floating_dtypes_are_cast_not_refused(ckpt, model_a):
    half = params(model_a)["norm.weight"].astype(np.float16)
    rewrite(ckpt / "model.safetensors", **{"model.norm.weight": half})
    model = from_pretrained(ckpt, progress=False)
    np.testing.assert_array_equal(params(model)["norm.weight"], half.astype(np.float32))


def test_unsupported_safetensors_dtype_names_file_and_tensor(ckpt):
    file = ckpt / "model.safetensors"
    n, entries = header(file)
    entries["model.norm.weight"]["dtype"] = "C64"  # 8 bytes per element: the offsets no longer match either
    raw = json.dumps(entries, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    file.write_bytes(file.read_bytes()[:8] + raw + file.read_bytes()[8 + n:])
    with pytest.raises(ValueError, match=rf"{file}: tensor 'model\.norm\.weight': safetensors dtype 'C64' is not "
                                         rf"supported here; supported: \["):
        from_pretrained(ckpt, progress=False)


# ------------------------------------------------------------------------------------------------ index and config
def test_index_naming_a_missing_shard(tmp_path, model_a):
    directory = save_pretrained(model_a, tmp_path / "sharded", max_shard_size=SMALL_SHARDS, progress=False)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[1]
    first = next(name for name, file in index["weight_map"].items() if file == missing)
    (directory / missing).unlink()
    with pytest.raises(ValueError) as info:
        from_pretrained(directory, progress=False)
    message = str(info.value)
    assert f"{directory / 'model.safetensors.index.json'} names the shard {missing}, which is missing from " \
           f"{directory}" in message
    assert repr(first) in message and f"copy or download that file into {directory}" in message


def test_index_naming_a_path_outside_the_directory(tmp_path, model_a):
    directory = save_pretrained(model_a, tmp_path / "sharded", max_shard_size=SMALL_SHARDS, progress=False)
    file = directory / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"maps 'model\.norm\.weight' to '\.\./elsewhere\.safetensors'; a shard "
                                         r"must be a file name in"):
        from_pretrained(directory, progress=False)


def test_unsupported_model_type_lists_the_supported_ones(ckpt):
    file = ckpt / "config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps(config | {"model_type": "bert"}))
    with pytest.raises(ValueError) as info:
        from_pretrained(ckpt, progress=False)
    message = str(info.value)
    assert message.startswith(f"{file}: model_type 'bert' is not supported; supported: ")
    assert all(name in message for name in SUPPORTED_MODEL_TYPES)
    file.write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
    with pytest.raises(ValueError, match=rf"{file} has no model_type; .*supported: llama, "):
        from_pretrained(ckpt, progress=False)


def test_config_missing_a_field_names_it(ckpt):
    file = ckpt / "config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=rf"{file} has no 'hidden_size', which a llama config needs; add it"):
        from_pretrained(ckpt, progress=False)


# ------------------------------------------------------------------------------------------------ failed saves
def no_temporaries(directory):
    return not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def permissions_hold() -> bool:
    """Whether a read-only directory refuses this process (root, with CAP_DAC_OVERRIDE, writes anyway)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o555)
        try:
            open(os.path.join(tmp, "probe"), "w").close()
        except PermissionError:
            return True
        finally:
            os.chmod(tmp, 0o755)
    return False


@pytest.mark.skipif(not permissions_hold(), reason="this process (root) writes into read-only directories; "
                                                   "test_save_refused_by_the_file_system simulates it")
def test_save_into_a_read_only_directory(ckpt, model_a):
    (ckpt / "tokenizer.json").write_text("{}")
    before = snapshot(ckpt)
    ckpt.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=rf"save_pretrained to {ckpt} failed .*nothing in {ckpt} was changed"
                                                  rf".*make {ckpt} \(or its parent\) writable, or save elsewhere"):
            save_pretrained(tiny_model(seed=1), ckpt, progress=False)
    finally:
        ckpt.chmod(0o755)
    assert snapshot(ckpt) == before


def test_save_refused_by_the_file_system(ckpt, monkeypatch):
    """What a read-only directory does to a user who is not root: the first file cannot be created."""
    (ckpt / "tokenizer.json").write_text("{}")
    before = snapshot(ckpt)

    def refuse(file, tensors, advance):
        raise PermissionError(errno.EACCES, "Permission denied", str(file))

    monkeypatch.setattr(checkpoint, "_write_safetensors", refuse)
    with pytest.raises(PermissionError, match=rf"Permission denied: {ckpt}/\.model\.safetensors\..*nothing in {ckpt} "
                                              rf"was changed .*make {ckpt} \(or its parent\) writable"):
        save_pretrained(tiny_model(seed=1), ckpt, progress=False)
    assert snapshot(ckpt) == before


def test_save_onto_a_file_keeps_the_file(tmp_path, model_a):
    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    with pytest.raises(ValueError, match=rf"{file} is a file; save_pretrained writes a directory"):
        save_pretrained(model_a, file, progress=False)
    with pytest.raises(ValueError, match=rf"{file} is a file, so the directory {file}/a/b cannot be made"):
        save_pretrained(model_a, file / "a" / "b", progress=False)
    assert file.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def fail_after(monkeypatch, tensors: int):
    """Make the tensor writer write ``tensors`` tensors, then half of the next one's bytes, then fail (disk full)."""
    real, calls = checkpoint._write_tensor, []

    def write(f, value):
        calls.append(value.nbytes)
        if len(calls) > tensors:
            f.write(value.reshape(-1).view(np.uint8).data[:value.nbytes // 2])
            f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, value)

    monkeypatch.setattr(checkpoint, "_write_tensor", write)
    return calls


@pytest.mark.parametrize("old_shards,new_shards", [("2GB", "2GB"), (SMALL_SHARDS, "2GB"), ("2GB", SMALL_SHARDS),
                                                   (SMALL_SHARDS, SMALL_SHARDS)],
                         ids=["single-single", "sharded-single", "single-sharded", "sharded-sharded"])
def test_interrupted_save_keeps_the_old_checkpoint(tmp_path, model_a, monkeypatch, old_shards, new_shards):
    directory = save_pretrained(model_a, tmp_path / "ckpt", max_shard_size=old_shards, progress=False)
    (directory / "tokenizer.json").write_text("{}")
    before = snapshot(directory)
    model_b = tiny_model(seed=1)
    calls = fail_after(monkeypatch, tensors=12)
    with pytest.raises(OSError) as info:
        save_pretrained(model_b, directory, max_shard_size=new_shards, progress=False)
    assert len(calls) == 13 and info.value.errno == errno.ENOSPC
    assert f"nothing in {directory} was changed (the temporary files are removed). To save, free disk space" \
        in str(info.value)
    assert snapshot(directory) == before and no_temporaries(directory)
    assert_same_params(from_pretrained(directory, progress=False), model_a)

    monkeypatch.undo()  # the same save, uninterrupted, replaces the checkpoint
    save_pretrained(model_b, directory, max_shard_size=new_shards, progress=False)
    assert_same_params(from_pretrained(directory, progress=False), model_b)
    assert "tokenizer.json" in snapshot(directory) and no_temporaries(directory)


def test_failure_after_the_weights_keeps_the_old_weights(ckpt, model_a, monkeypatch):
    """The new weights are all written when the configs fail: they must not have replaced the old ones."""
    before = snapshot(ckpt)

    def broken(model):
        raise RuntimeError("generation config broke")

    monkeypatch.setattr(checkpoint, "_generation_config", broken)
    with pytest.raises(RuntimeError, match="generation config broke"):
        save_pretrained(tiny_model(seed=1), ckpt, progress=False)
    assert snapshot(ckpt) == before
    assert_same_params(from_pretrained(ckpt, progress=False), model_a)


def test_interrupted_save_to_a_new_directory_leaves_nothing(tmp_path, model_a, monkeypatch):
    fail_after(monkeypatch, tensors=3)
    with pytest.raises(OSError, match=r"No space left on device.*nothing was written"):
        save_pretrained(model_a, tmp_path / "new" / "ckpt", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["new"] and list((tmp_path / "new").iterdir()) == []


def test_save_where_the_directory_cannot_be_made(tmp_path, model_a, monkeypatch):
    """What a read-only parent does to a user who is not root: the new directory cannot be made in it."""
    real = pathlib.Path.mkdir

    def refuse(self, *args, **kwargs):
        if not self.exists():
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    with pytest.raises(PermissionError, match=rf"save_pretrained to {tmp_path}/ckpt failed \(Permission denied: "
                                              rf"{tmp_path}/\.ckpt\..*\); nothing was written\. To save, make "
                                              rf"{tmp_path}/ckpt \(or its parent\) writable"):
        save_pretrained(model_a, tmp_path / "ckpt", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_saved_files_get_the_usual_permissions(tmp_path, model_a):
    """Temporaries are made like ordinary files (not tempfile's private 0600 / 0700), so others can read a save."""
    umask = os.umask(0)
    os.umask(umask)
    fresh = save_pretrained(model_a, tmp_path / "fresh", progress=False)
    again = save_pretrained(model_a, fresh, progress=False)
    assert (fresh.stat().st_mode & 0o777) == 0o777 & ~umask
    for file in again.iterdir():
        assert (file.stat().st_mode & 0o777) == 0o666 & ~umask, file.name
