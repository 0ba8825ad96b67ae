"""Run in a fresh process with ``JAX_ENABLE_X64=1`` (see test_x64.py): x64 must be on before JAX starts.

Prints one JSON object of measurements; the test asserts on them.
"""

import json
import os
import sys
import tempfile

# The test starts this process with JAX_ENABLE_X64=1 and 8 simulated devices in its environment. Nothing
# here may set them: pytest's --doctest-modules imports this module inside its workers, and an
# os.environ change would leak into every later process they start (notebook kernels included).
sys.path.insert(0, os.getcwd())

import jax
import jax.numpy as jnp
import numpy as np

from tests.core.models import numpy_reference
from tests.core.models.hf_reference import batch, hf_model, torch
from workbench.core.mesh import make_mesh
from workbench.core.models.auto import from_pretrained
from workbench.core.models.generation import GenerationConfig


def without_float32_islands(hf) -> None:
    """transformers' float64 forward with its float32 islands made float64: the rotary cos/sin (computed
    in float32, then cast), RMSNorm's variance (cast to float32) and eager attention's softmax (float32:
    SDPA instead, which stays in the inputs' dtype). Default rope only (the tiny configs here)."""
    import types

    def rms_norm(self, h):
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"]
                          ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    for module in hf.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(rms_norm, module)
        elif name.endswith("RotaryEmbedding"):
            assert module.rope_type == "default", module.rope_type
            module.forward = types.MethodType(rotary, module)
    hf.set_attn_implementation("sdpa")


def main() -> None:
    if not jax.config.jax_enable_x64:
        raise SystemExit("run with JAX_ENABLE_X64=1 in the environment (tests/core/models/test_x64.py does)")
    out = {"x64": bool(jax.config.jax_enable_x64)}
    for family in ("qwen2", "llama-bias-tied"):
        hf = hf_model(family, num_hidden_layers=3).to(torch.float64)
        path = tempfile.mkdtemp()
        hf.save_pretrained(path)
        model = from_pretrained(path, dtype=jnp.float64, progress=False)
        ids, mask = batch()
        real = mask.astype(bool)
        logits = model(jnp.asarray(ids), jnp.asarray(mask)).logits
        config, weights = numpy_reference.load(path)
        want = numpy_reference.forward(config, weights, ids, mask)
        got = np.asarray(logits)
        res = {"logits_dtype": str(logits.dtype),
               "param_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(model)}),
               "vs_numpy64": float(np.abs(got - want)[real].max()),
               "unrolled_vs_numpy64": float(np.abs(np.asarray(model.with_options(scan_layers=False)(
                   jnp.asarray(ids), jnp.asarray(mask)).logits) - want)[real].max())}
        with torch.no_grad():  # transformers' float64 forward (its norm, rotary and softmax run in float32)
            hf64 = hf(torch.tensor(ids[:1])).logits.numpy()
        res["hf64_vs_numpy64"] = float(np.abs(hf64 - numpy_reference.forward(config, weights, ids[:1])).max())
        without_float32_islands(hf)
        with torch.no_grad():
            hf64 = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        res["hf64_no_islands_vs_ours"] = float(np.abs(hf64 - got)[real].max())
        res["hf64_no_islands_vs_numpy64"] = float(np.abs(hf64 - want)[real].max())
        # cached decode equals the full forward, in float64
        full = np.asarray(model(jnp.asarray(ids)).logits)
        step = model(jnp.asarray(ids[:, :-1]), cache=model.init_cache(ids.shape[0], 16))
        last = model(jnp.asarray(ids[:, -1:]), cache=step.cache)
        res["decode_vs_full"] = float(np.abs(np.asarray(last.logits[:, -1]) - full[:, -1]).max())
        res["cache_dtype"] = str(step.cache.keys.dtype)
        # sharded over 8 devices equals unsharded
        sharded = model.shard_model(make_mesh(fsdp=2, tp=4))
        res["sharded_vs_unsharded"] = float(np.abs(np.asarray(sharded(jnp.asarray(ids), jnp.asarray(mask)).logits)
                                                   - got)[real].max())
        # generation: contiguous, paged and beam search run and agree
        config_ = GenerationConfig(max_new_tokens=6, do_sample=False)
        greedy = np.asarray(model.generate(jnp.asarray(ids), config_, attention_mask=jnp.asarray(mask)).sequences)
        pages = model.init_ragged_pages(batch_size=ids.shape[0], page_size=4, num_pages=16, max_model_length=32)
        paged = np.asarray(model.generate(jnp.asarray(ids), config_, attention_mask=jnp.asarray(mask),
                                          cache=pages).sequences)
        beam = model.generate(jnp.asarray(ids), config_.replace(num_beams=2), attention_mask=jnp.asarray(mask))
        res["paged_equals_contiguous"] = bool((greedy == paged).all())
        res["beam_shape"] = list(beam.sequences.shape)
        # a training step
        from workbench.core.models.training import make_train_step, to_state

        _, metrics = make_train_step()(to_state(sharded), {"input_ids": ids})
        res["train_loss"] = float(metrics["loss"])
        res["train_loss_dtype"] = str(metrics["loss"].dtype)
        out[family] = res
    # the widgets build on a float64 model
    from workbench.widgets import ModuleTree, ShardingExplorer

    tree = ModuleTree(model)
    explorer = ShardingExplorer(model, make_mesh(fsdp=2, tp=4))
    out["widgets"] = [repr(tree), repr(explorer).split(",")[0], explorer.error]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
