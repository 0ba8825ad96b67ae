"""Predicted step time of a Llama-3-70B train step on virtual clusters (`workbench.core.cost.compiled_step.step_time`).

    python benchmarks/step_time.py [--batch 16 2048]
    python benchmarks/step_time.py --predict [--batch 512 4096]

The train step (loss, gradient, AdamW update, state donated; bfloat16; remat "full") compiled as
`benchmarks/virtual_cluster.py` compiles it: on a TPU v5p:4x4x4 slice (XLA's TPU compiler, ahead of time) with
fsdp=16 x tp=4, and on 8 nodes x 8 H100 (a worker with 64 simulated CPU devices) with fsdp=8 x tp=8. Printed:
the model's compute / memory / communication parts, the collectives by network level, MFU and HFU, and on TPU XLA's own
estimate (`optimal_seconds`, a loop body counted once), then the same layout predicted from shapes without
compiling (`workbench.core.cost.predicted.predict_step`). Nothing is timed on a device: these are predictions.

``--predict`` times `predict_step` itself, what a layout search calls for every candidate: every mesh shape
(pp, dp, fsdp, tp, sp) of 64 to 1024 chips with three remat policies, cold (first sight of each mesh) and warm.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _header import header  # imports nothing of JAX

CASES = (("v5p:4x4x4", {"fsdp": 16, "tp": 4}), ("h100x8", {"fsdp": 8, "tp": 8}))


def layouts(cluster, batch):
    """Every (pp, dp, fsdp, tp, sp) mesh of ``cluster`` a 70B model can take (tp <= 16, pp <= 8 dividing its 80
    layers, the batch splitting over dp x fsdp and 2 pp microbatches), with each remat policy."""
    from workbench.core.pipeline_schedule import PipelineConfig

    for pp, dp, fsdp, tp, sp in cluster.valid_mesh_shapes(5):
        pipeline = PipelineConfig(pp, 2 * pp) if pp > 1 else None
        if tp > 16 or pp > 8 or 80 % pp or batch[0] % (dp * fsdp * (2 * pp if pp > 1 else 1)):
            continue
        for remat in ("full", "dots_saveable", "none"):
            yield {"pp": pp, "dp": dp, "fsdp": fsdp, "tp": tp, "sp": sp}, remat, pipeline


def predict_timing(batch: tuple[int, int]) -> None:
    """Seconds per `predict_step` call over every layout of 64 to 1024 chips (no timed asserts: a table)."""
    from _header import print_rows

    from workbench.core.cost.predicted import predict_step
    from workbench.core.hardware.cluster import Cluster
    from workbench.core.models.presets import full_config
    from workbench.core.units import format_seconds

    print(header(f"Llama-3-70B train step, batch {batch[0]} x {batch[1]}: predict_step over every layout"))
    config = full_config("llama-3-70b")
    rows = []
    for cluster in (Cluster.h100(nodes=8), Cluster.tpu("v5p:4x4x4"), Cluster.h100(nodes=32), Cluster.h100(nodes=128),
                    Cluster.tpu("v5p:8x8x16")):
        cases = list(layouts(cluster, batch))
        timings = []
        for _ in range(2):  # cold: the first sight of each mesh (where its groups sit); warm: remembered
            t0 = time.perf_counter()
            steps = [predict_step(config, cluster, mesh, batch=batch, remat=remat, pipeline=pipeline)
                     for mesh, remat, pipeline in cases]
            timings.append((time.perf_counter() - t0) / len(cases))
        best, (mesh, remat, _) = min(zip(steps, cases, strict=True), key=lambda pair: pair[0].time_s)
        shape = " x ".join(f"{k}={v}" for k, v in mesh.items() if v > 1)
        rows.append((cluster.name, str(len(cases)), f"{timings[0] * 1e3:.3f}", f"{timings[1] * 1e3:.3f}",
                     f"{shape}, remat {remat}: {format_seconds(best.time_s)} ({best.bound})"))
    print_rows(["cluster", "layouts", "ms / call cold", "ms / call warm", "fastest predicted (memory not checked)"],
               rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs=2, default=None, metavar=("SEQUENCES", "LENGTH"))
    parser.add_argument("--predict", action="store_true", help="time predict_step over many layouts instead")
    args = parser.parse_args()
    if args.predict:
        predict_timing(tuple(args.batch or (512, 4096)))
        return
    args.batch = args.batch or (16, 2048)
    import jax.numpy as jnp

    from workbench.core.compile.virtual import compile_step
    from workbench.core.cost.compiled_step import step_time
    from workbench.core.cost.flops import model_flops
    from workbench.core.cost.predicted import predict_step
    from workbench.core.hardware.cluster import Cluster
    from workbench.core.models.presets import full_config
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
        # the dots include remat's recompute (HFU); MFU counts the model's FLOPs, a device's share of them
        step = step_time(analysis, model_flops=model_flops(model.config, batch) / cluster.num_devices)
        tokens = batch[0] * batch[1]
        print(f"## {cluster.name}, {' x '.join(f'{k}={v}' for k, v in mesh_shape.items())}, batch {batch[0]} x "
              f"{batch[1]} ({tokens / cluster.num_devices:.0f} tokens per device); compiled in {seconds:.0f} s\n")
        print(step.summary())
        print(f"\n{tokens / step.time_s:,.0f} tokens/s predicted; at 50 % of peak FLOP/s: "
              f"{step_time(analysis, efficiency=0.5).time_s:.3g} s a step\n")
        shapes = predict_step(model.config, cluster, mesh_shape, batch=batch, remat="full")
        print("Predicted from shapes, without compiling (cost.predicted.predict_step):\n")
        print(shapes.summary(top=6) + "\n")


if __name__ == "__main__":
    main()
