"""Published serving steps, predicted vs measured: how true the serving model is.

    python benchmarks/published_serving.py

Prices every point of `workbench/core/interop/published_serving.json` (TensorRT-LLM and NVIDIA NIM on H100 / H200;
vLLM and sglang-jax on TPU v6e and TPU7x; the raw records with each quote are in `benchmarks/data/`) with the
serving model (`workbench/core/cost/serving.py`) and prints per point: the engine, the model, the chips, the
requests in flight (or the prompts sent at once), the lengths, measured and predicted, their ratio, and the ratio
with its engine's cost a layer refitted without it (leave-one-out: a decode point of a fitted engine and chip;
every prefill and throughput point is out of sample for it already). Decode is the time per output token (TPOT or
the mean inter-token latency); prefill the time to the first token; throughput output tokens a second at a running
batch the engine published. Then, per kind, the spread in sample and out of sample; each engine's cost a layer as
shipped, fitted and refitted; and the measured points set aside, each with why. Target (issue 49): decode and
prefill within 0.7-1.35x with the median |ratio| within 1.15x; throughput at most 1.35x the measured. Nothing is
timed: these are predictions held against others' measurements.
"""

import os
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _header import header, print_rows  # imports nothing of JAX

MEDIAN = 1.15
THROUGHPUT_CEILING = 1.35


def _measured(p) -> str:
    return f"{p.measured:,.0f} tok/s" if p.kind == "throughput" else f"{p.measured * 1e3:.2f} ms"


def _predicted(p) -> str:
    value = p.predicted()
    return f"{value:,.0f} tok/s" if p.kind == "throughput" else f"{value * 1e3:.2f} ms"


def _load(p) -> str:
    if p.kind != "prefill":
        return f"{p.concurrency} in flight"
    return f"{p.prompts} at once" + (f", {p.prefill_chunk:,} a step" if p.prefill_chunk else "")


def main() -> None:
    from workbench.core.interop.published_serving import (
        BAND,
        KINDS,
        accuracy,
        leave_one_out,
        not_held_points,
        published_points,
    )

    print(header("Published serving steps: predicted vs measured"))
    points = published_points()
    loo, refits = leave_one_out(points)
    for kind in KINDS:
        mine = [p for p in points if p.kind == kind]
        print(f"\n## {kind} ({len(mine)} points)\n")
        print_rows(["point", "engine", "chips", "mesh", "dtypes (w / kv)", "load", "in / out", "measured",
                    "predicted", "ratio", "out of sample"],
                   [(p.name, p.engine, p.cluster.name, " ".join(f"{a}={n}" for a, n in p.mesh.items()),
                     f"{p.weight_dtype or p.dtype} / {p.kv_dtype or p.dtype}", _load(p),
                     f"{p.input_len} / {p.output_len}", _measured(p), _predicted(p), f"{p.ratio():.2f}",
                     f"{loo[p.name]:.2f}") for p in mine])
        acc = accuracy(kind, points)
        out = [loo[p.name] for p in mine]
        print(f"\nin sample: {acc.low:.2f}x to {acc.high:.2f}x, median |ratio| {acc.median_abs:.2f}; out of sample: "
              f"{min(out):.2f}x to {max(out):.2f}x, median |ratio| "
              f"{statistics.median(max(r, 1 / r) for r in out):.2f}")
        if kind == "throughput":
            over = [p.name for p in mine if loo[p.name] > THROUGHPUT_CEILING]
            print(f"above {THROUGHPUT_CEILING}x the measured: {len(over)} of {len(mine)}" + (f" ({', '.join(over)})"
                                                                                            if over else ""))
        else:
            outside = [p.name for p in mine if not BAND[0] <= loo[p.name] <= BAND[1]]
            print(f"out of sample outside {BAND[0]}-{BAND[1]}x: {len(outside)} of {len(mine)}; target median "
                  f"|ratio| within {MEDIAN}")

    print("\n## each engine's cost a layer (fitted to its decode points)\n")
    print_rows(["engine", "chips", "decode points", "shipped", "fitted on all", "refitted without each"],
               [(r.engine, ", ".join(c.name for c in r.chips), str(len(r.left_out)), f"{r.shipped * 1e6:.0f} us",
                 f"{r.in_sample * 1e6:.1f} us",
                 f"{min(r.left_out.values()) * 1e6:.0f} to {max(r.left_out.values()) * 1e6:.0f} us") for r in refits])

    held_out = not_held_points()
    print(f"\n## set aside ({len(held_out)} measured points)\n")
    print_rows(["point", "why"], [(p["name"], p["why"]) for p in held_out])


if __name__ == "__main__":
    main()
