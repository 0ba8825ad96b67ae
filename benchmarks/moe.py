"""MoE strategies on 8 simulated devices: `alltoall` (tokens to experts) vs `dense` vs `ragged`.

    python benchmarks/moe.py [--runs 5] [--tokens 4096]

A Mixtral-shaped layer scaled to this CPU: 8 experts, top-2 routing, hidden 512, expert width 1792
(Mixtral's 3.5x), float32, random weights; a batch of `--tokens` tokens (sequences of 256). One training
step of the layer alone (forward, a squared-output loss, gradients of the weights and the input), compiled
for a `dp x ep` mesh with the batch over `dp`. For each strategy and ep in {2, 4, 8}:
- FLOPs per device from XLA's `cost_analysis()` of the compiled step (an SPMD program is one device's);
- temporary memory per device from `memory_analysis()`;
- step time: median wall time of `--runs` warm calls, the strategies taken round-robin (same machine noise).
`alltoall` runs at capacity factor 1.25 (drops reported) and with no drop (`None`). Simulated devices share
this machine's cores, so the times show relative cost, not a cluster's speed.
Targets (the expert-parallelism issue): alltoall's FLOPs per device <= 1/3 of dense's, and its step time
no worse than dense's at ep=8.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, __file__.rsplit("/", 1)[0])

import jax
import jax.numpy as jnp
import numpy as np
from _header import header, print_rows
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.mesh import make_mesh
from workbench.core.models.moe import MoE
from workbench.core.models.sharding import shard_model

D, F, E, K, SEQ = 512, 1792, 8, 2, 256
CASES = [("dense", None), ("ragged", None), ("alltoall", 1.25), ("alltoall", None)]


def compiled_step(strategy: str, capacity_factor, ep: int, tokens: int):
    mesh = make_mesh(dp=8 // ep, fsdp=1, ep=ep)
    layer = MoE(D, F, E, K, strategy=strategy, capacity_factor=capacity_factor, rngs=nnx.Rngs(0))
    layer = shard_model(layer, mesh)
    graphdef, params = nnx.split(layer, nnx.Param)
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((tokens // SEQ, SEQ, D)), jnp.float32),
                       NamedSharding(mesh, P("dp")))

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params)(x)
        return jnp.mean(y ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
    drops = None
    if strategy == "alltoall":
        _, d = jax.jit(lambda p, x: nnx.merge(graphdef, p).dispatch(x))(params, x)
        drops = int(d.dropped) / (tokens * K)
    return step, (params, x), drops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    print(header("MoE strategies: alltoall vs dense vs ragged (one training step of one layer)"))
    print(f"layer: {E} experts, top-{K}, hidden {D}, expert width {F}, float32; {args.tokens} tokens per step\n")
    for ep in (2, 4, 8):
        built = {case: compiled_step(*case, ep, args.tokens) for case in CASES}
        times = {case: [] for case in CASES}
        for _ in range(args.runs + 1):  # the first round warms up
            for case, (step, inputs, _) in built.items():
                t0 = time.perf_counter()
                jax.block_until_ready(step(*inputs))
                times[case].append(time.perf_counter() - t0)
        flops = {case: step.cost_analysis()["flops"] for case, (step, _, _) in built.items()}
        dense_flops, dense_ms = flops[CASES[0]], 1e3 * statistics.median(times[CASES[0]][1:])
        rows = []
        for case, (step, _, drops) in built.items():
            name = case[0] if case[0] != "alltoall" else f"alltoall (capacity {case[1] or 'no drop'})"
            ms = 1e3 * statistics.median(times[case][1:])
            temp = step.memory_analysis().temp_size_in_bytes / 2**20
            rows.append((name, f"{flops[case] / 1e9:.2f}", f"{flops[case] / dense_flops:.2f}", f"{temp:.1f}",
                         f"{ms:.0f}", f"{ms / dense_ms:.2f}", "-" if drops is None else f"{drops:.1%}"))
        print(f"## dp={8 // ep} x ep={ep}")
        print_rows(["strategy", "GFLOP/device", "vs dense", "temp MiB/device", "step ms", "vs dense",
                    "copies dropped"], rows)
        a2a = CASES[2]
        verdict = (f"alltoall (1.25) FLOPs {flops[a2a] / dense_flops:.2f}x dense (target <= 0.33: "
                   f"{'met' if flops[a2a] <= dense_flops / 3 else 'MISSED'})")
        if ep == 8:
            ratio = statistics.median(times[a2a][1:]) / statistics.median(times[CASES[0]][1:])
            verdict += f"; step time {ratio:.2f}x dense (target <= 1: {'met' if ratio <= 1 else 'MISSED'})"
        print(verdict + "\n")


if __name__ == "__main__":
    main()
