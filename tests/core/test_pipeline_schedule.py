"""Pipeline schedules as data: every table is a valid execution, its bubble is the closed form.

Closed forms: GPipe (Huang et al. 2019, section 2.3) and 1F1B (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.1): bubble time / total =
(p - 1) / (m + p - 1); interleaved with v stages per device (same paper, section 2.2.2): (p - 1) / (v m + p - 1).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from workbench.core.pipeline_schedule import BACKWARD, FORWARD, IDLE, PipelineConfig, pipeline_schedule

CASES = [(s, p, m) for s in ("gpipe", "1f1b", "interleaved") for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("schedule, p, m", CASES)
def test_table_is_a_valid_execution_with_the_closed_form_bubble(schedule, p, m):
    config = PipelineConfig(p, m, schedule)
    table = pipeline_schedule(config)
    v = config.virtual_stages
    when = {}
    for a in table.actions:
        assert a.stage % p == a.device  # stage k lives on device k mod p
        key = (a.kind, a.microbatch, a.stage)
        assert key not in when  # each runs once
        when[key] = a.tick
    stages = p * v
    assert len(when) == 2 * m * stages  # every microbatch through every stage, forward and backward
    for i, k in itertools.product(range(m), range(stages)):
        if k:
            assert when["forward", i, k - 1] < when["forward", i, k]
        assert when["forward", i, k] < when["backward", i, k]
        if k < stages - 1:
            assert when["backward", i, k + 1] < when["backward", i, k]
    busy = (table.grid != IDLE).sum()
    assert busy == 2 * m * v * p
    expected = (p - 1) / (v * m + p - 1)
    assert table.bubble_fraction == pytest.approx(expected, abs=1e-12)
    assert table.formula_bubble == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16)])
def test_gpipe_keeps_every_microbatch_1f1b_at_most_p(p, m):
    gpipe = pipeline_schedule(PipelineConfig(p, m, "gpipe")).in_flight()
    one_f_one_b = pipeline_schedule(PipelineConfig(p, m, "1f1b")).in_flight()
    assert gpipe.tolist() == [m] * p
    assert one_f_one_b.tolist() == [p - d for d in range(p)]


def test_rows_read_as_records():
    table = pipeline_schedule(PipelineConfig(2, 2, "gpipe"))
    rows = table.rows()
    assert rows[0] == {"tick": 0, "device": 0, "stage": 0, "microbatch": 0, "kind": "forward"}
    assert {r["kind"] for r in rows} == {"forward", "backward"}
    assert table.grid.shape == (table.ticks, 2) and set(np.unique(table.grid)) <= {IDLE, FORWARD, BACKWARD}


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_stages=2, num_microbatches=3, schedule="interleaved"), "multiple of num_stages=2"),
    (dict(num_stages=2, num_microbatches=4, schedule="zigzag"), "unknown pipeline schedule 'zigzag'"),
    (dict(num_stages=0, num_microbatches=4), "num_stages must be a positive int"),
    (dict(num_stages=2, num_microbatches=4, schedule="1f1b", virtual_stages=2), "needs schedule='interleaved'"),
    (dict(num_stages=2, num_microbatches=4, schedule="interleaved", virtual_stages=1), "virtual_stages >= 2"),
])
def test_bad_configs_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)


def test_layers_and_batch_that_do_not_divide_say_what_would():
    config = PipelineConfig(4, 4, "1f1b")
    assert config.check_layers(8) == 2
    with pytest.raises(ValueError, match=r"6 layers do not split into 4 equal stages.*num_stages may be 1, 2, 3, 6"):
        config.check_layers(6)
    with pytest.raises(ValueError, match=r"10 rows does not split into 4 microbatches.*may be 1, 2, 5, 10"):
        config.check_batch(10)
    with pytest.raises(ValueError, match=r"x 2 data-parallel ways"):
        config.check_batch(12, data_ways=2)
    assert PipelineConfig(2, 4, "circular").schedule == "interleaved"
