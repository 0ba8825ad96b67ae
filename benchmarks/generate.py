"""Greedy generation: workbench (compiled decode loop, contiguous and paged cache) vs Hugging Face torch.

    python benchmarks/generate.py [--runs 3] [--quick]

A Llama with vocab 4096, hidden 256, intermediate 688, 4 layers, 8 heads, 2 KV heads, random weights
(HF's init, seed 0), float32; the same weights in both (`from_hf_state_dict`). Prompt 64 random tokens,
128 new tokens, greedy, no EOS (every run makes all 128), batch 1 and 8. One CPU device (no simulated
devices: they would split XLA's threads); torch uses its default threads.

- first call: wall time of our first `generate` (tracing and compiling the prefill and the decode
  loop included) -- target <= 5 s;
- compile: the part of it spent compiling (`GenerationOutput.timings["compile"]`);
- TTFT (time to first token): ours, the prefill program (it returns the first token); HF, a
  `generate(max_new_tokens=1)` call;
- tokens/s: batch x 128 / median wall time of a warm call, calls taken round-robin so both libraries see
  the same machine noise. Targets: >= 2x HF at batch 1, >= 1.5x at batch 8.
The paged cache (page size 16, enough pages for the batch) runs the same loop with `paged` attention.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import torch
import transformers
from _header import header

from workbench.core.models import ModelConfig, from_hf_state_dict
from workbench.core.models.generation import GenerationConfig, generate

CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
              pad_token_id=0)
PROMPT, NEW = 64, 128
TARGETS = {1: 2.0, 8: 1.5}


def build():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float().eval()
    ours = from_hf_state_dict(ModelConfig.from_hf(hf.config.to_dict()),
                              {k: v.numpy() for k, v in hf.state_dict().items()}, attn_mechanism="vanilla")
    return hf, ours


def run_batch(hf, ours, config, batch: int, runs: int) -> list[tuple[str, ...]]:
    """Table rows for one batch size: workbench contiguous, workbench paged, HF."""
    ids = np.random.default_rng(batch).integers(1, CONFIG["vocab_size"], (batch, PROMPT)).astype(np.int32)
    mask = np.ones_like(ids)
    pages = -(-(PROMPT + NEW) // 16) * batch
    caches = {"contiguous": lambda: None,
              "paged": lambda: ours.init_ragged_pages(batch_size=batch, page_size=16, num_pages=pages,
                                                      max_model_length=PROMPT + NEW)}
    first, compile_s = {}, {}
    for name, make in caches.items():
        t0 = time.perf_counter()
        out = generate(ours, ids, config, attention_mask=mask, cache=make())
        first[name], compile_s[name] = time.perf_counter() - t0, out.timings["compile"]
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def hf_generate(n):
        with torch.no_grad():
            return hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)

    want = hf_generate(NEW).numpy()
    got = np.asarray(generate(ours, ids, config, attention_mask=mask).sequences)
    same = "yes" if np.array_equal(got, want) else f"no ({(got != want).sum()} tokens differ)"
    print(f"batch {batch}: greedy tokens identical to HF: {same}")
    times = {name: [] for name in (*caches, "hf")}
    ttft = {name: [] for name in times}
    for _ in range(runs):
        for name, make in caches.items():
            cache = make()
            t0 = time.perf_counter()
            out = generate(ours, ids, config, attention_mask=mask, cache=cache)
            jax.block_until_ready(out.sequences)
            times[name].append(time.perf_counter() - t0)
            ttft[name].append(out.timings["prefill"])
        t0 = time.perf_counter()
        hf_generate(NEW)
        times["hf"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf_generate(1)
        ttft["hf"].append(time.perf_counter() - t0)
    hf_tps = batch * NEW / statistics.median(times["hf"])
    rows = []
    for name in times:
        tps = batch * NEW / statistics.median(times[name])
        ours_row = name != "hf"
        ratio = tps / hf_tps
        verdict = "met" if ratio >= TARGETS[batch] else "MISSED"
        rows.append((str(batch), f"workbench {name}" if ours_row else "HF torch", f"{tps:,.0f}",
                     f"{1e3 * statistics.median(ttft[name]):.1f} ms",
                     f"{first[name]:.2f} s ({'met' if first[name] <= 5 else 'MISSED'})" if ours_row else "-",
                     f"{compile_s[name]:.2f} s" if ours_row else "-",
                     f"{ratio:.2f}x (target >= {TARGETS[batch]}x: {verdict})" if ours_row else ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 1 only, 2 runs")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    print(header("generate: workbench vs Hugging Face torch (greedy, prompt 64, 128 new tokens)"))
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}\n")
    hf, ours = build()
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    rows = []
    for batch in (1,) if args.quick else (1, 8):
        rows += run_batch(hf, ours, config, batch, runs)
    head = ("batch", "implementation", "tokens/s", "TTFT", "first call (<= 5 s)", "compile", "vs HF")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
