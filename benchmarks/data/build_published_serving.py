"""Builds workbench/core/interop/published_serving.json from the raw records beside this file
(published_serving_gpu.json, published_serving_tpu.json: every quote and derivation): which measured serving points
have a complete configuration, and the choices made in pricing each (the model, the chips, the running batch, the
lengths). Run it after editing a raw record: python benchmarks/data/build_published_serving.py (or ... OUT.json)."""

import json
import pathlib
import sys

root = pathlib.Path(__file__).resolve().parents[2]
RAW = {r["name"]: r for f in ("gpu", "tpu") for r in json.loads((root / f"benchmarks/data/published_serving_{f}.json")
                                                             .read_text())}

# Llama-2-7B is not a preset here: transformers' LlamaConfig defaults are its shapes ("Instantiating a configuration
# with the defaults will yield a similar configuration to that of the LLaMA-7B", transformers' configuration_llama.py)
LLAMA_2_7B = {"hf": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                     "tie_word_embeddings": False}}
L31_8B, L31_70B, L2_70B = {"full": "llama-3.1-8b"}, {"full": "llama-3.1-70b"}, {"full": "llama-2-70b"}
Q3_8B, Q3_32B, Q3_30B = {"full": "qwen3-8b"}, {"full": "qwen3-32b"}, {"full": "qwen3-30b-a3b"}
LLAMA_33 = "Llama-3.3-70B has Llama-3.1-70B's shapes (the llama-3.1-70b preset)"


def gpu(chip, n):
    return {"gpu": chip, "gpus": n}


def point(kind, engine, model, cluster, tp, *, input_len, output_len, concurrency=None, prompts=None, dtype="bf16",
          weight_dtype=None, kv_dtype=None, prefill_chunk=None, choices=""):
    return {"kind": kind, "engine": engine, "model": model, "cluster": cluster, "mesh": {"tp": tp},
            "concurrency": concurrency, "prompts": prompts, "input_len": input_len, "output_len": output_len,
            "dtype": dtype, "weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "prefill_chunk": prefill_chunk,
            "choices": choices}


LITTLE = "the running batch is Little's law on the published means (rate x (TTFT + (OSL - 1) x ITL)), rounded"
TRT14 = "TensorRT-LLM 0.14's online table (BF16, 500 requests at a fixed rate through Triton)"
NIM = ("NVIDIA NIM 1.8.0's fp8 TP2 profile, taken as TensorRT-LLM with fp8 weights and a bf16 KV cache (the table "
       "names neither the backend nor the cache's dtype); the H100s taken as SXM")
SWEEP = "sglang-jax's Qwen3 sweep of Sept 2025 (both engines on the same v6e-4, fixed lengths, fixed concurrency)"
STATIC = "static batching (gptSessionBenchmark): the batch prefilled once, then decoded for the output length"
# each engine's prompt tokens a step in the sweep: sglang-jax's server flags say --chunked-prefill-size=2048; vLLM's
# left --max-num-batched-tokens unset, and its default for `vllm serve` is 2,048 here. vLLM's per-chip TPU table
# (vllm/engine/arg_utils.py, default_max_num_batched_tokens_tpu: 'V6E' 1,024, at
# vllm-project/vllm@99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b) is keyed by the platform's device name, which the TPU
# platform of the time names "TPU V6E" (tpu_commons/platforms/tpu_jax.py, get_device_name, at
# vllm-project/tpu-inference@34af638133f75cbf30a2979d859e404759eff9e7): no key matches, and the generic default
# applies, 2,048 for a device whose memory is not known (that platform's get_device_total_memory raises).
SWEEP_CHUNK = {"sglang-jax": (2048, "its --chunked-prefill-size=2048"),
               "vLLM": (2048, "vLLM's default --max-num-batched-tokens for `vllm serve`, 2,048 (its per-chip TPU "
                              "table, 1,024 for a v6e, is keyed by a name its TPU platform does not give)")}
V7X = ("sglang-jax's TPU v7x-4 cookbook row (fixed lengths, max_concurrency 128, chunked prefill): tp=8 over the 8 "
       "TensorCores")
PLANS = {
    # -- GPU decode (TPOT / ITL) -----------------------------------------------------------------------------------
    "trtllm014_llama31_8b_h100_tp1_bf16_467x256_qps2_itl": point(
        "decode", "TensorRT-LLM", L31_8B, gpu("h100", 1), 1, input_len=467, output_len=256, concurrency=4,
        choices=f"{TRT14}; {LITTLE}"),
    "trtllm014_llama31_8b_h100_tp1_bf16_467x256_qps8_itl": point(
        "decode", "TensorRT-LLM", L31_8B, gpu("h100", 1), 1, input_len=467, output_len=256, concurrency=19,
        choices=f"{TRT14}; {LITTLE}"),
    "trtllm014_llama31_8b_h100_tp1_bf16_467x256_qps32_itl": point(
        "decode", "TensorRT-LLM", L31_8B, gpu("h100", 1), 1, input_len=467, output_len=256, concurrency=127,
        choices=f"{TRT14}; {LITTLE}"),
    "trtllm014_llama31_8b_h200_tp1_bf16_467x256_qps2_itl": point(
        "decode", "TensorRT-LLM", L31_8B, gpu("h200", 1), 1, input_len=467, output_len=256, concurrency=3,
        choices=f"{TRT14}; {LITTLE}"),
    "trtllm014_llama31_70b_h100_tp4_bf16_467x256_qps2_itl": point(
        "decode", "TensorRT-LLM", L31_70B, gpu("h100", 4), 4, input_len=467, output_len=256, concurrency=11,
        choices=f"{TRT14}; {LITTLE}"),
    "trtllm014_llama31_70b_h100_tp4_bf16_467x256_qps8_itl": point(
        "decode", "TensorRT-LLM", L31_70B, gpu("h100", 4), 4, input_len=467, output_len=256, concurrency=58,
        choices=f"{TRT14}; {LITTLE}"),
    "trtllm014_llama31_70b_h200_tp4_bf16_467x256_qps2_itl": point(
        "decode", "TensorRT-LLM", L31_70B, gpu("h200", 4), 4, input_len=467, output_len=256, concurrency=9,
        choices=f"{TRT14}; {LITTLE}"),
    "nim180_llama33_70b_2xh100_tp2_fp8_5000x500_c1_itl": point(
        "decode", "TensorRT-LLM", L31_70B, gpu("h100", 2), 2, input_len=5000, output_len=500, concurrency=1,
        dtype="fp8", kv_dtype="bf16", choices=f"{NIM}; {LLAMA_33}"),
    "nim180_llama33_70b_2xh100_tp2_fp8_5000x500_c25_itl": point(
        "decode", "TensorRT-LLM", L31_70B, gpu("h100", 2), 2, input_len=5000, output_len=500, concurrency=25,
        dtype="fp8", kv_dtype="bf16", choices=f"{NIM}; {LLAMA_33}"),
    "nim180_llama33_70b_2xh100_tp2_fp8_5000x500_c50_itl": point(
        "decode", "TensorRT-LLM", L31_70B, gpu("h100", 2), 2, input_len=5000, output_len=500, concurrency=50,
        dtype="fp8", kv_dtype="bf16", choices=f"{NIM}; {LLAMA_33}"),
    "nim180_llama33_70b_2xh100_tp2_fp8_500x2000_c1_itl": point(
        "decode", "TensorRT-LLM", L31_70B, gpu("h100", 2), 2, input_len=500, output_len=2000, concurrency=1,
        dtype="fp8", kv_dtype="bf16", choices=f"{NIM}; {LLAMA_33}"),
    # -- GPU prefill (TTFT) ---------------------------------------------------------------------------------------
    "trtllm014_llama31_8b_h100_tp1_bf16_467x16_qps2_ttft": point(
        "prefill", "TensorRT-LLM", L31_8B, gpu("h100", 1), 1, input_len=467, output_len=16, prompts=1,
        choices=f"{TRT14}; under one request in flight (Little's law: 0.25), one prompt at a time"),
    "trtllm014_llama31_8b_h200_tp1_bf16_467x16_qps2_ttft": point(
        "prefill", "TensorRT-LLM", L31_8B, gpu("h200", 1), 1, input_len=467, output_len=16, prompts=1,
        choices=f"{TRT14}; under one request in flight (Little's law: 0.19), one prompt at a time"),
    "trtllm014_llama31_70b_h100_tp4_bf16_467x16_qps2_ttft": point(
        "prefill", "TensorRT-LLM", L31_70B, gpu("h100", 4), 4, input_len=467, output_len=16, prompts=1,
        choices=f"{TRT14}; under one request in flight (Little's law: 0.65), one prompt at a time"),
    "nim180_llama33_70b_2xh100_tp2_fp8_5000x500_c1_ttft": point(
        "prefill", "TensorRT-LLM", L31_70B, gpu("h100", 2), 2, input_len=5000, output_len=500, prompts=1,
        dtype="fp8", kv_dtype="bf16", choices=f"{NIM}; {LLAMA_33}; concurrency 1"),
    "nim180_llama33_70b_2xh100_tp2_fp8_500x2000_c1_ttft": point(
        "prefill", "TensorRT-LLM", L31_70B, gpu("h100", 2), 2, input_len=500, output_len=2000, prompts=1,
        dtype="fp8", kv_dtype="bf16", choices=f"{NIM}; {LLAMA_33}; concurrency 1"),
    "trtllm05_llama2_70b_h100_tp4_fp8_bs1_isl2048_ttft": point(
        "prefill", "TensorRT-LLM", L2_70B, gpu("h100", 4), 4, input_len=2048, output_len=1, prompts=1, dtype="fp8",
        choices="TensorRT-LLM 0.5's first-token latency, static batch 1, fp8 weights and KV cache"),
    "trtllm05_llama2_70b_h100_tp4_fp8_bs1_isl128_ttft": point(
        "prefill", "TensorRT-LLM", L2_70B, gpu("h100", 4), 4, input_len=128, output_len=1, prompts=1, dtype="fp8",
        choices="TensorRT-LLM 0.5's first-token latency, static batch 1, fp8 weights and KV cache"),
    "trtllm05_llama2_7b_h100_tp1_fp8_bs1_isl2048_ttft": point(
        "prefill", "TensorRT-LLM", LLAMA_2_7B, gpu("h100", 1), 1, input_len=2048, output_len=1, prompts=1,
        dtype="fp8", choices="TensorRT-LLM 0.5's first-token latency, static batch 1, fp8 weights and KV cache"),
    "trtllm090_llama2_70b_h100_tp8_fp8_bs1_isl2048_ttft": point(
        "prefill", "TensorRT-LLM", L2_70B, gpu("h100", 8), 8, input_len=2048, output_len=1, prompts=1, dtype="fp8",
        choices="TensorRT-LLM 0.9's first-token latency, static batch 1, fp8 weights and KV cache"),
    "trtllm090_llama2_7b_h100_tp1_fp8_bs1_isl2048_ttft": point(
        "prefill", "TensorRT-LLM", LLAMA_2_7B, gpu("h100", 1), 1, input_len=2048, output_len=1, prompts=1,
        dtype="fp8", choices="TensorRT-LLM 0.9's first-token latency, static batch 1, fp8 weights and KV cache"),
    # -- GPU throughput at a published batch -------------------------------------------------------------------------
    "trtllm061_llama2_70b_h100_tp4_fp8_bs480_128x2048": point(
        "throughput", "TensorRT-LLM", L2_70B, gpu("h100", 4), 4, input_len=128, output_len=2048, concurrency=480,
        dtype="fp8", choices=f"TensorRT-LLM 0.6.1, {STATIC}; fp8 weights and KV cache"),
    "trtllm061_llama2_70b_h100_tp2_fp8_bs64_2048x2048": point(
        "throughput", "TensorRT-LLM", L2_70B, gpu("h100", 2), 2, input_len=2048, output_len=2048, concurrency=64,
        dtype="fp8", choices=f"TensorRT-LLM 0.6.1, {STATIC}; fp8 weights and KV cache"),
    "trtllm061_llama2_7b_h100_tp1_fp8_bs112_128x2048": point(
        "throughput", "TensorRT-LLM", LLAMA_2_7B, gpu("h100", 1), 1, input_len=128, output_len=2048,
        concurrency=112, dtype="fp8", choices=f"TensorRT-LLM 0.6.1, {STATIC}; fp8 weights and KV cache"),
    # -- TPU decode ---------------------------------------------------------------------------------------------------
    "vllm-tpu_llama3.3-70b_v6e-8_c64_tpot": point(
        "decode", "vLLM", L31_70B, {"tpu": "v6e:2x4"}, 8, input_len=1000, output_len=1000, concurrency=64,
        choices=f"tpu-recipes' vLLM run (fixed lengths, max concurrency 64); {LLAMA_33}"),
    "vllm-tpu_llama3.3-70b_v6e-8_c128_tpot": point(
        "decode", "vLLM", L31_70B, {"tpu": "v6e:2x4"}, 8, input_len=1000, output_len=1000, concurrency=128,
        choices=f"tpu-recipes' vLLM run (fixed lengths, max concurrency 128); {LLAMA_33}"),
    "sglang-jax_qwen3-8b_v6e-4_isl1024_b8_itl": point(
        "decode", "sglang-jax", Q3_8B, {"tpu": "v6e:2x2"}, 4, input_len=1024, output_len=1024, concurrency=8,
        choices=SWEEP),
    "vllm-tpu_qwen3-8b_v6e-4_isl1024_b8_itl": point(
        "decode", "vLLM", Q3_8B, {"tpu": "v6e:2x2"}, 4, input_len=1024, output_len=1024, concurrency=8,
        choices=SWEEP),
    "sglang-jax_qwen3-8b_v6e-4_isl1024_b64_itl": point(
        "decode", "sglang-jax", Q3_8B, {"tpu": "v6e:2x2"}, 4, input_len=1024, output_len=1024, concurrency=64,
        choices=SWEEP),
    "vllm-tpu_qwen3-8b_v6e-4_isl1024_b64_itl": point(
        "decode", "vLLM", Q3_8B, {"tpu": "v6e:2x2"}, 4, input_len=1024, output_len=1024, concurrency=64,
        choices=SWEEP),
    "sglang-jax_qwen3-8b_v6e-4_isl8192_b8_itl": point(
        "decode", "sglang-jax", Q3_8B, {"tpu": "v6e:2x2"}, 4, input_len=8192, output_len=1024, concurrency=8,
        choices=SWEEP),
    "vllm-tpu_qwen3-8b_v6e-4_isl8192_b8_itl": point(
        "decode", "vLLM", Q3_8B, {"tpu": "v6e:2x2"}, 4, input_len=8192, output_len=1024, concurrency=8,
        choices=SWEEP),
    "sglang-jax_qwen3-32b_v6e-4_isl1024_b8_itl": point(
        "decode", "sglang-jax", Q3_32B, {"tpu": "v6e:2x2"}, 4, input_len=1024, output_len=1024, concurrency=8,
        choices=SWEEP),
    "vllm-tpu_qwen3-32b_v6e-4_isl1024_b8_itl": point(
        "decode", "vLLM", Q3_32B, {"tpu": "v6e:2x2"}, 4, input_len=1024, output_len=1024, concurrency=8,
        choices=SWEEP),
    "sglang-jax_llama3.1-8b_v6e-4_c16_tpot": point(
        "decode", "sglang-jax", L31_8B, {"tpu": "v6e:2x2"}, 4, input_len=265, output_len=258, concurrency=16,
        choices="sglang-jax 0.1.0's cookbook run (random lengths: the published token totals' means, 265 in and "
                "258 out)"),
    "sglang-jax_qwen3-8b_v7x-4_c128_tpot": point(
        "decode", "sglang-jax", Q3_8B, {"tpu": "tpu7x:2x2x1"}, 8, input_len=1024, output_len=1024, concurrency=128,
        choices=V7X),
    "sglang-jax_llama3.3-70b_v7x-4_c128_tpot": point(
        "decode", "sglang-jax", L31_70B, {"tpu": "tpu7x:2x2x1"}, 8, input_len=1024, output_len=1024,
        concurrency=128, choices=f"{V7X}; {LLAMA_33}"),
    "sglang-jax_qwen3-30b-a3b_v7x-4_c128_tpot": point(
        "decode", "sglang-jax", Q3_30B, {"tpu": "tpu7x:2x2x1"}, 8, input_len=1024, output_len=1024,
        concurrency=128, choices=f"{V7X}; the experts split over tp as the dense layers are"),
    # -- TPU prefill (TTFT of 8 prompts sent together: the sweep's concurrency, one output token each) --------------
    **{f"{e}_{m}_v6e-4_isl{n}_b8_ttft": point(
        "prefill", engine, {"qwen3-8b": Q3_8B, "qwen3-32b": Q3_32B}[m], {"tpu": "v6e:2x2"}, 4, input_len=n,
        output_len=1, prompts=8, prefill_chunk=SWEEP_CHUNK[engine][0],
        choices=f"{SWEEP}; one output token at concurrency 8: the 8 prompts prefilled together (Little's law), in "
                f"steps of {SWEEP_CHUNK[engine][1]}")
       for e, engine in (("sglang-jax", "sglang-jax"), ("vllm-tpu", "vLLM"))
       for m, n in (("qwen3-8b", 1024), ("qwen3-8b", 8192), ("qwen3-32b", 1024))},
    # -- TPU throughput at a published running batch -----------------------------------------------------------------
    "vllm-tpu_qwen3-32b_tpu7x-1chip_1k8k_output_throughput": point(
        "throughput", "vLLM", Q3_32B, {"tpu": "tpu7x:1x1x1"}, 2, input_len=922, output_len=7373, concurrency=135,
        dtype="fp8", kv_dtype="fp8",
        choices="tpu-recipes' Ironwood vLLM run: 320 requests in flight, the server running at most 135 "
                "(--max-num-seqs); random lengths of range ratio 0.8, means 0.9 x 1,024 and 0.9 x 8,192; qwix fp8 "
                "weights and activations, an fp8 KV cache"),
}
NOT_HELD = {
    "sglang030_llama31_70b_4xh100_tp4_bf16_sharegpt_rps4_tpot": "ShareGPT's prompt and output lengths are not "
                                                                "published with the run",
    "sglang030_llama31_70b_4xh100_tp4_bf16_sharegpt_rps4_ttft": "ShareGPT's prompt lengths are not published with "
                                                                "the run",
    "vllm060_llama31_70b_4xh100_tp4_bf16_sharegpt_rps4_tpot": "ShareGPT's prompt and output lengths are not "
                                                              "published with the run",
    "vllm-tpu_llama3.1-8b_v6e-4_sharegpt_burst_throughput": "a burst of 1,000 requests: the running batch the "
                                                            "engine held is not published",
    "vllm-tpu_llama3.1-8b_v6e-1_1800in128out_burst_before-pr16458": "a burst: the running batch is not published",
    "jetstream-experimental-jax_llama2-7b_v5e-8_offline_throughput": "the batch and the weights' dtype are not "
                                                                     "published",
    "vllm-tpu_qwen3-coder-480b_tpu7x-4chip_1k8k_output_throughput": "Qwen3-Coder-480B's configuration is not among "
                                                                    "the presets here",
    "vllm-tpu_qwen3.5-397b_tpu7x-4chip_1k8k_output_throughput": "Qwen3.5's hybrid linear attention is not built here",
    "sglang-jax_qwen-7b-chat_v6e-4_c8_tpot": "Qwen-7B (the first Qwen) is not a family built here",
    "sglang-jax_qwen-7b-chat_v6e-4_c8_ttft": "Qwen-7B (the first Qwen) is not a family built here",
    "sglang-jax_gemma2-27b_v6e-4_c16_tpot": "Gemma 2 is not a family built here",
}
for name, r in RAW.items():
    if r["kind"] == "upper_bound" and name not in PLANS and name not in NOT_HELD:
        NOT_HELD[name] = "throughput at maximum load: the running batch the engine held is not published"


def build():
    points = []
    for name, plan in PLANS.items():
        raw = RAW[name]
        per_gpu = raw["metric"].endswith("_per_gpu")  # a per-GPU figure, over the whole tensor-parallel group
        measured = raw["value"] * (raw["num_gpus"] if per_gpu else 1)
        entry = {"name": name, "release": raw["engine"], "model_name": raw["model"], "source": raw["source"], **plan}
        if plan["kind"] == "throughput":
            entry["measured_tokens_per_s"] = measured
        else:
            entry["measured_s"] = measured / 1e3
        entry["note"] = raw.get("notes", "")
        points.append(entry)
    missing = sorted(set(RAW) - set(PLANS) - set(NOT_HELD))
    if missing:
        raise SystemExit(f"raw points neither priced nor set aside: {missing}")
    return {"about": "Serving steps others measured and published, with what pricing each needs; built by "
                     "benchmarks/data/build_published_serving.py from the raw records beside it (every quote).",
            "points": points,
            "not_held": [{"name": n, "why": why, "source": RAW[n]["source"]["url"]} for n, why in NOT_HELD.items()]}


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else root / "workbench/core/interop/published_serving.json"
    out.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {out}")
