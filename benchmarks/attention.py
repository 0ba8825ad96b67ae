"""Attention implementations vs `jax.nn.dot_product_attention`: run time, compile time, temporary memory.

    python benchmarks/attention.py [--lengths 512 1024 2048 4096] [--runs 5] [--quick]

Self-attention (S = T), causal, B=1, H=8, KV=2 (GQA), D=64, float32, on the CPU backend with 8
simulated devices (`workbench.simulate_devices(8)`); `ring` and `ulysses` run on
`make_mesh(fsdp=1, sp=8)` with inputs split on their length over sp, the others on one device.
The baseline is `jax.nn.dot_product_attention(implementation="xla", is_causal=True)`: for S = T
its top-left causal mask equals our bottom-right one. Each callable is `jax.jit`-ed; compile ms
is the wall time of `jax.jit(f).lower(...).compile()` (trace + lower + compile), temp MiB is
`compiled.memory_analysis().temp_size_in_bytes`, run ms the median of at least `--runs` calls
after a warm-up. Tables: forward, forward+backward (`jax.grad` of the output sum w.r.t. q, k, v),
the targets at T=2048, the cost of switching implementation inside one jitted function
(`impl` static), and paged decode vs a contiguous cache. `--quick`: lengths <= 2048, 3 runs.
"""

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import workbench  # cheap: nothing of JAX runs before simulate_devices

# The single-device kernels are also measured in a child process with one CPU device: splitting the
# CPU into 8 simulated devices slows XLA's small per-tile ops (flash) more than jax.nn's large ones.
SINGLE = "--single-device-targets" in sys.argv
workbench.simulate_devices(1 if SINGLE else 8)  # before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _header import header  # noqa: E402
from _timing import time_round_robin  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from workbench.core.mesh import make_mesh  # noqa: E402
from workbench.core.operations import OperationMetadata, OperationRegistry  # noqa: E402

B, H, KV, D = 1, 8, 2, 64
DTYPE = jnp.float32
SP = 8
JAX_NN = "jax.nn (xla)"
IMPLS = ("vanilla", "sdpa", "flash", "flex", "ring", "ulysses")
SEQUENCE_PARALLEL = ("ring", "ulysses")
MIN_TIMED_S = 1.0  # more rounds (same median) while the timed calls of one table group took less than this
MAX_RUNS = 50
TARGET_T = 2048
PAGED_S, PAGE_SIZE = 4096, 64
SWITCH_T = 1024
MiB = 2 ** 20
_START = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Notes:
    """Footnotes for table cells that could not be measured ("n/a [1]")."""

    def __init__(self):
        self.items: list[str] = []

    def add(self, text: str) -> str:
        text = " ".join(text.split())[:300]
        if text not in self.items:
            self.items.append(text)
        return f"n/a [{self.items.index(text) + 1}]"

    def render(self) -> str:
        return "\n".join(f"[{i}] {t}" for i, t in enumerate(self.items, 1))


# -- measuring --------------------------------------------------------------------------------------
def compile_one(fn, args) -> dict:
    """``jax.jit(fn)`` compiled for ``args``: the executable, compile ms and temporary bytes; run once (warm-up)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    stats = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))  # warm-up
    return {"compiled": compiled, "args": args, "compile_ms": compile_s * 1e3,
            "temp": None if stats is None else stats.temp_size_in_bytes}


def time_interleaved(cases: dict, runs: int) -> None:
    """Add the median run ms to each case, timed round-robin (``_timing.time_round_robin``)."""
    times = time_round_robin({n: (c["compiled"], c["args"]) for n, c in cases.items()}, runs, MIN_TIMED_S, MAX_RUNS)
    for name, case in cases.items():
        case["ms"] = statistics.median(times[name]) * 1e3
        case["runs"] = len(times[name])


def measure_all(fns: dict, args: dict, runs: int, notes: Notes, label: str) -> dict:
    """``{name: result dict or "n/a [i]"}``: compile every function, then time them interleaved."""
    results, cases = {}, {}
    for name, fn in fns.items():
        progress(f"{label}: compile {name}")
        try:
            cases[name] = results[name] = compile_one(fn, args[name])
        except Exception as e:  # a cell says why, the table goes on
            results[name] = notes.add(f"{name}, {label}: {type(e).__name__}: {e}")
    if cases:
        progress(f"{label}: timing {', '.join(cases)} interleaved")
        time_interleaved(cases, runs)
    for case in cases.values():
        del case["compiled"], case["args"]  # free the executables
    return results


def attention_fns(mesh) -> dict:
    """name -> ``f(q, k, v) -> (B, T, H, D)`` output, causal."""
    fns = {}
    for name in IMPLS:
        op = OperationRegistry.create(name, OperationMetadata(mesh=mesh if name in SEQUENCE_PARALLEL else None))
        fns[name] = lambda q, k, v, op=op: op(q, k, v, causal=True).attention_outputs
    fns[JAX_NN] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    return fns


def grad_fn(fn):
    return jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))


def inputs(t: int, s: int, seed: int = 0) -> tuple:
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (B, t, H, D), DTYPE), jax.random.normal(kk, (B, s, KV, D), DTYPE),
            jax.random.normal(kv, (B, s, KV, D), DTYPE))


def run_table(kind: str, fns: dict, lengths, runs: int, mesh, notes: Notes) -> dict:
    """``{(name, T): result dict or "n/a [i]"}`` for forward (kind "fwd") or forward+backward ("grad")."""
    results = {}
    for t in lengths:
        args = inputs(t, t)
        sharded = None if mesh is None else jax.device_put(args, NamedSharding(mesh, P(None, "sp", None, None)))
        row = measure_all({name: fn if kind == "fwd" else grad_fn(fn) for name, fn in fns.items()},
                          {name: sharded if name in SEQUENCE_PARALLEL else args for name in fns}, runs, notes,
                          f"{kind} T={t}")
        results |= {(name, t): r for name, r in row.items()}
    return results


# -- printing -------------------------------------------------------------------------------------
def cell(result, key: str, fmt: str) -> str:
    if isinstance(result, str):
        return result
    value = result[key]
    if value is None:
        return "n/a"
    return fmt.format(value / MiB if key == "temp" else value)


def print_table(results: dict, names, lengths, columns) -> None:
    """One row per (implementation, T); ``columns``: (header, key, format)."""
    heads = ["implementation", "T", *(h for h, _, _ in columns)]
    rows = [[name, str(t), *(cell(results[name, t], k, f) for _, k, f in columns)]
            for t in lengths for name in names]
    print_rows(heads, rows)


def print_rows(heads: list[str], rows: list[list[str]], text_columns: int = 1) -> None:
    """A markdown table; the first ``text_columns`` columns left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < text_columns else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    print(line(heads))
    rule = ("-" * (w + 2) if i < text_columns else "-" * (w + 1) + ":" for i, w in enumerate(widths))
    print("|" + "|".join(rule) + "|")
    for r in rows:
        print(line(r))


def ratio(results: dict, num: tuple, den: tuple, key: str) -> float | None:
    a, b = results.get(num), results.get(den)
    if not isinstance(a, dict) or not isinstance(b, dict) or a[key] is None or not b[key]:
        return None
    return a[key] / b[key]


def print_targets(fwd: dict, grad: dict) -> None:
    t = TARGET_T
    speedup = ratio(fwd, (JAX_NN, t), ("flash", t), "ms")
    fwd_temp = ratio(fwd, ("flash", t), (JAX_NN, t), "temp")
    grad_temp = ratio(grad, ("flash", t), (JAX_NN, t), "temp")
    grad_speedup = ratio(grad, (JAX_NN, t), ("flash", t), "ms")
    targets = [
        (f"flash forward speed-up vs jax.nn, T={t}", speedup, ">= 2.5x", lambda r: r >= 2.5, "{:.2f}x"),
        (f"flash forward temp / jax.nn, T={t}", fwd_temp, "<= 1/10", lambda r: r <= 0.1, "{:.4f}"),
        (f"flash fwd+bwd temp / jax.nn, T={t}", grad_temp, "<= 1/4", lambda r: r <= 0.25, "{:.4f}"),
        (f"flash fwd+bwd speed-up vs jax.nn, T={t} (info)", grad_speedup, "-", None, "{:.2f}x"),
    ]
    rows = []
    for label, value, target, ok, fmt in targets:
        if value is None:
            rows.append([label, "n/a", target, f"n/a (T={t} not measured)"])
        else:
            rows.append([label, fmt.format(value), target, "-" if ok is None else ("met" if ok(value) else "MISSED")])
    print_rows(["quantity", "measured", "target", "status"], rows, text_columns=4)


# -- switching implementation inside one jitted function ----------------------------------------------
class CompileCounter:
    """XLA backend compilations by function name (``jax.monitoring`` event ``EVENT``)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.names: list[str] = []
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    @property
    def count(self) -> int:
        return len(self.names)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.names.append(str(kwargs.get("fun_name", "?")))


def switch_cost(mesh, runs: int, counter: CompileCounter) -> None:
    ops = {name: OperationRegistry.create(name, OperationMetadata(mesh=mesh if name in SEQUENCE_PARALLEL else None))
           for name in IMPLS}

    def attend(q, k, v, impl):
        return ops[impl](q, k, v, causal=True).attention_outputs

    f = jax.jit(attend, static_argnames="impl")
    args = inputs(SWITCH_T, SWITCH_T, seed=1)  # uncommitted: every implementation takes them as they are
    jax.block_until_ready(args)

    def call(impl: str) -> tuple[float, list[str]]:
        before = counter.count
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args, impl=impl))
        return (time.perf_counter() - t0) * 1e3, counter.names[before:]

    first = {}
    for impl in IMPLS:
        progress(f"switch: first call {impl}")
        first[impl] = (*call(impl), f._cache_size())
    cache_after_first = f._cache_size()
    back: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    back_compiles = dict.fromkeys(IMPLS, 0)
    progress("switch: switching back")
    for _ in range(runs):  # every call switches from the previous implementation to an already used one
        for impl in IMPLS:
            ms, compiles = call(impl)
            back[impl].append(ms)
            back_compiles[impl] += len(compiles)
    cache_after = f._cache_size()
    rows = []
    for impl in IMPLS:
        ms, compiles, cache = first[impl]
        med = statistics.median(back[impl])
        helpers = [n for n in compiles if n != f"jit({attend.__name__})"]
        shown = f"{len(compiles)}" + (f" ({len(helpers)} x {'/'.join(sorted(set(helpers)))} [a])" if helpers else "")
        rows.append([impl, f"{ms:.0f}", shown, str(cache), f"{med:.2f}",
                     f"{back_compiles[impl]} in {runs}", f"{ms - med:.0f}", f"{ms / med:.0f}x"])
    print_rows(["implementation", "first call ms (trace+compile+run)", "XLA compiles", "cache size after",
                "switch-back call ms (median)", "XLA compiles", "difference ms", "first / switch-back"], rows)
    hit = cache_after == cache_after_first == len(IMPLS) and not any(back_compiles.values())
    print(f"\n`f._cache_size()`: {cache_after_first} after the first calls, {cache_after} after "
          f"{runs * len(IMPLS)} switching calls: {'cache hits, no recompilation' if hit else 'RECOMPILED'}. "
          f"XLA compiles counted with `jax.monitoring` ({CompileCounter.EVENT}); ring/ulysses compile into the "
          f"same program (their inner `jit` is inlined). The inputs are single-device (uncommitted) for all "
          f"five, so ring/ulysses calls include splitting them over sp.")
    helpers = {n for _, names, _ in first.values() for n in names if n != f"jit({attend.__name__})"}
    if helpers == {"jit(_multi_slice)"}:
        print("[a] jit(_multi_slice): JAX's helper that splits the single-device inputs over the sp devices for "
              "shard_map; compiled once per input shape, so only the first sequence-parallel implementation pays.")
    elif helpers:
        print(f"[a] computations JAX compiled outside the jitted function: {sorted(helpers)}")


# -- paged decode -------------------------------------------------------------------------------------
def paged_decode(runs: int, notes: Notes) -> None:
    pages_per_seq = PAGED_S // PAGE_SIZE
    num_pages = 2 * pages_per_seq  # a pool twice the size needed, pages scattered at random
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(2), 4)
    q = jax.random.normal(kq, (B, 1, H, D), DTYPE)
    key_pages = jax.random.normal(kk, (num_pages, PAGE_SIZE, KV, D), DTYPE)
    value_pages = jax.random.normal(kv, (num_pages, PAGE_SIZE, KV, D), DTYPE)
    page_table = jax.random.permutation(kp, num_pages)[: B * pages_per_seq].reshape(B, pages_per_seq)
    lengths = jnp.full((B,), PAGED_S, jnp.int32)
    k_cache = key_pages[page_table].reshape(B, PAGED_S, KV, D)  # the same keys, contiguous
    v_cache = value_pages[page_table].reshape(B, PAGED_S, KV, D)

    paged = OperationRegistry.create("paged")
    cases = {"paged": (lambda q, kp, vp, pt, n: paged(q, kp, vp, page_table=pt, kv_lengths=n,
                                                        causal=True).attention_outputs,
                       (q, key_pages, value_pages, page_table, lengths), f"{num_pages} pages x {PAGE_SIZE}")}
    for name in ("flash", "vanilla", "sdpa"):
        op = OperationRegistry.create(name)
        cases[name] = (lambda q, k, v, n, op=op: op(q, k, v, causal=True, kv_lengths=n).attention_outputs,
                       (q, k_cache, v_cache, lengths), f"contiguous ({B}, {PAGED_S}, {KV}, {D})")
    results = measure_all({name: fn for name, (fn, _, _) in cases.items()},
                          {name: args for name, (_, args, _) in cases.items()}, runs, notes, "paged decode")
    outputs = {name: np.asarray(jax.jit(fn)(*args)) for name, (fn, args, _) in cases.items()
               if isinstance(results[name], dict)}
    rows = []
    for name, (_, _, cache) in cases.items():
        r = results[name]
        err = (f"{np.abs(outputs[name] - outputs['vanilla']).max():.1e}"
               if name in outputs and "vanilla" in outputs else "n/a")
        rows.append([name, cache, cell(r, "ms", "{:.3f}"), cell(r, "temp", "{:.3f}"), cell(r, "compile_ms", "{:.0f}"),
                     err])
    print_rows(["implementation", "KV cache", "median ms", "temp MiB", "compile ms", "max abs diff vs vanilla"], rows,
               text_columns=2)


def single_device_targets(runs: int) -> None:
    """The T=2048 targets for flash vs jax.nn, both on the only device of this process."""
    fns = {n: f for n, f in attention_fns(None).items() if n in ("flash", JAX_NN)}
    notes = Notes()
    fwd = run_table("fwd", fns, [TARGET_T], runs, None, notes)
    grad = run_table("grad", fns, [TARGET_T], runs, None, notes)
    print(f"{jax.device_count()} CPU device; median ms: flash {fwd[('flash', TARGET_T)]['ms']:.1f}, "
          f"jax.nn {fwd[(JAX_NN, TARGET_T)]['ms']:.1f} (forward)\n")
    print_targets(fwd, grad)
    if notes.items:
        print("\n" + notes.render())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths T (= S)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per cell (at least; default 5)")
    parser.add_argument("--quick", action="store_true", help="lengths <= 2048 and 3 runs unless given")
    parser.add_argument("--single-device-targets", action="store_true",
                        help="(internal) only the T=2048 targets, in a process with one CPU device")
    args = parser.parse_args()
    if SINGLE:
        single_device_targets(args.runs or 5)
        return
    lengths = args.lengths or ([512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096])
    runs = args.runs or (3 if args.quick else 5)
    bad = [t for t in lengths if t % SP]
    if bad:
        parser.error(f"--lengths {bad}: each T must be divisible by sp={SP} (ring and ulysses split it)")

    counter = CompileCounter()
    mesh = make_mesh(fsdp=1, sp=SP)
    notes = Notes()
    print(header(f"attention: causal self-attention, B={B} H={H} KV={KV} D={D} float32, median of >= {runs} runs"))
    load_start = os.getloadavg()[0]
    print(f"ring/ulysses on {workbench.describe_mesh(mesh)}; the others on one device. Baseline {JAX_NN}: "
          f"jax.nn.dot_product_attention(implementation=\"xla\", is_causal=True) (S = T, so its top-left causal "
          f"mask is our bottom-right one). Compile ms: jax.jit(f).lower(...).compile() wall time. Temp MiB: "
          f"memory_analysis().temp_size_in_bytes, per device (ring/ulysses: per simulated device, {SP} of them). "
          f"Run ms: the implementations of one table group are timed round-robin (warm-up first), so they share "
          f"the noise of the machine.\n")

    fns = attention_fns(mesh)
    names = list(fns)
    fwd = run_table("fwd", fns, lengths, runs, mesh, notes)
    print("## Forward\n")
    print_table(fwd, names, lengths, [("median ms", "ms", "{:.2f}"), ("compile ms", "compile_ms", "{:.0f}"),
                                      ("temp MiB", "temp", "{:.2f}")])

    grad = run_table("grad", fns, lengths, runs, mesh, notes)
    print("\n## Forward + backward (jax.grad of output.sum() w.r.t. q, k, v)\n")
    print_table(grad, names, lengths, [("median ms", "ms", "{:.2f}"), ("compile ms", "compile_ms", "{:.0f}"),
                                       ("temp MiB", "temp", "{:.2f}")])

    print(f"\n## Targets (T={TARGET_T}, causal, from the tables above)\n")
    print_targets(fwd, grad)

    print("\n## Targets again, measured in a process with one CPU device (no simulated devices)\n")
    sys.stdout.flush()
    import subprocess

    subprocess.run([sys.executable, __file__, "--single-device-targets", "--runs", str(runs)], check=True)

    print(f"\n## Switch cost: one `jax.jit(f, static_argnames=\"impl\")`, T={SWITCH_T}, forward\n")
    try:
        switch_cost(mesh, runs, counter)
    except Exception as e:
        print(notes.add(f"switch cost: {type(e).__name__}: {e}"))

    print(f"\n## Paged decode: T=1 query over S={PAGED_S} cached keys (page_size {PAGE_SIZE}), kv_lengths={PAGED_S}\n")
    paged_decode(runs, notes)

    if notes.items:
        print("\n" + notes.render())
    total = time.perf_counter() - _START
    progress(f"done in {total:.0f}s")
    print(f"\n(total {math.ceil(total)} s; 1-minute load average {load_start:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
