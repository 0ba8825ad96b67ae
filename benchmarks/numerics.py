"""Float32 logits against a float64 reference on a real checkpoint: workbench, transformers and a plain-JAX control.

    python benchmarks/numerics.py [--checkpoint /tmp/smol] [--quick] [--xla-flags='--a=1 --b=2' ...]

The reference is ``tests/core/models/numpy_reference.py``: the checkpoint's Llama forward in NumPy float64
throughout (transformers' own float64 forward keeps three float32 islands: RMSNorm, rotary cos/sin and the
softmax; its row shows what they cost). Inputs: eight English texts (49-146 tokens with the checkpoint's
tokenizer), each alone (batch 1, no mask), and two left-padded batches of 2. An error is
``|logits - reference|`` over real (unpadded) tokens; "max" is over all inputs, "mean" the mean of the
per-input means. Ratios are to transformers float32 with its default attention (sdpa).

workbench runs as shipped (layers stacked and scanned), with its layers unrolled, and op by op
(``jax.disable_jit``). The control is the reference's math written straight in ``jax.numpy`` float32 (no
workbench code; layers scanned like workbench, or unrolled), jitted; its other rows switch one piece each.
The notes under the first table say whether workbench and the control produce the same bits.

XLA reads its flags once per process, so each ``--xla-flags`` set (default: the one that moves float32 dots
from YNNPACK, this jaxlib's default, to Eigen) runs workbench and the control again in a child process; so
does "exact dots" (the control with every matmul accumulated in float64 and rounded once to float32, under
``jax_enable_x64``): what float32 elementwise arithmetic alone costs.

End-to-end errors are chaotic: an op's rounding early in the 30 layers is amplified differently by every later
op, so changing the last bit anywhere (even making rope exact) moves the max by up to 2x and the mean by
10-20%; transformers' own sdpa and eager paths differ that much. The second table removes that: each decoder
layer gets the reference's input rounded to float32, and its float32 output is compared with the float64 layer
applied to that same input (mean |error| / mean |layer update|, over all layers of three texts); "head" is the
same for the final norm and LM head (mean |error| of the logits). These per-layer numbers move by about 3%
between texts.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--exact-dots" in sys.argv:
    import jax

    jax.config.update("jax_enable_x64", True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _header import header, print_rows  # noqa: E402

from tests.core.models import numpy_reference as ref  # noqa: E402

# One flag set is always measured: it moves XLA:CPU's float32 dots from YNNPACK fusions (this jaxlib's
# default) back to Eigen.
NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
TEXTS = [
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters.",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy into "
    "chemical energy. During photosynthesis, light energy is captured by chlorophyll and used to convert water, "
    "carbon dioxide and minerals into oxygen and energy-rich organic compounds such as glucose. The oxygen "
    "released into the atmosphere is a by-product of splitting water molecules, and nearly all life on Earth "
    "depends on it, directly or indirectly. Scientists estimate that photosynthetic organisms capture about "
    "one hundred and thirty terawatts of energy from sunlight, which is roughly six times the power consumed "
    "by human civilisation. The first photosynthetic organisms probably evolved early in the history of life "
    "and most likely used reducing agents such as hydrogen or hydrogen sulfide, rather than water, as sources "
    "of electrons.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and "
    "nothing particular to interest me on shore, I thought I would sail about a little and see the watery part "
    "of the world.",
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure.",
    "To make a simple loaf of bread, mix five hundred grams of flour with a teaspoon of salt and a packet of dried "
    "yeast. Add about three hundred millilitres of warm water and stir until the dough comes together. Knead it "
    "on a floured surface for ten minutes, until it is smooth and elastic, then leave it in a covered bowl in a "
    "warm place for an hour, or until it has doubled in size. Shape the loaf, let it rise again, and bake it at "
    "two hundred degrees for about thirty minutes.",
    "The city council met on Tuesday evening to discuss the proposed budget for the coming year. Several "
    "residents spoke in favour of more funding for public libraries and parks, while others urged the council "
    "to repair roads and improve street lighting before starting any new projects. The mayor said that a final "
    "decision would be made next month, after the finance committee had reviewed the numbers.",
    "Python is a high-level, general-purpose programming language. Its design philosophy emphasizes code "
    "readability with the use of significant indentation. Python is dynamically typed and garbage-collected. It "
    "supports multiple programming paradigms, including structured, object-oriented and functional programming.",
]
PADDED = [(0, 1), (2, 3)]  # left-padded batches of two texts
LOCAL_TEXTS = (0, 2, 5)  # the per-layer table (those of them that --quick measures)
# Control rows: one switch each from the control as the workbench computes it.
CONTROL = {"control": {},
           "control, layers unrolled": dict(scan=False),
           "control, not jitted": dict(jit=False, scan=False),
           "control, silu x/(1+exp(-x))": dict(silu="exp"),
           "control, jax.nn.softmax": dict(softmax="nn"),
           "control, x/sqrt for rsqrt": dict(norm="div"),
           "control, precision HIGHEST": dict(precision="highest"),
           "control, rope tables exact": dict(rope="exact"),
           "control, rope tables from torch": dict(rope="torch")}
_START = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def inputs(checkpoint: str, quick: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """``(ids, mask)`` pairs: each text alone (mask None), then the left-padded batches."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    texts = TEXTS[:3] if quick else TEXTS
    out = [(np.array([tok(t)["input_ids"]], np.int32), None) for t in texts]
    for a, b in PADDED[:1] if quick else PADDED:
        enc = tok([TEXTS[a], TEXTS[b]], padding=True, padding_side="left", return_tensors="np")
        out.append((enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)))
    return out


def local_texts(batches) -> list[int]:
    return [j for j in LOCAL_TEXTS if j < len(batches) and batches[j][1] is None]


def keep(ids, mask) -> np.ndarray:
    return np.ones(ids.shape, bool) if mask is None else mask.astype(bool)


# -- the plain-JAX control -----------------------------------------------------------------------------
def rope_tables(kind: str, positions_BT: np.ndarray, d: int, theta: float):
    """``cos, sin (B, T, d)`` float32 as numpy ("exact", "torch"), or the float32 angles for XLA ("xla")."""
    if kind == "exact":
        angles = positions_BT[..., None] * (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        angles = np.concatenate([angles, angles], -1)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    inv = (1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
    angles = positions_BT[..., None].astype(np.float32) * inv
    angles = np.concatenate([angles, angles], -1)
    if kind == "torch":
        import torch

        inv = (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)))
        t = (torch.tensor(positions_BT)[..., None].float() * inv)
        t = torch.cat([t, t], -1)
        return t.cos().numpy(), t.sin().numpy()
    return angles, None


def control_ops(config: dict, opts: dict):
    """``layer(lw, x, cos, sin, visible)`` (``lw``: one layer's weights, names after ``model.layers.{i}.``) and
    ``head(w, x)`` in float32 jax.numpy."""
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // h
    eps = np.float32(config["rms_norm_eps"])
    precision = jax.lax.Precision.HIGHEST if opts.get("precision") == "highest" else None

    def mm(a, b):
        if opts.get("dot") == "exact":
            return jnp.matmul(a, b, preferred_element_type=jnp.float64).astype(jnp.float32)
        return jnp.matmul(a, b, precision=precision)

    def norm(x, w):
        ms = jnp.mean(x * x, -1, keepdims=True) + eps
        return w * (x / jnp.sqrt(ms) if opts.get("norm") == "div" else x * jax.lax.rsqrt(ms))

    def lin(x, w, name):
        y = mm(x, w[f"{name}.weight"].T)
        return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

    def rotate(x, cos, sin):
        x1, x2 = jnp.split(x, 2, -1)
        return x * cos[:, :, None] + jnp.concatenate([-x2, x1], -1) * sin[:, :, None]

    def layer(lw, x_BTD, cos_BTD, sin_BTD, visible_BTS):
        b, t, _ = x_BTD.shape
        y = norm(x_BTD, lw["input_layernorm.weight"])
        q = rotate(lin(y, lw, "self_attn.q_proj").reshape(b, t, h, d), cos_BTD, sin_BTD)
        k = rotate(lin(y, lw, "self_attn.k_proj").reshape(b, t, kv, d), cos_BTD, sin_BTD)
        v = lin(y, lw, "self_attn.v_proj").reshape(b, t, kv, d)
        q_BHTD = q.transpose(0, 2, 1, 3)
        k_BHSD, v_BHSD = (jnp.repeat(a, h // kv, 2).transpose(0, 2, 1, 3) for a in (k, v))
        s = jnp.where(visible_BTS[:, None], mm(q_BHTD, k_BHSD.transpose(0, 1, 3, 2)) * np.float32(d**-0.5), -jnp.inf)
        m = jnp.max(s, -1, keepdims=True)
        if opts.get("softmax") == "nn":
            p_BHTS = jnp.where(jnp.isfinite(m), jax.nn.softmax(s, -1), 0.0)
        else:
            e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
            den = jnp.sum(e, -1, keepdims=True)
            p_BHTS = e / jnp.where(den == 0, 1.0, den)
        a = mm(p_BHTS, v_BHSD).transpose(0, 2, 1, 3).reshape(b, t, h * d)
        x_BTD = x_BTD + lin(a, lw, "self_attn.o_proj")
        y = norm(x_BTD, lw["post_attention_layernorm.weight"])
        g = lin(y, lw, "mlp.gate_proj")
        g = g / (1 + jnp.exp(-g)) if opts.get("silu") == "exp" else jax.nn.silu(g)
        return x_BTD + lin(g * lin(y, lw, "mlp.up_proj"), lw, "mlp.down_proj")

    def head(w, x_BTD):
        tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in w
        return mm(norm(x_BTD, w["model.norm.weight"]), w["model.embed_tokens.weight" if tied else "lm_head.weight"].T)

    return layer, head


class Control:
    """The control forward for one set of switches: float32 weights, the layers' weights stacked and run by
    ``lax.scan`` (as workbench does by default) or, with ``scan=False``, by a Python loop."""

    def __init__(self, config: dict, weights32: dict, stacked: dict, opts: dict):
        self.config, self.w, self.stacked, self.opts = config, weights32, stacked, opts
        layer, self.head = control_ops(config, opts)
        h = config["num_attention_heads"]
        self.d = config.get("head_dim") or config["hidden_size"] // h
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        self.theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        n = config["num_hidden_layers"]

        def forward(w, stacked, ids, keep_BT, cos, sin):
            if sin is None:  # float32 angles: cos and sin in XLA, as workbench does
                cos, sin = jnp.cos(cos), jnp.sin(cos)
            t = ids.shape[1]
            x = w["model.embed_tokens.weight"][ids]
            visible = jnp.tril(jnp.ones((t, t), bool))[None]
            if keep_BT is not None:  # padding: hide padded keys too
                visible = visible & keep_BT[:, None, :]
            if opts.get("scan", True):
                x, _ = jax.lax.scan(lambda x, lw: (layer(lw, x, cos, sin, visible), None), x, stacked)
            else:
                for i in range(n):
                    x = layer(jax.tree.map(lambda a, i=i: a[i], stacked), x, cos, sin, visible)
            return self.head(w, x)

        def one_layer(lw, x, cos, sin, visible):
            if sin is None:
                cos, sin = jnp.cos(cos), jnp.sin(cos)
            return layer(lw, x, cos, sin, visible)

        self.forward = jax.jit(forward) if opts.get("jit", True) else forward
        self.jit_layer, self.jit_head = jax.jit(one_layer), jax.jit(self.head)

    def tables(self, keep_BT):
        return rope_tables(self.opts.get("rope", "xla"), np.maximum(np.cumsum(keep_BT, -1) - 1, 0), self.d, self.theta)

    def __call__(self, ids, mask):
        cos, sin = self.tables(keep(ids, mask))
        return self.forward(self.w, self.stacked, jnp.asarray(ids),
                            None if mask is None else jnp.asarray(mask.astype(bool)), jnp.asarray(cos),
                            None if sin is None else jnp.asarray(sin))

    def local(self, i, x32):
        """Layer ``i`` on ``x32 (1, T, D)`` (no padding)."""
        cos, sin = self.tables(np.ones(x32.shape[:2], bool))
        t = x32.shape[1]
        return self.jit_layer(jax.tree.map(lambda a: a[i], self.stacked), jnp.asarray(x32), jnp.asarray(cos),
                              None if sin is None else jnp.asarray(sin), jnp.tril(jnp.ones((t, t), bool))[None])


def load_weights32(checkpoint: str) -> tuple[dict, dict, dict]:
    """``(config, weights, stacked)``: float32 weights outside the layers, and the layers' stacked on a leading axis."""
    from safetensors import safe_open

    config = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    w, layers = {}, [{} for _ in range(config["num_hidden_layers"])]
    for file in sorted(pathlib.Path(checkpoint).glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                parts = name.split(".")
                if name.startswith("model.layers."):
                    layers[int(parts[2])][".".join(parts[3:])] = f.get_tensor(name).astype(np.float32)
                else:
                    w[name] = jnp.asarray(f.get_tensor(name).astype(np.float32))
    stacked = {k: jnp.asarray(np.stack([lw[k] for lw in layers])) for k in layers[0]}
    return config, w, stacked


# -- the float64 reference ----------------------------------------------------------------------------
def reference(checkpoint: str, batches, path: pathlib.Path) -> None:
    """Reference logits of every input, and each reference layer's float32-rounded input and float64 output
    on that input (the per-layer table), saved to ``path``."""
    config, w64 = ref.load(checkpoint)
    eps, n = config["rms_norm_eps"], config["num_hidden_layers"]
    h = config["num_attention_heads"]
    d = config.get("head_dim") or config["hidden_size"] // h
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    out = {}
    for j, (ids, mask) in enumerate(batches):
        out[f"logits{j}"] = ref.forward(config, w64, ids, mask)
        progress(f"reference logits {ids.shape}")

    def layer(i, x, cos, sin, visible):
        p = f"model.layers.{i}"
        x = x + ref.attention(ref.rms_norm(x, w64[f"{p}.input_layernorm.weight"], eps), w64, f"{p}.self_attn",
                              config, cos, sin, visible)
        return x + ref.mlp(ref.rms_norm(x, w64[f"{p}.post_attention_layernorm.weight"], eps), w64, f"{p}.mlp")

    head = w64["model.embed_tokens.weight" if config.get("tie_word_embeddings", False) or "lm_head.weight" not in w64
               else "lm_head.weight"]
    for j in local_texts(batches):
        ids, _ = batches[j]
        t = ids.shape[1]
        cos, sin = ref.rotary(np.arange(t)[None], d, theta)
        visible = np.tril(np.ones((t, t), bool))[None]
        x64 = w64["model.embed_tokens.weight"][ids]
        for i in range(n):
            x32 = x64.astype(np.float32)
            out[f"in{j}_{i}"], out[f"out{j}_{i}"] = x32, layer(i, x32.astype(np.float64), cos, sin, visible)
            x64 = layer(i, x64, cos, sin, visible)
        x32 = x64.astype(np.float32)
        out[f"in{j}_head"] = x32
        out[f"out{j}_head"] = ref.rms_norm(x32.astype(np.float64), w64["model.norm.weight"], eps) @ head.T
        progress(f"reference layers {ids.shape}")
    np.savez(path, **out)


# -- measurements -------------------------------------------------------------------------------------
def logits_errors(batches, data, fn) -> tuple[float, float]:
    """(max, mean of per-input means) of |fn(ids, mask) - reference| over real tokens."""
    maxima, means = [], []
    for j, (ids, mask) in enumerate(batches):
        err = np.abs(np.asarray(fn(ids, mask), np.float64) - data[f"logits{j}"])[keep(ids, mask)]
        maxima.append(err.max())
        means.append(err.mean())
    return float(max(maxima)), float(np.mean(means))


def local_errors(batches, data, n_layers, layer_fn, head_fn) -> tuple[float, float]:
    """(mean over layers and texts of mean|err| / mean|update|, mean |head error|)."""
    rel, heads = [], []
    for j in local_texts(batches):
        for i in range(n_layers):
            x32, y64 = data[f"in{j}_{i}"], data[f"out{j}_{i}"]
            y = np.asarray(layer_fn(i, x32), np.float64)
            rel.append(np.abs(y - y64).mean() / np.abs(y64 - x32).mean())
        heads.append(np.abs(np.asarray(head_fn(data[f"in{j}_head"]), np.float64) - data[f"out{j}_head"]).mean())
    return float(np.mean(rel)), float(np.mean(heads))


def jax_rows(checkpoint: str, batches, data, controls: dict, with_workbench: bool) -> tuple[list, list, list]:
    """End-to-end and per-layer rows for workbench (when asked) and the given control variants, and notes
    saying whether workbench and the control compute the same bits."""
    e2e, local, notes = [], [], []
    config, w32, stacked = load_weights32(checkpoint)
    n = config["num_hidden_layers"]
    twins = {}  # control row -> the workbench forward it mirrors
    if with_workbench:
        from flax import nnx

        import workbench.models as wm

        model = wm.from_pretrained(checkpoint, progress=False)
        unrolled = model.with_options(scan_layers=False)
        as_jax = lambda mask: None if mask is None else jnp.asarray(mask)
        scanned_fn = lambda ids, mask: model(jnp.asarray(ids), as_jax(mask)).logits
        unrolled_fn = lambda ids, mask: unrolled(jnp.asarray(ids), as_jax(mask)).logits

        def op_by_op(ids, mask):
            with jax.disable_jit():
                return unrolled(jnp.asarray(ids), as_jax(mask)).logits

        attn = model.attn_mechanism
        for name, fn in ((f"workbench float32 ({attn}, layers scanned: the default)", scanned_fn),
                         (f"workbench float32 ({attn}, layers unrolled)", unrolled_fn),
                         (f"workbench float32 ({attn}, op by op)", op_by_op)):
            e2e.append((name, *logits_errors(batches, data, fn)))
        twins = {"control": ("workbench (layers scanned)", scanned_fn),
                 "control, layers unrolled": ("workbench (layers unrolled)", unrolled_fn)}
        head = nnx.jit(lambda m, x: m.head(m.norm(x)))
        local.append(("workbench float32", *local_errors(batches, data, n, workbench_layer(model),
                                                         lambda x: head(model, jnp.asarray(x)))))
        progress("workbench")
    for name, opts in controls.items():
        ctl = Control(config, w32, stacked, opts)
        e2e.append((name, *logits_errors(batches, data, ctl)))
        if name in twins:
            label, fn = twins[name]
            pairs = [(np.asarray(fn(ids, mask))[keep(ids, mask)], np.asarray(ctl(ids, mask))[keep(ids, mask)])
                     for ids, mask in batches]
            same = sum(np.array_equal(a, b, equal_nan=True) for a, b in pairs)
            notes.append(f"{label} vs {name}: bit-identical logits on {same} of {len(pairs)} inputs, max |difference| "
                         f"{max(float(np.nanmax(np.abs(a - b), initial=0.0)) for a, b in pairs):.2e}")
        if not opts or not set(opts) <= {"scan", "jit"}:  # per-layer rows: the control and arithmetic switches
            local.append((name, *local_errors(batches, data, n, ctl.local,
                                              lambda x, c=ctl: c.jit_head(c.w, jnp.asarray(x)))))
        progress(name)
    return e2e, local, notes


def workbench_layer(model):
    """``(i, x) -> layer i's output`` of a workbench model, batch 1 without padding."""
    from flax import nnx

    from workbench.core.models.rope import cos_sin, inv_frequencies

    c = model.config
    inv_freq = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
    layers = list(model.layers)  # one-layer blocks

    @nnx.jit
    def run(block, x):
        cos, sin = cos_sin(jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2]), inv_freq)
        return block(x, cos, sin, None)[0]

    return lambda i, x: run(layers[i], jnp.asarray(x))


def hf_rows(checkpoint: str, batches, data) -> tuple[list, list]:
    import torch
    import transformers

    e2e, local = [], []
    for impl, dtype in (("sdpa", torch.float32), ("eager", torch.float32), ("sdpa", torch.float64)):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation=impl)
        model.eval()

        def fn(ids, mask, model=model):
            with torch.no_grad():
                mask = np.ones_like(ids) if mask is None else mask
                return model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                             use_cache=False).logits.double().numpy()

        name = f"transformers {str(dtype).removeprefix('torch.')} ({impl})"
        e2e.append((name + (", float32 islands" if dtype == torch.float64 else ""), *logits_errors(batches, data, fn)))
        if dtype == torch.float32:
            local.append((name, *local_errors(batches, data, model.config.num_hidden_layers,
                                              hf_layer(model, batches), lambda x, m=model: hf_head(m, x))))
        progress(name)
    return e2e, local


def hf_layer(model, batches):
    """``(i, x) -> layer i's output`` with the keyword arguments transformers passes (captured once per length)."""
    import torch

    kwargs = {}
    for j in local_texts(batches):
        ids = torch.tensor(batches[j][0], dtype=torch.long)

        def capture(module, args, kw, t=ids.shape[1]):
            kwargs[t] = {k: v for k, v in kw.items() if k != "hidden_states"}

        hook = model.model.layers[0].register_forward_pre_hook(capture, with_kwargs=True)
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        hook.remove()

    def run(i, x):
        with torch.no_grad():
            out = model.model.layers[i](torch.tensor(x), **kwargs[x.shape[1]])
        return (out[0] if isinstance(out, tuple) else out).numpy()

    return run


def hf_head(model, x):
    import torch

    with torch.no_grad():
        return model.lm_head(model.model.norm(torch.tensor(x))).numpy()


def child(args) -> None:
    """Rows measured under this process's XLA flags (or with exact dots); printed as one JSON line."""
    batches = inputs(args.checkpoint, args.quick)
    data = np.load(args.data)
    if args.exact_dots:
        e2e, local, notes = jax_rows(args.checkpoint, batches, data, {"control, exact dots (float64 accumulation)":
                                                               dict(dot="exact")}, with_workbench=False)
    else:
        controls = {k: CONTROL[k] for k in ("control", "control, layers unrolled")}
        e2e, local, notes = jax_rows(args.checkpoint, batches, data, controls, with_workbench=True)
    print("ROWS " + json.dumps({"e2e": e2e, "local": local, "notes": notes}))


def run_child(args, data_path: pathlib.Path, flags: str | None) -> tuple[list, list, list]:
    env = dict(os.environ)
    extra = ["--exact-dots"] if flags is None else []
    if flags is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    cmd = [sys.executable, __file__, "--child", "--data", str(data_path), "--checkpoint", args.checkpoint, *extra]
    out = subprocess.run(cmd + (["--quick"] if args.quick else []), env=env, capture_output=True, text=True)
    tag = "exact dots" if flags is None else f"XLA_FLAGS {flags}"
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return [], [], [f"the child process for {tag} failed (exit status {out.returncode}); its rows are missing"]
    rows = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROWS "))[5:])
    label = lambda r: r[0] if flags is None else f"{r[0]} [{tag}]"
    return ([(label(r), *r[1:]) for r in rows["e2e"]], [(label(r), *r[1:]) for r in rows["local"]],
            [f"{n} [{tag}]" for n in rows["notes"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/smol", help="a Llama-family checkpoint directory "
                        "(config.json, *.safetensors, tokenizer)")
    parser.add_argument("--quick", action="store_true", help="three texts and one padded batch; two control rows")
    parser.add_argument("--xla-flags", action="append", metavar="FLAGS",
                        help=f"an XLA_FLAGS set to measure workbench and the control under, in a child process; "
                             f"repeatable, written --xla-flags='--a=1 --b=2' (default: {NO_YNN})")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exact-dots", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import torch
    import transformers

    print(header(f"numerics: float32 logits vs a float64 NumPy reference ({args.checkpoint})"))
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n")
    batches = inputs(args.checkpoint, args.quick)
    print("inputs (B, T): " + ", ".join(f"{ids.shape}" + ("" if m is None else " left-padded") for ids, m in batches))
    controls = {k: CONTROL[k] for k in ("control", "control, layers unrolled")} if args.quick else CONTROL
    with tempfile.TemporaryDirectory() as tmp:
        data_path = pathlib.Path(tmp) / "reference.npz"
        reference(args.checkpoint, batches, data_path)
        data = np.load(data_path)
        e2e, local = hf_rows(args.checkpoint, batches, data)
        more = jax_rows(args.checkpoint, batches, data, controls, with_workbench=True)
        e2e, local, notes = e2e + more[0], local + more[1], more[2]
        for flags in [*(args.xla_flags or [NO_YNN]), None]:
            more = run_child(args, data_path, flags)
            e2e, local, notes = e2e + more[0], local + more[1], notes + more[2]
            progress(f"child {flags or 'exact dots'}")
    base_max, base_mean = e2e[0][1], e2e[0][2]
    print("\nEnd to end: |logits - float64 reference| over real tokens (ratios to the first row)\n")
    fmt = lambda v: "-" if v != v else f"{v:.2e}"
    print_rows(["implementation", "max", "mean", "max ratio", "mean ratio"],
               [(n, fmt(mx), fmt(mn), f"{mx / base_max:.2f}", f"{mn / base_mean:.2f}") for n, mx, mn in e2e])
    print("\n" + "\n".join(notes))
    base_layer, base_head = local[0][1], local[0][2]
    print("\nPer layer: error one layer makes on the reference's input (ratios to the first row)\n")
    print_rows(["implementation", "layer err / update", "ratio", "head mean |err|", "ratio"],
               [(n, f"{a:.3e}", f"{a / base_layer:.2f}", f"{b:.3e}", f"{b / base_head:.2f}") for n, a, b in local])


if __name__ == "__main__":
    main()
