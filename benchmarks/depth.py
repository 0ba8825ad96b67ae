"""First-call (compile) time against depth: decoder layers run by `lax.scan` vs unrolled, and a 70B model abstractly.

    python benchmarks/depth.py [--layers 4 16 32 80] [--repeats 3] [--big | --no-big]

Small table: one small-width Llama (hidden 128, 4 heads, 2 KV heads, intermediate 256, vocab 512,
random weights, float32, one CPU device) at each depth of `--layers`, its layers scanned and unrolled
(`model.with_options(scan_layers=...)`, same weights: one model built per depth). Before each point
every compile cache is emptied (`jax.clear_caches()` and generate's compiled-program cache) and the
model is a new `with_options` copy, so its first calls trace and compile from scratch:
- generate: wall time of the first `model.generate(ids, GenerationConfig(max_new_tokens=8))`, batch 1,
  a 16-token prompt, an EOS id the model never emits (all 8 tokens made); "compile" is
  `out.timings["compile"]` (tracing, lowering and XLA compiling the prefill and the decode loop);
- train step: wall time of the first `make_train_step()(to_state(model), {"input_ids": (4, 64)})`
  (AdamW); "compile" is what JAX's monitoring events report for it (jaxpr tracing + MLIR lowering +
  XLA compile).
The XLA part alone (JAX's backend-compile events) is in brackets. Round 1 measures every point;
rounds 2..`--repeats` measure again the cheap ones the ratios divide by or target (scanned at the
smallest and largest depth, unrolled at the smallest); the table shows medians. A warm-up at 2 layers
(another width) first pays the process's one-time costs. Building the models is not timed.
Target: scanned first call at 80 layers <= 1.5x its 4-layer time, for generate and for the train step.

Big table (`--big`, the default; under a minute): the Llama-3.1-70B config (hidden 8192, 80 layers,
64 heads, 8 KV heads, intermediate 28672, vocab 128256, llama3 rope scaling, as its config.json):
the time of `CausalLM.lazy_init(config)` (abstract: nothing allocated), then, in a subprocess with 64
simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=64`), bfloat16 parameters
laid on an fsdp=64 and an fsdp=8 x tp=8 mesh, the time `explore.step_collectives(kind="train")` takes
to compile the loss, gradients and AdamW update from abstract values, and the collectives one step runs, by kind
(`sc.summary`: a collective inside the layer scan runs once per layer; bytes are left out: XLA's CPU
backend converts bfloat16 to float32 before its collectives, so they would read twice a GPU's or TPU's).
The issue that asked for the layer scan measured 7 s for `lazy_init` and 137 s for that compile before it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _header import header, print_rows  # imports nothing of JAX

WIDTH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=512)
PROMPT, NEW, TRAIN_BATCH = 16, 8, (4, 64)
TARGET = 1.5
LLAMA3_70B = dict(  # meta-llama/Llama-3.1-70B config.json
    architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=128000,
    eos_token_id=128001, hidden_act="silu", hidden_size=8192, initializer_range=0.02, intermediate_size=28672,
    max_position_embeddings=131072, mlp_bias=False, model_type="llama", num_attention_heads=64,
    num_hidden_layers=80, num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05,
    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
                      rope_type="llama3"),
    rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, vocab_size=128256)
MESHES = ((64, 1, (64, 128)), (8, 8, (8, 128)))  # fsdp, tp, (batch, length): one sequence per data shard
ISSUE_LAZY_INIT_S, ISSUE_COMPILE_S = 7.0, 137.0
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace", "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "xla"}


# -- small width, every depth ----------------------------------------------------------------------------
class CompileEvents:
    """Seconds JAX reports (monitoring events) for tracing, lowering and XLA compiling, since ``reset()``."""

    def __init__(self):
        import jax

        self.seconds = dict.fromkeys(EVENTS.values(), 0.0)
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name: str, seconds: float, **_) -> None:
        if name in EVENTS:
            self.seconds[EVENTS[name]] += seconds

    def reset(self) -> None:
        self.seconds = dict.fromkeys(EVENTS.values(), 0.0)


def build(layers: int, width: dict | None = None):
    from workbench.models import tiny

    return tiny("llama", num_hidden_layers=layers, **(WIDTH if width is None else width))


def first_calls(model, scanned: bool, events: CompileEvents) -> dict[str, float]:
    """Seconds of the first generate and the first train step of ``model``, every cache emptied first."""
    import jax
    import numpy as np

    from workbench.core.models.training import make_train_step, to_state
    from workbench.core.programs import PROGRAMS
    from workbench.models import GenerationConfig

    jax.clear_caches()
    PROGRAMS.clear()  # generate's and the train step's compiled programs (keyed by graphdef and shapes)
    model = model.with_options(scan_layers=scanned)
    layers, vocab = model.config.num_hidden_layers, model.config.vocab_size
    rng = np.random.default_rng(layers)
    ids = rng.integers(1, vocab, (1, PROMPT)).astype(np.int32)
    config = GenerationConfig(max_new_tokens=NEW, eos_token_id=vocab)  # an id no argmax gives: all NEW tokens
    events.reset()
    t0 = time.perf_counter()
    out = model.generate(ids, config)
    jax.block_until_ready(out.sequences)
    gen = time.perf_counter() - t0
    gen_xla = events.seconds["xla"]
    if out.num_new_tokens != NEW:
        print(f"note: generate made {out.num_new_tokens} tokens, not {NEW}, at {layers} layers")

    state, step = to_state(model), make_train_step()
    batch = {"input_ids": rng.integers(1, vocab, TRAIN_BATCH).astype(np.int32)}
    events.reset()
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, batch))
    train = time.perf_counter() - t0
    return {"gen": gen, "gen_compile": out.timings["compile"], "gen_xla": gen_xla, "train": train,
            "train_compile": sum(events.seconds.values()), "train_xla": events.seconds["xla"]}


def depth_table(layer_counts: list[int], repeats: int) -> None:
    events = CompileEvents()
    start = time.perf_counter()
    first_calls(build(2, dict(WIDTH, hidden_size=64, intermediate_size=128)), True, events)  # warm-up
    models = {n: build(n) for n in layer_counts}
    print(f"  [{time.perf_counter() - start:6.1f} s] warm-up at 2 layers done, models built", flush=True)
    every = [(n, scanned) for n in layer_counts for scanned in (True, False)]
    again = list(dict.fromkeys([(layer_counts[0], True), (layer_counts[0], False), (layer_counts[-1], True)]))
    points: dict[tuple[int, bool], list[dict[str, float]]] = {key: [] for key in every}
    for r in range(repeats):
        for n, scanned in every if r == 0 else again:
            t0 = time.perf_counter()
            points[(n, scanned)].append(first_calls(models[n], scanned, events))
            print(f"  [{time.perf_counter() - start:6.1f} s] round {r + 1}: {n} layers "
                  f"{'scanned' if scanned else 'unrolled'} ({time.perf_counter() - t0:.1f} s)", flush=True)
    med = {key: {k: statistics.median(run[k] for run in runs) for k in runs[0]} for key, runs in points.items()}
    base = {s: med[(layer_counts[0], s)] for s in (True, False)}
    rows = []
    for n in layer_counts:
        for scanned in (True, False):
            m = med[(n, scanned)]
            b = base[scanned]
            rows.append((str(n), f"{'scanned' if scanned else 'unrolled'} (x{len(points[(n, scanned)])})",
                         f"{m['gen']:.2f} s", f"{m['gen_compile']:.2f} s [{m['gen_xla']:.2f}]",
                         f"{m['train']:.2f} s", f"{m['train_compile']:.2f} s [{m['train_xla']:.2f}]",
                         f"{m['gen'] / b['gen']:.2f}x / {m['train'] / b['train']:.2f}x"))
    print()
    print_rows(["layers", "run as (runs)", "generate: first call", "compile [XLA]", "train step: first call",
                "compile [XLA]", f"first call vs {layer_counts[0]} layers, same run-as (generate / train)"], rows)
    print()
    if 80 in layer_counts and 4 in layer_counts:
        for what, key in (("generate", "gen"), ("train step", "train")):
            ratio = med[(80, True)][key] / med[(4, True)][key]
            print(f"target: scanned first call at 80 layers <= {TARGET}x its 4-layer time, {what}: {ratio:.2f}x "
                  f"({med[(80, True)][key]:.2f} s vs {med[(4, True)][key]:.2f} s): "
                  f"{'met' if ratio <= TARGET else 'MISSED'}")
        for what, key in (("generate", "gen"), ("train step", "train")):
            print(f"contrast at 80 layers, {what}: unrolled {med[(80, False)][key]:.1f} s = "
                  f"{med[(80, False)][key] / med[(80, True)][key]:.1f}x scanned; at 4 layers unrolled "
                  f"{med[(4, False)][key]:.1f} s = {med[(4, False)][key] / med[(4, True)][key]:.2f}x scanned")
    else:
        print(f"target (scanned first call at 80 layers <= {TARGET}x its 4-layer time): not measured "
              f"(run with --layers including 4 and 80)")


# -- Llama-3.1-70B, abstractly -----------------------------------------------------------------------------
def collectives_worker(fsdp: int, tp: int, batch: tuple[int, int]) -> None:
    """In a process with fsdp * tp simulated devices: lazy_init on the mesh, compile the train step's
    collectives; one JSON line on stdout."""
    import jax.numpy as jnp

    from workbench.core.mesh import make_mesh
    from workbench.core.views import explore
    from workbench.models import CausalLM, ModelConfig

    config = ModelConfig.from_hf(LLAMA3_70B)
    mesh = make_mesh(fsdp=fsdp, tp=tp)
    t0 = time.perf_counter()
    model = CausalLM.lazy_init(config, mesh=mesh, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    lazy = time.perf_counter() - t0
    t0 = time.perf_counter()
    layout = explore.Layout.of(model, mesh)
    layout_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sc = explore.step_collectives(model, layout, kind="train", batch=batch)
    wall = time.perf_counter() - t0
    print(json.dumps({"lazy_init": lazy, "layout": layout_s, "wall": wall, "compile": sc.compile_seconds,
                      "summary": sc.summary, "runs": sc.runs, "bytes": sc.bytes_per_device,
                      "warnings": list(sc.warnings)}))


def big_table() -> None:
    import jax
    from flax import nnx

    from workbench.models import CausalLM, ModelConfig

    config = ModelConfig.from_hf(LLAMA3_70B)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        model = CausalLM.lazy_init(config)
        times.append(time.perf_counter() - t0)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"## Llama-3.1-70B ({n_params / 1e9:.2f} B parameters), abstract\n")
    print(f"`CausalLM.lazy_init(config)` (float32, no mesh), 3 calls: first {times[0]:.2f} s, then "
          f"{times[1]:.2f} s, {times[2]:.2f} s (the issue: {ISSUE_LAZY_INIT_S:.0f} s before the layer scan)\n")
    rows = []
    for fsdp, tp, batch in MESHES:
        n = fsdp * tp
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip())
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--collectives-worker", str(fsdp), str(tp), *map(str, batch)],
                              env=env, capture_output=True, text=True)
        process_s = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"fsdp={fsdp} tp={tp}: the worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        kinds = ", ".join(f"{k} {v['runs']} ({v['count']})" for k, v in sorted(res["summary"].items()))
        rows.append((f"fsdp={fsdp}" + (f" x tp={tp}" if tp > 1 else ""), f"{batch[0]} x {batch[1]}",
                     f"{res['lazy_init']:.2f} s", f"{res['compile']:.1f} s",
                     f"{ISSUE_COMPILE_S / res['compile']:.0f}x faster", f"{process_s:.1f} s", str(res["runs"]), kinds))
        for w in res["warnings"][:3]:
            print(f"XLA warning (fsdp={fsdp} tp={tp}): {w[:200]}")
    print_rows(["mesh (64 simulated CPU devices)", "batch", "lazy_init on the mesh", "train-step compile",
                f"vs the issue's {ISSUE_COMPILE_S:.0f} s", "whole subprocess", "collectives run per step",
                "by kind: runs (HLO instructions)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32, 80])
    parser.add_argument("--repeats", type=int, default=3, help="runs of the points the ratios use (others: one)")
    parser.add_argument("--big", action=argparse.BooleanOptionalAction, default=True,
                        help="the Llama-3.1-70B table (under a minute)")
    parser.add_argument("--collectives-worker", nargs=4, type=int, metavar=("FSDP", "TP", "B", "T"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collectives_worker:
        fsdp, tp, b, t = args.collectives_worker
        collectives_worker(fsdp, tp, (b, t))
        return
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # a persistent cache would hide compiles
    print(header("first-call (compile) time vs depth: scanned vs unrolled decoder layers"))
    layer_counts = sorted(set(args.layers))
    print(f"small-width Llama {WIDTH}, float32; generate batch 1, prompt {PROMPT}, {NEW} new tokens; "
          f"train step batch {TRAIN_BATCH[0]} x {TRAIN_BATCH[1]}; depths {layer_counts}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    t0 = time.perf_counter()
    depth_table(layer_counts, max(1, args.repeats))
    print(f"\n(small table: {time.perf_counter() - t0:.0f} s)\n")
    if args.big:
        t0 = time.perf_counter()
        big_table()
        print(f"\n(big table: {time.perf_counter() - t0:.0f} s)")

if __name__ == "__main__":
    main()
