"""Layout export (issue 17): the Python snippet, exec'd, rebuilds a layout with the same specs; the JSON reads
back to an equal layout; what does not fit says what to change."""

import importlib.util
import json

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import workbench as wb
from workbench.core.axes import (
    EMPTY,
    EP,
    FSDP,
    MODE_DECODE,
    MODE_PREFILL,
    SP,
    TP,
    VOCAB,
    ColumnWise,
    DynamicShardingAxes,
    PartitionAxis,
)
from workbench.core.hardware.cluster import Cluster, cluster_mesh
from workbench.core.mesh import MESH_AXES, make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import FAMILIES, tiny_config
from workbench.core.models.sharding import param_specs, path_str
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.sharding import export as layout_export
from workbench.core.views.explore import Layout

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]"')
PLAN_FIELDS = ("partition_axis", "rules", "mode", "remat", "pipeline")


def abstract(family="llama"):
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(family)))


def run_snippet(code, model, name="model"):
    """The layout the snippet builds, pasted after ``import workbench as wb`` with the model defined."""
    namespace = {"wb": wb, name: model}
    exec(code, namespace)
    return namespace["layout"]


def assert_same_plan(got, want):
    assert got.specs == want.specs and got.paths == want.paths
    assert dict(got.mesh.shape) == dict(want.mesh.shape)
    for name in PLAN_FIELDS:
        assert getattr(got, name) == getattr(want, name), name


def layouts(model):
    """Several plans for one model: meshes, a non-default PartitionAxis, rules (a preset among them), modes,
    remat and a pipeline on a pp mesh."""
    moe = getattr(model.config, "num_local_experts", 0) > 0
    rules = [("embed_tokens", [TP, EMPTY]), ("o_proj/kernel", ColumnWise),
             ("lm_head", DynamicShardingAxes((None, (TP, FSDP)), 1))]
    return [
        Layout.of(model, make_mesh(dp=2, fsdp=2, tp=2)),
        Layout.of(model, make_mesh(fsdp=4, tp=2), PartitionAxis(batch_axis=(FSDP, "dp"), vocab_axis=None), rules),
        Layout.of(model, make_mesh(fsdp=2, sp=2, tp=2), rules=[("norm", (EMPTY,))], mode=MODE_DECODE,
                  remat="dots_saveable"),
        Layout.of(model, make_mesh(pp=2, fsdp=2, tp=2), PartitionAxis(layer_axis="pp"), mode=MODE_PREFILL,
                  remat="full", pipeline=PipelineConfig(2, 4)),
        *([Layout.of(model, make_mesh(ep=4, tp=2, fsdp=1), PartitionAxis(expert_axis=(EP, FSDP)))] if moe else []),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_snippet_and_the_json_rebuild_every_family_s_layouts(family):
    model = abstract(family)
    for layout in layouts(model):
        code = layout.to_code()
        compile(code, "<snippet>", "exec")  # plain Python
        rebuilt = run_snippet(code, model)
        assert_same_plan(rebuilt, layout)
        # an independent reference: the specs sharding.param_specs gives for the same settings
        reference = param_specs(model, layout.mesh, layout.partition_axis, layout.mode, layout.rules)
        assert rebuilt.specs == reference
        loaded = Layout.from_json(layout.to_json(), model)
        assert loaded == layout  # the same devices too: the mesh is rebuilt on this process's devices
        assert loaded.to_json() == layout.to_json()


def test_the_json_is_plain_data_in_a_stable_order():
    model = abstract()
    layout = Layout.of(model, make_mesh(pp=2, fsdp=2, tp=2), PartitionAxis(layer_axis="pp", batch_axis=(FSDP, "dp")),
                       [("embed_tokens", (VOCAB, EMPTY)), ("mlp", ColumnWise)], MODE_DECODE, remat="full",
                       pipeline=PipelineConfig(2, 4, "interleaved"))
    doc = json.loads(layout.to_json())
    assert tuple(doc) == layout_export.KEYS
    assert doc["format"] == "workbench.layout" and doc["version"] == 1
    assert doc["mesh"] == {"shape": {"pp": 2, "dp": 1, "fsdp": 2, "ep": 1, "tp": 2, "sp": 1}}
    assert doc["cluster"] is None
    assert doc["partition_axis"] == {"batch_axis": [FSDP, "dp"], "layer_axis": "pp"}  # only what differs
    assert doc["rules"] == [{"pattern": "embed_tokens", "axes": [VOCAB, EMPTY]},
                            {"pattern": "mlp", "axes": [[FSDP, SP], TP], "mode": "__train__"}]
    assert (doc["mode"], doc["remat"]) == (MODE_DECODE, "full")
    assert doc["pipeline"] == {"num_stages": 2, "num_microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}
    assert json.loads(Layout.of(model, make_mesh(fsdp=8)).to_json())["partition_axis"] == {}
    code = layout.to_code()
    assert "PipelineConfig(num_stages=2, num_microbatches=4, schedule='interleaved', virtual_stages=2)" in code
    assert "model = model.with_options(remat='full')" in code and "('mlp', ColumnWise)," in code
    assert "mesh = wb.make_mesh(pp=2, fsdp=2, tp=2)" in code
    assert "# from workbench.core.views.explore import apply; model, seconds = apply(model, layout)" in code
    assert_same_plan(run_snippet(code, model), layout)


def test_the_snippet_names_the_model_and_its_comment_places_a_live_model():
    from workbench.core.models.presets import tiny

    model = tiny("llama")
    layout = Layout.of(model, make_mesh(fsdp=4, tp=2), rules=[("embed_tokens", (TP, EMPTY))], remat="full")
    code = layout.to_code(model_expr="my_model")
    assert code.count("model = my_model\n") == 1
    place = code.rstrip().splitlines()[-1].removeprefix("# ")  # the commented line, uncommented
    namespace = {"wb": wb, "my_model": model}
    exec(code + place + "\n", namespace)
    assert_same_plan(namespace["layout"], layout)
    placed = namespace["model"]
    assert placed.remat == "full" and model.remat == "none"  # a new model; the given one is left alone
    for path, var in nnx.to_flat_state(nnx.state(placed, nnx.Param)):
        assert var.get_value().sharding.spec == layout[path_str(path)].spec


def test_meshes_with_other_names_or_explicit_axes_and_meshes_too_big_for_this_process():
    model = abstract()
    explicit = Layout.of(model, make_mesh(fsdp=4, tp=2, axis_types=AxisType.Explicit))
    assert "axis_types=AxisType.Explicit" in explicit.to_code()
    assert Layout.from_json(explicit.to_json(), model) == explicit
    assert_same_plan(run_snippet(explicit.to_code(), model), explicit)

    names = PartitionAxis(data_parallel_axis="data", fully_sharded_data_parallel_axis="data",
                          expert_parallel_axis="data", tensor_parallel_axis="model", sequence_parallel_axis="model")
    other = Layout.of(model, jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2), names)
    assert "jax.make_mesh((2, 4), ('data', 'model')" in other.to_code()
    assert Layout.from_json(other.to_json(), model) == other
    assert_same_plan(run_snippet(other.to_code(), model), other)

    # 64 devices are more than this process has: the layout reads back on an AbstractMesh (shapes only)
    big = Layout.of(model, AbstractMesh((1, 1, 16, 1, 4, 1), MESH_AXES))
    loaded = Layout.from_json(big.to_json(), model)
    assert isinstance(loaded.mesh, AbstractMesh) and loaded == big
    # four of the eight devices: a mesh on the first four
    small = Layout.from_json(Layout.of(model, AbstractMesh((1, 1, 2, 1, 2, 1), MESH_AXES)).to_json(), model)
    assert [d.id for d in small.mesh.devices.flat] == [0, 1, 2, 3]


def test_a_gpu_cluster_s_layout():
    model = abstract()
    cluster = Cluster.h100(nodes=8)
    layout = Layout.of(model, cluster_mesh(cluster, (1, 1, 16, 1, 4, 1), MESH_AXES), rules=[("lm_head", (EMPTY, TP))])
    doc = json.loads(layout.to_json(cluster=cluster))
    assert doc["cluster"] == {"gpu": "h100", "nodes": 8, "gpus_per_node": 8}
    assert Layout.from_json(layout.to_json(cluster=cluster), model) == layout
    code = layout.to_code(cluster=cluster)
    assert "cluster = Cluster.h100(nodes=8)" in code
    assert "mesh = cluster_mesh(cluster, (1, 1, 16, 1, 4, 1), ('pp', 'dp', 'fsdp', 'ep', 'tp', 'sp'))" in code
    assert_same_plan(run_snippet(code, model), layout)
    for other in (Cluster.h200(nodes=2, gpus_per_node=4), Cluster.cpu(16),
                  Cluster.gpu(Cluster.h100().chip, nodes=2, inter_node_bandwidth=1e11)):
        spec = layout_export.cluster_spec(other)
        assert layout_export.cluster_from_spec(spec) == other
        assert eval(layout_export._cluster_code(spec), {"Cluster": Cluster}) == other  # the snippet's constructor
    with pytest.raises(ValueError, match="has 64 devices but 2 x 4 H200 SXM has 8"):
        layout.to_json(cluster=Cluster.h200(nodes=2, gpus_per_node=4))
    with pytest.raises(TypeError, match=r"must be a workbench\.core\.hardware\.cluster\.Cluster"):
        layout.to_json(cluster="h100")


@needs_libtpu
def test_a_tpu_cluster_s_layout():
    model = abstract()
    cluster = Cluster.tpu("v5e:2x4")
    layout = Layout.of(model, cluster_mesh(cluster, (1, 1, 4, 1, 2, 1), MESH_AXES), remat="full")
    assert json.loads(layout.to_json(cluster=cluster))["cluster"] == {"tpu": "v5e:2x4", "slices": 1}
    loaded = Layout.from_json(layout.to_json(cluster=cluster), model)
    assert loaded.mesh.devices.flat[0].platform == "tpu" and loaded == layout
    code = layout.to_code(cluster=cluster)
    assert "cluster = Cluster.tpu('v5e:2x4')" in code
    assert_same_plan(run_snippet(code, model), layout)


def test_an_explicit_mesh_overrides_the_one_the_json_would_build():
    model = abstract()
    layout = Layout.of(model, make_mesh(fsdp=4, tp=2))
    devices = jax.devices()[::-1]
    mesh = make_mesh(fsdp=4, tp=2, devices=devices)
    assert Layout.from_json(layout.to_json(), model, mesh=mesh).mesh is mesh
    with pytest.raises(ValueError, match=r"the mesh has axes .*'tp': 4.* but the layout was exported on .*'tp': 2"):
        Layout.from_json(layout.to_json(), model, mesh=make_mesh(fsdp=2, tp=4))


def test_bad_documents_say_what_to_change():
    model = abstract()
    layout = Layout.of(model, make_mesh(pp=2, fsdp=4), PartitionAxis(layer_axis="pp"), pipeline=PipelineConfig(2, 2))
    good = json.loads(layout.to_json())

    def bad(match, **changes):
        doc = {**good, **changes}
        with pytest.raises(ValueError, match=match):
            Layout.from_json(json.dumps(doc), model)

    with pytest.raises(ValueError, match=r"not JSON .*give the text Layout\.to_json"):
        Layout.from_json("{'mesh': 1", model)
    with pytest.raises(ValueError, match='not a workbench layout: the JSON has no "format"'):
        Layout.from_json("[1, 2]", model)
    with pytest.raises(ValueError, match="give the JSON text"):
        Layout.from_json(None, model)
    bad("unknown layout format version 2; this workbench reads version 1", version=2)
    bad(r"unknown field\(s\) \['meshes'\] in the layout; its fields are \['format'", meshes={})
    bad(r"PartitionAxis has no field \['tp_axis'\]", partition_axis={"tp_axis": "tp"})
    bad("partition_axis: PartitionAxis.head_axis must be None", partition_axis={"head_axis": 3})
    bad(r"unknown pipeline field\(s\) \['stages'\]", pipeline={"stages": 2})
    bad("PipelineConfig.num_microbatches must be a positive int", pipeline={"num_stages": 2, "num_microbatches": 0})
    bad("the pipeline has num_stages=4 but the mesh's pp axis has size 2; use PipelineConfig\\(num_stages=2",
        pipeline={"num_stages": 4, "num_microbatches": 4})
    bad("unknown mode 'train'; use one of", mode="train")
    bad("unknown remat policy 'some'", remat="some")
    bad('mesh must be {"shape"', mesh={"shape": {"fsdp": 0}})
    bad("mesh axis_types must list one of", mesh={"shape": {"fsdp": 8}, "axis_types": ["Typed"]})
    bad('a rule is {"pattern": regex, "axes"', rules=[{"pattern": "x"}])
    bad("rule regex '\\(' does not compile", rules=[{"pattern": "(", "axes": [None]}])
    bad("an axis entry is a name, null or a list", rules=[{"pattern": "x", "axes": [1]}])
    bad("unknown cluster .*a cluster is", cluster={"tpu7": "v9"})
    bad("unknown TPU topology 'v5p:3x3x3'", cluster={"tpu": "v5p:3x3x3", "slices": 1})
    bad("unknown GPU 'a100'", cluster={"gpu": "a100", "nodes": 1, "gpus_per_node": 8})
    bad("mesh shape \\(2, 1, 4, 1, 1, 1\\) does not map onto 2 x 8 H100 SXM: it has 8 devices, the cluster 16",
        cluster={"gpu": "h100", "nodes": 2, "gpus_per_node": 8})
    bad("maps to mesh axis 'dp2' through PartitionAxis",
        partition_axis={"layer_axis": "pp", "data_parallel_axis": "dp2"})
    bad("grad_accumulation must be a positive int", grad_accumulation=0)
    bad("grad_accumulation must be a positive int", grad_accumulation=True)


def test_layout_carries_remat_and_pipeline_and_replace_takes_them():
    model = abstract()
    mesh = make_mesh(pp=2, fsdp=4)
    plain = Layout.of(model, mesh, None, [("embed_tokens", [TP, EMPTY])])  # positional calls as before
    assert plain.remat is None and plain.pipeline is None
    assert plain.rules == (("embed_tokens", (TP, EMPTY)),)  # lists kept as tuples: the layout is data
    planned = plain.replace(model, remat="full", pipeline=PipelineConfig(2, 4))
    assert (planned.remat, planned.pipeline) == ("full", PipelineConfig(2, 4)) and planned.specs == plain.specs
    assert planned.replace(model, mode=MODE_DECODE).remat == "full"  # carried along
    with pytest.raises(ValueError, match="unknown remat policy 'everything'"):
        plain.replace(model, remat="everything")
    with pytest.raises(ValueError, match="num_stages=4 but the mesh's pp axis has size 2"):
        plain.replace(model, pipeline=PipelineConfig(4, 4))
    with pytest.raises(TypeError, match="pipeline must be a PipelineConfig"):
        plain.replace(model, pipeline={"num_stages": 2})
    with pytest.raises(ValueError, match=r"Layout\.replace takes"):
        plain.replace(model, schedule="1f1b")


def test_the_plan_beyond_the_specs_travels_in_the_json_and_the_snippet():
    """An advisor's row: remat, ZeRO-1, gradient accumulation; a pipeline whose stages do not divide the layers
    (uneven, priced as the deepest). Each is written, read back equal, and rebuilt by the snippet; a document from
    before accumulation travelled reads as one microbatch."""
    model = abstract()  # 2 stacked layers
    mesh = make_mesh(dp=2, fsdp=4)
    accumulated = Layout.of(model, mesh, remat="full", zero_stage=1, grad_accumulation=4)
    doc = json.loads(accumulated.to_json())
    assert (doc["remat"], doc["zero_stage"], doc["grad_accumulation"]) == ("full", 1, 4)
    assert Layout.from_json(accumulated.to_json(), model) == accumulated
    code = accumulated.to_code()
    assert "Layout.of(model, mesh, remat='full', zero_stage=1, grad_accumulation=4)" in code
    assert "4 accumulated microbatches" in code.splitlines()[0]
    namespace = {"wb": wb, "model": model}
    exec(code, namespace)
    assert namespace["layout"] == accumulated
    older = {k: v for k, v in doc.items() if k != "grad_accumulation"}
    assert Layout.from_json(json.dumps(older), model).grad_accumulation == 1
    assert "accumulated" not in layout_export.describe(Layout.of(model, mesh))

    uneven = PipelineConfig(2, 4, "interleaved", 2, uneven=True)  # 2 layers over 4 stages
    piped = Layout.of(model, make_mesh(pp=2, fsdp=4), PartitionAxis(layer_axis="pp"), pipeline=uneven)
    assert json.loads(piped.to_json())["pipeline"]["uneven"] is True
    assert Layout.from_json(piped.to_json(), model).pipeline == uneven
    assert "uneven=True)" in piped.to_code()
    assert "uneven" not in json.loads(piped.replace(model, pipeline=PipelineConfig(2, 4)).to_json())["pipeline"]
