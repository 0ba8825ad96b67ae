"""The serving model against serving steps others measured and published
(workbench/core/interop/published_serving.json): the points are traceable and complete, the engines' fitted costs
are the fit, and issue 49's target, which does not hold yet (an expected failure that fails loudly once it holds)."""

import json
import re
import statistics
import subprocess
import sys

import pytest

from workbench.core.hardware.calibration import engine_layer
from workbench.core.interop.published_serving import (
    BAND,
    ENGINE_FITS,
    POINTS_FILE,
    accuracy,
    fit_engine_layer,
    fit_group,
    leave_one_out,
    not_held_points,
    published_points,
    serving_accuracy_text,
)
from workbench.core.vocab import SERVING_ENGINES


def test_at_least_15_points_from_three_engines_on_gpu_and_tpu_each_traceable():
    points = published_points()
    assert len(points) >= 15
    assert len({p.engine for p in points}) >= 3 and {p.cluster.platform for p in points} == {"gpu", "tpu"}
    assert {p.kind for p in points} == {"decode", "prefill", "throughput"}
    for p in points:
        assert p.engine in SERVING_ENGINES, p.name
        assert p.source["quote"] and p.source["derivation"], p.name
        url = p.source["url"]
        # a GitHub file at a commit, or a versioned documentation page
        assert re.search(r"github\.com/.+/blob/[0-9a-f]{40}/", url) or "nim/benchmarking/llm/1.0.0" in url, p.name
        assert p.input_len > 0 and p.output_len > 0 and p.measured > 0, p.name
        assert (p.prompts if p.kind == "prefill" else p.concurrency) >= 1, p.name


def test_the_quote_holds_the_measured_number():
    """Each point's measurement appears in its quoted source line (as printed there: ``8``, ``18.58``, ``1,486``)."""
    raw = {r["name"]: r for f in ("gpu", "tpu")
           for r in json.loads((POINTS_FILE.parents[3] / f"benchmarks/data/published_serving_{f}.json").read_text())}
    for p in published_points():
        value = raw[p.name]["value"]
        forms = {f"{value:g}", f"{value:,g}", f"{value:,.0f}", f"{value:.2f}", f"{value:,.2f}"}
        assert any(form in p.source["quote"] for form in forms), (p.name, value)


def test_the_points_file_is_what_the_builder_makes_of_the_raw_records(tmp_path):
    out = tmp_path / "serving.json"
    subprocess.run([sys.executable, str(POINTS_FILE.parents[3] / "benchmarks/data/build_published_serving.py"),
                    str(out)], check=True, capture_output=True)
    assert json.loads(out.read_text()) == json.loads(POINTS_FILE.read_text())
    assert all(p["why"] for p in not_held_points())


def test_each_engine_cost_shipped_is_its_fit_and_fitted_to_decode_steps_only():
    for engine, chips in ENGINE_FITS:
        group = fit_group(engine, chips)
        assert group and all(p.kind == "decode" for p in group)
        fitted = fit_engine_layer(group)
        for chip in chips:
            assert engine_layer(engine, chip).value == pytest.approx(fitted, abs=1e-6), (engine, chip.name)
        # the fit's criterion: the geometric mean of predicted / measured at 1
        assert statistics.geometric_mean(p.ratio(fitted) for p in group) == pytest.approx(1, abs=1e-6)


def test_leave_one_out_refits_only_the_decode_points_it_was_fitted_to():
    ratios, refits = leave_one_out()
    fitted = {name for r in refits for name in r.left_out}
    for p in published_points():
        if p.name not in fitted:
            assert ratios[p.name] == p.ratio(), p.name
    assert all(p.kind == "decode" for p in published_points() if p.name in fitted)


def test_fp8_decode_is_held_without_pricing_a_cast_of_every_weight():
    """The issue's first cause: Llama-3.3-70B, fp8, TP2 on two H100s, one sequence at 5,000 tokens measures 18.58 ms a
    token (NIM); the step model priced a training-time cast of every weight, 83 ms."""
    nim = next(p for p in published_points() if p.name == "nim180_llama33_70b_2xh100_tp2_fp8_5000x500_c1_itl")
    assert BAND[0] <= nim.ratio() <= BAND[1]


@pytest.mark.xfail(strict=True, reason="issue 49's target does not hold yet: TPU prefill is 0.51-0.88x with "
                                       "chunked prefill priced (vLLM and sglang-jax prefill slower than the step "
                                       "model's kernels, most at 8k tokens), TensorRT-LLM 0.5's 128-token TTFT "
                                       "0.53x, Llama-2-70B's static-batch throughput 2x the measured; see "
                                       "benchmarks/published_serving.py")
def test_issue_49_target_decode_and_prefill_within_band_and_throughput_not_above_1_35():
    ratios, _ = leave_one_out()
    for kind in ("decode", "prefill"):
        acc = accuracy(kind)
        assert all(BAND[0] <= ratios[name] <= BAND[1] for name in acc.ratios), kind
        assert acc.median_abs <= 1.15, kind
    assert all(ratios[p.name] <= 1.35 for p in published_points() if p.kind == "throughput")


def test_a_serving_prediction_says_how_far_the_model_was_out_of_sample():
    ratios, _ = leave_one_out()
    decode = [ratios[p.name] for p in published_points() if p.kind == "decode"]
    text = serving_accuracy_text("decode")
    assert f"on {len(decode)} published decode steps" in text and f"{min(decode):.2f}x to {max(decode):.2f}x" in text
    with pytest.raises(ValueError, match="kinds"):
        serving_accuracy_text("train")
