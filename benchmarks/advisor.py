"""The layout advisor: enumeration + ranking time per model and cluster (targets: <= 2 s up to 1,024 chips, <= 10 s up
to 16,384, before any compile), and the time to confirm the top layout with the compiler.

    python benchmarks/advisor.py [--confirm]

Llama-3-70B and DeepSeek-V3 (abstract, bfloat16) on TPU v5p slices of 64 and 1024 chips and a whole v5p pod
(16x20x28: 8,960 chips, searched with its 8,192- and 6,144-chip parts), and on 8, 128 and 2,048 nodes of 8
H100, train (AdamW, 4M tokens of 4096) and decode (64 sequences at 4096 tokens of cache). With ``--confirm``: the
top layout of Llama-3-70B training on each 64-device cluster compiled (TPU: XLA's TPU compiler ahead of time;
H100: a worker with 64 simulated CPU devices), its memory beside the ledger's, and the step model's terms
reconciled with the compiled program's (:func:`workbench.core.cost.reconcile.reconcile`).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _header import header, print_rows  # imports nothing of JAX

CLUSTERS = (("tpu", "v5p:4x4x4"), ("tpu", "v5p:8x8x16"), ("tpu", "v5p:16x20x28"), ("h100", 8), ("h100", 128),
            ("h100", 2048))
TASKS = (("train", 4 * 2**20, 4096), ("decode", 64, 4096))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--confirm", action="store_true", help="compile the top layout on the 64-device clusters")
    args = parser.parse_args()
    import jax.numpy as jnp

    from workbench.core.advisor import advise
    from workbench.core.cost.reconcile import table
    from workbench.core.hardware.cluster import Cluster
    from workbench.core.models.presets import full_config
    from workbench.models import CausalLM

    print(header("layout advisor: enumerate, prune by the ledger, rank by the step model (no compile)"))
    rows = []
    for name in ("llama-3-70b", "deepseek-v3"):
        model = CausalLM.lazy_init(full_config(name), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        model = model.with_options(remat="full")
        for kind, arg in CLUSTERS:
            cluster = Cluster.tpu(arg) if kind == "tpu" else Cluster.h100(nodes=arg)
            for task, tokens, seq in TASKS:
                advise(model, cluster, batch_tokens=tokens, seq_len=seq, task=task)  # warm: caches, imports
                t0 = time.perf_counter()
                advice = advise(model, cluster, batch_tokens=tokens, seq_len=seq, task=task)
                seconds = time.perf_counter() - t0
                best = advice.ranked[0].label if advice.ranked else "none fits"
                target = 2 if cluster.num_devices <= 1024 else 10
                rows.append((name, cluster.name, task, str(advice.considered), str(len(advice.ranked)),
                             f"{seconds:.2f} s", f"<= {target} s: {'met' if seconds <= target else 'MISSED'}", best))
                print(f"  {name} {cluster.name} {task}: {seconds:.2f} s", flush=True)
    print()
    print_rows(["model", "cluster", "task", "layouts predicted", "fit", "enumerate + rank", "target", "best"], rows)
    if not args.confirm:
        print("\n(--confirm compiles the top layout of Llama-3-70B training on the 64-device clusters)")
        return
    model = CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    confirmed, reconciled = [], []
    for cluster in (Cluster.tpu("v5p:4x4x4"), Cluster.h100(nodes=8)):
        advice = advise(model, cluster, batch_tokens=16 * 2048, seq_len=2048)
        c = next(c for c in advice.ranked if c.pipeline is None)
        t0 = time.perf_counter()
        advice.confirm_one(c)
        reconciled.append(c)
        seconds = time.perf_counter() - t0
        confirmed.append((cluster.name, c.label, f"{seconds:.1f} s", f"{c.ledger.total / 2**30:.2f} GiB",
                          f"{c.compiled.memory.total / 2**30:.2f} GiB",
                          f"{c.ledger.total / c.compiled.memory.total - 1:+.1%}",
                          f"{c.step.time_s * 1e3:.0f} ms", f"{c.compiled_step.time_s * 1e3:.0f} ms"))
    print()
    print_rows(["cluster", "top layout (batch 16 x 2048)", "confirm (compile + analysis)", "ledger", "compiled",
                "ledger vs compiled", "predicted step", "step from the compiled HLO"], confirmed)
    print("\nOn the H100 cluster the compiled program is XLA:CPU's (bfloat16 widened to float32 in the worker).")
    for (cluster_name, label, *_), c in zip(confirmed, reconciled, strict=True):
        print(f"\n{cluster_name}, {label}: the step model beside the compiled program\n{table(c.reconciled)}")


if __name__ == "__main__":
    main()
