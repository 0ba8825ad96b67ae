"""With ``jax_enable_x64`` on from the start and ``dtype=float64``, the whole forward runs in float64 and
equals an independent NumPy float64 forward to 1e-10; caches, sharding, generation, training and the
widgets work. x64 must be on before JAX starts, so the checks run in a fresh process (x64_worker.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.xla_flags import child_xla_flags

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def results():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags(8)}
    proc = subprocess.run([sys.executable, "-m", "tests.core.models.x64_worker"], capture_output=True, text=True,
                          env=env, timeout=600, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["qwen2", "llama-bias-tied"])
def test_float64_forward_equals_numpy_float64(results, family):
    r = results[family]
    assert results["x64"] and r["logits_dtype"] == "float64" and r["param_dtypes"] == ["float64"]
    assert r["vs_numpy64"] <= 1e-10 and r["unrolled_vs_numpy64"] <= 1e-10
    # transformers' own float64 forward keeps float32 islands (RMSNorm, rotary, softmax): it is off by far more
    assert r["hf64_vs_numpy64"] > 100 * max(r["vs_numpy64"], 1e-14)


@pytest.mark.parametrize("family", ["qwen2", "llama-bias-tied"])
def test_float64_forward_equals_transformers_float64_without_its_float32_islands(results, family):
    """With those islands made float64 (x64_worker.without_float32_islands), transformers agrees with the
    NumPy reference and with ours to 1e-10, left padding included: the islands are the whole difference."""
    r = results[family]
    assert r["hf64_no_islands_vs_numpy64"] <= 1e-10
    assert r["hf64_no_islands_vs_ours"] <= 1e-10


@pytest.mark.parametrize("family", ["qwen2", "llama-bias-tied"])
def test_caches_sharding_generation_and_training_work_in_float64(results, family):
    r = results[family]
    assert r["cache_dtype"] == "float64" and r["decode_vs_full"] <= 1e-10
    assert r["sharded_vs_unsharded"] <= 1e-10
    assert r["paged_equals_contiguous"] and r["beam_shape"] == [2, 12 + 6]
    assert r["train_loss_dtype"] == "float64" and 0 < r["train_loss"] < 10


def test_widgets_build_on_a_float64_model(results):
    tree, explorer, error = results["widgets"]
    assert tree.startswith("ModuleTree(CausalLM") and explorer.startswith("ShardingExplorer(") and error == ""
