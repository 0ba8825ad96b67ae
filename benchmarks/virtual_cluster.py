"""Llama-3-70B on virtual clusters: abstract model, ledger, and a train step compiled for the cluster.

On this machine (8 simulated CPU devices in this process): the time of `CausalLM.lazy_init` of the full-size
preset (target <= 1 s), of the memory ledger for a layout (the explorer's per-edit cost, target <= 300 ms), and of
`virtual.compile_step(kind="train")` (loss, gradient, AdamW update, state donated; bfloat16; remat "full") with
its analysis (target <= 15 s; issue 16's baseline: 137 s for the collectives of a train step on 64 simulated
devices), on a TPU v5p:4x4x4 slice (XLA's TPU compiler, ahead of time) and on 8 nodes x 8 H100 (a worker with
64 simulated CPU devices; its first compile includes starting the worker), FSDP x TP. Then the ledger's total
against the compiled one.
"""

import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _header import header, print_rows  # imports nothing of JAX

CASES = (("v5p:4x4x4", {"fsdp": 16, "tp": 4}, (16, 2048)), ("h100x8", {"fsdp": 8, "tp": 8}, (16, 2048)))
REMAT = "full"


def main() -> None:
    from workbench.core.mesh import simulate_devices

    simulate_devices(8)
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)
    from workbench.core.cluster import Cluster
    from workbench.core.explore import Layout
    from workbench.core.ledger import ledger
    from workbench.core.mesh import MESH_AXES
    from workbench.core.models.presets import full_config
    from workbench.core.steps import full_mesh_shape
    from workbench.core.virtual import cluster_mesh, compile_step
    from workbench.models import CausalLM

    print(header("Llama-3-70B on virtual clusters: lazy_init, ledger, train-step compile + analysis"))
    config = full_config("llama-3-70b")
    lazy = []
    for _ in range(3):
        t0 = time.perf_counter()
        model = CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        lazy.append(time.perf_counter() - t0)
    model = model.with_options(remat=REMAT)
    print(f"`CausalLM.lazy_init(llama-3-70b)`, bfloat16, 3 calls: {', '.join(f'{s:.2f} s' for s in lazy)} "
          f"(target <= 1 s: {'met' if min(lazy[1:]) <= 1 else 'MISSED'})\n")
    rows = []
    for name, mesh_shape, batch in CASES:
        cluster = Cluster.tpu(name) if ":" in name else Cluster.h100(nodes=8)
        mesh = cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES)
        t0 = time.perf_counter()
        layout = Layout.of(model, mesh)
        predicted = ledger(model, layout, batch=batch, cluster=cluster)
        ledger_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = compile_step(model, cluster, mesh_shape, batch=batch)
        wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        compile_step(model, cluster, mesh_shape, batch=batch)
        again = time.perf_counter() - t0
        total = compiled.memory.total
        xla = compiled.xla_seconds
        rows.append((cluster.name, " x ".join(f"{k}={v}" for k, v in mesh_shape.items()), f"{batch[0]} x {batch[1]}",
                     f"{ledger_s * 1e3:.0f} ms", f"{wall:.1f} s / {again:.1f} s", f"{compiled.compile_seconds:.1f} s",
                     f"{predicted.total / 2**30:.2f} GiB", f"{total / 2**30:.2f} GiB",
                     f"{predicted.total / total - 1:+.1%}", f"{cluster.hbm_per_device / 2**30:.1f} GiB",
                     "-" if xla is None else f"{xla:.3f} s", str(sum(c.trips for c in compiled.collectives))))
        print(f"  {cluster.name}: done ({wall:.1f} s)", flush=True)
    print()
    print_rows(["cluster", "mesh", "batch", "ledger (layout + parts)", "compile + analysis (first / again)",
                "XLA compile", "ledger total", "compiled total", "ledger vs compiled", "HBM / device",
                "XLA's time estimate", "collectives run"], rows)
    print(f"\nremat={REMAT}, AdamW in bfloat16 (optax keeps moments in the parameters' dtype). Targets: ledger "
          f"<= 300 ms, compile + analysis <= 15 s, ledger within 10 % of compiled. On the H100 cluster the compiled "
          f"total is XLA:CPU's buffer assignment (the worker compiles for CPU devices); its bfloat16 math is "
          f"widened to float32 there.")


if __name__ == "__main__":
    main()
