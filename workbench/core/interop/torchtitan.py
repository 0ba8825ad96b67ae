"""torchtitan's TOML job configuration, read into a :class:`~workbench.core.interop.recipe.TrainingRecipe`
and written back: :func:`from_torchtitan`, :func:`to_torchtitan`.

Keys and defaults are torchtitan's ``torchtitan/config/job_config.py`` at commit
238fa9953e4aec2a62582121564273d7cbb1e9f1 (February 2026, the last tree with TOML train configs before #2386 moved
them to Python registries): :data:`TORCHTITAN_DEFAULTS`. Older trees (before #1238, June 2025) name the per-rank batch
``[training] batch_size`` (``torchtitan/config_manager.py`` at e0d2de6820017082cfec45c7e1d7cb44880102da) and some
give ``pipeline_parallel_microbatches`` (a count) instead of a microbatch size; both are read.

torchtitan's degrees multiply to the world size without expert parallelism: ``ParallelDims`` carves EP out of the
``dp_shard`` (x ``cp``, x ``tp`` when ``expert_tensor_parallel_degree`` is 1) ranks. The workbench's ``ep`` is a mesh
axis of its own, so EP is taken out of ``dp_shard`` here (``fsdp = dp_shard / ep``) and the batch splits over
``ep`` too, as it does over torchtitan's EP ranks.
"""

from __future__ import annotations

import math
import typing as tp

from workbench.core.interop.model_names import preset_layers
from workbench.core.interop.recipe import TrainingRecipe, config_int, fill_degrees, read_text
from workbench.core.pipeline_schedule import PipelineConfig

TORCHTITAN_COMMIT = "238fa9953e4aec2a62582121564273d7cbb1e9f1"
TORCHTITAN_DEFAULTS: dict[str, dict[str, tp.Any]] = {
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "tensor_parallel_degree": 1, "context_parallel_degree": 1, "pipeline_parallel_degree": 1,
                    "expert_parallel_degree": 1, "expert_tensor_parallel_degree": 1,
                    "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": 1,
                    "pipeline_parallel_layers_per_stage": None},
    "training": {"local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "2"},
}
# torch.distributed.pipelining's schedule names (get_schedule_class matches them case-insensitively) -> the workbench
# schedule priced, whether the schedule holds several stages per rank, and what pricing it so leaves out.
_ZERO_BUBBLE = "splits each backward into input and weight gradients to fill the bubble; priced with the " \
               "interleaved 1F1B bubble, an upper bound"
TORCHTITAN_SCHEDULES: dict[str, tuple[str, str | None]] = {
    "1f1b": ("1f1b", None),
    "gpipe": ("gpipe", None),
    "interleaved1f1b": ("interleaved", None),
    "loopedbfs": ("interleaved", "runs each local stage over every microbatch before the next (breadth first); "
                                 "priced as interleaved 1F1B, same bubble, fewer activations held"),
    "interleavedzerobubble": ("interleaved", _ZERO_BUBBLE),
    "zbvzerobubble": ("interleaved", _ZERO_BUBBLE + " (V-shaped stage placement not modelled)"),
    "dualpipev": ("interleaved", _ZERO_BUBBLE + " (DualPipeV's two-way feeding not modelled)"),
}
_EXPORT_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
_SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved1f1b": "Interleaved1F1B", "loopedbfs": "LoopedBFS",
                   "interleavedzerobubble": "InterleavedZeroBubble", "zbvzerobubble": "ZBVZeroBubble",
                   "dualpipev": "DualPipeV"}


def _load_toml(text: str) -> dict[str, tp.Any]:
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"not a torchtitan TOML config: {err}") from None


def _section(doc: tp.Mapping[str, tp.Any], name: str) -> dict[str, tp.Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"[{name}] must be a TOML table; fix it")
    return value


def _remat(ac: tp.Mapping[str, tp.Any], notes: list[str]) -> tuple[str, str]:
    mode = ac.get("mode", TORCHTITAN_DEFAULTS["activation_checkpoint"]["mode"])
    if mode in ("full", "none"):
        return mode, mode
    if mode == "selective":
        option = str(ac.get("selective_ac_option", TORCHTITAN_DEFAULTS["activation_checkpoint"]["selective_ac_option"]))
        if option == "op":
            notes.append("torchtitan selective activation checkpointing 'op' saves chosen ops' outputs (matmuls, "
                         "attention) and recomputes the rest; priced as dots_saveable")
            return "dots_saveable", "selective:op"
        if not option.isdigit() or int(option) < 1:
            raise ValueError(f"[activation_checkpoint] selective_ac_option is 'op' or a positive int (checkpoint "
                             f"every n-th layer); got {option!r}")
        if int(option) == 1:
            return "full", "selective:1"
        notes.append(f"torchtitan selective activation checkpointing every {option}th layer (1 in {option} layers "
                     f"fully recomputed, the rest keep everything) has no workbench equivalent; priced as "
                     f"dots_saveable")
        return "dots_saveable", f"selective:{option}"
    if mode == "memory_budget":
        budget = ac.get("memory_budget", 0.5)
        notes.append(f"torchtitan memory_budget={budget} activation checkpointing (the compiler picks what to "
                     f"recompute) has no workbench equivalent; priced as dots_saveable")
        return "dots_saveable", f"memory_budget:{budget}"
    raise ValueError(f"[activation_checkpoint] mode must be one of 'full', 'selective', 'memory_budget', 'none'; "
                     f"got {mode!r}")


def _schedule(name: tp.Any) -> tuple[str, bool, str | None]:
    key = str(name).lower()
    if key not in TORCHTITAN_SCHEDULES:
        raise ValueError(f"pipeline_parallel_schedule {name!r} is not one the workbench prices; use one of "
                         f"{sorted(_SCHEDULE_NAMES.values())}")
    schedule, why = TORCHTITAN_SCHEDULES[key]
    return schedule, schedule == "interleaved", why


def from_torchtitan(text_or_path: tp.Any, *, num_devices: int | None = None,
                    num_layers: int | None = None) -> TrainingRecipe:
    """The :class:`TrainingRecipe` of a torchtitan TOML job config (its text or path).

    ``num_devices``: the world size, needed when ``data_parallel_shard_degree`` is -1 (the default) and checked
    against the degrees otherwise. ``num_layers``: the model's layers, needed to read
    ``pipeline_parallel_layers_per_stage`` (default: those of the preset ``[model]`` names).
    """
    doc = _load_toml(read_text(text_or_path))
    model_section = _section(doc, "model")
    name, flavor = model_section.get("name"), model_section.get("flavor")
    model = None if name is None else f"{name}/{flavor}" if flavor is not None else str(name)
    if num_layers is None:
        num_layers = preset_layers(model)
    par = {**TORCHTITAN_DEFAULTS["parallelism"], **_section(doc, "parallelism")}
    train = _section(doc, "training")
    notes: list[str] = []
    keys = {"dp_replicate": "data_parallel_replicate_degree", "dp_shard": "data_parallel_shard_degree",
            "cp": "context_parallel_degree", "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree"}
    by_key = {key: config_int(key, par[key], allow_fill=k == "dp_shard") for k, key in keys.items()}
    by_key = fill_degrees(by_key, num_devices, what="the [parallelism] degrees",
                          how="num_devices=" if num_devices is None else f"num_devices={num_devices}")
    deg = {k: by_key[key] for k, key in keys.items()}
    ep = config_int("expert_parallel_degree", par["expert_parallel_degree"])
    etp = config_int("expert_tensor_parallel_degree", par["expert_tensor_parallel_degree"])
    if ep > 1:
        if deg["dp_shard"] % ep:
            raise ValueError(f"expert_parallel_degree={ep} must divide data_parallel_shard_degree={deg['dp_shard']} "
                             f"here: the workbench takes its ep axis out of the dp_shard ranks (torchtitan may "
                             f"borrow cp and tp ranks too); change one of them")
        notes.append(f"torchtitan EP {ep} reuses dp_shard ranks: priced as an ep axis of {ep} and fsdp "
                     f"{deg['dp_shard'] // ep}, dense weights sharded over fsdp only (torchtitan shards them over all "
                     f"{deg['dp_shard']} dp_shard ranks)")
        if etp == 1 and deg["tp"] > 1:
            notes.append("torchtitan expert_tensor_parallel_degree=1 spreads the experts over the tp ranks too; "
                         "priced with the experts tensor-parallel over tp")
    mesh = {"pp": deg["pp"], "dp": deg["dp_replicate"], "fsdp": deg["dp_shard"] // ep, "ep": ep, "tp": deg["tp"],
            "sp": deg["cp"]}
    batch_ways = deg["dp_replicate"] * deg["dp_shard"]
    if "local_batch_size" in train:
        local_key = "local_batch_size"
    elif "batch_size" in train:
        local_key = "batch_size"  # torchtitan before #1238 (June 2025): the per-rank batch
    else:
        local_key = "local_batch_size"
    local = config_int(local_key, train.get(local_key, TORCHTITAN_DEFAULTS["training"]["local_batch_size"]))
    global_batch = config_int("global_batch_size", train.get("global_batch_size", -1), allow_fill=True)
    if global_batch == -1:
        global_batch = local * batch_ways
    if global_batch % (local * batch_ways):
        raise ValueError(f"global_batch_size={global_batch} is not a multiple of {local_key}={local} x "
                         f"{batch_ways} data-parallel ranks; change one of them")
    accumulation = global_batch // (local * batch_ways)
    seq_len = config_int("seq_len", train.get("seq_len", TORCHTITAN_DEFAULTS["training"]["seq_len"]))
    pipeline = None
    layers = None
    if mesh["pp"] > 1:
        schedule, multi, why = _schedule(par["pipeline_parallel_schedule"])
        if why:
            notes.append(f"torchtitan pipeline schedule {par['pipeline_parallel_schedule']!r} {why}")
        if "pipeline_parallel_microbatches" in par:  # older trees: a count
            micro = config_int("pipeline_parallel_microbatches", par["pipeline_parallel_microbatches"])
        else:
            size = config_int("pipeline_parallel_microbatch_size", par["pipeline_parallel_microbatch_size"])
            if local % size:
                raise ValueError(f"{local_key}={local} does not split into microbatches of "
                                 f"pipeline_parallel_microbatch_size={size}; change one of them")
            micro = local // size
        per_rank = 2 if multi else 1
        per_stage = par["pipeline_parallel_layers_per_stage"]
        if per_stage is not None:
            per_stage = config_int("pipeline_parallel_layers_per_stage", per_stage)
            if num_layers is None:
                named = "[model] names none" if model is None else f"[model] {model!r} names no preset"
                raise ValueError(f"pipeline_parallel_layers_per_stage sets the stages per rank from the model's "
                                 f"layers, and {named} the workbench has: pass num_layers= (the model's layers)")
            # torchtitan counts the embedding and the output as a layer each (pipeline_parallel.py)
            stages = math.ceil((num_layers + 2) / per_stage)
            if stages % mesh["pp"]:
                raise ValueError(f"{num_layers} layers (+ embedding and output) in stages of "
                                 f"pipeline_parallel_layers_per_stage={per_stage} make {stages} stages, not a multiple "
                                 f"of pipeline_parallel_degree={mesh['pp']}; change pipeline_parallel_layers_per_stage")
            per_rank = stages // mesh["pp"]
            if multi == (per_rank == 1):
                raise ValueError(f"{par['pipeline_parallel_schedule']!r} needs "
                                 f"{'several stages' if multi else 'one stage'} per rank; "
                                 f"pipeline_parallel_layers_per_stage={per_stage} gives {per_rank}: change it")
            layers = num_layers
        pipeline = PipelineConfig(mesh["pp"], micro, schedule, per_rank if multi else None, uneven=True)
        if accumulation > 1:
            notes.append(f"torchtitan runs {accumulation} accumulation steps of {micro} pipelined microbatches each")
    remat, source_remat = _remat(_section(doc, "activation_checkpoint"), notes)
    rules = (("batch_axis", tuple(a for a in ("fsdp", "dp", "ep") if mesh[a] > 1)),) if ep > 1 else ()
    # torchtitan's attention is SDPA (flash / cuDNN kernels on H100), its TP plan shards norms and residuals along
    # the sequence (SequenceParallel), its loss is computed whole, nothing offloaded; PyTorch's autograd saves what
    # a layer keeps without activation checkpointing
    return TrainingRecipe(mesh, (global_batch, seq_len), remat, accumulation, 3 if mesh["fsdp"] > 1 else 0, pipeline,
                          model=model, source_remat=source_remat, axis_rules=rules, num_layers=layers,
                          attention="flash", sequence_parallel=mesh["tp"] > 1, autograd="pytorch",
                          notes=tuple(notes))


# -- export ---------------------------------------------------------------------------------------------------------
def torchtitan_stage_layers(num_layers: int, num_stages: int, input_weight: int = 1,
                            output_weight: int = 1) -> list[int]:
    """The transformer layers of each of ``num_stages`` pipeline stages as torchtitan splits ``num_layers``:
    ``generate_llm_fqn_per_model_part`` (torchtitan/distributed/pipeline_parallel.py) counts the embedding as
    ``input_weight`` layers and the norm and output as ``output_weight``, gives each stage the same share of that
    total and the first ``total % num_stages`` stages one more, then takes the weights off the first and last stage.

    >>> torchtitan_stage_layers(80, 8)  # Llama-3-70B, 2 ranks x 4 stages: a stage of 11 where an even split has 10
    [10, 11, 10, 10, 10, 10, 10, 9]
    >>> torchtitan_stage_layers(32, 4)
    [8, 9, 8, 7]
    """
    if num_stages == 1:
        return [num_layers]
    per, extra = divmod(num_layers + input_weight + output_weight, num_stages)
    sizes = [per + (i < extra) for i in range(num_stages)]
    sizes[0] -= input_weight
    sizes[-1] -= output_weight
    return sizes


def _torchtitan_remat(recipe: TrainingRecipe) -> list[str]:
    if recipe.remat in ("full", "none"):
        return [f'mode = "{recipe.remat}"']
    src = recipe.source_remat or ""
    if src.startswith("memory_budget:"):
        return ['mode = "memory_budget"', f"memory_budget = {src.split(':', 1)[1]}"]
    option = src.split(":", 1)[1] if src.startswith("selective:") else "op"
    return ['mode = "selective"', f'selective_ac_option = "{option}"']


def to_torchtitan(recipe: TrainingRecipe) -> str:
    """A torchtitan TOML fragment of ``recipe`` (``[model]``, ``[training]``, ``[parallelism]``,
    ``[activation_checkpoint]``); a header says what torchtitan cannot express."""
    m, p = recipe.mesh_shape, recipe.pipeline
    lost = []
    if recipe.slices > 1:
        lost.append(f"the DCN split over TPU slices ({recipe._shape_text(recipe.dcn_shape)})")
    if recipe.zero_stage in (1, 2):
        lost.append(f"ZeRO-{recipe.zero_stage} over dp (torchtitan shards with FSDP: use data_parallel_shard_degree)")
    batch_rule = dict(recipe.axis_rules).get("batch_axis")
    other_rules = [f for f, _ in recipe.axis_rules if f != "batch_axis"]
    if other_rules:
        lost.append(f"PartitionAxis overrides {other_rules}")
    if m["ep"] > 1 and (batch_rule is None or "ep" not in batch_rule):
        lost.append("a batch not split over ep (torchtitan's EP ranks are data-parallel ranks)")
    if p is not None and not p.uneven:
        split = "" if recipe.num_layers is None else \
            f": it splits the {recipe.num_layers} layers over {p.total_stages} stages as " \
            + ", ".join(map(str, torchtitan_stage_layers(recipe.num_layers, p.total_stages)))
        lost.append(f"even pipeline stages (torchtitan counts the embedding and the output as a layer each{split})")
    if recipe.attention == "xla":
        lost.append("XLA attention with its scores in HBM (torchtitan runs SDPA's flash kernels)")
    elif recipe.attention != "flash":
        lost.append(f"the {recipe.attention} attention kernel (torchtitan runs SDPA's flash kernels)")
    if recipe.vocab_tiles > 1:
        lost.append(f"the loss in {recipe.vocab_tiles} vocabulary tiles (torchtitan computes it whole)")
    if recipe.offload:
        lost.append("saved activations offloaded to host memory")
    if m["tp"] > 1 and not recipe.sequence_parallel:
        lost.append("the residual stream whole over tp (torchtitan's TP plan splits it along the sequence)")
    if recipe.autograd != "pytorch" and recipe.remat == "none":
        lost.append("JAX's saved activations (torchtitan's layers keep what PyTorch's autograd saves)")
    dp_ways = m["dp"] * m["fsdp"] * m["ep"]
    local, rest = divmod(recipe.batch[0], dp_ways * recipe.grad_accumulation)
    if rest or not local:
        raise ValueError(f"{recipe.batch[0]} sequences do not split into {recipe.grad_accumulation} accumulation steps "
                         f"over {dp_ways} data-parallel ranks (dp x fsdp x ep); change the batch")
    lines = ["# Written by workbench (workbench.core.interop.torchtitan.to_torchtitan): a torchtitan job "
             "config fragment.",
             "# No torchtitan equivalent: " + ("; ".join(lost) if lost else "none (everything below is torchtitan's)")]
    lines += [f"# source note: {n}" for n in recipe.notes]
    if recipe.model:
        if "/" in recipe.model:
            name, flavor = recipe.model.split("/", 1)
            lines += ["", "[model]", f'name = "{name}"', f'flavor = "{flavor}"']
        else:
            lines.insert(2, f"# model (MaxText name): {recipe.model}")
    lines += ["", "[training]", f"local_batch_size = {local}", f"global_batch_size = {recipe.batch[0]}",
              f"seq_len = {recipe.batch[1]}",
              "", "[parallelism]", f"data_parallel_replicate_degree = {m['dp']}",
              f"data_parallel_shard_degree = {m['fsdp'] * m['ep']}", f"tensor_parallel_degree = {m['tp']}",
              f"context_parallel_degree = {m['sp']}", f"pipeline_parallel_degree = {m['pp']}",
              f"expert_parallel_degree = {m['ep']}"]
    if m["ep"] > 1:
        lines.append(f"expert_tensor_parallel_degree = {m['tp']}")
    if p is not None:
        size, rest = divmod(local, p.num_microbatches)
        if rest or not size:
            raise ValueError(f"the local batch of {local} does not split into {p.num_microbatches} pipeline "
                             f"microbatches; change the batch or the pipeline's num_microbatches")
        lines += [f'pipeline_parallel_schedule = "{_EXPORT_SCHEDULES[p.schedule]}"',
                  f"pipeline_parallel_microbatch_size = {size}"]
        if p.schedule == "interleaved" and p.virtual_stages != 2:
            if recipe.num_layers is None:
                raise ValueError(f"torchtitan holds 2 stages per rank unless pipeline_parallel_layers_per_stage says "
                                 f"otherwise, which needs the model's layers: set the recipe's num_layers for "
                                 f"virtual_stages={p.virtual_stages}")
            per_stage = math.ceil((recipe.num_layers + 2) / p.total_stages)
            if math.ceil((recipe.num_layers + 2) / per_stage) != p.total_stages:
                raise ValueError(f"no pipeline_parallel_layers_per_stage splits {recipe.num_layers} layers "
                                 f"(+ embedding and output) into {p.total_stages} stages; change virtual_stages")
            lines.append(f"pipeline_parallel_layers_per_stage = {per_stage}")
    lines += ["", "[activation_checkpoint]", *_torchtitan_remat(recipe)]
    return "\n".join(lines) + "\n"

