"""Where the step model's predictions hold (workbench.core.advisor.regimes): each parallelism's regime, the published
runs that validate it, and the range of a layout that rests on a regime none validates, held against hand counts
and the published runs' own layouts."""

import math

import pytest

from workbench.core.advisor import Constraints, advise
from workbench.core.advisor.rank import time_band
from workbench.core.advisor.regimes import Regime, evidence, lowest_ratio, regimes, standing, validated
from workbench.core.cost.price import price
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.out_of_sample import out_of_sample
from workbench.core.interop.published import BAND, published_runs
from workbench.core.models.presets import full_config
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import PRODUCTION, Plan


def test_a_layout_s_regimes_are_its_split_axes_at_the_level_their_groups_span():
    """32 nodes of 8 H100s, fsdp=32 x tp=8: tp's groups are the 8 GPUs of a node (NVLink), fsdp's 32 GPUs one per
    node (the inter-node network); sp=4 of 8,192-token sequences holds 2,048-token chunks."""
    cluster = Cluster.h100(nodes=32)
    assert regimes(Plan({"fsdp": 32, "tp": 8}), cluster, 8192) == (
        Regime("fsdp", "gpu", "inter-node", 32), Regime("tp", "gpu", "nvlink", 8))
    sp = regimes(Plan({"fsdp": 64, "sp": 4}), cluster, 8192)
    assert sp[1] == Regime("sp", "gpu", "nvlink", 4, chunk=2048)
    pipe = PipelineConfig(2, 8, "interleaved", 4)
    pp = regimes(Plan({"pp": 2, "fsdp": 128}, pipeline=pipe), cluster, 8192)[-1]
    assert (pp.term, pp.schedule, pp.virtual, pp.per_stage) == ("pp", "interleaved", 4, 4.0)
    two_slices = regimes(Plan({"dp": 2, "fsdp": 256}), Cluster.tpu("v6e:16x16", slices=2), 4096)
    assert [r.level for r in two_slices] == ["dcn", "ici"]


@pytest.mark.parametrize("regime, run, covered", [
    (Regime("sp", "gpu", "nvlink", 2, chunk=8192), Regime("sp", "gpu", "nvlink", 2, chunk=4096), True),
    (Regime("sp", "gpu", "nvlink", 2, chunk=2048), Regime("sp", "gpu", "nvlink", 2, chunk=4096), False),  # shorter
    (Regime("sp", "gpu", "nvlink", 4, chunk=4096), Regime("sp", "gpu", "nvlink", 2, chunk=4096), False),  # larger
    (Regime("sp", "gpu", "inter-node", 2, chunk=4096), Regime("sp", "gpu", "nvlink", 2, chunk=4096), False),
    (Regime("sp", "tpu", "ici", 2, chunk=4096), Regime("sp", "gpu", "nvlink", 2, chunk=4096), False),
    (Regime("tp", "gpu", "nvlink", 4), Regime("tp", "gpu", "nvlink", 8), True),
    (Regime("fsdp", "tpu", "ici", 2048), Regime("fsdp", "tpu", "ici", 256), True),  # any size at its level
    (Regime("dp", "tpu", "ici", 4), Regime("fsdp", "tpu", "ici", 256), True),  # both reduce behind the backward
    (Regime("fsdp", "tpu", "ici", 4), Regime("dp", "tpu", "ici", 256), False),  # dp gathers no weights
    (Regime("pp", "gpu", size=2, schedule="interleaved", virtual=4, per_stage=4.0),
     Regime("pp", "gpu", size=8, schedule="interleaved", virtual=5, per_stage=8.0), False),  # fewer a stage
    (Regime("pp", "gpu", size=2, schedule="interleaved", virtual=4, per_stage=16.0),
     Regime("pp", "gpu", size=8, schedule="interleaved", virtual=5, per_stage=8.0), True),
    (Regime("pp", "gpu", size=2, schedule="1f1b", per_stage=16.0),
     Regime("pp", "gpu", size=8, schedule="interleaved", virtual=5, per_stage=8.0), False),  # another schedule
])
def test_a_run_validates_a_regime_at_its_level_up_to_its_size_and_down_to_its_chunk(regime, run, covered):
    assert regime.covered_by(run) is covered


def test_validating_runs_are_those_inside_the_band_out_of_sample_at_the_level_they_ran():
    """Every cited run's leave-one-out ratio lies in BAND. Megatron-Bridge's 405B (tp=8 x cp=2 on 8-GPU nodes) ran tp
    inside a node and cp across; the workbench's mesh puts sp innermost, so the model priced each at the other's
    level and that run validates neither. On TPU no published run pipelines; the sequence is sharded only by the
    Ironwood runs at 131,072 tokens (MaxText's context parallelism, sp=8: 16,384-token chunks)."""
    ratios = out_of_sample().ratios
    cited = validated()
    assert cited and all(BAND[0] <= ratios[e.run] <= BAND[1] and math.isclose(e.ratio, ratios[e.run]) for e in cited)
    megatron = [e.regime.term for e in cited if e.run == "megatron-bridge-25.11-llama3.1-405b-h100x1024-fp8cs"]
    assert sorted(megatron) == ["dp", "pp"]
    assert not [e for e in cited if e.regime.platform == "tpu" and e.regime.term == "pp"]
    tpu_sp = {(e.run, e.regime.size, e.regime.level, e.regime.chunk) for e in cited
              if e.regime.platform == "tpu" and e.regime.term == "sp"}
    assert tpu_sp == {(f"tpurecipes-llama3.1-70b-128k-tpu7x-4x8x8-{d}", 8, "ici", 16384) for d in ("bf16", "fp8")}
    gpu_sp = {(e.regime.size, e.regime.level, e.regime.chunk) for e in cited
              if e.regime.term == "sp" and e.regime.platform == "gpu"}
    assert gpu_sp == {(2, "nvlink", 4096)}  # NeMo's cp=2 runs on one node and inside tp=4 x cp=2
    assert evidence(Regime("sp", "gpu", "nvlink", 2, chunk=8192)).regime.chunk == 4096
    assert evidence(Regime("sp", "tpu", "ici", 2, chunk=8192)) is None


def test_the_slow_end_exposes_the_ring_and_allows_the_model_s_largest_miss():
    """Llama-3-8B on a v5p:4x4x4 as fsdp=32 x sp=2 (no published TPU run shards the sequence): the slow end is the
    step with ring attention's passes exposed, divided by the lowest out-of-sample ratio. The exposed ring adds
    exactly what the attention kernels hid: min(ring, attention)."""
    cluster, config, batch = Cluster.tpu("v5p:4x4x4"), full_config("llama-3-8b"), (64, 8192)
    plan = Plan({"fsdp": 32, "sp": 2}, remat="full", **PRODUCTION)
    point = price(plan, config, cluster, batch)
    got = standing(plan, cluster, 8192, point.time_s, lambda p, **kw: price(p, config, cluster, batch, **kw))
    assert [r.text() for r in got.unvalidated] == ["sp=2 over ici, 4,096-token chunks"]
    ring = sum(c.seconds * c.runs for c in point.collectives if c.role == "ring")
    attention = sum(t.seconds for t in point.terms if t.name == "attention kernels")
    assert ring > 0 and attention > 0
    exposed = price(plan, config, cluster, batch, ring_overlap=False)
    assert exposed.time_s - point.time_s == pytest.approx(min(ring, attention), rel=1e-9)
    assert got.slow_s == pytest.approx(exposed.time_s / out_of_sample().accuracy.low, rel=1e-12)
    assert lowest_ratio() == min(out_of_sample().ratios.values())
    assert got.range_text().count(" to ") == 1 and got.ranked_s == got.slow_s


def test_an_unvalidated_interleaved_pipeline_s_slow_end_has_1f1b_s_bubble():
    """pp=2 interleaved v=4 with 4 microbatches (2 a stage; the published interleaved runs have 4 to 24): the slow
    end prices the bubble of 1F1B at the same microbatches, (p - 1) / (m + p - 1) = 1/5, not 1/17."""
    cluster, config, batch = Cluster.h100(nodes=16), full_config("llama-3-70b"), (512, 8192)
    plan = Plan({"pp": 2, "fsdp": 64}, remat="full", pipeline=PipelineConfig(2, 4, "interleaved", 4), **PRODUCTION)
    seen = []

    def reprice(p, **kw):
        seen.append(p.pipeline)
        return price(p, config, cluster, batch, **kw)

    got = standing(plan, cluster, 8192, price(plan, config, cluster, batch).time_s, reprice)
    assert [r.term for r in got.unvalidated] == ["pp"]
    assert seen[0].schedule == "1f1b" and seen[0].bubble_fraction == pytest.approx(1 / 5)
    assert plan.pipeline.bubble_fraction == pytest.approx(1 / 17)


def test_a_validated_layout_cites_its_runs_and_keeps_its_point():
    cluster = Cluster.h100(nodes=32)
    plan = Plan({"fsdp": 32, "tp": 8}, **PRODUCTION)
    got = standing(plan, cluster, 8192, 20.0, lambda p, **kw: pytest.fail("a validated layout is not repriced"))
    assert got.slow_s is None and got.ranked_s == 20.0 and not got.unvalidated
    assert [e.regime.term for e in got.validated] == ["fsdp", "tp"]
    assert "torchtitan" in got.text() and "within the band" in got.text()


def test_the_advisor_ranks_a_range_by_its_slow_end_and_says_which_regime_no_run_validates():
    """Llama-3-8B on a v6e-8, 24 sequences of 8k (tpu-recipes' run): its sequence-sharded rows are ranges ranked by
    their slow ends, so the ranking is sorted by what it reads; the summary counts them. Ranked by the model alone
    they keep their points."""
    run = next(r for r in published_runs() if r.name == "tpurecipes-llama3.1-8b-v6e8")
    advice = advise(run.config, run.cluster, batch_tokens=24 * 8192, seq_len=8192,
                    constraints=Constraints(**run.plan.program()))
    bands = [time_band(c) for c in advice.ranked]  # the ranking's 1 % bands of ranked_s: ties within one
    assert bands == sorted(bands)
    sp = [c for c in advice.ranked if c.mesh_shape["sp"] > 1]
    assert sp and all(c.unvalidated and "no published run validates sp=" in c.reason for c in sp)
    assert all(" to " in c.step_text() for c in sp)
    assert not advice.best.unvalidated
    assert f"{len(sp)} of {len(advice.ranked)} rest on a parallelism no published run validates" in advice.summary()
    model = advise(run.config, run.cluster, batch_tokens=24 * 8192, seq_len=8192,
                   constraints=Constraints(**run.plan.program(), ranking="model"))
    assert all(c.standing is None for c in model.ranked)
    assert model.best.mesh_shape["sp"] > 1  # the model alone puts a ring first; no published TPU run checks it


def test_a_top_layout_below_the_published_one_s_0_85_is_validated():
    """Issue 47's target on two published runs: the top layout is predicted at >= 0.85x the published layout's
    time, or every part of it is validated by a published run its reason cites."""
    for name in ("tpurecipes-llama3.1-8b-v6e8", "torchtitan-llama3-8b-h100x64-fsdp8-tp8-asynctp-bf16"):
        run = next(r for r in published_runs() if r.name == name)
        advice = advise(run.config, run.cluster, batch_tokens=run.batch[0] * run.batch[1], seq_len=run.batch[1],
                        constraints=Constraints(**run.plan.program()))
        published = price(run.plan.replace(dtype="bf16"), run.config, run.cluster, run.batch).time_s
        best = advice.best
        assert best.ranked_s >= 0.85 * published or (not best.unvalidated and "published run" in best.reason)


def test_ranking_is_one_of_two():
    with pytest.raises(ValueError, match="evidence"):
        Constraints(ranking="fastest")


def test_a_recipe_s_pipeline_is_a_row_when_the_constraints_give_it():
    """Megatron-Bridge's Llama-3-70B on 64 H100s: pp=8 x dp=2 x tp=4, 64 microbatches interleaved at v=5, which the
    advisor's own pipelines (m = p, 2p, 4p; v = 2, 4) never try. Given in ``Constraints.pipelines`` it is the only
    pipeline of each pp=8 layout, ranked with its ledger; one of other stages is skipped."""
    run = next(r for r in published_runs() if r.name == "megatron-bridge-25.11-llama3-70b-h100x64-fp8cs")
    p = run.plan
    mesh = {a: n for a, n in p.mesh_shape.items() if n > 1}
    advice = advise(run.config, run.cluster, batch_tokens=run.batch[0] * run.batch[1], seq_len=run.batch[1],
                    constraints=Constraints(fixed=mesh, pipelines=(p.pipeline, PipelineConfig(4, 8)),
                                            **p.program()))
    rows = advice.ranked + advice.rejected
    assert rows and {c.pipeline for c in rows} == {p.pipeline}
    assert any(c.pipeline == p.pipeline for c in advice.ranked)
    with pytest.raises(TypeError, match="PipelineConfig"):
        Constraints(pipelines=({"num_stages": 8},))
