"""Train the tiny Llama on the shipped text (Genesis, KJV) for a few minutes, then generate from prompts.

    python benchmarks/train_tiny.py [--minutes 3] [--steps N] [--batch-size 32] [--seq-len 128]
                                    [--tokenizer byte|char] [--family llama] [--save DIR]

The text is split 95 / 5: training windows come from the first part, the validation loss from
fixed windows of the last part (Genesis 48-50, never trained on). Without ``--steps`` the step
time is measured first and the cosine schedule sized to fill ``--minutes``. Prints a table of
train / validation loss (nats per token) every ``--log-every`` steps, then greedy and sampled
continuations.
``--save DIR`` writes a Hugging Face checkpoint (``model.save_pretrained``: config.json +
safetensors, loadable with ``CausalLM.from_pretrained(DIR)`` or transformers) and
``tokenizer.json`` (the tokenizer's kind, and its characters for ``char``).
"""

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from _header import header

from workbench.core.models.presets import tiny
from workbench.core.models.tokenizer import ByteTokenizer, CharTokenizer
from workbench.core.models.training import (
    batches,
    from_state,
    make_eval_step,
    make_optimizer,
    make_train_step,
    to_state,
)
from workbench.data import load_text

PROMPTS = ["In the beginning God", "And Joseph said unto his brethren,", "And the LORD said unto Abram,",
           "Chapter 12\n\n"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="llama")
    p.add_argument("--minutes", type=float, default=3.0, help="training time budget (ignored with --steps)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tokenizer", choices=("byte", "char"), default="byte")
    p.add_argument("--log-every", type=int, default=None, help="default: about 12 rows")
    p.add_argument("--max-new-tokens", type=int, default=96,
                   help="keep prompt + new tokens within --seq-len: positions beyond it were never trained")
    p.add_argument("--temperature", type=float, default=0.8, help="for the sampled continuations (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default="auto", help="attention implementation name")
    p.add_argument("--save", type=pathlib.Path, default=None, help="directory for the trained checkpoint")
    return p.parse_args()


def continuations(model, tokenizer, prompts: list[str], new_tokens: int, temperature: float = 0.0) -> list[str]:
    """Greedy (or, with a temperature, sampled) continuations: ``model.generate`` when the model has it,
    else greedy by repeated full forward passes."""
    batch = tokenizer(prompts, padding_side="left")
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    if hasattr(model, "generate"):
        from workbench.core.models.generation import GenerationConfig

        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=temperature > 0,
                                  temperature=temperature if temperature > 0 else 1.0)
        out = model.generate(ids, generation_config=config, attention_mask=mask, prng_key=jax.random.key(0))
        new = np.asarray(out.sequences)[:, ids.shape[1]:]
    else:
        forward = jax.jit(lambda ids, mask: getattr(out := model(ids, mask), "logits", out)[:, -1].argmax(-1))
        new = []
        for _ in range(new_tokens):  # full forward pass per token: quadratic, fine for a demo
            token = forward(ids, mask)
            new.append(np.asarray(token))
            ids = jnp.concatenate([ids, token[:, None].astype(ids.dtype)], axis=1)
            mask = jnp.concatenate([mask, jnp.ones_like(mask[:, :1])], axis=1)
        new = np.stack(new, axis=1)
    return [tokenizer.decode(row) for row in new]


def main() -> None:
    args = parse()
    print(header(f"train_tiny: tiny {args.family} on Genesis (KJV), {args.tokenizer} tokenizer"))
    text = load_text("genesis")
    tokenizer = ByteTokenizer() if args.tokenizer == "byte" else CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    split = int(len(ids) * 0.95)
    train_ids, val_ids = ids[:split], ids[split:]
    model = tiny(args.family, seed=args.seed, attn_mechanism=args.attn,
                 vocab_size=None if args.tokenizer == "byte" else tokenizer.vocab_size)
    n_params = sum(x.size for x in jax.tree.leaves(model))
    b, t = args.batch_size, args.seq_len
    print(f"model: {n_params:,} parameters, vocab {model.config.vocab_size}, attention {model.attn_mechanism}; "
          f"text: {len(ids):,} tokens ({len(train_ids):,} train / {len(val_ids):,} validation); "
          f"batch {b} x {t} = {b * t:,} tokens per step")

    data = batches(train_ids, b, t, seed=args.seed)
    val = np.stack([next(batches(val_ids, b, t, seed=1234))["input_ids"] for _ in range(4)])
    train_step, eval_step = make_train_step(), make_eval_step()

    steps, calibration = args.steps, 0.0
    if steps is None:  # time a few steps (compile excluded) and size the schedule to the budget
        t0 = time.perf_counter()
        probe = to_state(model, make_optimizer(None, lr=args.lr))
        probe, _ = train_step(probe, next(data))
        jax.block_until_ready(probe)
        t1 = time.perf_counter()
        for _ in range(10):
            probe, metrics = train_step(probe, next(data))
        jax.block_until_ready(metrics)
        per_step = (time.perf_counter() - t1) / 10
        calibration = time.perf_counter() - t0
        compile_s = t1 - t0
        steps = max(24, int((args.minutes * 60 - calibration - compile_s) / per_step) // 12 * 12)
        del probe
        print(f"calibration: {per_step * 1e3:.0f} ms/step after a {compile_s:.1f} s compile -> {steps} steps "
              f"for {args.minutes:g} minutes")
        data = batches(train_ids, b, t, seed=args.seed)
    log_every = args.log_every or max(1, steps // 12)

    optimizer = make_optimizer(steps, lr=args.lr)
    state = to_state(model, optimizer)
    print(f"\nAdamW lr {args.lr:g} (warmup {min(100, steps // 10)} steps, cosine to {args.lr / 10:g}), "
          f"weight decay 0.1, clip 1.0\n")
    print(f"{'step':>6} {'train loss':>11} {'val loss':>9} {'val bits/char':>14} {'tokens/s':>9} {'elapsed':>8}")
    window, t_start, t_last, tokens_since = [], time.perf_counter(), time.perf_counter(), 0
    first_loss = None
    for i in range(1, steps + 1):
        state, metrics = train_step(state, next(data))
        window.append(metrics["loss"])
        tokens_since += b * t
        if i % log_every == 0 or i == steps or i == 1:
            train_loss = float(np.mean([float(x) for x in window]))
            first_loss = train_loss if first_loss is None else first_loss
            val_loss = float(np.mean([float(eval_step(state, {"input_ids": v})["loss"]) for v in val]))
            now = time.perf_counter()
            rate = tokens_since / (now - t_last)
            print(f"{i:>6} {train_loss:>11.3f} {val_loss:>9.3f} {val_loss / np.log(2):>14.3f} {rate:>9.0f} "
                  f"{now - t_start:>7.1f}s", flush=True)
            window, t_last, tokens_since = [], now, 0
    elapsed = time.perf_counter() - t_start
    print(f"\n{steps} steps in {elapsed:.1f} s ({elapsed / steps * 1e3:.0f} ms/step, compile included; "
          f"{calibration:.1f} s calibration before); train loss {first_loss:.3f} (step 1) -> {train_loss:.3f}, "
          f"validation {val_loss:.3f} nats/token")

    trained = from_state(state, copy=False)
    how = "model.generate" if hasattr(trained, "generate") else "full forward passes"
    kinds = [("greedy", 0.0)]
    if args.temperature > 0 and hasattr(trained, "generate"):
        kinds.append((f"sampled at temperature {args.temperature:g}", args.temperature))
    for kind, temperature in kinds:
        t0 = time.perf_counter()
        samples = continuations(trained, tokenizer, PROMPTS, args.max_new_tokens, temperature)
        print(f"\n{kind} ({args.max_new_tokens} new tokens, {how}, {time.perf_counter() - t0:.1f} s):")
        for prompt, sample in zip(PROMPTS, samples, strict=True):
            print(f"  {prompt!r} -> {sample!r}")

    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        trained.save_pretrained(args.save)
        kind = {"kind": "byte"} if args.tokenizer == "byte" else {"kind": "char", "chars": list(tokenizer.chars)}
        (args.save / "tokenizer.json").write_text(json.dumps(kind))
        print(f"\nsaved to {args.save}: {sorted(p.name for p in args.save.iterdir())}")


if __name__ == "__main__":
    main()
