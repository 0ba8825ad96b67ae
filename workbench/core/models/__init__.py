"""NNX transformers sharing ONE decoder block; a family is a config (Llama, Mistral, Qwen2, Qwen3, GPT-2, Mixtral).

Names load lazily: ``from workbench.core.models import CausalLM`` imports flax then, and the
Hugging Face conversion never imports torch or transformers.
"""

from __future__ import annotations

from workbench._lazy import lazy_exports

_LAZY = {
    "ModelConfig": "workbench.core.models.config",
    "RopeScaling": "workbench.core.models.config",
    "SUPPORTED_MODEL_TYPES": "workbench.core.models.config",
    "CausalLM": "workbench.core.models.causal_lm",
    "CausalLMOutput": "workbench.core.models.causal_lm",
    "SequenceClassifier": "workbench.core.models.causal_lm",
    "KVCache": "workbench.core.models.cache",
    "PagedKVCache": "workbench.core.models.cache",
    "StreamingKVCache": "workbench.core.models.cache",
    "BaseModuleProtocol": "workbench.core.models.protocol",
    "hf_state_dict": "workbench.core.models.hf_convert",
    "GenerationConfig": "workbench.core.models.generation_config",
    "GenerationOutput": "workbench.core.models.generation",
    "generate": "workbench.core.models.generation",
    "MoE": "workbench.core.models.moe",
    "from_pretrained": "workbench.core.models.auto",
    "save_pretrained": "workbench.core.models.checkpoint",
    "tiny": "workbench.core.models.presets",
    "tiny_config": "workbench.core.models.presets",
    "full_config": "workbench.core.models.presets",
    "cache_footprint": "workbench.core.models.cache",
    "kv_layout": "workbench.core.models.cache",
    "MLAttention": "workbench.core.models.mla",
    "ByteTokenizer": "workbench.core.models.tokenizer",
    "CharTokenizer": "workbench.core.models.tokenizer",
    "local_checkpoint": "workbench.core.models.zoo",
    "as_tokenizer": "workbench.core.models.tokenizer",
    "TrainState": "workbench.core.models.training",
    "make_train_step": "workbench.core.models.training",
    "train": "workbench.core.models.training",
    "causal_lm_loss": "workbench.core.models.loss",
    "DecoderBlock": "workbench.core.models.decoder",
    "from_hf_state_dict": "workbench.core.models.auto",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
