"""The models' public face: ``workbench.models.from_pretrained(path)`` and friends.

Names load lazily (``import workbench.models`` imports neither JAX nor flax); the code lives in
``workbench.core.models``::

    from workbench.models import from_pretrained
    model = from_pretrained("path/to/checkpoint")   # a local directory written by transformers
"""

from __future__ import annotations

from workbench._lazy import lazy_exports

_LAZY = {
    "from_pretrained": "workbench.core.models.auto",
    "save_pretrained": "workbench.core.models.checkpoint",
    "CausalLM": "workbench.core.models.causal_lm",
    "SequenceClassifier": "workbench.core.models.causal_lm",
    "ModelConfig": "workbench.core.models.config",
    "GenerationConfig": "workbench.core.models.generation_config",
    "as_tokenizer": "workbench.core.models.tokenizer",
    "tiny": "workbench.core.models.presets",
    "tiny_config": "workbench.core.models.presets",
    "FAMILIES": "workbench.core.models.presets",
    "full_config": "workbench.core.models.presets",
    "FULL_SIZE": "workbench.core.models.presets",
    "local_checkpoint": "workbench.core.models.zoo",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
