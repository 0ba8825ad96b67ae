"""MaxText's YAML configuration, read into a :class:`~workbench.core.interop.recipe.TrainingRecipe` and
written back: :func:`from_maxtext`, :func:`to_maxtext`.

A MaxText config layers overrides on ``base.yml``; what a file leaves unset takes :data:`MAXTEXT_BASE` (the defaults
of AI-Hypercomputer/maxtext ``src/maxtext/configs/base.yml`` at commit e591f30cbbf217ed67ef71263ec0538239f9c3b8;
older trees keep it at ``MaxText/configs/base.yml``). MaxText's mesh axes fold onto the workbench's: data and diloco
-> dp, fsdp and fsdp_transpose -> fsdp, sequence and the context axes -> sp, tensor, tensor_transpose,
tensor_sequence and autoregressive -> tp, expert -> ep, stage (``*_pipeline_parallelism``) -> pp; ``dcn_*`` degrees
multiply the ``ici_*`` ones axis by axis. Keys MaxText has and the workbench does not price are ignored; a known key
with a bad value raises a ValueError naming it.
"""

from __future__ import annotations

import math
import typing as tp

from workbench.core.interop.model_names import preset_layers
from workbench.core.interop.recipe import (
    TrainingRecipe,
    config_int,
    default_field_axes,
    fill_degrees,
    global_batch_int,
    read_text,
)
from workbench.core.mesh import MESH_AXES
from workbench.core.pipeline_schedule import PipelineConfig

MAXTEXT_BASE_COMMIT = "e591f30cbbf217ed67ef71263ec0538239f9c3b8"
# MaxText's parallelism axis (the name in ici_<name>_parallelism) -> the workbench mesh axis it is priced as.
# base.yml lists diloco, data, stage (pipeline), fsdp, fsdp_transpose, context, context_usp_ulysses,
# context_autoregressive, tensor, tensor_sequence, expert, autoregressive; sequence and tensor_transpose are older
# trees' names.
MAXTEXT_AXES = {
    "diloco": "dp", "data": "dp", "pipeline": "pp", "fsdp": "fsdp", "fsdp_transpose": "fsdp", "sequence": "sp",
    "context": "sp", "context_usp_ulysses": "sp", "context_autoregressive": "sp", "tensor": "tp",
    "tensor_transpose": "tp", "tensor_sequence": "tp", "expert": "ep", "autoregressive": "tp",
}
# What pricing a MaxText axis as its workbench axis leaves out, said when the axis is used.
_AXIS_NOTES = {
    "diloco": "DiLoCo replicas synchronise every few hundred steps; priced as dp, which all-reduces every step",
    "fsdp_transpose": "fsdp_transpose shards the weights' other dimension; priced as more fsdp",
    "context_usp_ulysses": "context_usp_ulysses exchanges heads all-to-all (Ulysses); priced as sp",
    "context_autoregressive": "context_autoregressive splits decode caches; priced as sp",
    "tensor_transpose": "tensor_transpose shards the weights' other dimension; priced as more tp",
    "tensor_sequence": "tensor_sequence is tensor parallelism with sequence-sharded activations; priced as tp",
    "autoregressive": "autoregressive shards heads for decoding; priced as tp",
}
# The workbench axis -> the MaxText axis written for it (to_maxtext) and named in logical_axis_rules.
_EXPORT_AXES = {"pp": "pipeline", "dp": "data", "fsdp": "fsdp", "ep": "expert", "tp": "tensor", "sp": "context"}
_RULE_AXES = {**{k: v for k, v in MAXTEXT_AXES.items() if k != "pipeline"}, "stage": "pp"}

# base.yml defaults (commit above) of every key from_maxtext reads.
MAXTEXT_BASE: dict[str, tp.Any] = {
    "model_name": "default",
    "per_device_batch_size": 12.0,
    "max_target_length": 2048,
    "gradient_accumulation_steps": 1,
    "remat_policy": "full",
    "num_layers_per_pipeline_stage": 1,
    "num_pipeline_repeats": -1,
    "pipeline_parallel_layers": -1,
    "num_pipeline_microbatches": -1,
    "pipeline_delay_activation_forwarding": False,
    "shard_optimizer_over_data": False,
    "num_slices": -1,
    "override_logical_axis_rules": False,
    "attention": "autoselected",
    "num_vocab_tiling": 1,
    **{f"ici_{a}_parallelism": 1 for a in MAXTEXT_AXES},
    **{f"dcn_{a}_parallelism": 1 for a in MAXTEXT_AXES},
    "ici_fsdp_parallelism": -1,  # "recommended ICI axis to be auto-sharded"
    "dcn_data_parallelism": -1,  # "recommended DCN axis to be auto-sharded"
}
# base.yml's logical_axis_rules (first entry of each name) for the names the workbench has a PartitionAxis field for
_BASE_ACTIVATION_RULES = {
    "activation_batch": ("data", "fsdp", "fsdp_transpose", "expert"),
    "activation_length": ("context", "context_usp_ulysses"),
    "activation_embed": ("tensor",),
    "activation_heads": ("tensor", "tensor_sequence", "autoregressive"),
    "activation_kv_heads": ("tensor", "tensor_sequence"),
    "activation_mlp": ("tensor", "tensor_sequence"),
    "activation_vocab": ("tensor", "tensor_sequence"),
    "activation_exp": ("expert",),
}
# ... and for the weight names, which the workbench's parameter specs (roles) decide instead.
_BASE_WEIGHT_RULES = {
    "embed": ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"),
    "mlp": ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"),
    "heads": ("tensor", "tensor_sequence", "autoregressive"),
    "q_heads": ("tensor", "tensor_sequence", "autoregressive"),
    "kv_heads": ("tensor", "tensor_sequence", "autoregressive"),
    "vocab": ("tensor", "tensor_sequence", "autoregressive"),
    "exp": ("expert",),
    "layers": ("stage",),
}
# MaxText activation name -> the PartitionAxis fields (train mode) it sets; the semantic axis each field maps.
_RULE_FIELDS = {
    "activation_batch": ("batch_axis",), "activation_length": ("sequence_axis", "query_sequence_axis"),
    "activation_embed": ("hidden_state_axis",), "activation_heads": ("head_axis",),
    "activation_kv_heads": ("kv_head_axis",), "activation_mlp": ("mlp_intermediate_axis",),
    "activation_vocab": ("vocab_axis",), "activation_exp": ("expert_axis",),
}
_FIELD_RULE = {f: name for name, fields in _RULE_FIELDS.items() for f in fields}

# remat_policy -> (the workbench policy it is priced as, what that leaves out; None when nothing)
_SAVES_DOTS = "it saves every projection's output, as dots_saveable saves every matmul's"
MAXTEXT_REMATS: dict[str, tuple[str, str | None]] = {
    "full": ("full", None),
    "none": ("none", "its NNX decoders then skip remat, while its Linen decoders (layers/decoders.py "
                     "get_remat_policy) pass policy None to nn.remat, which recomputes the whole layer"),
    "minimal_with_context": ("dots_saveable", _SAVES_DOTS + " (and the attention context)"),
    "minimal_flash": ("dots_saveable", _SAVES_DOTS + " (and the attention context)"),
    "minimal": ("dots_saveable", _SAVES_DOTS + " but recomputes attention"),
    "minimal_with_quantization": ("dots_saveable", _SAVES_DOTS + " but recomputes attention"),
    "minimal_with_context_and_quantization": ("dots_saveable", _SAVES_DOTS),
    "save_dot_with_context_except_mlp": ("dots_saveable", "it saves attention's projections and context, not the "
                                                          "MLP's: the MLP's recompute is not priced"),
    "save_dot_except_mlpwi": ("dots_saveable", "it recomputes the MLP's up projections: not priced"),
    "save_dot_except_mlp": ("dots_saveable", "it recomputes the MLP: not priced"),
    "save_qkv_proj": ("dots_saveable", "it saves only q, k, v projections: the rest's recompute is not priced"),
    "save_out_proj": ("dots_saveable", "it saves only the attention output projection: the rest's recompute is not "
                                       "priced"),
    "qkv_proj_offloaded": ("dots_saveable", "it saves only the q, k, v projections (offloaded to host memory: "
                                            "counted there), the rest's recompute is not priced"),
    "minimal_offloaded": ("dots_saveable", None),
    "custom": ("dots_saveable", "its per-tensor choices between saving and recomputing are priced as saving every "
                                "projection"),
}
# The remat policies that keep what they save in host memory (the ledger's offload).
OFFLOADED_REMATS = ("qkv_proj_offloaded", "minimal_offloaded")
# remat_policy 'custom': each tensor's base.yml choice ('device' keeps it in HBM, 'offload' in host memory, 'remat'
# recomputes it). All 'remat' but the layer's input is full remat.
CUSTOM_TENSORS = {"decoder_layer_input": "device", "context": "remat", "mlpwi": "remat", "mlpwi_0": "remat",
                  "mlpwi_1": "remat", "mlpwo": "remat", "query_proj": "remat", "key_proj": "remat",
                  "value_proj": "remat", "qkv_proj": "remat", "out_proj": "remat"}
# MaxText's attention -> the kernel the ledger counts (autoselected runs splash, TPU's flash kernel, to train)
MAXTEXT_ATTENTION = {"dot_product": "xla", "flash": "flash", "autoselected": "flash", "cudnn_flash_te": "flash",
                     "cudnn_flash_jax": "flash"}


def _load_yaml(text: str) -> dict[str, tp.Any]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"not a MaxText YAML config: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"a MaxText config is a YAML mapping of keys to values; got {type(data).__name__}")
    return data


def _degrees(cfg: tp.Mapping[str, tp.Any], kind: str) -> dict[str, int]:
    return {a: config_int(f"{kind}_{a}_parallelism", cfg[f"{kind}_{a}_parallelism"], allow_fill=True)
            for a in MAXTEXT_AXES}


def _fold(degrees: tp.Mapping[str, int]) -> dict[str, int]:
    out = dict.fromkeys(MESH_AXES, 1)
    for name, n in degrees.items():
        out[MAXTEXT_AXES[name]] *= n
    return out


def _rule_axes(value: tp.Any, name: str) -> tuple[str, ...]:
    axes = (value,) if isinstance(value, str) else tuple(value or ())
    unknown = [a for a in axes if not isinstance(a, str) or a not in _RULE_AXES]
    if unknown:
        raise ValueError(f"logical_axis_rules {name!r} names mesh axes {unknown}; MaxText's are {sorted(_RULE_AXES)}")
    return axes


def _workbench_axes(axes: tp.Sequence[str], sizes: tp.Mapping[str, int]) -> tuple[str, ...]:
    """MaxText mesh axes as workbench axes, each once, those of size 1 dropped."""
    return tuple(a for a in dict.fromkeys(_RULE_AXES[x] for x in axes) if sizes[a] > 1)


def _axis_rules(cfg: tp.Mapping[str, tp.Any], sizes: tp.Mapping[str, int], notes: list[str]
                ) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """PartitionAxis overrides for the activation rules whose axes (as workbench axes of size > 1) differ from the
    workbench's defaults; a note for weight rules changed from base.yml and for names without a field."""
    given: dict[str, tuple[str, ...]] = {}
    raw = cfg.get("logical_axis_rules") or []
    if not isinstance(raw, list):
        raise ValueError("logical_axis_rules is a list of [logical name, mesh axes] pairs; fix its value")
    for rule in raw:
        if not isinstance(rule, list | tuple) or len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"logical_axis_rules entries are [logical name, mesh axes]; fix {rule!r}")
        given.setdefault(rule[0], _rule_axes(rule[1], rule[0]))
    override = bool(cfg.get("override_logical_axis_rules"))
    rules = []
    for name, fields in _RULE_FIELDS.items():
        source = given.get(name, () if override else _BASE_ACTIVATION_RULES[name])
        axes = _workbench_axes(source, sizes)
        for field in fields:
            if set(axes) != set(default_field_axes(field, sizes)):
                rules.append((field, axes))
    for name, base in _BASE_WEIGHT_RULES.items():
        have = given.get(name, () if override else base)
        if set(_workbench_axes(have, sizes)) != set(_workbench_axes(base, sizes)):
            notes.append(f"MaxText logical_axis_rules {name!r} -> {list(have)} shards weights differently from "
                         f"base.yml; the workbench's parameter specs decide weights: not represented")
    other = sorted(set(given) - set(_RULE_FIELDS) - set(_BASE_WEIGHT_RULES))
    if other:
        notes.append(f"MaxText logical_axis_rules for {other} have no workbench PartitionAxis field: ignored")
    return tuple(rules)


def _custom(cfg: tp.Mapping[str, tp.Any]) -> tuple[str | None, bool]:
    """remat_policy 'custom': the workbench policy its per-tensor choices are (None: not one), and whether it
    offloads any tensor."""
    choices = {name: cfg.get(name, default) for name, default in CUSTOM_TENSORS.items()}
    bad = {n: c for n, c in choices.items() if c not in ("device", "offload", "remat")}
    if bad:
        raise ValueError(f"remat_policy 'custom' takes 'device', 'offload' or 'remat' per tensor; got {bad}")
    full = all(c == "remat" for n, c in choices.items() if n != "decoder_layer_input")
    return ("full" if full else None), "offload" in choices.values()


def _remat(name: tp.Any, notes: list[str], cfg: tp.Mapping[str, tp.Any] | None = None) -> str:
    if name not in MAXTEXT_REMATS:
        raise ValueError(f"remat_policy {name!r} is not one of MaxText's {sorted(MAXTEXT_REMATS)}; use one of those")
    if name == "custom" and _custom(cfg or {})[0] == "full":
        return "full"  # every tensor recomputed but the layer's input: what full remat keeps
    remat, why = MAXTEXT_REMATS[name]
    if why:
        notes.append(f"MaxText remat_policy {name!r} " + ("is priced as no remat: " if remat == "none" else
                                                           f"has no workbench equivalent; priced as {remat}: ")
                     + why)
    return remat


def _pipeline(cfg: tp.Mapping[str, tp.Any], given: tp.Container[str], pp: int, num_layers: int | None,
              notes: list[str]) -> tuple[PipelineConfig | None, int | None]:
    """MaxText's (circular) pipeline: ``num_pipeline_repeats`` (or layers / (stages x layers per stage)) stages per
    device, ``num_pipeline_microbatches`` (default: the stages; twice that with delayed forwarding)."""
    if pp == 1:
        return None, None
    per_stage = config_int("num_layers_per_pipeline_stage", cfg["num_layers_per_pipeline_stage"])
    repeats = config_int("num_pipeline_repeats", cfg["num_pipeline_repeats"], allow_fill=True)
    pipelined = config_int("pipeline_parallel_layers", cfg["pipeline_parallel_layers"], allow_fill=True)
    delay = bool(cfg["pipeline_delay_activation_forwarding"])
    if pipelined != -1:
        notes.append(f"MaxText pipeline_parallel_layers={pipelined}: it pipelines those layers and runs the rest with "
                     f"the stage axis as data parallelism; the workbench pipelines every layer")
        num_layers = pipelined
    if "base_num_decoder_layers" in cfg and num_layers is None:
        num_layers = config_int("base_num_decoder_layers", cfg["base_num_decoder_layers"])
    if repeats == -1:
        if num_layers is None:
            raise ValueError(f"a {pp}-stage MaxText pipeline repeats num_decoder_layers / ({pp} x "
                             f"num_layers_per_pipeline_stage) times, and the config does not say the layers (nor "
                             f"names a model the workbench has a preset for): pass num_layers=, or set "
                             f"base_num_decoder_layers or num_pipeline_repeats")
        if num_layers % (pp * per_stage):
            raise ValueError(f"{num_layers} layers do not split into {pp} stages of num_layers_per_pipeline_stage="
                             f"{per_stage}; change num_layers_per_pipeline_stage or ici/dcn_pipeline_parallelism")
        repeats = num_layers // (pp * per_stage)
    elif num_layers is not None and num_layers != pp * repeats * per_stage:
        raise ValueError(f"num_pipeline_repeats={repeats} x {pp} stages x num_layers_per_pipeline_stage={per_stage} "
                         f"is not the {num_layers} pipelined layers; change one of them")
    micro = config_int("num_pipeline_microbatches", cfg["num_pipeline_microbatches"], allow_fill=True)
    if micro == -1:
        micro = 2 * pp if delay else pp
    if micro % pp:
        raise ValueError(f"num_pipeline_microbatches={micro} must be a multiple of the {pp} pipeline stages (MaxText "
                         f"asserts it); use {pp * max(1, micro // pp)}")
    if delay:
        notes.append("MaxText pipeline_delay_activation_forwarding doubles the bubble; not priced")
    if repeats > 1:
        notes.append(f"MaxText's circular pipeline ({repeats} repeats) runs every forward, then every backward "
                     f"(autodiff of its scan); priced as the interleaved schedule with virtual_stages={repeats}, "
                     f"whose bubble is base.yml's (p - 1) / (repeats m + p - 1) but which keeps fewer microbatches' "
                     f"activations")
        pipeline = PipelineConfig(pp, micro, "interleaved", repeats)
    else:
        pipeline = PipelineConfig(pp, micro, "gpipe")
    if num_layers is None and "num_layers_per_pipeline_stage" in given:
        num_layers = pp * repeats * per_stage  # the config says every factor
    return pipeline, num_layers


def from_maxtext(text_or_path: tp.Any, *, num_devices: int | None = None, num_slices: int | None = None,
                 num_layers: int | None = None) -> TrainingRecipe:
    """The :class:`TrainingRecipe` of a MaxText YAML config (its text or path), over base.yml's defaults.

    ``num_devices``: the devices it runs on, needed when an ``ici_*`` degree is -1 (base.yml's
    ``ici_fsdp_parallelism``) and checked against the degrees otherwise. ``num_slices``: TPU slices, for a -1
    ``dcn_*`` degree (base.yml's ``dcn_data_parallelism``); default: the config's ``num_slices``, else what the
    ``ici_*`` degrees leave of ``num_devices``, else the explicit ``dcn_*`` degrees' product. ``num_layers``: the
    model's decoder layers, for a pipeline whose repeats the config leaves to them (default: the config's
    ``base_num_decoder_layers``, else those of the preset its ``model_name`` names).
    """
    given = _load_yaml(read_text(text_or_path))
    cfg = {**MAXTEXT_BASE, **given}
    model = cfg["model_name"]
    if not isinstance(model, str):
        raise ValueError(f"model_name is a string such as 'llama3-8b'; got {model!r}")
    if num_layers is None and "base_num_decoder_layers" not in cfg:
        num_layers = preset_layers(model)
    notes: list[str] = []
    ici, dcn = _degrees(cfg, "ici"), _degrees(cfg, "dcn")
    slices = config_int("num_slices", cfg["num_slices"], allow_fill=True)
    if slices == -1:
        slices = num_slices
    ici_known = -1 not in ici.values()
    if slices is None and num_devices is not None and ici_known:
        slices, rest = divmod(num_devices, math.prod(ici.values()))
        if rest or not slices:
            raise ValueError(f"the ici_* degrees multiply to {math.prod(ici.values())}, which does not divide "
                             f"num_devices={num_devices}; change them or num_devices")
    if slices is None:
        slices = math.prod(v for v in dcn.values() if v != -1)
    dcn = fill_degrees({f"dcn_{a}_parallelism": v for a, v in dcn.items()}, slices, what="the dcn_* degrees",
                       how=f"{slices} slice(s)")
    per_slice = None if num_devices is None else num_devices // slices
    if num_devices is not None and num_devices % slices:
        raise ValueError(f"num_devices={num_devices} is not a whole number of {slices} slices; change num_devices "
                         f"or num_slices")
    ici = fill_degrees({f"ici_{a}_parallelism": v for a, v in ici.items()}, per_slice, what="the ici_* degrees",
                       how="num_devices=" if per_slice is None else f"{per_slice} devices per slice")
    ici = {a: ici[f"ici_{a}_parallelism"] for a in MAXTEXT_AXES}
    dcn = {a: dcn[f"dcn_{a}_parallelism"] for a in MAXTEXT_AXES}
    both = {a: ici[a] * dcn[a] for a in MAXTEXT_AXES}
    for name, why in _AXIS_NOTES.items():
        if both[name] > 1:
            notes.append(f"MaxText {name} parallelism {both[name]}: {why}")
    mesh, dcn_shape = _fold(both), _fold(dcn)
    devices = math.prod(mesh.values())
    pdbs = cfg["per_device_batch_size"]
    if isinstance(pdbs, bool) or not isinstance(pdbs, int | float) or pdbs <= 0:
        raise ValueError(f"per_device_batch_size must be a positive number (fractions allowed); got {pdbs!r}")
    ga = config_int("gradient_accumulation_steps", cfg["gradient_accumulation_steps"])
    seqs = global_batch_int(pdbs * devices * ga, "per_device_batch_size",
                            f"{pdbs:g} x {devices} devices x {ga} accumulation steps")
    length = config_int("max_target_length", cfg["max_target_length"])
    remat = _remat(cfg["remat_policy"], notes, cfg)
    offload = cfg["remat_policy"] in OFFLOADED_REMATS or (cfg["remat_policy"] == "custom" and _custom(cfg)[1])
    if cfg["attention"] not in MAXTEXT_ATTENTION:
        raise ValueError(f"attention {cfg['attention']!r} is not one the workbench reads; one of "
                         f"{sorted(MAXTEXT_ATTENTION)}")
    tiles = config_int("num_vocab_tiling", cfg["num_vocab_tiling"])
    pipeline, layers = _pipeline(cfg, given, mesh["pp"], num_layers, notes)
    zero = 3 if mesh["fsdp"] > 1 else 0
    if cfg["shard_optimizer_over_data"]:
        if mesh["dp"] > 1:
            zero = 1
        else:
            notes.append("MaxText shard_optimizer_over_data has no data axis to shard over (data parallelism 1)")
    rules = _axis_rules(cfg, mesh, notes)
    # base.yml shards the embed activations (activation_embed) over tensor: the residual stream split over tp
    embed = dict(rules).get("hidden_state_axis", default_field_axes("hidden_state_axis", mesh))
    return TrainingRecipe(mesh, (seqs, length), remat, ga, zero, pipeline, dcn_shape,
                          model=None if model == "default" else model, source_remat=cfg["remat_policy"],
                          axis_rules=rules, num_layers=layers, attention=MAXTEXT_ATTENTION[cfg["attention"]],
                          vocab_tiles=tiles, offload=offload, sequence_parallel=mesh["tp"] > 1 and "tp" in embed,
                          notes=tuple(notes))


# -- export ---------------------------------------------------------------------------------------------------------
def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _maxtext_remat(recipe: TrainingRecipe) -> list[str]:
    """The remat_policy lines of ``recipe``: its policy, offloaded where it offloads."""
    if recipe.offload and recipe.remat == "full":  # the layer's input offloaded, every other tensor recomputed
        return ["remat_policy: 'custom'", "decoder_layer_input: 'offload'"]
    if recipe.offload and recipe.source_remat == "custom":  # the tpu-recipes' custom policy: the layer's input and
        # the attention's projections offloaded (its per-tensor choices are not kept: they are priced as this)
        offloaded = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")
        return ["remat_policy: 'custom'", *(f"{name}: 'offload'" for name in offloaded)]
    if recipe.offload:
        return ["remat_policy: 'minimal_offloaded'"]
    if recipe.remat != "dots_saveable":
        return [f"remat_policy: '{recipe.remat}'"]
    src = recipe.source_remat
    name = src if src in MAXTEXT_REMATS and MAXTEXT_REMATS[src][0] == "dots_saveable" and src not in \
        (*OFFLOADED_REMATS, "custom") else "minimal_with_context"
    return [f"remat_policy: '{name}'"]


def _rules_to_write(recipe: TrainingRecipe) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """The logical_axis_rules that make MaxText shard as the recipe says, and the recipe's rules it cannot say."""
    sizes, have = recipe.mesh_shape, dict(recipe.axis_rules)
    out, lost = [], [f for f in have if f not in _FIELD_RULE]
    for name, fields in _RULE_FIELDS.items():
        want = have.get(fields[0], default_field_axes(fields[0], sizes))
        if set(want) != set(_workbench_axes(_BASE_ACTIVATION_RULES[name], sizes)):
            out.append((name, tuple(_EXPORT_AXES[a] if a != "pp" else "stage" for a in want)))
    return out, lost


def to_maxtext(recipe: TrainingRecipe) -> str:
    """A MaxText YAML config (over base.yml) of ``recipe``: its ``ici_*`` / ``dcn_*`` degrees, batch, remat,
    pipeline and the logical axis rules that differ from base.yml's; a header says what MaxText cannot express."""
    lost: list[str] = []
    p = recipe.pipeline
    if p is not None and p.schedule == "1f1b":
        lost.append("the 1F1B pipeline schedule (MaxText's pipeline runs GPipe order: written as its plain pipeline)")
    if p is not None and p.uneven:
        lost.append("uneven pipeline stages (MaxText splits the layers evenly)")
    if recipe.attention not in ("xla", "flash"):
        lost.append(f"the {recipe.attention} attention kernel (written as MaxText's flash)")
    if p is not None and p.num_microbatches % p.num_stages:
        raise ValueError(f"MaxText needs num_pipeline_microbatches a multiple of the {p.num_stages} stages; the recipe "
                         f"has {p.num_microbatches}: change the pipeline's num_microbatches")
    if recipe.offload and recipe.remat == "none":
        raise ValueError("MaxText offloads what a remat policy saves; remat 'none' saves everything in HBM: pick "
                         "remat 'full' or 'dots_saveable' to offload, or offload=False")
    if recipe.mesh_shape["tp"] > 1 and not recipe.sequence_parallel:
        lost.append("the residual stream whole over tp (MaxText shards the embed activations over tensor: its run "
                    "keeps them split, sequence_parallel)")
    rules, unsaid = _rules_to_write(recipe)
    lost += [f"PartitionAxis.{f} (no MaxText logical axis)" for f in unsaid]
    ici, dcn = recipe.ici_shape, recipe.dcn_shape
    pdbs = recipe.batch[0] / (recipe.devices * recipe.grad_accumulation)
    lines = ["# Written by workbench (workbench.core.interop.maxtext.to_maxtext): a MaxText config over "
             "base.yml.",
             "# No MaxText equivalent: " + ("; ".join(lost) if lost else "none (everything below is MaxText's own)")]
    if recipe.model and "/" in recipe.model:
        lines.append(f"# model (torchtitan name/flavor): {recipe.model}")
    lines += [f"# source note: {n}" for n in recipe.notes]
    lines.append('base_config: "base.yml"')
    if recipe.model and "/" not in recipe.model:
        lines.append(f'model_name: "{recipe.model}"')
    for kind, shape in (("ici", ici), ("dcn", dcn)):
        lines += [f"{kind}_{_EXPORT_AXES[a]}_parallelism: {shape[a]}" for a in MESH_AXES]
    lines += [f"per_device_batch_size: {_number(pdbs)}", f"max_target_length: {recipe.batch[1]}",
              f"gradient_accumulation_steps: {recipe.grad_accumulation}", *_maxtext_remat(recipe),
              f"attention: '{'dot_product' if recipe.attention == 'xla' else 'flash'}'"]
    if recipe.vocab_tiles > 1:
        lines.append(f"num_vocab_tiling: {recipe.vocab_tiles}")
    if recipe.zero_stage in (1, 2):
        lines.append("shard_optimizer_over_data: true")
    if p is not None:
        lines += [f"num_pipeline_microbatches: {p.num_microbatches}", f"num_pipeline_repeats: {p.virtual_stages}"]
        if recipe.num_layers is not None:
            per_stage, rest = divmod(recipe.num_layers, p.total_stages)
            if rest:
                raise ValueError(f"{recipe.num_layers} layers do not split into {p.total_stages} equal MaxText "
                                 f"stages; change the pipeline or num_layers")
            lines.append(f"num_layers_per_pipeline_stage: {per_stage}")
    if rules:
        lines.append("logical_axis_rules: [")
        lines += [f"  ['{name}', [{', '.join(repr(a) for a in axes)}]]," for name, axes in rules]
        lines.append("]")
    return "\n".join(lines) + "\n"
