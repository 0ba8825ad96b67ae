"""The entry points that choose the model class for you, as ``transformers``' Auto classes do: a
:class:`.causal_lm.CausalLM` unless ``model_cls`` says otherwise (``SequenceClassifier``).

Checkpoint and conversion code (:mod:`.checkpoint`, :mod:`.hf_convert`) take the class as an argument
and never import the model module; this is the one place that names the default.
"""

from __future__ import annotations

import os
import typing as tp

from workbench.core.models import checkpoint, hf_convert
from workbench.core.models.causal_lm import CausalLM
from workbench.core.models.config import ModelConfig

__all__ = ["from_hf_state_dict", "from_pretrained"]


def from_pretrained(path: str | os.PathLike, *, model_cls: type | None = None, **kwargs: tp.Any):
    """A model from a local Hugging Face directory: :func:`.checkpoint.from_pretrained` with
    ``model_cls`` defaulting to :class:`CausalLM`.

    Example (a local directory written by ``transformers``)::

        model = from_pretrained("path/to/llama", dtype=jnp.bfloat16, mesh=make_mesh(fsdp=-1))
    """
    return checkpoint.from_pretrained(path, model_cls=CausalLM if model_cls is None else model_cls, **kwargs)


def from_hf_state_dict(config: ModelConfig, state_dict: tp.Mapping[str, tp.Any], *, model_cls: type | None = None,
                       **kwargs: tp.Any):
    """A model from a HF ``state_dict`` (name -> tensor): :func:`.hf_convert.from_hf_state_dict` with
    ``model_cls`` defaulting to :class:`CausalLM`."""
    return hf_convert.from_hf_state_dict(config, state_dict, model_cls=CausalLM if model_cls is None else model_cls,
                                         **kwargs)
