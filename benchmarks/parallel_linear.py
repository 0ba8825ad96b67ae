"""Tensor-parallel MLP (column D->F, then row F->D) vs the single-device `x @ w1 @ w2`: overhead per method.

    python benchmarks/parallel_linear.py [--runs 5] [--quick]

T=512 tokens, D=1024, F=4096, float32, no bias, no activation, on the CPU backend with 8 simulated
devices (`workbench.simulate_devices(8)`). For n in 1, 2, 4, 8 the layers run on
`make_mesh(fsdp=1, tp=n, devices=jax.devices()[:n])` with each `matmul_method` (gspmd, shard_map,
collective_matmul); the baseline is `jax.jit(lambda x, w1, w2: x @ w1 @ w2)` on device 0, with the same
weights. Each parallel input is placed where the column layer asks for it (`activation_specs`: replicated,
or split on its rows over tp for collective_matmul); every output is replicated. All 13 programs are
compiled first, then timed round-robin (one call of each per round) so they share the machine's noise:
median ms of at least `--runs` rounds after a warm-up, more rounds while the timed calls took under 10 s.
Collectives are those of the compiled program (`workbench.core.hlo.collectives.collectives`), bytes per device
their result bytes (`summarize`). Simulated devices share the host's cores, so the target is overhead,
not speed-up: each method within 1.2x of the single-device time. `--quick`: 3 runs, no extra rounds.
"""

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import workbench  # cheap: nothing of JAX runs before simulate_devices

workbench.simulate_devices(8)  # before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _header import header  # noqa: E402
from _timing import time_round_robin  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from workbench.core.hlo.collectives import collectives, summarize  # noqa: E402
from workbench.core.linear import (  # noqa: E402
    MATMUL_METHODS,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelConfig,
)
from workbench.core.mesh import make_mesh  # noqa: E402
from workbench.core.sharding.memory import memory_per_device  # noqa: E402

T, D, F = 512, 1024, 4096
DTYPE = jnp.float32
DEVICE_COUNTS = (1, 2, 4, 8)
TARGET = 1.2
DENSE = "dense (1 device)"
MIN_TIMED_S = 10.0  # more rounds (up to MAX_RUNS) while the timed calls took less than this
MAX_RUNS = 50
MiB = 2**20
_START = time.perf_counter()

# The kind names HLO uses, shortened for the table.
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def mlp_case(n: int, method: str, x: np.ndarray) -> dict:
    """The column -> row MLP on ``tp=n`` devices with ``method``: compiled program, args, collectives."""
    mesh = make_mesh(fsdp=1, tp=n, devices=jax.devices()[:n])
    config = TensorParallelConfig(mesh, matmul_method=method)
    up = ColumnParallelLinear(D, F, use_bias=False, param_dtype=DTYPE, parallel_config=config, rngs=nnx.Rngs(1))
    down = RowParallelLinear(F, D, use_bias=False, param_dtype=DTYPE, parallel_config=config, rngs=nnx.Rngs(2))
    graphdef, state = nnx.split((up, down))

    def mlp(state, x):
        up, down = nnx.merge(graphdef, state)
        return down(up(x))

    x_spec, _ = up.activation_specs(x.shape)
    x_dev = jax.device_put(x, NamedSharding(mesh, x_spec))
    t0 = time.perf_counter()
    compiled = jax.jit(mlp).lower(state, x_dev).compile()
    compile_ms = (time.perf_counter() - t0) * 1e3
    records = collectives(compiled, mesh=mesh)
    params = memory_per_device(jax.tree.leaves(state))
    return {"compiled": compiled, "args": (state, x_dev), "compile_ms": compile_ms, "collectives": records,
            "param_bytes": params.max, "weights": (np.asarray(up.kernel[...]), np.asarray(down.kernel[...]))}


def dense_case(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> dict:
    device = jax.devices()[0]
    args = jax.device_put((x, w1, w2), device)
    t0 = time.perf_counter()
    compiled = jax.jit(lambda x, w1, w2: x @ w1 @ w2).lower(*args).compile()
    compile_ms = (time.perf_counter() - t0) * 1e3
    return {"compiled": compiled, "args": args, "compile_ms": compile_ms, "collectives": [],
            "param_bytes": w1.nbytes + w2.nbytes}


def time_interleaved(cases: dict, runs: int, min_timed_s: float) -> None:
    """Add the median run ms to each case, timed round-robin (``_timing.time_round_robin``)."""
    for case in cases.values():  # warm-up; its output is compared with the float64 product
        case["out"] = np.asarray(jax.block_until_ready(case["compiled"](*case["args"])))
    times = time_round_robin({n: (c["compiled"], c["args"]) for n, c in cases.items()}, runs, min_timed_s, MAX_RUNS,
                             on_round=lambda r, elapsed: progress(f"round {r}: {elapsed:.1f}s timed"))
    for name, case in cases.items():
        case["ms"] = statistics.median(times[name]) * 1e3
        case["spread"] = (min(times[name]) * 1e3, max(times[name]) * 1e3)
        case["runs"] = len(times[name])


def collectives_cell(records) -> str:
    summary = summarize(records)
    return ", ".join(f"{SHORT.get(kind, kind)} x{s['count']}" for kind, s in summary.items()) or "-"


def comm_bytes(records) -> int:
    return sum(s["bytes"] for s in summarize(records).values())


def print_rows(heads: list[str], rows: list[list[str]], text: tuple[int, ...] = (0,)) -> None:
    """A markdown table; the columns in ``text`` left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i in text else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    print(line(heads))
    rule = ("-" * (w + 2) if i in text else "-" * (w + 1) + ":" for i, w in enumerate(widths))
    print("|" + "|".join(rule) + "|")
    for r in rows:
        print(line(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="timed rounds (at least; default 5, 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="3 runs unless given, no extra rounds")
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    min_timed_s = 0.0 if args.quick else MIN_TIMED_S

    flops = 2 * T * D * F * 2
    print(header(f"tensor-parallel MLP: x[{T},{D}] @ w1[{D},{F}] @ w2[{F},{D}], float32, "
                 f"median of >= {runs} rounds"))
    print(f"{flops / 1e9:.1f} GFLOP per call. Column (w1 split on F over tp) then row (w2 split on F over tp) "
          f"layers of workbench.core.linear on make_mesh(fsdp=1, tp=n, devices=jax.devices()[:n]); "
          f"{DENSE}: jax.jit(lambda x, w1, w2: x @ w1 @ w2) on {jax.devices()[0]}, same weights. All programs "
          f"timed round-robin in one loop. Collectives: AR all-reduce, AG all-gather, RS reduce-scatter, "
          f"CP collective-permute; bytes = result bytes per device, summed. {jax.device_count()} simulated "
          f"devices share {os.cpu_count()} cores: the target is overhead (<= {TARGET}x the "
          f"single-device time), not speed-up.\n")

    x = np.random.default_rng(0).standard_normal((T, D)).astype(np.float32)
    cases: dict = {}
    for n in DEVICE_COUNTS:
        for method in MATMUL_METHODS:
            progress(f"compile tp={n} {method}")
            cases[n, method] = mlp_case(n, method, x)
    w1, w2 = cases[DEVICE_COUNTS[0], MATMUL_METHODS[0]]["weights"]
    assert all(np.array_equal(c["weights"][0], w1) and np.array_equal(c["weights"][1], w2) for c in cases.values())
    progress("compile dense")
    cases = {DENSE: dense_case(x, w1, w2), **cases}
    progress(f"timing {len(cases)} programs round-robin")
    time_interleaved(cases, runs, min_timed_s)

    reference = np.asarray(x, np.float64) @ w1.astype(np.float64) @ w2.astype(np.float64)
    scale = np.abs(reference).max()
    dense = cases[DENSE]
    rows, missed = [], 0
    for key, case in cases.items():
        n, method = (1, "x @ w1 @ w2") if key == DENSE else key
        ratio = case["ms"] / dense["ms"]
        err = np.abs(case["out"] - reference).max() / scale
        if key == DENSE:
            status = "baseline"
        else:
            status = "met" if ratio <= TARGET else "MISSED"
            missed += status == "MISSED"
        lo, hi = case["spread"]
        rows.append([str(n) if key != DENSE else "1 (dense)", method, f"{case['ms']:.1f}", f"{lo:.1f}-{hi:.1f}",
                     f"{ratio:.3f}x", collectives_cell(case["collectives"]),
                     f"{comm_bytes(case['collectives']) / MiB:.2f}", f"{case['param_bytes'] / MiB:.1f}",
                     f"{err:.1e}", f"{case['compile_ms']:.0f}", status])
    print(f"## Forward, median of {dense['runs']} rounds\n")
    print_rows(["devices", "method", "median ms", "min-max ms", "vs dense", "collectives",
                "comm MiB/device", "params MiB/device", "max|Δ|/max|y|", "compile ms", f"<= {TARGET}x"],
               rows, text=(0, 1, 5, 10))

    print("\n## Collectives of the tp=8 programs (from the compiled HLO)\n")
    detail = []
    for method in MATMUL_METHODS:
        for kind, group in _by_kind(cases[8, method]["collectives"]).items():
            shapes = sorted({f"{r.dtype}[{','.join(map(str, r.shape))}]" for r in group})
            axes = sorted({",".join(r.mesh_axes or ()) or "-" for r in group})
            detail.append([method, kind, str(len(group)), " ".join(shapes), f"{group[0].bytes:,}",
                           f"{sum(r.bytes for r in group):,}", "/".join(axes)])
    print_rows(["method", "kind", "count", "result shape", "bytes/device each", "bytes/device total", "mesh axes"],
               detail, text=(0, 1, 3, 6))

    print("\nAt tp=1 the shard_map and collective_matmul programs keep a one-device all-reduce / all-gather "
          "(replica groups {0}): XLA leaves them in, though no other device takes part.")
    measured = len(cases) - 1
    print(f"\n{measured - missed} of {measured} rows met the target (each method <= {TARGET}x the single-device "
          f"time): {'met' if not missed else 'MISSED'}")
    total = time.perf_counter() - _START
    progress(f"done in {total:.0f}s")
    print(f"\n(total {math.ceil(total)} s)")


def _by_kind(records) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(r.kind, []).append(r)
    return out


if __name__ == "__main__":
    main()
