"""``CausalLM``: token (and learned position) embedding, the decoder blocks (stacked on a leading
``layers`` axis and scanned, see ``stack.py``), final norm, LM head; ``SequenceClassifier``: the
same trunk with a score head on the last token."""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core.axes import (
    BATCH,
    EMPTY,
    MODE_TRAIN,
    QUERY_LENGTH,
    VOCAB,
    DynamicShardingAxes,
    PartitionAxis,
    RowWise,
)
from workbench.core.checks import positive_int
from workbench.core.linear import ColumnParallelLinear
from workbench.core.mesh import as_auto, call_on_auto_axes, explicit_mesh_of
from workbench.core.models.block import ACTIVATION_AXES, Attention, make_norm
from workbench.core.models.cache import (
    KVCache,
    PagedKVCache,
    StreamingKVCache,
    cache_decisions,
    check_streaming_attention,
    kv_layout,
)
from workbench.core.models.config import ModelConfig
from workbench.core.models.decoder import DecoderBlock
from workbench.core.models.generation_config import GenerationConfig
from workbench.core.models.mla import MLAttention
from workbench.core.models.model_methods import ModelMethods
from workbench.core.models.moe import MoE, check_strategy
from workbench.core.models.moe_alltoall import capacity
from workbench.core.models.rope import attention_factor, cos_sin, inv_frequencies
from workbench.core.models.sharding import with_mesh
from workbench.core.models.stack import check_remat, run_layers, stack_blocks
from workbench.core.operations import OperationRegistry
from workbench.core.operations.attention.common import SINKS, SOFT_CAP, VALUE_DIM, unsupported

Array = jax.Array
AUTO_ATTENTION = {"cpu": "vanilla", "gpu": "sdpa", "tpu": "flash"}
KEEP = object()  # with_options: leave this option as it is
# Logits as a forward on Explicit axes types them (on Auto axes XLA chooses): rows as the hidden states, vocab over tp.
LOGITS_AXES = DynamicShardingAxes((BATCH, QUERY_LENGTH, VOCAB), 1)


def needed_attention_features(config: ModelConfig) -> tuple[str, ...]:
    """What a family asks of its attention implementation beyond plain causal attention."""
    return ((SINKS,) * config.attention_sinks + (SOFT_CAP,) * (config.attn_logit_softcapping is not None)
            + (VALUE_DIM,) * config.mla)  # MLA attends with latent values narrower than its keys


def resolve_attention(name: str, config: ModelConfig | None = None) -> str:
    """``"auto"`` -> the implementation for the default backend (``AUTO_ATTENTION``), or, when that one
    lacks a feature ``config``'s family needs (GPT-OSS's sinks, MLA's value head dim), the first of flash /
    vanilla that has it;
    a named one is checked, and refused (naming who can) if it lacks such a feature."""
    needed = () if config is None else needed_attention_features(config)
    if name == "auto":
        candidates = [AUTO_ATTENTION.get(jax.default_backend(), "vanilla"), "flash", "vanilla"]
        return next(n for n in candidates if all(n in OperationRegistry.supporting(f) for f in needed))
    name = OperationRegistry.canonical_name(name)
    for feature in needed:
        if name not in OperationRegistry.supporting(feature):
            raise unsupported(name, feature)
    return name


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CausalLMOutput:
    """``logits (B, T, V)`` float32; ``cache`` updated when one was passed; ``router_logits``
    ``(layers, B*T, E)`` for a mixture of experts."""

    logits: Array
    cache: KVCache | PagedKVCache | StreamingKVCache | None = None
    router_logits: Array | None = None


class CausalLM(ModelMethods, nnx.Module):
    """A decoder-only language model for every supported family (see :class:`ModelConfig`).

    ``attention_mask (B, T)`` (1 = token, 0 = padding, left padding) sets the positions to
    ``cumsum(mask) - 1`` and hides padded keys; logits of padded queries are meaningless.
    ``attn_mechanism`` names a registered attention implementation, "auto" picks one for the
    default backend; :meth:`with_attention` switches it later.

    The decoder blocks are one :class:`DecoderBlock` whose parameters are stacked on a leading
    ``layers`` axis (``model.layers[3]`` is layer 3 as a one-layer block). A MoE config with
    ``first_dense_layers = k`` stacks its leading dense layers apart: ``model.dense_layers[i]`` is layer
    ``i`` and ``model.layers[i]`` layer ``k + i``. ``scan_layers`` runs
    them with ``lax.scan`` (compiled once, whatever the depth) or, if False, as an unrolled loop;
    ``remat`` ("none", "dots_saveable", "full", ...) is the per-block rematerialisation policy a
    backward pass follows. :meth:`with_options` changes either later.
    """

    base_model_prefix = "model"

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, attn_mechanism: str = "auto", dtype=jnp.float32,
                 param_dtype=jnp.float32, scan_layers: bool = True, remat: str = "none"):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"{type(self).__name__} takes a ModelConfig (ModelConfig.from_hf(dict)); "
                            f"got {type(config).__name__}")
        attn_mechanism = resolve_attention(attn_mechanism, config)
        if not isinstance(scan_layers, bool):
            raise TypeError(f"scan_layers must be True or False; got {scan_layers!r}")
        self.scan_layers, self.remat = scan_layers, check_remat(remat)
        self.config = config
        self.dtype, self.param_dtype = dtype, param_dtype
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype),
                                      semantic_axes=RowWise)
        self.embed_positions = (
            nnx.Param(init(rngs.params(), (config.max_position_embeddings, config.hidden_size), param_dtype),
                      semantic_axes=DynamicShardingAxes((EMPTY, EMPTY), MODE_TRAIN))
            if config.position_embedding == "learned" else nnx.data(None))
        k = config.first_dense_layers
        block = lambda c: lambda r: DecoderBlock(c, attn_mechanism=attn_mechanism, dtype=dtype,
                                                 param_dtype=param_dtype, rngs=r)
        # leading dense-MLP layers of a MoE model (DeepSeek-V3, Qwen3-MoE): their own stack, HF layers 0..k-1
        self.dense_layers = stack_blocks(block(config.dense_prefix()), k, rngs) if k else nnx.data(None)
        self.layers = stack_blocks(block(config), config.num_hidden_layers - k, rngs)
        self.norm = make_norm(config, param_dtype=param_dtype)
        self._init_head(config, rngs)
        # What generate() falls back on for unset fields: a checkpoint's generation_config.json (from_pretrained
        # sets it), else the config's bos/eos/pad ids, as transformers does.
        self.generation_config = GenerationConfig.from_model_config(config)
        # The mesh the model is laid on (shard_model sets it): hidden states are constrained to it per layer.
        self.mesh, self.partition_axis = None, None

    def _init_head(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.lm_head = (nnx.data(None) if config.tie_word_embeddings else
                        ColumnParallelLinear(config.hidden_size, config.vocab_size, use_bias=False, dtype=self.dtype,
                                             param_dtype=self.param_dtype, rngs=rngs))

    @property
    def attn_mechanism(self) -> str:
        return self.layers.self_attn.attn_mechanism

    def with_options(self, *, scan_layers: bool | None = None, remat: str | None = None,
                     moe_strategy: str | None = None, capacity_factor: tp.Any = KEEP) -> CausalLM:
        """A model running its layers scanned or unrolled, with another remat policy, or another MoE strategy
        (``"dense"``, ``"ragged"``, ``"alltoall"``; see :mod:`.moe`) and all-to-all ``capacity_factor``
        (None: never drop); parameters shared."""
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        if moe_strategy is not None or capacity_factor is not KEEP:
            moes = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoE)]
            if not moes:
                raise ValueError(f"this {self.config.model_type} model has no mixture-of-experts layers; "
                                 f"moe_strategy / capacity_factor apply to MoE families only")
            if moe_strategy is not None:
                check_strategy(moe_strategy)
            if capacity_factor not in (KEEP, None):
                capacity(1, 1, 1, capacity_factor)  # checks it is > 0
            for m in moes:
                m.strategy = m.strategy if moe_strategy is None else moe_strategy
                m.capacity_factor = m.capacity_factor if capacity_factor is KEEP else capacity_factor
        if scan_layers is not None:
            if not isinstance(scan_layers, bool):
                raise TypeError(f"scan_layers must be True or False; got {scan_layers!r}")
            model.scan_layers = scan_layers
        if remat is not None:
            model.remat = check_remat(remat)
        return model

    def with_attention(self, name: str, **options: tp.Any) -> CausalLM:
        """A model running attention ``name`` that shares this model's parameter arrays (no copy); its
        Variables are new, so updating one model's parameters leaves the other's alone. ``options`` go to
        the implementation's ``OperationMetadata.options`` (e.g. ``load_balance="zigzag"`` for ``ring``); on
        a model laid on a mesh (``shard_model``) the operation also gets that mesh, so sequence-parallel
        implementations (``ring``, ``ulysses``) run inside the model on an ``sp`` axis."""
        name = resolve_attention(name, self.config)
        try:
            frozen = tuple(sorted(options.items()))
            hash(frozen)
        except TypeError:
            raise TypeError(f"attention options must be hashable values (strings, numbers, tuples); got {options!r}"
                            ) from None
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        for _, module in nnx.iter_modules(model):
            if isinstance(module, Attention | MLAttention):
                module.attn_mechanism, module.attn_options = name, frozen
        return model

    def init_cache(self, batch_size: int, max_length: int, *, dtype=None, mesh: tp.Any = None,
                   partition_axis: PartitionAxis | None = None) -> KVCache:
        """An empty contiguous cache for ``batch_size`` rows of up to ``max_length`` tokens (MLA: latents and
        rope keys, see ``cache.kv_layout``).

        On a mesh (``mesh``, else the one the model's parameters are typed on or ``shard_model`` laid it on) keys
        and values are laid out as :func:`~workbench.core.sharding.plan.kv_cache_spec` says (``partition_axis``,
        default the model's): rows over ``(fsdp, dp)``, heads over ``tp``, and where ``tp`` is a multiple of the
        KV heads above their count, each head repeated to one per ``tp`` device (``cache.stored_kv_heads``), as
        serving engines keep GQA caches; a step writes each new key and value repeated alike. Without a mesh
        the cache holds the model's KV heads, unplaced."""
        c, layout = self.config, kv_layout(self.config)
        dtype = dtype or self.dtype
        explicit = explicit_mesh_of(nnx.state(self, nnx.Param))
        mesh = mesh if mesh is not None else explicit if explicit is not None else getattr(self, "mesh", None)
        if mesh is None:
            return self._typed(KVCache.create(c.num_hidden_layers, batch_size, max_length, layout.kv_heads,
                                              layout.key_dim, dtype, value_dim=layout.value_dim))
        abstract = self.abstract_cache(batch_size, max_length, mesh=mesh, partition_axis=partition_axis,
                                       dtype=dtype)
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), abstract)

    def abstract_cache(self, batch_size: int, max_length: int, *, mesh: tp.Any,
                       partition_axis: PartitionAxis | None = None, dtype=None) -> KVCache:
        """:meth:`init_cache`'s cache on ``mesh`` as ``jax.ShapeDtypeStruct`` leaves, each with the
        ``NamedSharding`` it is made with (nothing allocated): the cache a compiled decode step takes
        (:mod:`workbench.core.compile.steps`). ``mesh`` may be abstract or a virtual cluster's."""
        c, layout = self.config, kv_layout(self.config)
        dtype = dtype or self.dtype
        batch_size, max_length = positive_int("batch_size", batch_size), positive_int("max_length", max_length)
        pa = partition_axis or getattr(self, "partition_axis", None) or PartitionAxis()
        shape, decisions = cache_decisions(c, batch_size, max_length, mesh, pa)
        kv_spec = PartitionSpec(None, *(d.spec_entry for d in decisions))  # layers stacked first, whole
        create = lambda: KVCache.create(c.num_hidden_layers, batch_size, max_length, shape[2], shape[3], dtype,
                                        value_dim=layout.value_dim)
        abstract = jax.eval_shape(create)  # checks the sizes
        specs = dataclasses.replace(abstract, keys=kv_spec, values=None if layout.value_dim else kv_spec,
                                    valid_BS=PartitionSpec(), positions_B=PartitionSpec(), index=PartitionSpec())
        placed = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        return jax.tree.map(placed, abstract, specs)

    def init_streaming_cache(self, batch_size: int, *, sinks: int = 4, window: int, dtype=None) -> StreamingKVCache:
        """An empty StreamingLLM cache (:class:`~workbench.core.models.cache.StreamingKVCache`): the first ``sinks``
        tokens plus the ``window`` most recent, ``(L, B, sinks + window, KV, D)`` whatever the length generated;
        keys cached before rotary embedding and rotated with their positions within the cache.

        Rotary families only: learned absolute positions (GPT-2) are added to the embeddings, so every layer's
        cached keys and values carry the position they were written at and cannot be re-positioned after an
        eviction; multi-head latent attention (DeepSeek-V3) rotates its keys itself. The model's attention
        implementation must take an explicit mask (the cache's visibility)."""
        c = self.config
        if c.mla:
            raise ValueError("the streaming cache re-rotates cached keys at their positions within the cache, and "
                             "multi-head latent attention (MLA, DeepSeek-V3) caches them rotated in its latent; use "
                             "init_cache() or init_ragged_pages()")
        if self.embed_positions is not None or c.position_embedding != "rope":
            raise ValueError(f"the streaming cache needs rotary positions (keys re-rotated at their positions within "
                             f"the cache after evictions); {c.model_type}'s {c.position_embedding} absolute positions "
                             f"are added to the embeddings, so cached keys and values keep the position they were "
                             f"written at: use init_cache() or init_ragged_pages()")
        cache = StreamingKVCache.create(c.num_hidden_layers, batch_size, c.num_key_value_heads, c.head_dim,
                                        sinks=sinks, window=window, dtype=dtype or self.dtype)
        if cache.capacity > c.max_position_embeddings:
            raise ValueError(f"sinks + window = {cache.capacity} positions exceed the model's max_position_embeddings="
                             f"{c.max_position_embeddings}; the cache's positions must stay within it: lower window")
        check_streaming_attention(self.attn_mechanism)
        return self._typed(cache)

    def _typed(self, cache: tp.Any) -> tp.Any:
        """``cache`` replicated on the model's mesh when its parameters carry Explicit axes, else as it is.

        On Explicit axes every array needs a type: an unplaced cache would be laid out by XLA on its way
        into a step but typed replicated on its way out, and donating it would then fail.
        """
        mesh = explicit_mesh_of(nnx.state(self, nnx.Param))
        if mesh is None:
            return cache
        return jax.sharding.reshard(cache, NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def init_ragged_pages(self, *, batch_size: int, page_size: int = 16, num_pages: int | None = None,
                          hbm_utilization: float | None = None, max_model_length: int | None = None,
                          dtype=None) -> PagedKVCache:
        """An empty paged cache. Give ``num_pages``, or ``hbm_utilization`` (a fraction of the first
        device's memory limit spent on pages); ``max_model_length`` (default the config's
        ``max_position_embeddings``) bounds one row."""
        c, layout = self.config, kv_layout(self.config)
        dtype = jnp.dtype(dtype or self.dtype)
        max_model_length = max_model_length or c.max_position_embeddings
        if (num_pages is None) == (hbm_utilization is None):
            raise ValueError("pass exactly one of num_pages= or hbm_utilization=")
        if num_pages is None:
            if not 0 < hbm_utilization <= 1:
                raise ValueError(f"hbm_utilization must be in (0, 1]; got {hbm_utilization}")
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" not in stats:
                raise ValueError(f"{jax.devices()[0].platform} devices report no memory limit; pass num_pages= "
                                 f"instead of hbm_utilization=")
            free = stats["bytes_limit"] * hbm_utilization - stats.get("bytes_in_use", 0)
            page_bytes = c.num_hidden_layers * page_size * layout.numbers_per_token * dtype.itemsize
            num_pages = int(free // page_bytes)
            if num_pages < 1:
                raise ValueError(f"hbm_utilization={hbm_utilization} leaves no room for one page of {page_bytes} B")
        return self._typed(PagedKVCache.create(c.num_hidden_layers, batch_size, num_pages, page_size,
                                               max_model_length, layout.kv_heads, layout.key_dim, dtype,
                                               value_dim=layout.value_dim))

    def __call__(self, input_ids: Array, attention_mask: Array | None = None, *,
                 cache: KVCache | PagedKVCache | None = None) -> CausalLMOutput:
        """Logits for ``input_ids (B, T)``; with ``cache`` the tokens continue what it holds.

        Called outside ``jit`` the forward runs compiled (once per structure and input shapes),
        not op by op; inside a traced function it is traced like any other code.
        """
        return compiled_call(self, "forward", input_ids, attention_mask, cache)

    def forward(self, input_ids: Array, attention_mask: Array | None = None, *,
                cache: KVCache | PagedKVCache | None = None) -> CausalLMOutput:
        """:meth:`__call__` as plain traceable code."""
        x_BTD, cache, router = self.hidden_states(input_ids, attention_mask, cache=cache)
        return CausalLMOutput(self.head(x_BTD).astype(self.logits_dtype), cache, router)

    def last_token_logits(self, input_ids: Array, attention_mask: Array | None = None, *,
                          cache: KVCache | PagedKVCache | None = None) -> CausalLMOutput:
        """:meth:`__call__` with logits ``(B, 1, V)`` of the last position only: the LM head reads one row of
        hidden states, not T (what ``generate``'s prefill needs, as transformers' ``logits_to_keep=1``)."""
        return compiled_call(self, "_last_token_forward", input_ids, attention_mask, cache)

    def _last_token_forward(self, input_ids: Array, attention_mask: Array | None = None, *,
                            cache: KVCache | PagedKVCache | None = None) -> CausalLMOutput:
        x_BTD, cache, router = self.hidden_states(input_ids, attention_mask, cache=cache)
        return CausalLMOutput(self.head(x_BTD[:, -1:]).astype(self.logits_dtype), cache, router)

    @property
    def logits_dtype(self):
        """float32, or float64 for a float64 model (x64 numerics)."""
        return jnp.promote_types(self.dtype, jnp.float32)

    def _activation_constraint(self) -> tp.Callable[[Array], Array]:
        """``x -> x`` pinned to ``ACTIVATION_AXES`` on the model's mesh (identity without a mesh)."""
        mesh = getattr(self, "mesh", None)
        if mesh is None:
            return lambda x: x
        pa = self.partition_axis or PartitionAxis()

        def constrain(x_BTD: Array) -> Array:
            spec = pa.resolve(ACTIVATION_AXES, shape=x_BTD.shape, mesh=mesh)
            return jax.lax.with_sharding_constraint(x_BTD, NamedSharding(mesh, spec))

        return constrain

    def head(self, x_BTD: Array) -> Array:
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x_BTD, self.embed_tokens[...].astype(self.dtype))
        else:
            logits = self.lm_head(x_BTD)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    @staticmethod
    def positions(input_ids: Array, attention_mask: Array | None) -> tuple[Array, Array | None]:
        """Without a cache: each token's position ``(B, T)`` (``cumsum(mask) - 1`` under left padding) and
        the key mask ``(B, 1, 1, T)`` hiding padded keys (None without ``attention_mask``)."""
        b, t = input_ids.shape
        if attention_mask is None:
            return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), None
        keep_BT = attention_mask.astype(bool)
        return jnp.maximum(jnp.cumsum(keep_BT, axis=-1, dtype=jnp.int32) - 1, 0), keep_BT[:, None, None, :]

    def embed(self, input_ids: Array, positions_BT: Array) -> Array:
        """Token embeddings ``(B, T, D)`` in the model's dtype (times the family's multiplier, plus learned
        position embeddings where the family has them)."""
        c = self.config
        x_BTD = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        if c.embedding_multiplier is not None:  # in the model's dtype, as HF does (sqrt(3072) is 55.5 in bf16)
            x_BTD = x_BTD * jnp.asarray(c.embedding_multiplier, self.dtype)
        if self.embed_positions is not None:
            x_BTD = x_BTD + jnp.take(self.embed_positions[...], positions_BT, axis=0).astype(self.dtype)
        return x_BTD

    def rope_tables(self, positions_BT: Array) -> dict[str, tuple[Array, Array]] | None:
        """Each rotary table the layers use (``"global"``, ``"local"``) -> its ``(cos, sin)`` at these
        positions; None for a family with learned positions."""
        if self.embed_positions is not None:
            return None
        c = self.config
        tables = {"global": (c.rope_theta, c.rope_scaling), "local": (c.local_rope_theta, None)}
        used = sorted({c.layer_kind(i)[1] for i in range(c.num_hidden_layers)})
        return {name: cos_sin(positions_BT, inv_frequencies(c.head_dim, *tables[name], dtype=self.logits_dtype),
                              attention_factor(tables[name][1]))
                for name in used}

    def hidden_states(self, input_ids: Array, attention_mask: Array | None = None, *,
                      cache: KVCache | PagedKVCache | None = None) -> tuple[Array, tp.Any, Array | None]:
        """Final normed hidden states ``(B, T, D)``, the updated cache and stacked router logits."""
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be an int array (batch, length); got {input_ids.dtype} {input_ids.shape}")
        b, t = input_ids.shape
        if attention_mask is not None:
            attention_mask = jnp.asarray(attention_mask)
            if attention_mask.shape != (b, t):
                raise ValueError(f"attention_mask has shape {attention_mask.shape}; it must be (B, T) = {(b, t)} "
                                 f"like input_ids")
        c = self.config
        kinds_L = [c.layer_kind(i) for i in range(c.num_hidden_layers)]
        step, mask_B1TS = None, None
        if cache is not None:
            step = cache.begin(jnp.ones((b, t), bool) if attention_mask is None else attention_mask)
            if getattr(step, "rotates_keys", False):  # the cache rotates keys at their positions within it
                step = step.with_key_rope(self.rope_tables, [kind[1] for kind in kinds_L])
            positions_BT = step.positions_BT
        else:
            positions_BT, mask_B1TS = self.positions(input_ids, attention_mask)
        x_BTD = self.embed(input_ids, positions_BT)
        ropes = self.rope_tables(positions_BT)
        kv = None if step is None else step.arrays()
        constrain = self._activation_constraint()
        x_BTD = constrain(x_BTD)
        k = c.first_dense_layers
        run = functools.partial(run_layers, ropes=ropes, mask_B1TS=mask_B1TS, step=step, scan=self.scan_layers,
                                remat=self.remat, constrain=constrain)
        if k:
            x_BTD, kv, _ = run(self.dense_layers, x_BTD, kinds_L=kinds_L[:k], kv=kv)
        x_BTD, kv, router = run(self.layers, x_BTD, kinds_L=kinds_L[k:], kv=kv, first_layer=k)
        cache = None if step is None else step.finish(kv)
        return self.norm(x_BTD), cache, router


def _traced(*trees: tp.Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compiled(graphdef, method: str, state, input_ids, attention_mask, cache):
    return _call(nnx.merge(graphdef, state), method, input_ids, attention_mask, cache)


def _call(model: CausalLM, method: str, input_ids, attention_mask, cache):
    """``model.<method>(...)``; on arrays typed with Explicit mesh axes, run as on Auto axes.

    The model's code is written for Auto axes (GSPMD chooses what annotations leave open); Explicit
    types would make JAX refuse its gathers and contractions as ambiguous. So the body runs through
    :func:`workbench.core.mesh.call_on_auto_axes` on the model's mesh made Auto, and the outputs are
    typed back: logits as ``LOGITS_AXES`` resolve, a cache as it came in, router logits replicated.
    """
    args = (input_ids, attention_mask, cache)
    own = getattr(model, "mesh", None)
    typed = {m.abstract_mesh: m for m in map(explicit_mesh_of, jax.tree.leaves((nnx.state(model, nnx.Param), args)))
             if m is not None}
    if not typed:
        if own is not None and own.explicit_axes:  # already inside an Auto region (e.g. generate's programs)
            model = with_mesh(model, as_auto(own), model.partition_axis)
        return getattr(model, method)(input_ids, attention_mask, cache=cache)
    if len(typed) > 1 or (own is not None and own.abstract_mesh not in typed):
        meshes = [*typed, *([own.abstract_mesh] if own is not None and own.abstract_mesh not in typed else [])]
        raise ValueError("the model's mesh, its parameters and its inputs are typed on different meshes ("
                         + " and ".join(f"{dict(m.shape)} {'/'.join(sorted({t.name for t in m.axis_types}))}"
                                        for m in meshes)
                         + "); place them on one: model.shard_model(mesh), jax.device_put(ids, NamedSharding(mesh, "
                           "spec))")
    mesh = own if own is not None else next(iter(typed.values()))
    inner = model if own is None else with_mesh(model, as_auto(own), model.partition_axis)
    graphdef, state = nnx.split(inner)
    pa = getattr(model, "partition_axis", None) or PartitionAxis()
    cache_specs = [jax.typeof(x).sharding.spec if explicit_mesh_of(x) is not None else jax.sharding.PartitionSpec()
                   for x in jax.tree.leaves(cache)]

    def out_specs(out: CausalLMOutput) -> CausalLMOutput:
        logits = out.logits.shape
        axes = LOGITS_AXES if len(logits) == 3 else DynamicShardingAxes((BATCH, EMPTY), MODE_TRAIN)
        new_cache = out.cache
        if out.cache is not None:
            leaves, tree = jax.tree.flatten(out.cache)
            same = len(leaves) == len(cache_specs) and all(
                len(s) <= x.ndim for s, x in zip(cache_specs, leaves, strict=True))
            new_cache = tree.unflatten(cache_specs if same else [jax.sharding.PartitionSpec()] * len(leaves))
        return CausalLMOutput(pa.resolve(axes, shape=logits, mesh=mesh), new_cache,
                              None if out.router_logits is None else jax.sharding.PartitionSpec())

    def body(state, input_ids, attention_mask, cache):
        return getattr(nnx.merge(graphdef, state), method)(input_ids, attention_mask, cache=cache)

    return call_on_auto_axes(body, (state, *args), mesh, out_specs)


def compiled_call(model: CausalLM, method: str, input_ids, attention_mask, cache):
    """``model.<method>(input_ids, attention_mask, cache=cache)``, compiled when called eagerly.

    Checks that need concrete values (does the cache have room?) run here first, since inside
    the compiled program they cannot raise.
    """
    state = nnx.state(model)
    if _traced(state, input_ids, attention_mask, cache):
        return _call(model, method, input_ids, attention_mask, cache)
    input_ids = jnp.asarray(input_ids)
    attention_mask = None if attention_mask is None else jnp.asarray(attention_mask)
    if cache is not None and input_ids.ndim == 2:
        cache.check_fits(jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask)
    return _compiled(nnx.graphdef(model), method, state, input_ids, attention_mask, cache)


class SequenceClassifier(CausalLM):
    """The Llama-family trunk with a ``score`` head ``(D, num_labels)`` read at each row's last
    token (Hugging Face ``*ForSequenceClassification``; with left padding that is column -1)."""

    classifier = True

    def __init__(self, config: ModelConfig, *, num_labels: int, rngs: nnx.Rngs, **kwargs: tp.Any):
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels must be a positive int; got {num_labels!r}")
        self.num_labels = num_labels
        super().__init__(config, rngs=rngs, **kwargs)

    def _init_head(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.lm_head = nnx.data(None)
        self.score = ColumnParallelLinear(config.hidden_size, self.num_labels, use_bias=False, dtype=self.dtype,
                                          param_dtype=self.param_dtype, rngs=rngs)

    def __call__(self, input_ids: Array, attention_mask: Array | None = None, *,
                 cache: tp.Any = None) -> CausalLMOutput:
        """``logits (B, num_labels)`` of each row's last token (pass left-padded batches)."""
        if cache is not None:
            raise ValueError("SequenceClassifier takes no cache")
        return compiled_call(self, "forward", input_ids, attention_mask, None)

    def forward(self, input_ids: Array, attention_mask: Array | None = None, *, cache: tp.Any = None
                ) -> CausalLMOutput:
        x_BTD, _, router = self.hidden_states(input_ids, attention_mask)
        return CausalLMOutput(self.score(x_BTD[:, -1]).astype(self.logits_dtype), None, router)
