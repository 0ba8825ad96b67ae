"""Full-size models on virtual clusters: abstract model, ledger, and a train step compiled for the cluster.

On this machine (8 simulated CPU devices in this process): the time of `CausalLM.lazy_init` of the full-size
preset (target <= 1 s), of the memory ledger for a layout (the explorer's per-edit cost, target <= 300 ms), and of
`virtual.compile_step(kind="train")` (loss, gradient, AdamW update, state donated; bfloat16; remat "full") with
its analysis:

- Llama-3-70B, FSDP x TP, target <= 15 s (issue 16's baseline: 137 s for the collectives of a train step on 64
  simulated devices), on a TPU v5p:4x4x4 slice (XLA's TPU compiler, ahead of time) and on 8 nodes x 8 H100 (a
  worker with 64 simulated CPU devices);
- DeepSeek-V3 on 32 nodes x 8 H100 (256 simulated devices), ep=64 x fsdp=4, MoE layers `alltoall` at capacity
  factor 1.25, batch 64 x 4096 (notebook 05, section 10), target <= 30 s.

Each step is compiled three times: first (a worker cluster's first compile includes starting the worker, which
overlaps the tracing), again after `virtual.ANALYSES.clear()` (a full recompile), and once more with the
analysis cache (`cached`: tracing and lowering only, the program being the same). The first time is the one
held to the target; its breakdown says where it went. Then the ledger's total against the compiled one.

`--depth` adds XLA:TPU's compile of the Llama step against the number of layers (2, 8, 80; the layers are a
`lax.scan`, so the program is the same size), each in a fresh process with libtpu's stage log: its HLO passes,
its backend (lowering every fusion to TPU instructions, scheduling, register allocation) and code generation.
"""

import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _header import header, print_rows  # imports nothing of JAX

REMAT = "full"
# (model, cluster, mesh shape, batch, model options, target seconds for compile + analysis)
CASES = (("llama-3-70b", "v5p:4x4x4", {"fsdp": 16, "tp": 4}, (16, 2048), {}, 15.0),
         ("llama-3-70b", "h100x8", {"fsdp": 8, "tp": 8}, (16, 2048), {}, 15.0),
         ("deepseek-v3", "h100x32", {"ep": 64, "fsdp": 4}, (64, 4096), {"capacity_factor": 1.25}, 30.0))
LEDGER_TARGET_S, LEDGER_TOLERANCE = 0.3, 0.10
DEPTHS = (2, 8, 80)
STAGES = ("HLO_PASSES", "BACKEND_PASSES", "CODE_GENERATION", "END_TO_END")


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def model_of(name: str, layers: int | None = None, **options):
    import jax.numpy as jnp

    from workbench.core.models.config import ModelConfig
    from workbench.core.models.presets import full_config_dict
    from workbench.models import CausalLM

    config = full_config_dict(name)
    if layers is not None:
        config["num_hidden_layers"] = layers
    model = CausalLM.lazy_init(ModelConfig.from_hf(config), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return model.with_options(remat=REMAT, **options)


def cluster_of(name: str):
    from workbench.core.hardware.cluster import Cluster

    return Cluster.tpu(name) if ":" in name else Cluster.h100(nodes=int(name.removeprefix("h100x")))


def breakdown(seconds: dict[str, float]) -> str:
    names = {"trace_lower": "trace+lower", "worker_start": "worker start", "worker_lower": "worker lower",
             "compile": "XLA compile", "analysis": "analysis", "transfer": "transfer"}
    return ", ".join(f"{label} {seconds[key]:.2f}" for key, label in names.items()
                     if key in seconds and (key != "worker_start" or seconds[key] >= 0.005))


def main() -> None:
    from workbench.core.mesh import simulate_devices

    simulate_devices(8)
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)
    from workbench.core.compile import virtual
    from workbench.core.compile.steps import full_mesh_shape
    from workbench.core.compile.virtual import compile_step
    from workbench.core.cost.ledger import ledger
    from workbench.core.hardware.cluster import cluster_mesh
    from workbench.core.mesh import MESH_AXES
    from workbench.core.models.presets import full_config
    from workbench.core.views.explore import Layout
    from workbench.models import CausalLM

    print(header("Full-size models on virtual clusters: lazy_init, ledger, train-step compile + analysis"))
    lazy = []
    for _ in range(3):
        t0 = time.perf_counter()
        CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        lazy.append(time.perf_counter() - t0)
    print(f"`CausalLM.lazy_init(llama-3-70b)`, bfloat16, 3 calls: {', '.join(f'{s:.2f} s' for s in lazy)} "
          f"(target <= 1 s: {verdict(min(lazy[1:]) <= 1)})\n")
    rows, details, missed = [], [], []
    for model_name, cluster_name, mesh_shape, batch, options, target in CASES:
        model = model_of(model_name, **options)
        cluster = cluster_of(cluster_name)
        mesh = cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES)
        t0 = time.perf_counter()
        layout = Layout.of(model, mesh)
        predicted = ledger(model, layout, batch=batch, cluster=cluster)
        ledger_s = time.perf_counter() - t0
        times, analyses = [], []
        for attempt in ("first", "recompile", "cached"):
            if attempt == "recompile":
                virtual.ANALYSES.clear()
            t0 = time.perf_counter()
            analyses.append(compile_step(model, cluster, mesh_shape, batch=batch))
            times.append(time.perf_counter() - t0)
        compiled, again = analyses[0], analyses[1]
        assert analyses[2].cached and not again.cached and again.memory == compiled.memory
        total = compiled.memory.total
        off = predicted.total / total - 1
        xla = compiled.xla_seconds
        name = f"{model_name} on {cluster.name}"
        checks = {"compile + analysis": times[0] <= target, "ledger time": ledger_s <= LEDGER_TARGET_S}
        if cluster.platform == "tpu":  # compiled for the cluster's own chips: the one compiled total to hold to
            checks["ledger vs compiled"] = abs(off) <= LEDGER_TOLERANCE
        missed += [f"{name}: {check}" for check, ok in checks.items() if not ok]
        rows.append((model_name, cluster.name, " x ".join(f"{k}={v}" for k, v in mesh_shape.items()),
                     f"{batch[0]} x {batch[1]}", f"{ledger_s * 1e3:.0f} ms ({verdict(checks['ledger time'])})",
                     f"{times[0]:.1f} s / {times[1]:.1f} s / {times[2]:.2f} s",
                     f"<= {target:.0f} s: {verdict(checks['compile + analysis'])}",
                     f"{predicted.total / 2**30:.2f} GiB", f"{total / 2**30:.2f} GiB",
                     f"{off:+.1%} ({verdict(checks[held]) if (held := 'ledger vs compiled') in checks else 'XLA:CPU'})",
                     f"{cluster.hbm_per_device / 2**30:.1f} GiB", "-" if xla is None else f"{xla:.3f} s",
                     str(sum(c.trips for c in compiled.collectives))))
        details.append(f"  {name}: first {breakdown(compiled.seconds)}; recompile {breakdown(again.seconds)} (s)")
        print(f"  {name}: done ({times[0]:.1f} s)", flush=True)
    print()
    print_rows(["model", "cluster", "mesh", "batch", "ledger (layout + parts)",
                "compile + analysis (first / recompile / cached)", "target", "ledger total", "compiled total",
                "ledger vs compiled", "HBM / device", "XLA's time estimate", "collectives run"], rows)
    print("\nWhere the time went (seconds; XLA compile is `lowered.compile()` alone):")
    print("\n".join(details))
    print(f"\nremat={REMAT}, AdamW in bfloat16 (optax keeps moments in the parameters' dtype). Targets: ledger "
          f"<= {LEDGER_TARGET_S * 1e3:.0f} ms, compile + analysis (first call) <= 15 s (Llama-3-70B) and <= 30 s "
          f"(DeepSeek-V3 on 256 devices), ledger within {LEDGER_TOLERANCE:.0%} of compiled where the compile is "
          f"for the cluster's chips (TPU). On the H100 clusters the compiled total is XLA:CPU's buffer assignment "
          f"(the worker compiles for CPU devices): its bfloat16 math is widened to float32 and its schedule is not "
          f"a GPU's, so it is no H100 number (for DeepSeek-V3's all-to-all MoE step it is far above one) and the "
          f"ledger is not held to it.")
    print("targets " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    if "--depth" in sys.argv:
        depth()


def depth() -> None:
    """XLA:TPU's compile of the Llama step against depth, each in a fresh process with libtpu's stage log."""
    print("\nXLA:TPU compile of the Llama-3-70B train step (v5p:4x4x4, fsdp=16 x tp=4) against depth "
          "(each in a fresh process; seconds):")
    env = dict(os.environ, TPU_MIN_LOG_LEVEL="0", TPU_STDERR_LOG_LEVEL="0",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        os.environ.get("PYTHONPATH")])))
    rows = []
    for layers in DEPTHS:
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, __file__, "--compile-child", str(layers)], env=env,
                             capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        stages = {}
        for name, duration in re.findall(rf"({'|'.join(STAGES)}) stage duration: ([\d.hmusn]+)", out.stderr):
            stages[name] = stages.get(name, 0.0) + absl_seconds(duration)
        bundles = re.search(r"final program bundle count: ([\d,]+)", out.stderr)
        rows.append((str(layers), f"{result['trace_lower']:.2f}", f"{result['compile']:.1f}",
                     f"{result['compile_cpu']:.1f}", *(f"{stages[s]:.2f}" if s in stages else "-" for s in STAGES),
                     bundles[1] if bundles else "-", f"{result['peak'] / 2**30:.2f} GiB", f"{load:.1f}"))
    print_rows(["layers", "trace + lower", "lowered.compile() wall", "its CPU time (all threads)",
                "libtpu: HLO passes", "backend passes", "code generation", "end to end", "TPU bundles",
                "XLA's peak / chip", "load before (1 min)"], rows)
    print("Nearly all of XLA's compile is its TPU backend (each fusion lowered to TPU instructions, scheduled, "
          "registers allocated), run on both cores; the HLO passes that decide memory and collectives take "
          "about half a second. It hardly grows with depth: the layers are one scanned body.")


def absl_seconds(duration: str) -> float:
    """Seconds of an absl duration as libtpu logs it: ``481.77ms``, ``19.37s``, ``1m20.5s``."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(value) * units[unit] for value, unit in re.findall(r"([\d.]+)(h|ms|us|ns|m|s)", duration))


def compile_child(layers: int) -> None:
    """One Llama-3-70B train step compiled for v5p:4x4x4 with ``layers`` layers; JSON on stdout."""
    import resource

    import jax

    from workbench.core.compile.steps import abstract_step, full_mesh_shape
    from workbench.core.hardware.cluster import Cluster, cluster_mesh
    from workbench.core.mesh import MESH_AXES

    model = model_of("llama-3-70b", layers)
    cluster = Cluster.tpu("v5p:4x4x4")
    mesh = cluster_mesh(cluster, full_mesh_shape({"fsdp": 16, "tp": 4}, cluster), MESH_AXES)
    step = abstract_step(model, mesh, kind="train", batch=(16, 2048))
    t0 = time.perf_counter()
    lowered = jax.jit(step.fn, donate_argnums=step.donate_argnums, out_shardings=step.out_shardings).lower(*step.args)
    trace_lower = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    peak = compiled.memory_analysis().peak_memory_in_bytes
    print(json.dumps({"trace_lower": trace_lower, "compile": seconds, "compile_cpu": cpu, "peak": peak}))


if __name__ == "__main__":
    if "--compile-child" in sys.argv:
        compile_child(int(sys.argv[sys.argv.index("--compile-child") + 1]))
    else:
        main()
