"""``ModelMethods``: the mixin that implements :class:`.protocol.BaseModuleProtocol` for the model
classes (:mod:`.causal_lm`), each method delegating to the module of its concern (cache.py, generation.py,
sharding.py, checkpoint.py, hf_convert.py, lora.py, quantize.py, training.py).

Every method returns new objects; none mutates the model it is called on.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from workbench.core.axes import MODE_TRAIN
from workbench.core.models import checkpoint, generation, hf_convert, lora, quantize, sharding, training
from workbench.core.models.config import ModelConfig
from workbench.core.models.loss import causal_lm_loss, labels_from
from workbench.core.models.moe_losses import load_balancing_loss, router_z_loss
from workbench.core.models.protocol import is_classifier


class ModelMethods:
    """The :class:`BaseModuleProtocol` methods shared by the model classes (a mixin)."""

    config: ModelConfig
    base_model_prefix = "model"
    classifier: tp.ClassVar[bool] = False  # SequenceClassifier: True

    # ----- call and loss
    def compute_loss(self, input_ids, attention_mask=None, labels=None, *, router_aux_loss_coef: float = 0.0,
                     router_z_loss_coef: float = 0.0) -> tuple[jax.Array, tp.Any]:
        """Mean next-token cross-entropy (Hugging Face ``ForCausalLMLoss``) and the model output.

        ``labels=None`` uses ``input_ids``, ignoring (-100) padded positions and the first token
        after padding: its prediction would come from a padded position, whose logits mean nothing.
        A MoE model adds ``router_aux_loss_coef`` times the Switch load-balancing loss (as transformers
        does with ``output_router_logits=True``) and ``router_z_loss_coef`` times the router z-loss
        (:mod:`.moe_losses`), over the real tokens of ``attention_mask``.
        """
        out = self(input_ids, attention_mask)
        if labels is None:
            labels = labels_from(input_ids, attention_mask)
            if attention_mask is not None:
                real_BT = jnp.asarray(attention_mask).astype(bool)
                after_pad_BT = jnp.pad(~real_BT[:, :-1], ((0, 0), (1, 0)))
                labels = jnp.where(after_pad_BT, -100, labels)
        loss, _ = causal_lm_loss(out.logits, jnp.asarray(labels))
        if router_aux_loss_coef or router_z_loss_coef:
            loss = loss + self._router_losses(out.router_logits, attention_mask, router_aux_loss_coef,
                                              router_z_loss_coef)
        return loss, out

    def _router_losses(self, router_logits, attention_mask, aux_coef: float, z_coef: float) -> jax.Array:
        config = self.config
        if router_logits is None:
            raise ValueError(f"router losses need a mixture of experts; this {config.model_type} model has none: "
                             f"leave router_aux_loss_coef and router_z_loss_coef at 0")
        if aux_coef and config.moe_routing == "sigmoid_grouped":
            raise ValueError("DeepSeek-V3 balances its experts without an auxiliary loss: leave router_aux_loss_coef "
                             "at 0 and move the router's correction bias with moe_losses.update_correction_bias")
        total = jnp.zeros((), jnp.float32)
        if aux_coef:
            total += aux_coef * load_balancing_loss(router_logits, config.num_experts_per_tok, attention_mask)
        if z_coef:
            total += z_coef * router_z_loss(router_logits, attention_mask)
        return total

    def prepare_inputs_for_call(self, input_ids, attention_mask=None, **kwargs) -> dict:
        """``input_ids``/``attention_mask`` as int32 arrays, checked (mask defaults to ones)."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
        return {"input_ids": input_ids, "attention_mask": mask, **kwargs}

    def can_generate(self) -> bool:
        """False for a classifier (a ``score`` head, no language-model head)."""
        return not is_classifier(self)

    @property
    def config_class(self) -> type:
        return ModelConfig

    def get_static_arguments(self) -> tuple:
        """Arguments a compiled call treats as static (none: the graphdef carries the structure)."""
        return ()

    # ----- generation
    def generate(self, input_ids, generation_config=None, attention_mask=None, prng_key=None, streamer=None,
                 cache=None, layer_loop=None):
        """Greedy, sampling or beam search; see :func:`workbench.core.models.generation.generate`."""
        if not self.can_generate():
            raise ValueError(f"{type(self).__name__} has no language-model head; use a CausalLM to generate")
        return generation.generate(self, input_ids, generation_config=generation_config, attention_mask=attention_mask,
                                   prng_key=prng_key, streamer=streamer, cache=cache, layer_loop=layer_loop)

    def prepare_inputs_for_generation(self, input_ids, max_length: int, attention_mask=None) -> dict:
        """The prefill inputs: ids, mask and a fresh cache of ``max_length`` tokens."""
        inputs = self.prepare_inputs_for_call(input_ids, attention_mask)
        return inputs | {"cache": self.init_cache(inputs["input_ids"].shape[0], max_length)}

    def update_inputs_for_generation(self, output, inputs: dict) -> dict:
        """The next decode step's inputs: ``inputs["input_ids"]`` (B, 1) new tokens and the output's cache."""
        ids = jnp.asarray(inputs["input_ids"], jnp.int32).reshape(-1, 1)
        return {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "cache": output.cache}

    def create_cache_metadata(self, batch_size: int, max_length: int) -> dict:
        """Shapes and bytes of the contiguous cache ``init_cache`` would build (nothing allocated);
        ``keys_shape`` is one layer's ``(B, S, KV, D)`` (the cache stacks ``layers`` of them); ``value_dim``
        is set when the values are the keys' first channels (MLA's latent, stored once)."""
        cache = jax.eval_shape(lambda: self.init_cache(batch_size, max_length))
        keys = cache.keys
        return {"kind": "contiguous", "layers": keys.shape[0], "keys_shape": tuple(keys.shape[1:]),
                "dtype": str(keys.dtype), "value_dim": cache.value_dim,
                "nbytes": keys.size * keys.dtype.itemsize * (1 if cache.values is None else 2)}

    def create_paged_metadata(self, **kwargs) -> dict:
        """Shapes and bytes of the paged cache ``init_ragged_pages(**kwargs)`` would build."""
        cache = jax.eval_shape(lambda: self.init_ragged_pages(**kwargs))
        pages = cache.key_pages
        return {"kind": "paged", "layers": pages.shape[0], "pages_shape": tuple(pages.shape[1:]),
                "num_pages": pages.shape[1], "page_size": pages.shape[2],
                "page_table_shape": tuple(cache.page_table.shape), "dtype": str(pages.dtype),
                "value_dim": cache.value_dim,
                "nbytes": pages.size * pages.dtype.itemsize * (1 if cache.value_pages is None else 2)}

    # ----- parameters
    @property
    def graphdef(self):
        return nnx.graphdef(self)

    @property
    def graphstate(self) -> nnx.State:
        return nnx.state(self, nnx.Param)

    @property
    def graphother(self) -> nnx.State:
        return nnx.split(self, nnx.Param, ...)[2]

    def split_params(self) -> tuple[tp.Any, nnx.State, nnx.State]:
        """``(graphdef, params, other)``."""
        return nnx.split(self, nnx.Param, ...)

    def split_params_dict(self) -> dict:
        """The parameters as a nested dict of arrays."""
        return nnx.to_pure_dict(self.graphstate)

    def merge_params(self, params: nnx.State):
        """A new model with ``params`` in place of this one's."""
        graphdef, _, other = self.split_params()
        return nnx.merge(graphdef, params, other)

    def merge_params_dict(self, params: dict):
        state = self.graphstate
        nnx.replace_by_pure_dict(state, params)
        return self.merge_params(state)

    def params_sharding(self, mesh, partition_axis=None, mode=MODE_TRAIN, rules=None) -> nnx.State:
        return sharding.params_sharding(self, mesh, partition_axis, mode, rules)

    def shard_model(self, mesh, partition_axis=None, mode=MODE_TRAIN, rules=None):
        return sharding.shard_model(self, mesh, partition_axis, mode, rules)

    def gather_model(self):
        return sharding.gather_model(self)

    @classmethod
    def lazy_init(cls, config, *, mesh=None, partition_axis=None, mode=MODE_TRAIN, rules=None, **kwargs):
        """An abstract model (``ShapeDtypeStruct`` parameters with shardings when ``mesh`` is given)."""
        return sharding.lazy_init(lambda: cls(config, rngs=nnx.Rngs(0), **kwargs), mesh, partition_axis, mode, rules)

    def to_dtype(self, dtype):
        """A copy whose floating parameters are ``dtype`` (computation dtype unchanged)."""
        graphdef, params, other = self.split_params()
        cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        return nnx.merge(graphdef, jax.tree.map(cast, params), other)

    def half(self):
        return self.to_dtype(jnp.bfloat16)

    def float(self):
        return self.to_dtype(jnp.float32)

    def to_state(self, optimizer=None):
        """A train state (graphdef, params, optimizer state, step); see ``training.to_state``."""
        return training.to_state(self, optimizer) if optimizer is not None else training.to_state(self)

    # ----- adapters and quantization
    def apply_lora_to_layers(self, rank: int, pattern: str = ".*", **kwargs):
        return lora.apply_lora_to_layers(self, rank, pattern, **kwargs)

    def split_lora_params(self):
        return lora.split_lora_params(self)

    def merge_lora_params(self, lora_state):
        return lora.merge_lora_params(self, lora_state)

    def unwrap_lora_to_layers(self):
        return lora.unwrap_lora_to_layers(self)

    def quantize(self, **kwargs):
        return quantize.quantize(self, **kwargs)

    # ----- I/O
    @classmethod
    def from_pretrained(cls, path, **kwargs):
        return checkpoint.from_pretrained(path, model_cls=cls, **kwargs)

    def save_pretrained(self, path, **kwargs):
        return checkpoint.save_pretrained(self, path, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        return checkpoint.push_to_hub(self, repo_id, **kwargs)

    def to_torch(self):
        return checkpoint.to_torch(self)

    def get_torch_loader(self):
        """A function ``torch state_dict -> model of this config`` (the loading used by tests)."""
        return lambda state_dict: hf_convert.from_hf_state_dict(self.config, state_dict, model_cls=type(self))

    def transform_fn(self, state_dict) -> dict:
        """HF checkpoint tensors -> parameter arrays by path (what loading does), as a flat dict."""
        return {path: hf_convert.load_param(self.config, path, entry, state_dict)
                for path, entry in hf_convert.param_table(self.config, classifier=is_classifier(self)).items()}

    def pure_transform_fn(self, state_dict) -> dict:
        """:meth:`transform_fn` as a nested dict ready for ``nnx.replace_by_pure_dict``."""
        return nnx.traversals.unflatten_mapping(self.transform_fn(state_dict))

    # ----- text views
    def get_module_repr(self) -> str:
        """One line per parameter: path, shape, dtype, semantic axes."""
        lines = [f"{type(self).__name__}({self.config.model_type}, {self.num_params():,} parameters)"]
        for path, var in nnx.to_flat_state(nnx.state(self, nnx.Param)):
            axes = getattr(var, "semantic_axes", None)
            lines.append(f"  {'/'.join(map(str, path))}: {tuple(var.shape)} {var.dtype} "
                         f"{'' if axes is None else list(axes.axes)}")
        return "\n".join(lines)

    def prettify_nnx(self) -> str:
        return self.get_module_repr()

    def printify_nnx(self) -> None:
        print(self.get_module_repr())

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
