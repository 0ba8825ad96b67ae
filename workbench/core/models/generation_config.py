"""``GenerationConfig``: how to decode, with Hugging Face's meaning and merge rules for every field.

A field left unset (None) is filled when ``generate`` runs, in transformers' order: the value the
caller set, else the model's own ``generation_config`` (a checkpoint's ``generation_config.json``,
or the bos/eos/pad ids of its ``config.json``), else transformers' global defaults
(:data:`HF_DEFAULTS`: greedy, ``top_k`` 50 when sampling, 20 new tokens). So a chat model's first
``model.generate(ids)`` stops at its EOS as it does in transformers.

>>> GenerationConfig(max_new_tokens=8, eos_token_id=2).replace(num_beams=4).eos_token_id
(2,)
>>> cfg = GenerationConfig(max_new_tokens=8).merged(GenerationConfig(eos_token_id=2, do_sample=True))
>>> cfg.eos_token_id, cfg.do_sample, cfg.resolved(prompt_len=5).top_k
((2,), True, 50)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import typing as tp

import numpy as np

from workbench.core.checks import is_int, positive_int

# transformers.GenerationConfig._get_default_generation_params, for the fields this config has.
HF_DEFAULTS: dict[str, tp.Any] = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50,
                                  "top_p": 1.0, "repetition_penalty": 1.0, "num_beams": 1, "length_penalty": 1.0,
                                  "early_stopping": False}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to decode; None means unset (filled from the model's config, then transformers' defaults).

    ``top_k`` 0, ``top_p`` 1.0, ``min_p`` None and ``repetition_penalty`` 1.0 are off; ``temperature``
    and the filters act only with ``do_sample``. ``max_new_tokens`` wins over ``max_length`` (prompt plus
    new tokens). ``eos_token_id`` is an int or a sequence (stored as a tuple); ``pad_token_id`` None
    means ``eos_token_id[0]``, as in HF. ``early_stopping`` is True, False or ``"never"`` (beam search).
    """

    max_new_tokens: int | None = None
    max_length: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        if self.do_sample is not None:
            if not isinstance(self.do_sample, (bool, np.bool_)):
                raise TypeError(f"do_sample must be True or False; got {self.do_sample!r}")
            set_("do_sample", bool(self.do_sample))
        for name in ("max_new_tokens", "max_length", "num_beams"):
            if getattr(self, name) is not None:
                set_(name, positive_int(name, getattr(self, name), what="an int >= 1"))
        if (self.num_beams or 1) > 1 and self.do_sample:
            raise ValueError("beam sampling (num_beams > 1 with do_sample=True) is not supported; set do_sample=False "
                             "for beam search or num_beams=1 for sampling")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
                    raise TypeError(f"{name} must be a float; got {value!r}")
                set_(name, float(value))
        if self.do_sample and self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling; got {self.temperature}. For greedy decoding set "
                             "do_sample=False")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 0):
            raise ValueError(f"top_k must be None or an int >= 0 (0 = off); got {self.top_k!r}")
        for name in ("top_p", "min_p"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float, np.floating)) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be None or a float in [0, 1]; got {value!r}")
            if value is not None:
                set_(name, float(value))
        if self.repetition_penalty is not None:
            if not (isinstance(self.repetition_penalty, (int, float, np.floating)) and self.repetition_penalty > 0):
                raise ValueError(f"repetition_penalty must be None or a float > 0 (1.0 = off); got "
                                 f"{self.repetition_penalty!r}")
            set_("repetition_penalty", float(self.repetition_penalty))
        if self.early_stopping is not None:
            if not (isinstance(self.early_stopping, (bool, np.bool_)) or self.early_stopping == "never"):
                raise ValueError(f"early_stopping must be True, False or 'never'; got {self.early_stopping!r}")
            if self.early_stopping != "never":
                set_("early_stopping", bool(self.early_stopping))
        eos = self.eos_token_id
        if eos is not None:
            eos = (eos,) if is_int(eos) else tuple(eos)
            if not eos or not all(is_int(e) and e >= 0 for e in eos):
                raise ValueError(f"eos_token_id must be None, an int >= 0 or a non-empty sequence of them; got "
                                 f"{self.eos_token_id!r}")
            set_("eos_token_id", tuple(int(e) for e in eos))
        for name in ("pad_token_id", "bos_token_id"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                raise ValueError(f"{name} must be None or an int; got {getattr(self, name)!r}")

    def replace(self, **changes) -> GenerationConfig:
        """A new config with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def set_fields(self) -> dict[str, tp.Any]:
        """The fields that are set (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def merged(self, base: GenerationConfig | None) -> GenerationConfig:
        """This config, its unset fields taken from ``base`` (the model's ``generation_config``)."""
        if base is None:
            return self
        if not isinstance(base, GenerationConfig):
            raise TypeError(f"a model's generation_config must be a GenerationConfig; got {type(base).__name__}")
        return dataclasses.replace(base, **self.set_fields())

    def resolved(self, prompt_len: int, max_positions: int | None = None) -> GenerationConfig:
        """Every field a decode loop reads set: unset ones take :data:`HF_DEFAULTS`, and ``max_new_tokens``
        comes from ``max_length`` (prompt included) when only that was set, else 20 (capped, like HF, so
        prompt + new tokens stay within ``max_positions``)."""
        values = {k: v for k, v in HF_DEFAULTS.items() if getattr(self, k) is None}
        new = self.max_new_tokens
        if new is None and self.max_length is not None:
            new = self.max_length - prompt_len
            if new < 1:
                raise ValueError(f"max_length={self.max_length} leaves no room after the {prompt_len}-token prompt "
                                 f"(max_length counts the prompt, as in transformers); set max_new_tokens instead")
        elif new is None:
            limit = HF_DEFAULTS["max_length"] + prompt_len
            if max_positions is not None:
                limit = max(min(limit, max_positions), prompt_len + 1)
            new = limit - prompt_len
        return dataclasses.replace(self, **values, max_new_tokens=new)

    @classmethod
    def from_hf(cls, hf_config) -> GenerationConfig:
        """From a ``transformers.GenerationConfig`` or its dict: the fields it sets (fields we lack are ignored)."""
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields and v is not None})

    @classmethod
    def from_model_config(cls, config: tp.Any) -> GenerationConfig:
        """The bos/eos/pad ids of a model's config, as transformers' ``from_model_config`` takes them."""
        return cls(**{k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> GenerationConfig:
        """A checkpoint directory's ``generation_config.json`` (or that file itself)."""
        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "generation_config.json"
        if not file.is_file():
            raise ValueError(f"{file} does not exist; a Hugging Face checkpoint keeps its decoding defaults in "
                             f"generation_config.json")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{file} is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{file} must hold a JSON object")
        return cls.from_hf(data)

    def to_hf(self) -> dict[str, tp.Any]:
        """The set fields as a ``generation_config.json`` dict (eos as a list when several)."""
        out = self.set_fields()
        if isinstance(out.get("eos_token_id"), tuple):
            eos = out["eos_token_id"]
            out["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
        return out

    @property
    def pad_id(self) -> int | None:
        """The pad token HF uses: ``pad_token_id``, else ``eos_token_id[0]``, else None."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_id[0] if self.eos_token_id else None
