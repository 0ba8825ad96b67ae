"""Builds workbench/core/interop/published_runs.json from the raw records beside this file (published_runs_tpu.json,
published_runs_gpu.json: every quote and derivation): which runs have a complete configuration, and the choices
made in pricing each (the recompute fraction a remat policy comes to, the batch axes, the chip). Run it after
editing a raw record: python benchmarks/data/build_published_runs.py (or ... OUT.json to write elsewhere)"""

import json
import pathlib
import sys

root = str(pathlib.Path(__file__).resolve().parents[2]) + "/"
T = {r["name"]: r for r in json.load(open(root + "benchmarks/data/published_runs_tpu.json"))}
G = {r["name"]: r for r in json.load(open(root + "benchmarks/data/published_runs_gpu.json"))}
IRONWOOD = {r["name"]: r for r in json.load(open(root + "benchmarks/data/published_runs_ironwood.json"))["runs"]}
BLACKWELL = {r["name"]: r for r in json.load(open(root + "benchmarks/data/published_runs_blackwell.json"))["runs"]}


def hf(m):
    keys = [
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "num_local_experts",
        "num_experts_per_tok",
    ]
    d = {k: m[k] for k in keys if k in m}
    return {"hf": d}


def _gelu(model_type, m, *, kv_heads, head_dim, vocab, norm, position):
    """A non-gated (two-matrix) MLP decoder as ModelConfig fields, tied embeddings."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return {"config": {"model_type": model_type, **{k: m[k] for k in keys}, "num_key_value_heads": kv_heads,
                       "head_dim": head_dim, "vocab_size": vocab, "tie_word_embeddings": True, "mlp_type": "gelu",
                       "hidden_act": "gelu", "norm_type": norm, "position_embedding": position}}


def maxtext2023(m):
    return _gelu("maxtext-2023", m, kv_heads=m["num_key_value_heads"], head_dim=m["head_dim"], vocab=m["vocab_size"],
                 norm="rms", position="rope")


def gpt(m, vocab, positions=None):
    """``positions``: the learned position table's rows, where the run sized it (else the config's default)."""
    out = _gelu("gpt3", m, kv_heads=m["num_attention_heads"], head_dim=m["hidden_size"] // m["num_attention_heads"],
                vocab=vocab, norm="layer", position="learned")
    if positions is not None:
        out["config"]["max_position_embeddings"] = positions
    return out


def src(r):
    s = r["source"]
    return {
        "url": s.get("url"),
        "revision": s.get("revision"),
        "quote": s.get("quote"),
        "config": (r.get("config_source") or {}).get("url")
        if isinstance(r.get("config_source"), dict)
        else r.get("config_source"),
        "derivation": r["measured"]["derivation"],
    }


runs = []
# Fine-grained MoE runs (more than 16 experts: DeepSeek-V3, Qwen3-MoE, GPT-OSS) are priced but not held (not_held):
# the step model misses them both ways, on GPUs and on TPUs, for causes it does not yet model; the views print that
# spread beside such a step. Mixtral's 8 large experts are held as the dense runs are.
NOT_HELD_WHY = (
    "fine-grained MoE, not yet held: the step model prices the experts' grouped GEMMs and token permutes at the "
    "dense GEMMs' rate by their shapes (GPT-OSS-120B, 128 experts of width 2,880, measures 2x slower than predicted "
    "on TPU7x and on B200 and GB200 alike), MLA's attention in its absorbed form (the workbench's program; MaxText and "
    "Megatron train it expanded, qk 192 / v 128: about 3.4x fewer score FLOPs), every routed copy of a token over "
    "the inter-node network (DeepEP sends one per node and dispatches in fp8), and expert all-to-alls on the "
    "critical path (Megatron overlaps them with other microbatches)"
)
not_held = []


def hold_not(why=NOT_HELD_WHY):
    """The run just added is priced and shown, not held (see NOT_HELD_WHY)."""
    runs[-1]["not_held"] = why
    not_held.append(runs.pop())


def add(raw, **kw):
    r = {"name": raw["name"], "source": src(raw), "measured_s": raw["measured"]["step_time_s"]}
    r.update(kw)
    runs.append(r)


def add_as_recorded(raw, framework, model, **kw):
    """A run whose cluster, mesh and batch are the raw record's."""
    add(raw, framework=framework, model=model, cluster=raw["cluster"], mesh=raw["mesh"], batch=raw["batch"], **kw)


# --- TPU (MaxText) ---------------------------------------------------------------------------------------
def add_maxtext(raw, recompute, why, dtype="bf16", **kw):
    """A tpu-recipes run of a Hugging Face architecture, as recorded, its remat policy priced as ``recompute``."""
    add_as_recorded(raw, "MaxText", hf(raw["model"]), recompute=recompute, remat_note=why, dtype=dtype, **kw)


SAVE_QKV_O = (
    "custom policy: q, k, v and out projections saved (offloaded), mlpwi recomputed, mlpwo's recompute "
    "dropped by XLA: recompute = mlpwi / (all projections but mlpwo)"
)
SAVE_QKV = (
    "q, k, v projections saved (offloaded), out_proj and mlpwi recomputed: recompute = (o + mlpwi) / "
    "(all projections but mlpwo)"
)
for name, rec, why in (
    ("tpurecipes-llama3.1-8b-v6e8", 0.73, SAVE_QKV_O),
    ("tpurecipes-llama3.1-8b-v6e256", 0.73, SAVE_QKV_O),
    ("tpurecipes-llama3.1-70b-v6e32", 0.86, SAVE_QKV),
    ("tpurecipes-llama3.1-70b-v6e256", 0.86, SAVE_QKV),
    ("tpurecipes-llama3.1-405b-2xv6e256", 1.0, "custom: only the layer input offloaded, the rest recomputed"),
    ("tpurecipes-llama2-70b-v6e256", 0.86, "qkv_proj_offloaded: " + SAVE_QKV),
    ("tpurecipes-llama3.1-405b-v5p1024", 1.0, "custom: context and mlpwo offloaded, every projection recomputed"),
):
    add_maxtext(T[name], rec, why)
for name, rec, why, axes in (
    ("tpurecipes-mixtral-8x7b-v6e256", 0.85, SAVE_QKV_O, None),
    ("tpurecipes-mixtral-8x22b-v6e256", 0.85, SAVE_QKV_O, ["fsdp", "dp", "ep"]),
):
    raw = T[name]
    m = dict(raw["model"])
    m.setdefault("num_local_experts", 8)
    m.setdefault("num_experts_per_tok", 2)
    kw = dict(
        framework="MaxText",
        model=hf(m),
        cluster=raw["cluster"],
        mesh=raw["mesh"],
        batch=raw["batch"],
        recompute=rec,
        remat_note=why + "; experts as dense einsums over a dispatch mask (capacity 1.25)",
        dtype="bf16",
        capacity_factor=1.25,
    )
    if axes:
        kw["batch_axes"] = axes
    add(raw, **kw)
raw = T["tpurecipes-gpt3-175b-v6e256-bf16"]
add(
    raw,
    framework="MaxText",
    model=gpt(
        raw["model"] | {"intermediate_size": raw["model"].get("intermediate_size", 4 * raw["model"]["hidden_size"])},
        raw["model"]["vocab_size"],
    ),
    cluster=raw["cluster"],
    mesh=raw["mesh"],
    batch=raw["batch"],
    recompute=1.0,
    remat_note="full",
    dtype="bf16",
)
for name in (
    "maxtext-v5e-16b-1xv5e256",
    "maxtext-v5e-32b-32xv5e256",
    "maxtext-v5e-128b-1xv5e256",
    "maxtext-v5p-32b-v5p128",
    "maxtext-v5p-128b-v5p256",
    "maxtext-v5p-1024b-v5p4096",
    "maxtext-v4-22b-v4-128",
    "maxtext-v4-52b-v4-384",
):
    raw = T[name]
    full = raw["remat_policy"] == "full"
    add_as_recorded(
        raw,
        "MaxText (2023 README table)",
        maxtext2023(raw["model"]),
        recompute=1.0 if full else 0.0,
        remat_note=raw["remat_policy"] + ("" if full else ": every projection's output saved, none recomputed"),
        dtype="bf16",
        note="MaxText's 2023 default decoder (parallel attention and MLP, a relu MLP of one up and one down "
        "projection, head_dim 256): priced as a GELU MLP of the same two matrices",
    )

# --- TPU7x (Ironwood): tpu-recipes' training/ironwood table, MaxText with Tokamax splash attention -----------------
IRONWOOD_SAVED = ("custom policy: the layer input, q, k, v and the attention context saved in HBM (device), out_proj "
                  "and mlpwi recomputed: recompute = (o + mlpwi) / (all projections but mlpwo), as for v6e")
for name, rec, why, program in (
    ("tpurecipes-llama3.1-70b-tpu7x-4x4x4-bf16", 0.86, IRONWOOD_SAVED, {}),
    ("tpurecipes-llama3.1-70b-tpu7x-4x8x8-bf16", 0.86, IRONWOOD_SAVED, {}),
    ("tpurecipes-llama3.1-70b-tpu7x-4x4x4-fp8", 0.86, IRONWOOD_SAVED, {}),
    ("tpurecipes-llama3.1-70b-tpu7x-4x8x8-fp8", 0.86, IRONWOOD_SAVED, {}),
    ("tpurecipes-llama3.1-70b-128k-tpu7x-4x8x8-bf16", 0.86, IRONWOOD_SAVED + "; mlpwo's output saved too",
     {"vocab_tiles": 4}),
    ("tpurecipes-llama3.1-70b-128k-tpu7x-4x8x8-fp8", 0.86, IRONWOOD_SAVED + "; mlpwo's output saved too",
     {"vocab_tiles": 4}),
    ("tpurecipes-llama3.1-405b-tpu7x-4x8x8-bf16", 0.99,
     "custom: the layer input and mlpwo offloaded to host, k and v saved, q, out_proj, mlpwi and the attention "
     "recomputed: recompute = (q + o + mlpwi) / (all projections but mlpwo) = 0.99",
     {"vocab_tiles": 4, "offload": True}),
    ("tpurecipes-llama3.1-405b-tpu7x-4x8x8-fp8", 1.0, "custom: only the layer input offloaded, the rest recomputed",
     {"offload": True}),
):
    raw = IRONWOOD[name]
    fp8 = raw["dtype"].startswith("fp8")
    add_maxtext(
        raw,
        rec,
        why,
        dtype="fp8" if fp8 else "bf16",
        note="MaxText quantization=fp8_full (Qwix): the projections' matmuls in fp8, the attention kernel and the "
        "LM head in bf16" if fp8 else "",
        **program,
    )

# MoE on Ironwood: the same table's DeepSeek-V3, Qwen3-235B and GPT-OSS-120B rows. Dropless (capacity -1), experts
# sharded over fsdp with grouped GEMMs (megablox / Tokamax), no expert parallelism; every projection recomputed, the
# layer input offloaded to host (GPT-OSS: mlpwo's output too, which the convention above leaves out of the count).
for raw in IRONWOOD.values():
    m = dict(raw["model"])
    if m["model_type"] not in ("deepseek_v3", "qwen3_moe", "gpt_oss"):
        continue
    if m["model_type"] == "gpt_oss":  # alternating sliding-window (128) and full attention, as its HF config
        m["layer_types"] = ["sliding_attention", "full_attention"] * (m["num_hidden_layers"] // 2)
    fp8 = raw["dtype"].startswith("fp8")
    add_as_recorded(raw, "MaxText", {"hf": m}, recompute=1.0, dtype="fp8" if fp8 else "bf16", offload=True,
                    remat_note="custom: the layer input offloaded to host, every projection recomputed",
                    note="dropless MoE, experts over fsdp (grouped GEMMs); "
                    + ("learned routing" if "use_random_routing=True" not in raw["recipe_source"]["quote"]
                       else "routing drawn at random (use_random_routing: load balanced in expectation)"))
    hold_not()

# --- GPU -------------------------------------------------------------------------------------------------
SAC = "torchtitan selective AC 'op': every other matmul's output saved, about half recomputed"
for name, dtype, _, mesh, rec, why, overlap in (
    ("torchtitan-llama3.1-8b-h100x8-fsdp-compile-bf16", "bf16", None, {"fsdp": 8}, 0.5, SAC, False),
    (
        "torchtitan-llama3.1-8b-h100x8-fsdp-eager-bf16",
        "bf16",
        None,
        {"fsdp": 8},
        0.5,
        SAC + "; no torch.compile",
        False,
    ),
    ("torchtitan-llama3.1-8b-h100x8-fsdp-compile-fp8", "fp8", None, {"fsdp": 8}, 0.5, SAC, False),
    ("torchtitan-llama3.1-8b-h100x128-fsdp-compile-bf16", "bf16", None, {"fsdp": 128}, 0.5, SAC, False),
    (
        "torchtitan-llama3.1-70b-h100x256-fsdp32-tp8-asynctp-fp8",
        "fp8",
        None,
        {"fsdp": 32, "tp": 8},
        1.0,
        "full AC",
        True,
    ),
    (
        "torchtitan-llama3-70b-h100x256-fsdp32-tp8-asynctp-bf16",
        "bf16",
        None,
        {"fsdp": 32, "tp": 8},
        1.0,
        "full AC",
        True,
    ),
    ("torchtitan-llama3-8b-h100x64-fsdp8-tp8-asynctp-bf16", "bf16", None, {"fsdp": 8, "tp": 8}, 0.5, SAC, True),
    ("torchtitan-llama3.1-8b-h200x32-fsdp-compile-fp8", "fp8", None, {"fsdp": 32}, 0.5, SAC, False),
):
    raw = G[name]
    cl = dict(raw["cluster"])
    if cl["gpu"] == "h100":
        cl["gpu"] = "h100-96gb-500w"
    add(
        raw,
        framework="torchtitan",
        model=hf(raw["model"]),
        cluster=cl,
        mesh=mesh,
        batch=raw["batch"],
        recompute=rec,
        remat_note=why,
        dtype=dtype,
        tp_overlap=overlap,
        note="torchtitan's H100s: Grand Teton's 96 GB HBM2e (2.4 TB/s) parts at 500 W (chips.H100_500W)"
        if "h100" in name
        else "",
    )
raw = G["torchtitan-llama3.1-405b-h100x512-fsdp8-tp8-pp8-1f1b-fp8"]
add(
    raw,
    framework="torchtitan",
    model=hf(raw["model"]),
    cluster={"gpu": "h100-96gb-500w", "nodes": 64},
    mesh={"pp": 8, "fsdp": 8, "tp": 8},
    batch=raw["batch"],
    pipeline={"stages": 8, "microbatches": 8, "schedule": "1f1b", "uneven": True},
    recompute=1.0,
    remat_note="full AC",
    dtype="fp8",
    tp_overlap=True,
    note="microbatches: torchtitan's default (one per stage), not stated in the benchmark; 126 layers on 8 stages "
    "(split points not published: the largest stage priced, 16 layers); Grand Teton 96 GB / 500 W H100s",
)
NEMO = ("Megatron recipes: no activation recompute assumed (not stated), TP communication overlapped (perf "
        "recipes' default)")
for name, mesh, pipe, ga, model in (
    ("megatron-bridge-25.11-llama3-8b-h100x8-fp8cs", {"fsdp": 8}, None, 16, None),
    (
        "megatron-bridge-25.11-llama3-70b-h100x64-fp8cs",
        {"pp": 8, "dp": 2, "tp": 4},
        {"stages": 8, "microbatches": 64, "virtual_stages": 5, "schedule": "interleaved"},
        1,
        None,
    ),
    (
        "megatron-bridge-25.11-llama3.1-405b-h100x1024-fp8cs",
        {"pp": 8, "dp": 8, "tp": 8, "sp": 2},
        {"stages": 8, "microbatches": 64, "virtual_stages": 8, "schedule": "interleaved", "uneven": True},
        1,
        None,
    ),
    ("nemo-24.07-llama3-8b-h100x8-cp2-fp8", {"dp": 4, "sp": 2}, None, 32, None),
    (
        "nemo-24.07-llama3-70b-h100x64-tp4pp4cp2vp5-fp8",
        {"pp": 4, "dp": 2, "tp": 4, "sp": 2},
        {"stages": 4, "microbatches": 64, "virtual_stages": 5, "schedule": "interleaved"},
        1,
        None,
    ),
    (
        "nemo-24.07-gpt3-175b-h100x512-tp4pp8vp6-fp8",
        {"pp": 8, "dp": 16, "tp": 4},
        {"stages": 8, "microbatches": 64, "virtual_stages": 6, "schedule": "interleaved"},
        1,
        "gpt",
    ),
):
    raw = G[name]
    m = gpt(raw["model"], raw["model"]["vocab_size"]) if model == "gpt" else hf(raw["model"])
    kw = dict(
        framework="Megatron-Bridge" if "bridge" in name else "NeMo",
        model=m,
        cluster=raw["cluster"],
        mesh=mesh,
        batch=raw["batch"],
        recompute=0.0,
        remat_note=NEMO,
        dtype="fp8",
        tp_overlap=True,
    )
    if pipe:
        kw["pipeline"] = pipe
    if ga > 1:
        kw["grad_accumulation"] = ga
    add(raw, **kw)

# --- GPU: Blackwell (DGX B200, GB200 NVL72), Megatron-Bridge's performance summary ----------------------------------
# Every MoE run: tokens dropless with routing forced to balance (the table's footnote), experts carved out of the
# data-parallel ranks (Megatron's EP inside DP): the batch splits over dp and ep. MXFP8 (block-scaled fp8) priced as
# fp8. Selective recompute of small modules (MLA's up projections, layer norms, the MoE activation) priced as none.
# The MoE runs (128 to 256 experts) are not held (NOT_HELD_WHY).
for name, raw in BLACKWELL.items():
    m = dict(raw["model"])
    if m["model_type"] == "gpt_oss":  # alternating sliding-window (128) and full attention, as its HF config
        m["layer_types"] = ["sliding_attention", "full_attention"] * (m["num_hidden_layers"] // 2)
    m.pop("num_nextn_predict_layers", None)  # DeepSeek-V3's MTP layer: not priced (noted)
    pipe = raw["mesh"]["pipeline"]
    mesh = {k: v for k, v in raw["mesh"].items() if k != "pipeline" and v > 1}
    kw = dict(
        framework="Megatron-Bridge",
        model={"hf": m},
        cluster=raw["cluster"],
        mesh=mesh,
        batch=raw["batch"],
        recompute=0.0,
        remat_note=raw["remat_policy"],
        dtype="fp8" if "fp8" in raw["dtype"] else "bf16",
        tp_overlap=True,
    )
    if raw["grad_accumulation"] not in (1, None):
        kw["grad_accumulation"] = raw["grad_accumulation"]
    if pipe["stages"] > 1:
        virtual = pipe["virtual_stages"] if pipe["schedule"] == "interleaved" else 1
        kw["pipeline"] = {k: pipe[k] for k in ("stages", "microbatches", "virtual_stages", "schedule")} | {
            "uneven": m["num_hidden_layers"] % (pipe["stages"] * virtual) != 0}
    if "ep" in mesh:
        kw["batch_axes"] = ["fsdp", "dp", "ep"]
    if "offloading of 40 of 80" in raw["remat_policy"]:
        kw["offload"] = True
    notes = [n for n in ("MXFP8 priced as fp8" if raw["dtype"] == "mxfp8" else "",
                         "DeepSeek-V3's multi-token-prediction layer not priced" if "deepseek" in name else "") if n]
    if notes:
        kw["note"] = "; ".join(notes)
    add(raw, **kw)
    if "ep" in mesh:
        hold_not()

# --- GPU: llm-foundry's MPT runs at 8k-64k tokens a sequence (FSDP on one 8-GPU node) ----------------------------
for name in [n for n in G if n.startswith("llmfoundry-")]:
    raw = G[name]
    add(
        raw,
        framework="llm-foundry",
        model=gpt(raw["model"], raw["model"]["vocab_size"], positions=raw["model"]["max_position_embeddings"]),
        cluster=raw["cluster"],
        mesh=raw["mesh"],
        batch=raw["batch"],
        recompute=1.0 if raw["activation_checkpointing"] else 0.0,
        remat_note="Composer FSDP activation checkpointing: every block recomputed (full)"
        if raw["activation_checkpointing"] else "no activation checkpointing",
        dtype="bf16",
        tp_overlap=False,
        grad_accumulation=raw["grad_accumulation"],
        attention="flash_triton",
        note="llm-foundry's attn_impl 'triton' (Tri Dao's 2022 Triton FlashAttention on triton-pre-mlir), priced at "
        "its own rate (calibration: attention_kernels['flash_triton'], from two of these runs)",
    )

# --- the program each ran (Plan's attention, offload, vocab_tiles; the policies nearest its remat) ----------------
# every run above used a flash kernel (MaxText's splash, torchtitan's SDPA, Megatron's Transformer Engine)
OFFLOADED = {n for n in T if n.startswith("tpurecipes-") and "gpt3" not in n}  # MaxText 'offload' remat entries
PROGRAM = {
    "tpurecipes-llama3.1-405b-v5p1024": {"vocab_tiles": 4},  # num_vocab_tiling: 4 in its recipe
    # MaxText's "minimal" saves every projection's output
    "maxtext-v5p-32b-v5p128": {"remat": "dots_saveable"},
    "maxtext-v5p-128b-v5p256": {"remat": "dots_saveable"},
}
BRIDGE_8B = "megatron-bridge-25.11-llama3-8b-h100x8-fp8cs"
for r in runs:
    r.setdefault("attention", "flash")
    if r["name"] in OFFLOADED:
        r["offload"] = True
    r.update(PROGRAM.get(r["name"], {}))
    if r["name"] == BRIDGE_8B:
        r.update(
            recompute=5 / 32,
            remat="none",
            remat_note="Megatron-Bridge's perf config (LLAMA3_8B_PRETRAIN_CONFIG_H100_FP8_CS_BASE_CONFIG, "
            "scripts/performance/configs/llama/llama3_workload_base_configs.py at 5776a6d90; utils/overrides.py sets "
            "recompute_granularity full, recompute_method block) recomputes 5 of the 32 layers whole: priced as 5/32 "
            "of the forward recomputed; the ledger does not model block recompute and holds all 32 layers' saved "
            "activations. TP communication overlapped (perf recipes' default)",
        )

json.dump(
    {
        "about": "Training steps others measured and published with a complete configuration, as "
        "workbench.core.interop.published prices them. Built from the raw records in "
        "benchmarks/data/published_runs_tpu.json and published_runs_gpu.json (every quote and derivation there); "
        "the choices made in mapping each run (recompute fraction, batch axes, assumptions) are in its fields. "
        "attention is the kernel each ran (flash: MaxText's splash, torchtitan's SDPA flash/cuDNN, Megatron's "
        "Transformer Engine fused attention; flash_triton: llm-foundry's Triton FlashAttention); offload says the "
        "recipe's remat policy keeps its saved tensors in host memory (MaxText's 'offload' entries); vocab_tiles "
        "is MaxText's num_vocab_tiling. remat, where given, is the workbench policy nearest the run's (MaxText's "
        "minimal saves every projection's output: dots_saveable); else full where recompute > 0, none at 0. "
        "not_held: runs priced and printed but not held within the band, each saying why (its not_held field).",
        "runs": runs,
        "not_held": not_held,
    },
    open(sys.argv[1] if len(sys.argv) > 1 else root + "workbench/core/interop/published_runs.json", "w"),
    indent=1,
)
print(len(runs), "held,", len(not_held), "not held")
