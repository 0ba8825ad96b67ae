"""The advisor's serving answer (``workbench.core.advisor.serving``): the front's point for a latency or throughput
target, on hand-made fronts whose answer is read off by eye, and on a real front against its definition."""

import dataclasses

import pytest

from workbench.core.advisor.serving import advise_serving, lowest_decode_ratio, pick_from_front
from workbench.core.cost.serving import FrontierPoint
from workbench.core.hardware.chips import H100
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.published_serving import out_of_sample, published_points
from workbench.core.models.presets import full_config


@dataclasses.dataclass(frozen=True)
class _Step:
    """What a frontier point reads of its step."""

    time_s: float
    tokens_per_s_per_chip: float
    concurrency: int


def _point(ms, tps, concurrency, on_front=True):
    return FrontierPoint({"tp": 8}, _Step(ms / 1e3, tps, concurrency), on_front)


# fastest first: 10 ms / 100, 20 ms / 500, 40 ms / 900 on the front; 30 ms / 400 behind it
FRONT = (_point(10, 100, 1), _point(20, 500, 8), _point(40, 900, 64), _point(30, 400, 32, on_front=False))


def test_a_latency_target_takes_the_most_throughput_within_it():
    pick, why = pick_from_front(FRONT, max_ms_per_token=25)
    assert pick is FRONT[1]
    assert "at or under 25 ms" in why and "64 in flight: 40.0 ms a token" in why and "misses" in why
    pick, _ = pick_from_front(FRONT, max_ms_per_token=1000)
    assert pick is FRONT[2]


def test_a_throughput_target_takes_the_fastest_point_that_gives_it():
    assert pick_from_front(FRONT, min_tokens_per_s_per_chip=400)[0] is FRONT[1]  # not the 30 ms point off the front
    assert pick_from_front(FRONT, min_tokens_per_s_per_chip=50)[0] is FRONT[0]


def test_both_targets_take_the_most_throughput_meeting_both():
    assert pick_from_front(FRONT, max_ms_per_token=45, min_tokens_per_s_per_chip=400)[0] is FRONT[2]
    pick, why = pick_from_front(FRONT, max_ms_per_token=25, min_tokens_per_s_per_chip=800)
    assert pick is None and "the most within it is tp=8, 8 in flight" in why


def test_an_unreachable_target_names_the_nearest_point():
    pick, why = pick_from_front(FRONT, max_ms_per_token=5)
    assert pick is None and "fastest point is tp=8, 1 in flight: 10.0 ms" in why
    pick, why = pick_from_front(FRONT, min_tokens_per_s_per_chip=1000)
    assert pick is None and "the most is tp=8, 64 in flight" in why


def test_a_pick_the_measured_spread_would_carry_past_its_target_says_so():
    """The lowest out-of-sample predicted / measured of the published decode steps: a 20 ms prediction could be
    20 / that ratio measured, past a 25 ms target (and a 500 tokens/s prediction that times the ratio)."""
    ratios, _ = out_of_sample()
    low = min(ratios[p.name] for p in published_points() if p.kind == "decode")
    assert 20 / low > 25
    _, why = pick_from_front(FRONT, max_ms_per_token=25)
    assert f"{20 / low:.1f} ms a token, over the 25 ms target" in why
    _, why = pick_from_front(FRONT, max_ms_per_token=1000)
    assert f"{40 / low:.1f} ms a token, within the 1000 ms target" in why
    _, why = pick_from_front(FRONT, min_tokens_per_s_per_chip=400)
    assert f"{500 * low:,.0f} tokens/s a chip, " + ("under" if 500 * low < 400 else "meeting") in why


def test_a_pick_past_its_target_at_the_miss_names_the_point_that_is_not():
    """At a miss of 0.5x (a step twice as long as predicted), the 25 ms target's pick, 20 ms, would take 40; only
    the 10 ms point (20 ms at that miss) meets 25. A 15 ms target at that miss: no point."""
    pick, why = pick_from_front(FRONT, max_ms_per_token=25, spread=(0.5, "two test steps"))
    assert pick is FRONT[1] and "(0.5x) it would give 40.0 ms a token, over the 25 ms target" in why
    assert "the point that meets the target even at that miss is tp=8, 1 in flight: 10.0 ms" in why
    assert "(20.0 ms a token and 50 tokens/s a chip at that miss)" in why
    _, why = pick_from_front(FRONT, max_ms_per_token=15, spread=(0.5, "two test steps"))
    assert "no point of the front meets the target at that miss" in why
    # a throughput target: 400 a chip picks the 500 point, 250 at that miss; the 900 point gives 450
    _, why = pick_from_front(FRONT, min_tokens_per_s_per_chip=400, spread=(0.5, "two test steps"))
    assert "250 tokens/s a chip, under the 400 target" in why and "even at that miss is tp=8, 64 in flight" in why


def test_the_evidence_is_the_engine_s_own_decode_steps_on_the_chip():
    """TensorRT-LLM on an H100: its 11 decode steps on H100 and H200; an engine with none on a chip: all of them."""
    ratios, _ = out_of_sample()
    trt = [p for p in published_points() if p.kind == "decode" and p.engine == "TensorRT-LLM"]
    low, of = lowest_decode_ratio("TensorRT-LLM", H100)
    assert low == min(ratios[p.name] for p in trt) and f"{len(trt)} published decode steps on H100" in of
    low, of = lowest_decode_ratio("vLLM", H100)
    assert of == f"all {sum(p.kind == 'decode' for p in published_points())} published decode steps"


def test_targets_are_required_and_positive():
    with pytest.raises(ValueError, match="latency target"):
        pick_from_front(FRONT)
    with pytest.raises(ValueError, match="max_ms_per_token is a positive target"):
        pick_from_front(FRONT, max_ms_per_token=-1)
    with pytest.raises(TypeError, match="ModelConfig"):
        advise_serving("llama", Cluster.h100(nodes=1), input_len=10, output_len=10, max_ms_per_token=20)


def test_the_advisor_picks_a_front_point_within_the_latency_target():
    """Llama-3.1-70B in fp8 on one 8-H100 node under TensorRT-LLM's cost: the pick is on the front, within 30 ms,
    and every front point giving more tokens a second a chip is slower than 30 ms."""
    advice = advise_serving(full_config("llama-3.1-70b"), Cluster.h100(nodes=1), input_len=1000, output_len=1000,
                            dtype="fp8", weight_dtype="fp8", kv_dtype="fp8", engine="TensorRT-LLM",
                            max_ms_per_token=30)
    pick = advice.pick
    assert pick is not None and pick.on_front and pick.ms_per_token <= 30
    assert all(p.ms_per_token > 30 for p in advice.front if p.tokens_per_s_per_chip > pick.tokens_per_s_per_chip)
    assert "published decode steps" in advice.summary()
