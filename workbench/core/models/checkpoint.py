"""Hugging Face checkpoint directories <-> models: ``from_pretrained``, ``save_pretrained``, ``to_torch``,
``push_to_hub``.

Only safetensors are read or written; nothing is ever unpickled. Loading opens the files lazily
(memory-mapped) and reads, converts and places one parameter at a time, each straight onto its
``NamedSharding`` when a mesh is given, so the whole model never sits on the host. Saving gathers
one parameter at a time and streams it into its file. Paths are local: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import pathlib
import re
import shutil
import struct
import tempfile
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.axes import MODE_TRAIN
from workbench.core.checks import is_positive_int
from workbench.core.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from workbench.core.models.generation_config import GenerationConfig
from workbench.core.models.hf_convert import (
    CheckpointTensor,
    convert_into,
    host_buffer,
    load_model,
    place_on_default_device,
    tensor_plan,
)
from workbench.core.models.protocol import check_model_class, is_classifier
from workbench.core.models.safetensors_mmap import MappedSafetensors
from workbench.core.models.sharding import param_specs, path_str

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".bin.index.json")
CONVERT_HINT = ("convert it once, where you trust the file, with transformers: "
                "AutoModelForCausalLM.from_pretrained(path).save_pretrained(path, safe_serialization=True)")
ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# ----------------------------------------------------------------------------------------------- loading
class SafetensorsReader:
    """The tensors of a checkpoint directory by name, read lazily as NumPy arrays (bfloat16 via ml_dtypes):
    read-only views of the memory-mapped files, so reading copies nothing until a parameter is built.

    ``model.safetensors`` wins over ``model.safetensors.index.json`` as in ``transformers``. Use as a
    context manager; it closes its files on exit.
    """

    def __init__(self, directory: str | os.PathLike):
        directory = pathlib.Path(directory)
        self._stack = contextlib.ExitStack()
        if (directory / SAFE_WEIGHTS).is_file():
            files = {SAFE_WEIGHTS: None}
        elif (directory / SAFE_INDEX).is_file():
            files = _read_index(directory)
        else:
            raise ValueError(_no_weights_message(directory))
        self._where: dict[str, tp.Any] = {}
        try:
            for file, names in files.items():
                handle = self._stack.enter_context(MappedSafetensors(directory / file))
                have = set(handle.keys())
                missing = sorted(set(names or ()) - have)
                if missing:
                    raise ValueError(f"{directory / SAFE_INDEX} maps {missing[:4]} to {file}, which does not hold "
                                     f"them; the checkpoint is inconsistent (re-save it)")
                self._where |= {name: handle for name in (have if names is None else names)}
        except Exception:
            self._stack.close()
            raise

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> np.ndarray:
        return self._where[name].get_tensor(name)

    def keys(self) -> list[str]:
        return list(self._where)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_index(directory: pathlib.Path) -> dict[str, list[str]]:
    index = _read_json(directory / SAFE_INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{directory / SAFE_INDEX} has no 'weight_map' {{tensor name: shard file}}; re-save it")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or pathlib.PurePath(file).name != file:
            raise ValueError(f"{directory / SAFE_INDEX} maps {name!r} to {file!r}; a shard must be a file name in "
                             f"{directory} (re-save the checkpoint)")
        files.setdefault(file, []).append(name)
    for file, names in files.items():
        if not (directory / file).is_file():
            raise ValueError(f"{directory / SAFE_INDEX} names the shard {file}, which is missing from {directory} "
                             f"(it holds {len(names)} tensors, e.g. {names[0]!r}); copy or download that file "
                             f"into {directory}, or re-save the checkpoint")
    return files


def _read_json(file: pathlib.Path) -> tp.Any:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None


def _model_config(file: pathlib.Path, hf: dict[str, tp.Any]) -> ModelConfig:
    """``ModelConfig.from_hf(hf)``; its errors name ``file`` and what to change there."""
    model_type = hf.get("model_type")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if "model_type" not in hf:
        raise ValueError(f"{file} has no model_type; a Hugging Face config.json names its family (supported: "
                         f"{supported})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{file}: model_type {model_type!r} is not supported; supported: {supported}. Load a "
                         f"checkpoint of one of these families (renaming model_type does not convert the weights)")
    try:
        return ModelConfig.from_hf(hf)
    except KeyError as err:
        raise ValueError(f"{file} has no {err.args[0]!r}, which a {model_type} config needs; add it (transformers' "
                         f"save_pretrained writes it)") from None
    except (ValueError, TypeError) as err:
        raise type(err)(f"{file}: {err}") from None


def _no_weights_message(directory: pathlib.Path) -> str:
    pickles = sorted(p.name for p in directory.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        return (f"{directory} holds only pickle checkpoints {pickles}; workbench reads safetensors only and never "
                f"unpickles (loading a pickle can run arbitrary code). To use them, {CONVERT_HINT}")
    held = sorted(p.name for p in directory.iterdir())
    return (f"{directory} has no {SAFE_WEIGHTS} or {SAFE_INDEX} (it holds {held}); pass the directory a Hugging "
            f"Face save_pretrained wrote")


def checkpoint_dir(path: str | os.PathLike) -> pathlib.Path:
    """``path`` as a local checkpoint directory with a ``config.json``; ValueError saying what is missing."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a local directory (str or os.PathLike); got {type(path).__name__}")
    directory = pathlib.Path(path).expanduser()
    if not directory.exists():
        text = os.fspath(path)
        hub_like = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text) is not None and not text.startswith(".")
        hint = (f"; if {text!r} is a Hugging Face Hub id: nothing is downloaded here, so download it where there is "
                f"network (huggingface_hub.snapshot_download({text!r}, local_dir=...)) and pass that local "
                f"directory") if hub_like else ""
        raise ValueError(f"there is no local directory {text!r} (from_pretrained reads local directories only){hint}")
    if not directory.is_dir():
        raise ValueError(f"{directory} is a file; pass the checkpoint directory that holds config.json and the "
                         f"safetensors files")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json; a checkpoint directory needs one (Hugging Face "
                         f"save_pretrained writes it)")
    return directory


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_layer(stack, layer_value, i, sharding):
    out = jax.lax.dynamic_update_index_in_dim(stack, layer_value.astype(stack.dtype), i, 0)
    return jax.lax.with_sharding_constraint(out, sharding)


def assemble_layers(shape: tuple[int, ...], dtype: np.dtype, sharding, read, num_layers: int) -> jax.Array:
    """A stacked ``(L, ...)`` array placed with ``sharding``, built one layer slice at a time on the devices:
    host memory holds one layer's slice, never the stack."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    layer_sharding = NamedSharding(sharding.mesh, P(*spec[1:]))
    stack = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    for i in range(num_layers):
        value = np.empty(shape[1:], dtype)
        convert_into(value, read(i))
        piece = jax.make_array_from_callback(value.shape, layer_sharding, lambda index, v=value: v[index])
        stack = _set_layer(stack, piece, i, sharding)
    return stack


def _placer(mesh, specs: dict[str, tp.Any] | None):
    """``place(path, var, read, num_layers)`` for :func:`load_model`: each parameter onto its NamedSharding."""
    from jax.sharding import NamedSharding

    if mesh is None:
        return place_on_default_device

    def place(path, var, read, num_layers) -> jax.Array:
        dtype = np.dtype(var.dtype)
        sharding = NamedSharding(mesh, specs[path_str(path)])
        if num_layers is not None:
            return assemble_layers(tuple(var.shape), dtype, sharding, read, num_layers)
        value = host_buffer(tuple(var.shape), dtype)  # a copy: an array may alias the host memory it is given,
        convert_into(value, read(None))  # and must not alias the mapped checkpoint file
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return place


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, mesh=None,
                    partition_axis=None, mode: str = MODE_TRAIN, rules=None, attn_mechanism: str = "auto",
                    model_cls: type, strict: bool = True, num_labels: int | None = None,
                    progress: bool = True):
    """A model of ``model_cls`` (``CausalLM.from_pretrained`` passes its class; :mod:`.auto`'s
    ``from_pretrained`` defaults to :class:`CausalLM`) from a local Hugging Face directory (``config.json`` +
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``).

    ``dtype`` is the computation dtype, ``param_dtype`` (default ``dtype``) the stored one. With a
    ``mesh`` each parameter goes straight to its ``NamedSharding`` (``partition_axis``, ``mode``,
    ``rules`` as in :func:`workbench.core.models.sharding.param_specs`). ``strict`` refuses
    checkpoint tensors the model has no place for. ``num_labels`` is for ``model_cls=SequenceClassifier``
    (default: the config's ``id2label``).

    Example (a local directory written by ``transformers``)::

        model = from_pretrained("path/to/llama", dtype=jnp.bfloat16, mesh=make_mesh(fsdp=-1))
    """
    from flax import nnx

    directory = checkpoint_dir(path)
    check_model_class(model_cls)
    for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if value is not None and not jnp.issubdtype(jnp.dtype(value), jnp.floating):
            raise ValueError(f"{name} must be a floating dtype such as jnp.float32 or jnp.bfloat16; got {value!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False; got {progress!r}")
    hf = _read_json(directory / "config.json")
    if not isinstance(hf, dict):
        raise ValueError(f"{directory / 'config.json'} must hold a JSON object")
    config = _model_config(directory / "config.json", hf)
    kwargs: dict[str, tp.Any] = dict(attn_mechanism=attn_mechanism, dtype=dtype,
                                     param_dtype=dtype if param_dtype is None else param_dtype)
    if is_classifier(model_cls):
        kwargs["num_labels"] = num_labels if num_labels is not None else len(hf.get("id2label") or {}) or None
        if kwargs["num_labels"] is None:
            raise ValueError(f"{directory / 'config.json'} has no id2label; pass num_labels= for a SequenceClassifier")
    elif num_labels is not None:
        raise ValueError("num_labels is for model_cls=SequenceClassifier; a CausalLM has no labels")
    specs = None
    if mesh is not None:
        abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0), **kwargs))
        specs = param_specs(abstract, mesh, partition_axis, mode, rules)
    elif partition_axis is not None or rules is not None:
        raise ValueError("partition_axis and rules only act with a mesh; pass mesh= too")

    def bar(items):
        from tqdm.auto import tqdm

        return tqdm(items, desc=f"loading {directory.name}", unit="param", disable=not progress)

    with SafetensorsReader(directory) as reader:
        model = load_model(config, reader, model_cls=model_cls, strict=strict, place=_placer(mesh, specs),
                           progress=bar, **kwargs)
    if (directory / "generation_config.json").is_file():  # as transformers: the file, else config.json's ids
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model


# ----------------------------------------------------------------------------------------------- saving
def hf_tensor_plan(model, dtype=None) -> list[CheckpointTensor]:
    """The checkpoint tensors of ``model`` (names ``transformers`` writes), each computed on demand by
    gathering only the parameters it needs; ``dtype`` (default: each parameter's) is the one written."""
    from flax import nnx

    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"expected a workbench model (CausalLM, SequenceClassifier); got {type(model).__name__}")
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    held: dict[tuple, np.ndarray] = {}

    def get(path, layer) -> np.ndarray:  # one parameter (layer slice) on the host at a time
        if (path, layer) not in held:
            held.clear()
            value = params[path].get_value()
            held[(path, layer)] = np.asarray(jax.device_get(value if layer is None else value[layer]))
        return held[(path, layer)]

    return tensor_plan(config, params, get, classifier=is_classifier(model), dtype=dtype)


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"2GB"`` (10**9) or ``"500MiB"`` (2**20), as ``transformers``."""
    if is_positive_int(size):
        return int(size)
    pattern = r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*"
    match = re.fullmatch(pattern, size, re.IGNORECASE) if isinstance(size, str) else None
    if match is None or match.group(2).upper() not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive int (bytes) or a string like '2GB' or '500MiB'; "
                         f"got {size!r}")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


def _write_safetensors(file: pathlib.Path, tensors: list[CheckpointTensor], advance: tp.Callable[[], None]) -> None:
    """The safetensors format, streamed: u64 header size, JSON header, then each tensor's bytes."""
    header: dict[str, tp.Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        if t.dtype.name not in ST_DTYPES:
            raise ValueError(f"{t.name} has dtype {t.dtype}, which safetensors cannot store; pass dtype=jnp.float32")
        header[t.name] = {"dtype": ST_DTYPES[t.dtype.name], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            value = np.ascontiguousarray(t.read(), dtype=t.dtype)
            if value.shape != t.shape:
                raise RuntimeError(f"internal: {t.name} computed with shape {value.shape}, planned {t.shape}")
            _write_tensor(f, value)
            advance()


def _write_tensor(f: tp.BinaryIO, value: np.ndarray) -> None:
    """One tensor's bytes (C order, little-endian as NumPy holds them here) onto the open file."""
    f.write(value.reshape(-1).view(np.uint8).data)


def _hf_config(model, dtype: np.dtype) -> dict[str, tp.Any]:
    hf = model.config.to_hf()
    if is_classifier(model):
        arch = hf["architectures"][0].replace("ForCausalLM", "").replace("LMHeadModel", "")
        hf["architectures"] = [f"{arch}ForSequenceClassification"]
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
        hf["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
    return hf | {"torch_dtype": dtype.name, "dtype": dtype.name}


def _generation_config(model) -> dict[str, tp.Any] | None:
    generation = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
    values = generation.to_hf()
    return values or None


def save_pretrained(model, path: str | os.PathLike, *, max_shard_size: int | str = "2GB", dtype=None,
                    progress: bool = True) -> pathlib.Path:
    """Write ``model`` as a Hugging Face directory ``transformers.AutoModel*.from_pretrained`` loads.

    Writes ``config.json``, ``generation_config.json`` (the model's ``generation_config``, when it sets anything) and
    ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_size``
    (a bigger tensor gets its own shard) plus ``model.safetensors.index.json``. ``dtype`` (default:
    the parameters') is the dtype written. Every file is first written under a temporary name (in
    ``path`` when it exists, else in a temporary directory beside it that then becomes ``path``) and
    moved into place with ``os.replace`` only once all are written, so a failure while writing removes
    the temporaries and leaves ``path`` as it was. In an existing directory only these files are
    replaced (old weight files removed); others (a tokenizer, a README) are kept. Returns the directory.
    """
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating dtype such as jnp.float32 or jnp.bfloat16; got {dtype!r}")
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a local directory (str or os.PathLike); got {type(path).__name__}")
    dest = pathlib.Path(path).expanduser()
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"{dest} is a file; save_pretrained writes a directory")
    blocker = next((p for p in dest.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{blocker} is a file, so the directory {dest} cannot be made; save under a directory")
    limit = parse_size(max_shard_size)
    tensors = hf_tensor_plan(model, dtype)
    shards: list[list[CheckpointTensor]] = [[]]
    for t in tensors:
        if shards[-1] and sum(s.nbytes for s in shards[-1]) + t.nbytes > limit:
            shards.append([])
        shards[-1].append(t)
    names = ([SAFE_WEIGHTS] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    fresh = not dest.exists()
    try:
        stage = _new_dir(dest) if fresh else dest
    except OSError as err:
        raise _save_error(err, dest, "nothing was written") from err
    temps: dict[str, pathlib.Path] = {}  # final name -> where it is written first

    def temp(name: str) -> pathlib.Path:
        temps[name] = stage / name if fresh else _unused_name(dest, f".{name}.", ".tmp")
        return temps[name]

    try:
        from tqdm.auto import tqdm

        with tqdm(total=len(tensors), desc=f"saving {dest.name}", unit="tensor", disable=not progress) as bar:
            for name, shard in zip(names, shards, strict=True):
                _write_safetensors(temp(name), shard, bar.update)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                     "weight_map": {t.name: name for name, shard in zip(names, shards, strict=True) for t in shard}}
            temp(SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written_dtype = tensors[0].dtype
        temp("config.json").write_text(json.dumps(_hf_config(model, written_dtype), indent=2, sort_keys=True) + "\n")
        generation = _generation_config(model)
        if generation is not None:
            temp("generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    except BaseException as err:
        _discard(stage if fresh else None, temps.values())
        if isinstance(err, OSError):
            where = "nothing was written" if fresh else f"nothing in {dest} was changed"
            raise _save_error(err, dest, f"{where} (the temporary files are removed)") from err
        raise
    try:
        if fresh:
            stage.rename(dest)
        else:
            _move_into_place(dest, temps)
    except OSError as err:
        _discard(stage if fresh else None, temps.values())
        where = "nothing was written" if fresh else f"{dest} may now mix old and new files; save again"
        raise _save_error(err, dest, f"moving the written files into place failed: {where}") from err
    return dest


def _unused_name(parent: pathlib.Path, prefix: str, suffix: str) -> pathlib.Path:
    """A name in ``parent`` that does not exist yet (``prefix`` + random hex + ``suffix``)."""
    import secrets

    while (candidate := parent / f"{prefix}{secrets.token_hex(6)}{suffix}").exists():
        pass
    return candidate


def _new_dir(dest: pathlib.Path) -> pathlib.Path:
    """An empty directory beside ``dest`` (made with the usual permissions, unlike ``tempfile.mkdtemp``'s 0700)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    while True:
        stage = _unused_name(dest.parent, f".{dest.name}.", ".tmp")
        with contextlib.suppress(FileExistsError):
            stage.mkdir()
            return stage


def _move_into_place(dest: pathlib.Path, temps: dict[str, pathlib.Path]) -> None:
    """``os.replace`` each written file onto its name, weights first, then drop weight files of an earlier save
    that the new ones do not replace (they would shadow or contradict them), then the configs."""
    weights = [name for name in temps if name.endswith(".safetensors") or name == SAFE_INDEX]
    for name in weights:
        os.replace(temps[name], dest / name)
    for old in dest.iterdir():
        if (old.name in (SAFE_WEIGHTS, SAFE_INDEX) or SHARD_RE.fullmatch(old.name)) and old.name not in temps:
            old.unlink()
    for name in temps.keys() - set(weights):
        os.replace(temps[name], dest / name)


def _discard(stage: pathlib.Path | None, files: tp.Iterable[pathlib.Path]) -> None:
    """Remove what a failed save wrote: the staging directory, or the temporary files."""
    if stage is not None:
        shutil.rmtree(stage, ignore_errors=True)
    for file in files:
        with contextlib.suppress(OSError):
            file.unlink(missing_ok=True)


def _save_error(err: OSError, dest: pathlib.Path, outcome: str) -> OSError:
    """``err`` (same errno, so the same OSError subclass) with a message saying what happened and what to change."""
    fix = {errno.EACCES: f"make {dest} (or its parent) writable, or save elsewhere",
           errno.EPERM: f"make {dest} (or its parent) writable, or save elsewhere",
           errno.EROFS: "the file system is read-only: save elsewhere",
           errno.ENOSPC: "free disk space (or save elsewhere)",
           errno.EDQUOT: "free space within your quota (or save elsewhere)"}.get(err.errno, "fix the cause")
    reason = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    message = f"save_pretrained to {dest} failed ({reason}); {outcome}. To save, {fix} and call it again"
    return OSError(err.errno, message) if err.errno is not None else OSError(message)


# ----------------------------------------------------------------------------------------------- torch, Hub
def to_torch(model):
    """The ``transformers`` torch model (float32, eval mode) with ``model``'s weights: a
    ``*ForCausalLM``, or ``*ForSequenceClassification`` for a :class:`SequenceClassifier`."""
    import torch
    import transformers

    auto = (transformers.AutoModelForSequenceClassification if is_classifier(model)
            else transformers.AutoModelForCausalLM)
    with tempfile.TemporaryDirectory(prefix="workbench-to-torch-") as tmp:
        save_pretrained(model, tmp, dtype=np.float32, progress=False)
        return auto.from_pretrained(tmp, dtype=torch.float32).eval()


def push_to_hub(model, repo_id: str, *, token: str | None = None, private: bool = False,
                commit_message: str = "Upload model with workbench", max_shard_size: int | str = "2GB"):
    """Save ``model`` to a local temporary directory, then upload it to the Hub repo ``repo_id``
    (created if missing). If the upload fails (no network, no token) a RuntimeError says where the
    local copy is; it is kept. Returns the commit info."""
    from huggingface_hub import HfApi

    if not isinstance(repo_id, str) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id):
        raise ValueError(f"repo_id must look like 'user/model-name'; got {repo_id!r}")
    local = pathlib.Path(tempfile.mkdtemp(prefix="workbench-push-"))
    save_pretrained(model, local, max_shard_size=max_shard_size, progress=False)
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=local, repo_id=repo_id, commit_message=commit_message)
    except Exception as err:
        raise RuntimeError(
            f"push_to_hub: uploading to {repo_id!r} failed ({type(err).__name__}: {err}). Nothing is lost: the "
            f"checkpoint is saved at {local}; upload it later with huggingface_hub.HfApi().upload_folder("
            f"folder_path={str(local)!r}, repo_id={repo_id!r}) or load it with from_pretrained({str(local)!r})"
        ) from err
    shutil.rmtree(local, ignore_errors=True)
    return info
