"""Predicted step time of a Llama-3-70B train step on virtual clusters (`workbench.core.cost.step_time`).

    python benchmarks/step_time.py [--batch 16 2048]

The train step (loss, gradient, AdamW update, state donated; bfloat16; remat "full") compiled as
`benchmarks/virtual_cluster.py` compiles it: on a TPU v5p:4x4x4 slice (XLA's TPU compiler, ahead of time) with
fsdp=16 x tp=4, and on 8 nodes x 8 H100 (a worker with 64 simulated CPU devices) with fsdp=8 x tp=8. Printed:
the model's compute / memory / communication parts, the collectives by network level, MFU, and on TPU XLA's own
estimate (`optimal_seconds`, a loop body counted once). Nothing is timed on a device: these are predictions.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _header import header  # imports nothing of JAX

CASES = (("v5p:4x4x4", {"fsdp": 16, "tp": 4}), ("h100x8", {"fsdp": 8, "tp": 8}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs=2, default=(16, 2048), metavar=("SEQUENCES", "LENGTH"))
    args = parser.parse_args()
    import jax.numpy as jnp

    from workbench.core.cluster import Cluster
    from workbench.core.cost import step_time
    from workbench.core.models.presets import full_config
    from workbench.core.virtual import compile_step
    from workbench.models import CausalLM

    print(header("Llama-3-70B train step: predicted step time on virtual clusters"))
    model = CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = model.with_options(remat="full")
    batch = tuple(args.batch)
    for name, mesh_shape in CASES:
        cluster = Cluster.tpu(name) if ":" in name else Cluster.h100(nodes=8)
        t0 = time.perf_counter()
        analysis = compile_step(model, cluster, mesh_shape, batch=batch)
        seconds = time.perf_counter() - t0
        step = step_time(analysis)
        tokens = batch[0] * batch[1]
        print(f"## {cluster.name}, {' x '.join(f'{k}={v}' for k, v in mesh_shape.items())}, batch {batch[0]} x "
              f"{batch[1]} ({tokens / cluster.num_devices:.0f} tokens per device); compiled in {seconds:.0f} s\n")
        print(step.summary())
        print(f"\n{tokens / step.time_s:,.0f} tokens/s predicted; at 50 % of peak FLOP/s: "
              f"{step_time(analysis, mfu=0.5).time_s:.3g} s a step\n")


if __name__ == "__main__":
    main()
