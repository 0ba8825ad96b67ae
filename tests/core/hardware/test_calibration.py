"""Each cited measurement of workbench/core/hardware/calibration.py, reproduced by the step model within its stated
tolerance: the H100 figures in benchmarks/data/h100_measured_2026-11-27.json (benchmarks/gpu_constants.py on a
lent H100 SXM), and every constant either sourced or saying it is not."""

import dataclasses
import json
import pathlib
import statistics

import pytest

from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.kernels import attention_efficiency, attention_rate, gemm_efficiency, memory_seconds
from workbench.core.cost.predicted import predict_step
from workbench.core.hardware.calibration import CALIBRATIONS, calibration
from workbench.core.hardware.chips import H100, TPU_V5P
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.published import price, published_runs
from workbench.core.models.presets import full_config
from workbench.core.vocab import ATTENTION_KERNELS

ROOT = pathlib.Path(__file__).parents[3]
MEASURED = json.loads((ROOT / "benchmarks/data/h100_measured_2026-11-27.json").read_text())
PEAK = H100.peak_flops("bf16")


def _gemm_s(m, k, n):
    return 2 * m * k * n / (PEAK * gemm_efficiency(m, k, n, H100))


def test_large_gemms_within_20_percent_of_the_measured_h100():
    """Every GEMM of the two models' projections (8,192 tokens; forward, dx, dw) and the squares from 4096^3."""
    large = [g for g in MEASURED["gemm"] if g["label"] != "square" or g["m"] >= 4096]
    large = [g for g in large if not g["label"].startswith(("skinny", "decode"))]
    assert len(large) >= 30
    for g in large:
        assert _gemm_s(g["m"], g["k"], g["n"]) / g["seconds"] == pytest.approx(1, abs=0.20), g["label"]
    ratios = [_gemm_s(g["m"], g["k"], g["n"]) / g["seconds"] for g in large]
    assert statistics.median(ratios) == pytest.approx(1, abs=0.05)


@pytest.mark.parametrize("kind", ["skinny-n", "skinny-k"])
def test_skinny_gemms_within_25_percent(kind):
    """N or K of 64 to 1,024 (M 8,192): the tile's idle columns and the contraction's pipeline fill."""
    rows = [g for g in MEASURED["gemm"] if g["label"] == kind]
    assert len(rows) == 5
    for g in rows:
        assert _gemm_s(g["m"], g["k"], g["n"]) / g["seconds"] == pytest.approx(1, abs=0.25), (g["k"], g["n"])


def test_flash_attention_within_10_percent():
    """cuDNN, causal, forward and backward (2.5x the forward), FLOPs of the kept tiles."""
    rows = [a for a in MEASURED["attention"] if a["impl"] == "cudnn" and a["causal"] and a["part"] == "fwd+bwd"]
    assert len(rows) >= 4
    for a in rows:
        flops = 3.5 * 4 * a["batch"] * a["heads"] * a["seq"] ** 2 * a["head_dim"] / 2
        predicted = flops / (PEAK * attention_efficiency(a["seq"], a["head_dim"], H100))
        assert predicted / a["seconds"] == pytest.approx(1, abs=0.10), (a["seq"], a["head_dim"])


def test_the_triton_flash_rate_is_what_two_published_mpt_runs_imply():
    """llm-foundry's MPT-7B on 8 H100s at 32,768 and 65,536 tokens a sequence (benchmarks/data/
    published_runs_gpu.json, quoted from its README): the same 1,048,576 tokens a step, so the same matmuls, norms
    and gathers; the 27.5 s between the steps is attention's extra causal FLOPs, 4.5 x 2 T d a token a layer
    (forward, backward 2.5x, the full remat's second forward) over 8 GPUs. The step model's difference agrees."""
    raw = {r["name"]: r for r in json.loads((ROOT / "benchmarks/data/published_runs_gpu.json").read_text())}
    short, long_ = (raw[f"llmfoundry-mpt-7b-h100x8-fsdp-{k}k-bf16"] for k in (32, 64))
    (b_s, t_s), (b_l, t_l) = short["batch"], long_["batch"]
    assert b_s * t_s == b_l * t_l == 1_048_576 and short["model"]["hidden_size"] == 4096
    measured = long_["measured"]["step_time_s"] - short["measured"]["step_time_s"]
    extra_flops = b_s * t_s * 4.5 * 2 * (t_l - t_s) * 4096 * 32 / 8
    assert extra_flops / measured / PEAK == pytest.approx(calibration(H100).attention_kernels["flash_triton"].value,
                                                          abs=0.01)
    runs = {r.name: r for r in published_runs()}
    predicted = [price(runs[f"llmfoundry-mpt-7b-h100x8-fsdp-{k}k-bf16"]).time_s for k in (32, 64)]
    assert (predicted[1] - predicted[0]) / measured == pytest.approx(1, abs=0.1)


def test_a_kernel_without_a_rate_on_a_chip_says_which_have_one():
    assert attention_rate(H100, "xla") == attention_rate(H100, "flash") == calibration(H100).attention.value
    assert attention_rate(H100, "flash_triton") < attention_rate(H100, "flash")
    with pytest.raises(ValueError, match=r"no measured rate for the 'flash_triton' attention kernel on TPU v5p; "
                                         r"kernels with one there: \['flash', 'xla'\]"):
        attention_rate(TPU_V5P, "flash_triton")
    with pytest.raises(ValueError, match="attention"):
        attention_rate(H100, "flash9")


def test_memory_bound_kernels_within_15_percent():
    for row in MEASURED["memory"]:
        predicted = memory_seconds(row["bytes"], H100, H100.hbm_bandwidth)
        assert predicted / row["seconds"] == pytest.approx(1, abs=0.15), row["label"]


def test_the_one_gpu_llama_1b_train_step_within_25_percent():
    """The measured step: Llama-3.2-1B, 4 x 2,048 tokens, AdamW with float32 master weights, cuDNN attention, on
    one H100 (160 ms without remat, 158 ms with full remat). The roofline of the day predicted 68 and 82 ms."""
    config = full_config("llama-3.2-1b")
    one = Cluster.h100(nodes=1, gpus_per_node=1)
    for run in MEASURED["train"]:
        step = predict_step(config, one, {}, batch=tuple(run["batch"]), remat=run["remat"])
        assert step.time_s / run["seconds"] == pytest.approx(1, abs=0.25), run["remat"]


def test_every_constant_is_sourced_or_says_it_is_not():
    for chip, cal in CALIBRATIONS.items():
        name = chip.name
        assert cal.chip == name
        for field in ("gemm", "attention", "hbm", "fusion", "network"):
            evidence = getattr(cal, field)
            assert evidence.source, (name, field)
            if evidence.sourced:  # a measurement this repository holds
                path = evidence.source.split(" in this repository")[0]
                assert path.startswith("benchmarks/data/") and (ROOT / path).is_file(), (name, field)
            assert 0 < evidence.value <= (4 if field == "fusion" else 1), (name, field)
        for kernel, evidence in cal.attention_kernels.items():
            assert kernel in ATTENTION_KERNELS and evidence.source and 0 < evidence.value <= 1, (name, kernel)
    assert calibration(H100).gemm.sourced
    with pytest.raises(ValueError, match="calibrated chips"):
        calibration(dataclasses.replace(H100, name="TPU v9"))
    with pytest.raises(TypeError, match="not str 'H100 SXM'"):
        calibration("H100 SXM")  # a chip, not its name: renaming a chip cannot unlink its calibration


def test_simulated_cpu_devices_have_no_step_time():
    """No chip numbers: a clear error, whichever pricing is asked for."""
    cpu = Cluster.cpu(8)
    with pytest.raises(ValueError, match="no peak numbers"):
        predict_step(full_config("llama-3-8b"), cpu, {"fsdp": 8}, batch=(8, 128))
    with pytest.raises(ValueError, match="no peak numbers"):
        step_time(cluster=cpu, mesh_shape={"fsdp": 8}, flops=1.0, hbm_bytes=1.0, collectives=[])
