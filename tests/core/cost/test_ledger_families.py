"""Issue 16's target for the memory ledger: within 10 % of the compiled train step's memory for every preset family
at the three remat policies, on a TPU slice (XLA's TPU compiler via libtpu, ahead of time) and on the CPU cluster
(XLA:CPU in the compile worker). One compile per case; the cases the ledger misses are xfail (strict) with the
measured gap and its reason.

A TPU compile takes 4-10 s, a CPU one 1-3 s: the 60 cases take about 4 minutes on 2 cores. By default each family
runs at one remat policy per compiler (rotating, so every policy meets every compiler; about 80 s);
``WORKBENCH_LEDGER_SWEEP=1`` runs them all. Measured gaps (ledger / compiled - 1) of the whole sweep, none /
dots_saveable / full, TPU then CPU: llama, mistral +1.1 / +3.2 / -0.2, -0.8 / -2.3 / -0.7 %; qwen2 -0.3 / +0.7 /
-1.7, the same as llama on CPU; qwen3 -0.1 / -0.7 / -5.8, -2.0 / -4.3 / -3.7 %; gpt2 -0.6 / -2.1 / +2.2, +0.1 / -0.8
/ -0.6 %; mixtral -3.8 / +6.1 / +0.2, +2.7 / +1.5 / -0.2 %; qwen3_moe +2.9 / +5.8 / +1.8, +2.0 / +2.4 / +13.7 %;
gpt_oss -3.3 / -8.2 / -7.0, -1.2 / +5.2 / +16.2 %; gemma3 -4.6 / -5.0 / +8.3, -2.9 / +6.2 / +18.1 %; deepseek_v3
-1.6 / +5.9 / +4.3, +6.2 / +8.0 / +21.4 % (libtpu 0.0.42, JAX 0.10, the softmax's shift a stop_gradient).
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from workbench.core.compile.steps import full_mesh_shape
from workbench.core.compile.virtual import TPU_HBM_ONLY, compile_step
from workbench.core.cost.ledger import LIBTPU_HOLDS_DONATED_PARAMETERS, ledger, libtpu_version
from workbench.core.hardware.cluster import Cluster, cluster_mesh
from workbench.core.mesh import MESH_AXES
from workbench.core.views.explore import Layout
from workbench.core.vocab import REMATS
from workbench.models import FAMILIES, CausalLM, ModelConfig, tiny_config

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')
MESH = {"fsdp": 4, "tp": 2}


def _sizes(family: str, tpu: bool) -> dict:
    """Each family's tiny preset at hidden 256 (CPU, float32) or 512 with 128-wide heads (TPU, bfloat16: narrower
    heads pad on TPU), 4 layers, MLP 1024; a few seconds per compile."""
    d, f, layers, heads, head_dim = (512, 1024, 4, 4, 128) if tpu else (256, 1024, 4, 4, 64)
    base = tiny_config(family)
    if family == "gpt2":
        sizes = dict(n_embd=d, n_inner=f, n_layer=layers, n_head=heads)
    else:
        sizes = dict(hidden_size=d, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=2)
        if "head_dim" in base:
            sizes["head_dim"] = head_dim
    if family == "qwen3_moe":
        sizes["moe_intermediate_size"] = f // 2
    if family == "deepseek_v3":  # MLA: q LoRA, latent, nope + rope query/key dims, value dim
        mla = (256, 192, 64, 64, 128) if tpu else (128, 32, 16, 8, 16)
        sizes |= dict(num_key_value_heads=heads, moe_intermediate_size=f // 4,
                      **dict(zip(("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
                                 mla, strict=True)))
    if "layer_types" in base:  # alternating sliding / full layers
        sizes["layer_types"] = base["layer_types"] * (layers // len(base["layer_types"]))
    sizes["vocab_size"] = 2048 if tpu else 264
    return sizes


def _gap(family: str, remat: str, tpu: bool) -> float:
    cluster = Cluster.tpu("v5e:2x4", libtpu=libtpu_version()) if tpu else Cluster.cpu(8)
    dtype = jnp.bfloat16 if tpu else jnp.float32
    batch = (16, 256) if tpu else (16, 128)
    config = ModelConfig.from_hf(tiny_config(family, **_sizes(family, tpu)))
    model = CausalLM.lazy_init(config, dtype=dtype, param_dtype=dtype).with_options(remat=remat)
    compiled = compile_step(model, cluster, MESH, batch=batch, compiler_options=TPU_HBM_ONLY if tpu else None)
    layout = Layout.of(model, cluster_mesh(cluster, full_mesh_shape(MESH, cluster), MESH_AXES))
    return ledger(model, layout, batch=batch, cluster=cluster).total / compiled.memory.total - 1


SWEEP = os.environ.get("WORKBENCH_LEDGER_SWEEP", "") not in ("", "0")
# XLA:CPU, remat="full", the two families whose layers alternate sliding and full attention: the scanned layer is a
# lax.switch over two kinds, and XLA keeps the other kind's branch buffers too. The ledger adds one layer's "none"
# set per further kind, as measured on XLA:TPU (all three policies) and on XLA:CPU without remat; XLA:CPU's
# full-remat backward holds about a third of that.
_SWITCH = ("measured {:+.1f} % on XLA:CPU: the layer-kind switch (sliding / full attention) costs XLA:CPU's "
           "full-remat backward about a third of the layer's 'none' set the ledger adds per further kind")
# The two MoE families with remat="full" on XLA:CPU: their full-remat backward holds less than the 2.75 layer
# dots_saveable sets the dense families' compiled steps hold (WORKING_SET); 2.25 would fit qwen3_moe (+0.9 %), 2.0
# deepseek_v3 (-0.1 %), and the dense families would then be 9-13 % under. Already over before the softmax's shift
# was a stop_gradient (+11.4 % and +19.1 %, the ledger the same and the compiled steps 2 % larger); outside the sweep
# these cases do not run (the rotation gives both families dots_saveable on CPU).
_MOE_FULL = ("measured {:+.1f} % on XLA:CPU: the MoE layer's full-remat backward holds fewer than the 2.75 "
             "dots_saveable sets of the dense families' (WORKING_SET)")
CPU_MISSES = {("gemma3", "full"): _SWITCH.format(18.1), ("gpt_oss", "full"): _SWITCH.format(16.2),
              ("qwen3_moe", "full"): _MOE_FULL.format(13.7), ("deepseek_v3", "full"): _MOE_FULL.format(21.4)}
if jax.__version_info__ >= (0, 12):  # its XLA:CPU holds less there: measured +7.7 % (gemma3: +21.2 %) with 0.12.0.1
    del CPU_MISSES["gpt_oss", "full"]


# XLA:TPU from libtpu 0.0.50, Gemma 3 with remat="full": the recomputed layer-kind switch passes fewer arrays out
# of its backward (one bf16[4,256,512] activation, an f32 array now bf16, the weight slices 0.0.42 passed out), so
# the compiled peak falls 61.63 -> 60.16 MiB and the ledger, already +8.5 % over with 0.0.42, reads +11.1 %.
# GPT-OSS, the other family with alternating kinds, has the same peak on both versions (136.40 MiB): no term keyed
# on the version describes both, so this stays a stated miss until the switch's working set is modelled.
TPU_MISSES = {}
if (libtpu_version() or (0,)) >= LIBTPU_HOLDS_DONATED_PARAMETERS:
    TPU_MISSES["gemma3", "full"] = ("measured +11.1 % with libtpu 0.0.50: its full-remat backward's layer-kind "
                                    "switch passes 1.5 MiB fewer arrays out than 0.0.42's (+8.5 %)")


def _cases(misses: dict[tuple[str, str], str], shift: int) -> list:
    """Every family x remat; outside a sweep, family ``i`` runs at remat ``(i + shift) % 3`` only."""
    cases = []
    for i, family in enumerate(FAMILIES):
        for j, remat in enumerate(REMATS):
            marks = [pytest.mark.xfail(strict=True, reason=misses[family, remat])] if (family, remat) in misses else []
            if not SWEEP and j != (i + shift) % len(REMATS):
                marks.append(pytest.mark.skip(reason="one remat policy per family unless WORKBENCH_LEDGER_SWEEP=1"))
            cases.append(pytest.param(family, remat, marks=marks))
    return cases


@needs_libtpu
@pytest.mark.parametrize(("family", "remat"), _cases(TPU_MISSES, 0))
def test_ledger_matches_the_compiled_step_on_a_tpu_slice(family, remat):
    """XLA:TPU's HBM peak (memory-space assignment to VMEM off: ``TPU_HBM_ONLY``) on v5e:2x4, bfloat16."""
    assert abs(_gap(family, remat, tpu=True)) <= 0.10


@pytest.mark.parametrize(("family", "remat"), _cases(CPU_MISSES, 1))
def test_ledger_matches_the_compiled_step_on_the_cpu_cluster(family, remat):
    """XLA:CPU's arguments + outputs + temporaries on 8 simulated devices, float32."""
    assert abs(_gap(family, remat, tpu=False)) <= 0.10


@pytest.mark.parametrize("remat", REMATS)
def test_the_alltoall_dispatch_on_an_ep_mesh(remat):
    """Mixtral on ep=2 x fsdp=2 x tp=2: "auto" runs the all-to-all strategy, each device's experts on the rows the
    ep devices send it (E / ep per token without a capacity factor); measured -1.7 / -6.6 / -5.7 %."""
    cluster, mesh, batch = Cluster.cpu(8), {"ep": 2, "fsdp": 2, "tp": 2}, (16, 128)
    config = ModelConfig.from_hf(tiny_config("mixtral", **_sizes("mixtral", tpu=False)))
    model = CausalLM.lazy_init(config).with_options(remat=remat)
    compiled = compile_step(model, cluster, mesh, batch=batch)
    layout = Layout.of(model, cluster_mesh(cluster, full_mesh_shape(mesh, cluster), MESH_AXES))
    assert ledger(model, layout, batch=batch, cluster=cluster).total == pytest.approx(compiled.memory.total, rel=0.10)
