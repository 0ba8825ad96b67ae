"""The plan record: checked once when it is made, equal by value, hashable, labelled as the advisor prints it."""

import numpy as np
import pytest

from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import Plan, microbatch


def test_a_plan_holds_every_mesh_axis():
    plan = Plan({"fsdp": 16, "tp": 4})
    assert dict(plan.mesh_shape) == {"pp": 1, "dp": 1, "fsdp": 16, "ep": 1, "tp": 4, "sp": 1}
    assert plan.devices == 64 and plan.remat == "full" and plan.zero_stage == 0 and plan.grad_accumulation == 1


def test_plans_are_equal_by_value_and_hashable():
    a = Plan({"fsdp": 8, "tp": 2}, grad_accumulation=2)
    b = Plan({"tp": 2, "fsdp": 8, "dp": 1}, grad_accumulation=np.int64(2))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != a.replace(remat="none") and a.replace(remat="none").remat == "none"
    with pytest.raises(TypeError):
        a.mesh_shape["tp"] = 4  # a plan is frozen, its mesh too


def test_the_label_names_the_split_axes_the_pipeline_and_the_accumulation():
    assert Plan({}).label() == "one device"
    plan = Plan({"pp": 4, "fsdp": 8}, pipeline=PipelineConfig(4, 16, "interleaved", 2), grad_accumulation=2)
    assert plan.label() == "pp=4 x fsdp=8, 16 microbatches interleaved v=2, 2 accumulated microbatches"


@pytest.mark.parametrize("kwargs, message", [
    ({"mesh_shape": {"xp": 2}}, r"names axes \['xp'\]"),
    ({"mesh_shape": {"tp": 0}}, "positive"),
    ({"mesh_shape": {"fsdp": 8}, "remat": "minimal"}, "remat must be one of"),
    ({"mesh_shape": {"dp": 8}, "zero_stage": 3}, "ZeRO-3 is the 'fsdp' axis"),
    ({"mesh_shape": {"dp": 8}, "grad_accumulation": 0}, "grad_accumulation must be a positive int"),
    ({"mesh_shape": {"dp": 8}, "batch_axes": ("data",)}, r"batch_axes names axes \['data'\]"),
    ({"mesh_shape": {"pp": 2, "dp": 4}}, "pp=2 needs a pipeline of 2 stages; got no pipeline"),
    ({"mesh_shape": {"dp": 4}, "pipeline": PipelineConfig(2, 4)}, "pp=1 needs a pipeline of 1 stages; got 2"),
])
def test_a_bad_plan_says_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Plan(**kwargs)


def test_a_microbatch_is_the_step_s_sequences_split_k_ways():
    assert Plan({"fsdp": 8}, grad_accumulation=4).microbatch((16, 128)) == microbatch((16, 128), 4) == (4, 128)
    assert microbatch((16, 128), 1) == (16, 128)
    with pytest.raises(ValueError, match=r"12 sequences do not split into 5 microbatches; use a count that divides "
                                         r"12: 1, 2, 3, 4, 6, 12$"):
        microbatch((12, 1024), 5)
    with pytest.raises(ValueError) as err:  # many divisors: the smallest, then the batch itself
        microbatch((2**20, 1), 3)
    assert str(err.value).endswith(": 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1048576")
    with pytest.raises(ValueError, match="grad_accumulation must be a positive int"):
        microbatch((8, 64), 0)
