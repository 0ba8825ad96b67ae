"""Greedy generation: workbench (compiled decode loop, contiguous and paged cache) vs Hugging Face torch.

    python benchmarks/generate.py [--runs 3] [--quick] [--no-real]

Two models, each in both libraries in the same run.

Tiny: a Llama with vocab 4096, hidden 256, intermediate 688, 4 layers, 8 heads, 2 KV heads, random weights
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
- decode loop: how the calls ran the stacked layers: `generate(..., layer_loop="views")`, unrolled over
  per-layer views of the stacked weights, so a CPU decode step reads each weight once
  (`workbench/core/models/layer_views.py`); for SmolLM2 at batch 1 also the default scan, for comparison.
- decode step / read-once floor: a warm call's decode seconds / (new tokens - 1), against the time to read
  every weight of the model once (a compiled `jnp.sum` of each parameter), both medians timed in the same
  round-robin, so both see the same machine (ours after a 0.3 s pause that follows torch's calls: its
  OpenMP threads spin for a while after a call and would slow whatever runs next).
The paged cache (page size 16, enough pages for the batch) runs the same loop with `paged` attention.

Real: SmolLM2-135M-Instruct from `workbench.models.local_checkpoint()` (float32, 30 layers, vocab
49152), loaded by each library from the same directory (`from_pretrained`). Prompts are user
messages asking for long answers, through the tokenizer's chat template (left-padded for batch 8),
64 new tokens, greedy. HF runs with `min_new_tokens=64` (it masks EOS until then); ours with an EOS
id no argmax can give (the vocab size), so both make all 64 tokens. The generated tokens are
compared (identical, or the first differing row and position, and whether EOS was there). Same
columns as above, contiguous cache only; targets at batch 1: >= 2x HF tokens/s, the decode step within
1.3x of the read-once floor, TTFT at or below HF's (batch 8 is shown, no target). Then where a batch-1
decode step's time goes on XLA:CPU, for SmolLM2's shapes:
the matmuls over stacked `(L, ...)` weights in a `lax.scan` (what the model runs: XLA:CPU copies
each layer's weight slice before its dot) vs separate per-layer arrays, and one read of every weight.
`--quick`: batch 1 only and 2 runs, for both models; `--no-real` skips the SmolLM2 section.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from _header import header, print_rows
from flax import nnx

from workbench.core.models import ModelConfig, from_hf_state_dict
from workbench.core.models.generation import GenerationConfig, generate

CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
              pad_token_id=0)
PROMPT, NEW = 64, 128
TARGETS = {1: 2.0, 8: 1.5}
REAL_NEW, REAL_TARGETS = 64, {1: 2.0}
STEP_TARGET = 1.3  # a batch-1 decode step within 1.3x of reading every weight once
PAUSE_S = 0.3  # after torch's calls, so its OpenMP threads have stopped spinning before ours are timed
REAL_PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe the water cycle thoroughly for a high-school student.",
    "Write a detailed essay on the history of the printing press.",
    "Give a long, step-by-step guide to baking sourdough bread at home.",
    "Explain how the immune system fights a viral infection, in detail.",
    "Write a long letter from a sailor to his family describing a storm at sea.",
    "Describe, in detail, how a city plans and builds a new subway line.",
]


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
        out = generate(ours, ids, config, attention_mask=mask, cache=make(), layer_loop="views")
        first[name], compile_s[name] = time.perf_counter() - t0, out.timings["compile"]
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def hf_generate(n):
        with torch.no_grad():
            return hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)

    want = hf_generate(NEW).numpy()
    got = np.asarray(generate(ours, ids, config, attention_mask=mask, layer_loop="views").sequences)
    same = "yes" if np.array_equal(got, want) else f"no ({(got != want).sum()} tokens differ)"
    print(f"batch {batch}: greedy tokens identical to HF: {same}")
    times = {name: [] for name in (*caches, "hf")}
    ttft = {name: [] for name in times}
    steps, loops, floor = {name: [] for name in caches}, {}, ReadOnce(ours)
    for _ in range(runs):
        for name, make in caches.items():
            cache = make()
            t0 = time.perf_counter()
            out = generate(ours, ids, config, attention_mask=mask, cache=cache, layer_loop="views")
            jax.block_until_ready(out.sequences)
            times[name].append(time.perf_counter() - t0)
            ttft[name].append(out.timings["prefill"])
            steps[name].append(out.timings["decode"] / (NEW - 1))
            loops[name] = out.layer_loop
        floor.time()
        t0 = time.perf_counter()
        hf_generate(NEW)
        times["hf"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf_generate(1)
        ttft["hf"].append(time.perf_counter() - t0)
        time.sleep(PAUSE_S)
    hf_tps = batch * NEW / statistics.median(times["hf"])
    rows = []
    for name in times:
        tps = batch * NEW / statistics.median(times[name])
        ours_row = name != "hf"
        ratio = tps / hf_tps
        verdict = "met" if ratio >= TARGETS[batch] else "MISSED"
        rows.append((str(batch), f"workbench {name} ({loops[name]})" if ours_row else "HF torch", f"{tps:,.0f}",
                     f"{1e3 * statistics.median(ttft[name]):.1f} ms",
                     f"{first[name]:.2f} s ({'met' if first[name] <= 5 else 'MISSED'})" if ours_row else "-",
                     f"{compile_s[name]:.2f} s" if ours_row else "-",
                     floor.row(steps[name]) if ours_row else "-",
                     f"{ratio:.2f}x (target >= {TARGETS[batch]}x: {verdict})" if ours_row else ""))
    return rows


class ReadOnce:
    """The floor of a decode step: the time to read every weight of ``model`` once (a compiled ``jnp.sum`` of each
    parameter, timed beside the steps it is compared with, so both see the same machine)."""

    def __init__(self, model):
        self.leaves = [x for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.Array)]
        self.fn = jax.jit(lambda leaves: sum(jnp.sum(x) for x in leaves))
        self.fn(self.leaves).block_until_ready()
        self.seconds: list[float] = []

    def time(self) -> None:
        self.seconds.append(_seconds(lambda: self.fn(self.leaves).block_until_ready()))

    def row(self, steps: list[float], target: float | None = None) -> str:
        """'step ms / floor ms = ratio' (medians), with the target's verdict where there is one."""
        step, floor = statistics.median(steps), statistics.median(self.seconds)
        verdict = "" if target is None else f" (target <= {target}x: {'met' if step / floor <= target else 'MISSED'})"
        return f"{1e3 * step:.1f} / {1e3 * floor:.1f} ms = {step / floor:.2f}x{verdict}"


def real_models():
    """SmolLM2-135M-Instruct in both libraries, from the same local directory, and its tokenizer."""
    from workbench.models import from_pretrained, local_checkpoint

    path = local_checkpoint()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, hf, from_pretrained(path, progress=False)


def chat_prompts(tok, batch: int) -> tuple[np.ndarray, np.ndarray]:
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in REAL_PROMPTS[:batch]]
    enc = tok(texts, return_tensors="np", padding=True)
    return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


def compare(got: np.ndarray, want: np.ndarray, prompt_len: int, eos: int) -> str:
    """'yes', or where the generated tokens first differ (row, new-token position, both tokens)."""
    if got.shape == want.shape and np.array_equal(got, want):
        return "yes"
    if got.shape != want.shape:
        return f"no (shapes {got.shape} vs HF {want.shape})"
    rows, cols = np.nonzero(got != want)
    first = np.lexsort((rows, cols))[0]  # the earliest position, then the lowest row
    r, c = rows[first], cols[first]
    note = " (ours emitted EOS there; HF's min_new_tokens forbids it)" if got[r, c] == eos else ""
    return (f"no: {len(set(rows.tolist()))} row(s) differ; first at row {r}, new token {c - prompt_len}: ours "
            f"{got[r, c]}, HF {want[r, c]}{note}")


def run_real(tok, hf, ours, batch: int, runs: int, loops: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Table rows for SmolLM2 at one batch size: workbench (contiguous cache) with each decode loop, HF."""
    ids, mask = chat_prompts(tok, batch)
    vocab, eos = ours.config.vocab_size, tok.eos_token_id
    config = GenerationConfig(max_new_tokens=REAL_NEW, do_sample=False, eos_token_id=vocab,  # never made: all tokens
                              pad_token_id=tok.pad_token_id)
    first, compile_s, got = {}, {}, {}
    for loop in loops:
        t0 = time.perf_counter()
        out = generate(ours, ids, config, attention_mask=mask, layer_loop=loop)
        jax.block_until_ready(out.sequences)
        first[loop], compile_s[loop], got[loop] = time.perf_counter() - t0, out.timings["compile"], out.sequences
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def hf_generate(n):
        with torch.no_grad():
            return hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               temperature=None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)

    want = hf_generate(REAL_NEW).numpy()
    for loop in loops:
        print(f"SmolLM2 batch {batch} (prompt {ids.shape[1]} tokens{', left-padded' if batch > 1 else ''}), {loop}: "
              f"greedy tokens identical to HF: {compare(np.asarray(got[loop]), want, ids.shape[1], eos)}")
    if batch == 1:
        reply = tok.decode(np.asarray(got[loops[0]])[0, ids.shape[1]:], skip_special_tokens=False).replace("\n", " ")
        print(f"  reply: {reply[:150]!r}...")
    times, ttft = {k: [] for k in (*loops, "hf")}, {k: [] for k in (*loops, "hf")}
    steps, floor = {loop: [] for loop in loops}, ReadOnce(ours)
    for _ in range(runs):
        for loop in loops:
            t0 = time.perf_counter()
            out = generate(ours, ids, config, attention_mask=mask, layer_loop=loop)
            jax.block_until_ready(out.sequences)
            times[loop].append(time.perf_counter() - t0)
            ttft[loop].append(out.timings["prefill"])
            steps[loop].append(out.timings["decode"] / (REAL_NEW - 1))
            floor.time()
        t0 = time.perf_counter()
        hf_generate(REAL_NEW)
        times["hf"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf_generate(1)
        ttft["hf"].append(time.perf_counter() - t0)
        time.sleep(PAUSE_S)
    tps = {k: batch * REAL_NEW / statistics.median(v) for k, v in times.items()}
    ms = {k: f"{1e3 * statistics.median(v):.1f} ms" for k, v in ttft.items()}
    target = REAL_TARGETS.get(batch)
    rows = []
    for loop in loops:
        ratio = tps[loop] / tps["hf"]
        verdict = f" (target >= {target}x: {'met' if ratio >= target else 'MISSED'})" if target else " (no target)"
        shown = f"{ratio:.3f}" if target and abs(ratio - target) < 0.01 else f"{ratio:.2f}"  # never "2.00x MISSED"
        ttft_met = statistics.median(ttft[loop]) <= statistics.median(ttft["hf"])
        rows.append((str(batch), f"workbench contiguous ({loop})", f"{tps[loop]:,.0f}",
                     f"{ms[loop]} ({'met' if ttft_met else 'MISSED'})", f"{first[loop]:.2f} s",
                     f"{compile_s[loop]:.2f} s", floor.row(steps[loop], STEP_TARGET if batch == 1 else None),
                     f"{shown}x{verdict}"))
    return [*rows, (str(batch), "HF torch", f"{tps['hf']:,.0f}", ms["hf"], "-", "-", "-", "")]


def stacked_weights_cost(config, runs: int) -> None:
    """Where a batch-1 decode step's time goes on XLA:CPU: the matmuls of one step of ``config``'s
    shapes (random weights) over stacked ``(L, ...)`` weights in a ``lax.scan`` vs over separate
    per-layer arrays, and the time to read every weight once (the weight-streaming bound)."""
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    shapes = dict(q=(h, h), k=(h, kv), v=(h, kv), o=(h, h), gate=(h, i), up=(h, i), down=(i, h))
    rng = np.random.default_rng(0)
    stacked = {k: jnp.asarray(rng.standard_normal((config.num_hidden_layers, *s), np.float32) * 0.02)
               for k, s in shapes.items()}
    separate = [{k: jnp.array(v[n]) for k, v in stacked.items()} for n in range(config.num_hidden_layers)]
    embed = jnp.asarray(rng.standard_normal((config.vocab_size, h), np.float32) * 0.02)

    def layer(x, w):
        x = x + (x @ w["q"] + (x @ w["k"]).sum() + (x @ w["v"]).sum()) @ w["o"]
        return x + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]

    def scanned(ws, x):
        return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0] @ embed.T

    def unrolled(ws, x):
        for w in ws:
            x = layer(x, w)
        return x @ embed.T

    def steps(step):  # 16 dependent steps in one program, as in the decode loop
        return jax.jit(lambda ws, x: jax.lax.fori_loop(0, 16, lambda _, x: x + step(ws, x)[:, :h] * 1e-3, x))

    x = jnp.ones((1, h), jnp.float32)
    read_all = jax.jit(lambda ws: sum(v.sum() for v in jax.tree.leaves(ws)) + embed.sum())
    cases = {"stacked (L, ...) weights, lax.scan": (steps(scanned), stacked),
             "separate per-layer arrays, unrolled": (steps(unrolled), separate)}
    ms = {}
    for name, (fn, ws) in cases.items():
        fn(ws, x).block_until_ready()
        ms[name] = min(_seconds(lambda fn=fn, ws=ws: fn(ws, x).block_until_ready()) for _ in range(runs)) / 16 * 1e3
    read_all(stacked).block_until_ready()
    ms["every weight read once (jnp.sum)"] = min(_seconds(lambda: read_all(stacked).block_until_ready())
                                                 for _ in range(runs)) * 1e3
    print(f"\nwhere a batch-1 decode step goes on XLA:CPU (SmolLM2's shapes, matmuls only, random weights, "
          f"min of {runs}): XLA:CPU copies each layer's slice of a stacked weight before its matmul (a dot "
          f"operand is a whole buffer), which separate arrays avoid")
    print_rows(["one step", "ms"], [(k, f"{v:.1f}") for k, v in ms.items()])


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def real_section(quick: bool, runs: int) -> None:
    print(f"\n## SmolLM2-135M-Instruct (greedy, chat prompts, {REAL_NEW} new tokens)\n")
    try:
        tok, hf, ours = real_models()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        print(f"skipped: local_checkpoint() is not available ({err})")
        return
    rows = []
    for batch in (1,) if quick else (1, 8):
        rows += run_real(tok, hf, ours, batch, runs, ("views", "scan") if batch == 1 else ("views",))
    print()
    print_rows(["batch", "implementation (decode loop)", "tokens/s", "TTFT (<= HF's)", "first call", "compile",
                "decode step / read-once floor", "vs HF"], rows)
    stacked_weights_cost(ours.config, max(runs, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 1 only, 2 runs")
    parser.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                        help="the SmolLM2-135M-Instruct section (local_checkpoint())")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    print(header("generate: workbench vs Hugging Face torch (greedy)"))
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    transformers.utils.logging.disable_progress_bar()
    print(f"## tiny Llama (random weights, prompt {PROMPT}, {NEW} new tokens)\n")
    hf, ours = build()
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    rows = []
    for batch in (1,) if args.quick else (1, 8):
        rows += run_batch(hf, ours, config, batch, runs)
    print()
    print_rows(["batch", "implementation (decode loop)", "tokens/s", "TTFT", "first call (<= 5 s)", "compile",
                "decode step / read-once floor", "vs HF"], rows)
    if args.real:
        real_section(args.quick, runs)
    print(f"\n(load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
