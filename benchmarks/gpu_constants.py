"""Measure the GPU constants a step model needs, on the GPU JAX finds: GEMM efficiency by shape, attention
kernel efficiency, achievable HBM bandwidth, the AdamW update, and a real one-GPU train step of Llama-3.2-1B.

    python benchmarks/gpu_constants.py [--out FILE.json] [--smoke]

Each figure is the median of timed calls after warm-up, calls enqueued back to back and synchronised once
(so a launch's host overhead overlaps the previous kernel, as in a training step). ``--smoke`` runs every
part at toy sizes, to check the script on a CPU before spending device time. The JSON it writes is what
the step model's GPU constants are held against (``benchmarks/data/``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def timed(fn, *args, calls: int = 10, repeats: int = 5, min_s: float = 0.05) -> float:
    """Median seconds of one call of ``fn(*args)`` (jitted), ``calls`` enqueued per timing, after warm-up."""
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - start
    calls = max(calls, min(200, math.ceil(min_s / max(one, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def gemms(smoke: bool) -> list[dict]:
    """bf16 x bf16 -> bf16 (f32 accumulation) GEMMs: squares, the projections of Llama-3.2-1B and -3-8B on
    8,192 tokens with their two backward products, skinny N or K, and decode-sized M."""
    m = 256 if smoke else 8192
    shapes: list[tuple[str, int, int, int]] = []
    for s in ((128, 256) if smoke else (512, 1024, 2048, 4096, 8192, 16384)):
        shapes.append(("square", s, s, s))
    models = {"1b": dict(d=2048, q=2048, kv=512, f=8192, v=128256), "8b": dict(d=4096, q=4096, kv=1024, f=14336,
                                                                              v=128256)}
    if smoke:
        models = {"toy": dict(d=64, q=64, kv=32, f=128, v=264)}
    for name, c in models.items():
        for op, k, n in (("qkv", c["d"], c["q"] + 2 * c["kv"]), ("o", c["q"], c["d"]), ("gate", c["d"], c["f"]),
                         ("down", c["f"], c["d"]), ("head", c["d"], c["v"])):
            shapes.append((f"{name}.{op}.fwd", m, k, n))
            shapes.append((f"{name}.{op}.dx", m, n, k))  # dY @ W^T
            shapes.append((f"{name}.{op}.dw", k, m, n))  # X^T @ dY: contraction over the tokens
    big = 128 if smoke else 4096
    for n in ((16, 32) if smoke else (64, 128, 256, 512, 1024)):
        shapes.append(("skinny-n", m, big, n))
        shapes.append(("skinny-k", m, n, big))
    for mm in ((1, 8) if smoke else (1, 8, 32, 128, 512, 2048)):
        shapes.append(("decode-m", mm, big, big))
    rows = []
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    key = jax.random.key(0)
    for label, mm, k, n in shapes:
        a = jax.random.normal(key, (mm, k), jnp.bfloat16)
        b = jax.random.normal(key, (k, n), jnp.bfloat16)
        s = timed(dot, a, b)
        flops = 2.0 * mm * k * n
        hbm = 2.0 * (mm * k + k * n + mm * n)
        rows.append(dict(label=label, m=mm, k=k, n=n, seconds=s, tflops=flops / s / 1e12, gbps=hbm / s / 1e9))
        print(f"gemm {label:16s} {mm:6d} x {k:6d} x {n:6d}  {s * 1e3:9.3f} ms  {flops / s / 1e12:7.1f} TFLOP/s "
              f"{hbm / s / 1e9:7.0f} GB/s", flush=True)
        del a, b
    return rows


def attention(smoke: bool) -> list[dict]:
    """``jax.nn.dot_product_attention`` on the GPU's fused kernel (cuDNN) and XLA's, causal and not, forward
    and forward+backward; FLOPs count the causal half (forward 4·B·H·T²·D/2, backward 2.5 times that)."""
    impls = ("xla",) if smoke else ("cudnn",)
    cases = [(1, 256, 4, 2, 32)] if smoke else [(4, 2048, 32, 8, 64), (2, 4096, 32, 8, 64), (4, 2048, 32, 8, 128),
                                                (1, 8192, 32, 8, 128), (1, 16384, 32, 8, 128)]
    rows = []
    for impl in impls:
        for b, t, h, kvh, d in cases:
            for causal in (True, False):
                key = jax.random.key(1)
                q = jax.random.normal(key, (b, t, h, d), jnp.bfloat16)
                k = jax.random.normal(key, (b, t, kvh, d), jnp.bfloat16)
                v = jax.random.normal(key, (b, t, kvh, d), jnp.bfloat16)
                fwd = jax.jit(lambda q, k, v, c=causal, i=impl: jax.nn.dot_product_attention(q, k, v, is_causal=c,
                                                                                           implementation=i))
                loss = lambda q, k, v, c=causal, i=impl: jax.nn.dot_product_attention(
                    q, k, v, is_causal=c, implementation=i).astype(jnp.float32).sum()
                both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                f_flops = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
                for part, fn, flops in (("fwd", fwd, f_flops), ("fwd+bwd", both, 3.5 * f_flops)):
                    try:
                        s = timed(fn, q, k, v)
                    except Exception as e:  # a kernel that refuses a shape is a finding, not a crash
                        print(f"attention {impl} {part} B={b} T={t} D={d} causal={causal}: {type(e).__name__}: "
                              f"{str(e)[:200]}", flush=True)
                        continue
                    rows.append(dict(impl=impl, part=part, batch=b, seq=t, heads=h, kv_heads=kvh, head_dim=d,
                                     causal=causal, seconds=s, tflops=flops / s / 1e12))
                    print(f"attention {impl:5s} {part:7s} B={b} T={t:5d} H={h} KV={kvh} D={d:3d} causal={causal!s:5s} "
                          f"{s * 1e3:8.3f} ms {flops / s / 1e12:6.1f} TFLOP/s", flush=True)
    return rows


def memory(smoke: bool) -> list[dict]:
    """Memory-bound passes: a copy, a read-only reduction, RMSNorm over (tokens, width), and AdamW's update of
    float32 parameters (reads params, grads, two moments; writes params and two moments)."""
    n = 1 << (16 if smoke else 29)  # 512 Mi elements: 1 GiB of bf16
    rows = []
    x = jnp.ones((n,), jnp.bfloat16)
    for label, fn, nbytes in (("copy x+1 bf16", jax.jit(lambda x: x + 1), 4 * n),
                              ("sum bf16 (read only)", jax.jit(lambda x: x.astype(jnp.float32).sum()), 2 * n)):
        s = timed(fn, x)
        rows.append(dict(label=label, bytes=nbytes, seconds=s, gbps=nbytes / s / 1e9))
        print(f"memory {label:28s} {s * 1e3:8.3f} ms {nbytes / s / 1e9:7.0f} GB/s", flush=True)
    del x
    t, d = (256, 64) if smoke else (8192, 4096)
    h = jax.random.normal(jax.random.key(2), (t, d), jnp.bfloat16)
    w = jnp.ones((d,), jnp.bfloat16)

    def rms(h, w):
        h32 = h.astype(jnp.float32)
        return (h32 * jax.lax.rsqrt((h32 * h32).mean(-1, keepdims=True) + 1e-6)).astype(jnp.bfloat16) * w

    s = timed(jax.jit(rms), h, w)
    rows.append(dict(label="rmsnorm bf16", bytes=4 * t * d, seconds=s, gbps=4 * t * d / s / 1e9))
    print(f"memory {'rmsnorm bf16':28s} {s * 1e3:8.3f} ms {4 * t * d / s / 1e9:7.0f} GB/s", flush=True)
    import optax

    p = 1 << (16 if smoke else 28)  # 268M float32 parameters in one array
    params = {"w": jnp.zeros((p,), jnp.float32)}
    grads = {"w": jnp.full((p,), 1e-3, jnp.float32)}
    tx = optax.adamw(1e-3)
    state = tx.init(params)

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    s = timed(jax.jit(update), params, state, grads)
    nbytes = 4 * p * (4 + 3)
    rows.append(dict(label="adamw f32 update", bytes=nbytes, params=p, seconds=s, gbps=nbytes / s / 1e9))
    print(f"memory {'adamw f32 update (28 B/param)':28s} {s * 1e3:8.3f} ms {nbytes / s / 1e9:7.0f} GB/s", flush=True)
    return rows


def train_step(smoke: bool, profile_ops: bool = False) -> list[dict]:
    """A real train step of Llama-3.2-1B (float32 master weights, bfloat16 compute, AdamW, cuDNN attention
    through ``sdpa``) on one GPU, at two remat policies; MFU from :func:`workbench.core.cost.flops.train_flops`
    against the chip's datasheet peak, and the step model's prediction beside it."""
    import optax
    from flax import nnx

    from workbench.core.cost.flops import train_flops
    from workbench.core.cost.predicted import predict_step
    from workbench.core.hardware.cluster import Cluster
    from workbench.core.models.causal_lm import CausalLM
    from workbench.core.models.config import ModelConfig
    from workbench.core.models.loss import causal_lm_loss, labels_from
    from workbench.core.models.presets import full_config_dict, tiny_config

    if smoke:
        config, batch = ModelConfig.from_hf(tiny_config("llama")), (2, 64)
    else:
        config, batch = ModelConfig.from_hf(full_config_dict("llama-3.2-1b")), (4, 2048)
    cluster = Cluster.h100(gpus_per_node=1)
    rows = []
    for remat in ("none", "full"):
        model = CausalLM(config, rngs=nnx.Rngs(0), attn_mechanism="sdpa", dtype=jnp.bfloat16,
                         param_dtype=jnp.float32, remat=remat)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.adamw(1e-4)
        ids = jax.random.randint(jax.random.key(3), batch, 0, config.vocab_size)

        def step(state, ids, graphdef=graphdef, rest=rest, tx=tx):
            params, opt_state = state
            loss_of = lambda p: causal_lm_loss(nnx.merge(graphdef, p, rest)(ids).logits, labels_from(ids))[0]
            loss, grads = jax.value_and_grad(loss_of)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        state = (params, tx.init(params))
        del model
        start = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=0).lower(state, ids).compile()
        compile_s = time.perf_counter() - start
        memory_gib = None
        try:
            ma = compiled.memory_analysis()
            memory_gib = (ma.temp_size_in_bytes + ma.argument_size_in_bytes) / 2**30
        except Exception:
            pass
        for _ in range(2):
            state, loss = compiled(state, ids)
        jax.block_until_ready(loss)
        seconds = []
        for _ in range(3 if smoke else 8):
            start = time.perf_counter()
            state, loss = compiled(state, ids)
            jax.block_until_ready(loss)
            seconds.append(time.perf_counter() - start)
        s = statistics.median(seconds)
        flops = train_flops(config, batch, remat=remat)
        peak = cluster.chip.peak_flops()
        predicted = predict_step(config, cluster, {}, batch=batch, remat=remat)
        row = dict(model="llama-3.2-1b" if not smoke else "tiny-llama", batch=list(batch), remat=remat,
                   seconds=s, compile_s=compile_s, memory_gib=memory_gib, loss=float(loss),
                   model_flops=flops.model, hardware_flops=flops.hardware, mfu=flops.mfu(s, peak),
                   hfu=flops.hfu(s, peak), predicted_s=predicted.time_s, predicted_bound=predicted.bound,
                   tokens_per_s=flops.tokens / s)
        rows.append(row)
        print(f"train {row['model']} batch {batch} remat={remat:4s} {s * 1e3:8.1f} ms  MFU {row['mfu']:.1%} "
              f"HFU {row['hfu']:.1%}  {row['tokens_per_s']:,.0f} tok/s  compile {compile_s:.0f} s  "
              f"memory {memory_gib and round(memory_gib, 1)} GiB  loss {row['loss']:.3f}  predicted "
              f"{predicted.time_s * 1e3:.1f} ms ({predicted.bound}-bound)", flush=True)
        if profile_ops and remat == "none":
            from workbench.core.hlo.op_profile import profile

            prof = profile(compiled, state, ids, runs=2, carry=True)
            print(prof.summary(), flush=True)
            for op in prof.by_kind()[:12]:
                print(f"  kind {op.kind:28s} x{op.count:5d} {op.total_s * 1e3 / 2:8.2f} ms/step", flush=True)
            for op in prof.ops[:30]:
                print(f"  op {op.name[:40]:40s} {op.kind:24s} x{op.count:4d} {op.total_s * 1e3 / 2:8.2f} ms/step",
                      flush=True)
            row["profile_by_kind"] = [dict(kind=o.kind, count=o.count, seconds=o.total_s / 2)
                                      for o in prof.by_kind()]
            row["profile_top_ops"] = [dict(name=o.name, kind=o.kind, count=o.count, seconds=o.total_s / 2)
                                      for o in prof.ops[:60]]
            state = None
        del state, compiled
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--parts", default="gemm,attention,memory,train")
    args = parser.parse_args()
    device = jax.devices()[0]
    header = dict(platform=device.platform, device=getattr(device, "device_kind", str(device)),
                  jax=jax.__version__, python=platform.python_version(),
                  date=time.strftime("%Y-%m-%d"))
    print(json.dumps(header), flush=True)
    parts = args.parts.split(",")
    result: dict = {"header": header}
    for name, fn in (("gemm", gemms), ("attention", attention), ("memory", memory), ("train", train_step),
                     ("profile", lambda smoke: train_step(smoke, profile_ops=True))):
        if name in parts:
            start = time.perf_counter()
            try:
                result[name] = fn(args.smoke)
            except Exception as e:
                print(f"{name}: failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
                result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"[{name} took {time.perf_counter() - start:.0f} s]", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
