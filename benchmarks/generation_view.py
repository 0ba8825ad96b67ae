"""GenerationView against plain ``generate``: decode tokens/s with the widget streaming (rendered on the
stream's own thread, every 0.1 s) and without.

    python benchmarks/generation_view.py [--rounds 5] [--tokens 128] [--model tiny|smollm2]

Both decode the same prompt greedily with a KV cache, compiled once before timing; the rounds alternate
plain and view (same machine noise). tokens/s = new tokens / the decode time ``generate`` reports.
Target (the reliability issue): the view within 10 % of plain ``generate``.
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from _header import header, print_rows

from workbench.widgets.generation_view import GenerationView


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    args = parser.parse_args()
    print(header("GenerationView vs generate: decode tokens/s"))
    if args.model == "tiny":
        from workbench.core.models.presets import tiny

        model, tokenizer = tiny("llama", num_hidden_layers=4, hidden_size=256, intermediate_size=768), None
    else:
        from transformers import AutoTokenizer

        from workbench.core.models.auto import from_pretrained
        from workbench.models import local_checkpoint

        path = local_checkpoint()
        model, tokenizer = from_pretrained(path, progress=False), AutoTokenizer.from_pretrained(path)
    view = GenerationView(model, tokenizer, prompt="Tell me about the sea.", cache_length=args.tokens + 64)
    view.max_new_tokens.value, view.stop_at_eos.value = args.tokens, False
    config = view.generation_config()
    ids, mask = view.prompt_inputs()

    def plain() -> float:
        cache, _ = view._make_cache(ids.shape[0], config)
        out = model.generate(ids, config, mask, cache=cache, streamer=_null_stream())
        return out.num_new_tokens / out.timings["decode"]

    def widget() -> float:
        view.generate()
        view.wait()
        return view.output.num_new_tokens / view.output.timings["decode"]

    plain(), widget()  # compile both (the view streams with the same program as a plain streamer)
    rates = {"generate": [], "GenerationView": []}
    for _ in range(args.rounds):
        rates["generate"].append(plain())
        rates["GenerationView"].append(widget())
    base = statistics.median(rates["generate"])
    rows = [(name, f"{statistics.median(r):.1f}", f"{statistics.median(r) / base:.3f}") for name, r in rates.items()]
    print(f"{args.model}, {args.tokens} new tokens, greedy, median of {args.rounds} rounds\n")
    print_rows(["", "tokens/s", "vs generate"], rows)


def _null_stream():
    """A streamer that records nothing: plain generate streams through the same compiled program."""
    from workbench.core.views.token_stream import TokenStream

    return TokenStream()


if __name__ == "__main__":
    main()
