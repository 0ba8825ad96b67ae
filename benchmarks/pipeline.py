"""Pipeline parallelism on 8 simulated devices: every schedule against the unpipelined step.

    python benchmarks/pipeline.py [--runs 3] [--layers 8] [--hidden 256] [--batch 32] [--seq 128]

A Llama-shaped model (``--layers`` layers of width ``--hidden``, float32, random weights) and a batch of
``--batch`` x ``--seq`` tokens. For pp in {2, 4, 8} (the rest of the 8 devices on dp), microbatches
m in {p, 2p, 4p} and each schedule (GPipe, 1F1B, interleaved with 2 stages per device):
- compile time of the pipelined loss-and-gradients step;
- step time (median of ``--runs`` warm calls, round-robin with the unpipelined step on an 8-way dp mesh in
  the same run) and the ratio; simulated devices share this CPU's cores, so the ratio is the pipeline's
  overhead in work (the stage recompute in the backward, the idle branches, the permutes), not the bubble:
  an idle simulated device costs no CPU;
- bubble fraction of the table against the closed form;
- activation bytes per stage: predicted (the schedule's buffers x one microbatch's hidden states) and the
  compiled step's temporary memory beyond 1F1B's, set against the predicted difference.
Target (the parallelism issue): step-time overhead <= 1.3x at m = 4p.
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
from _header import header, print_rows
from _timing import time_round_robin
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.mesh import make_mesh
from workbench.core.models.loss import causal_lm_loss
from workbench.core.models.presets import tiny
from workbench.core.pipeline import (
    PipelineConfig,
    activation_stash_bytes,
    pipeline_loss_and_grads,
    pipeline_partition_axis,
    pipeline_schedule,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(header("pipeline parallelism: schedules vs the unpipelined step (8 simulated devices)"))
    model = tiny("llama", num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                 num_attention_heads=8, num_key_value_heads=4)
    batch = {"input_ids": jnp.zeros((args.batch, args.seq), jnp.int32)}

    plain_mesh = make_mesh(dp=8, fsdp=1)
    plain = model.shard_model(plain_mesh)
    gd0, params0, other0 = nnx.split(plain, nnx.Param, ...)

    def plain_step(params, batch):
        def loss(params):
            out = nnx.merge(gd0, params, other0).forward(batch["input_ids"])
            return causal_lm_loss(out.logits, batch["input_ids"])[0]
        return jax.value_and_grad(loss)(params)

    plain_batch = jax.device_put(batch, NamedSharding(plain_mesh, P("dp")))
    plain_fn = jax.jit(plain_step).lower(params0, plain_batch).compile()

    rows = []
    for p in (2, 4, 8):
        mesh = make_mesh(pp=p, dp=8 // p, fsdp=1)
        sharded = model.shard_model(mesh, pipeline_partition_axis())
        graphdef, params, other = nnx.split(sharded, nnx.Param, ...)
        pp_batch = jax.device_put(batch, NamedSharding(mesh, P("dp")))
        for m in (p, 2 * p, 4 * p):
            temps, results = {}, {}
            for schedule in ("gpipe", "1f1b", "interleaved"):
                if args.layers % (2 * p) and schedule == "interleaved":
                    continue
                config = PipelineConfig(p, m, schedule)
                t0 = time.perf_counter()
                step = lambda pr, o, b, config=config, graphdef=graphdef, mesh=mesh: pipeline_loss_and_grads(
                    graphdef, pr, o, b, config, mesh)
                fn = jax.jit(step).lower(params, other, pp_batch).compile()
                compile_s = time.perf_counter() - t0
                temps[schedule] = fn.memory_analysis().temp_size_in_bytes
                times = time_round_robin({"pipeline": (fn, (params, other, pp_batch)),
                                          "plain": (plain_fn, (params0, plain_batch))}, args.runs, 0.0, args.runs)
                table = pipeline_schedule(config)
                predicted = activation_stash_bytes(config, batch_size=args.batch, seq_len=args.seq,
                                                   hidden_size=args.hidden, data_ways=8 // p)
                results[schedule] = (config, compile_s, statistics.median(times["pipeline"]),
                                     statistics.median(times["plain"]), table, predicted)
            base = results["1f1b"][5], temps["1f1b"]
            for schedule, (_, compile_s, t_pipe, t_plain, table, predicted) in results.items():
                extra = temps[schedule] - base[1]
                # interleaved cuts the layers into 2p stages, so its temporaries differ in more than the buffers
                versus = ("n/a (stages of half the layers)" if schedule == "interleaved" else
                          f"{(predicted - base[0]) / 2**20:+.2f} / {extra / 2**20:+.2f}")
                rows.append((str(p), str(m), schedule, f"{compile_s:.1f}", f"{t_pipe * 1e3:.0f}",
                             f"{t_plain * 1e3:.0f}", f"{t_pipe / t_plain:.2f}x",
                             f"{table.bubble_fraction:.3f} / {table.formula_bubble:.3f}",
                             f"{predicted / 2**20:.2f}", versus))
            print(f"pp={p} m={m} done", flush=True)
    print()
    print_rows(["pp", "m", "schedule", "compile s", "step ms", "plain ms", "overhead", "bubble table / formula",
                "act. MiB/stage (pred.)", "vs 1F1B MiB pred. / compiled"], rows)


if __name__ == "__main__":
    main()
