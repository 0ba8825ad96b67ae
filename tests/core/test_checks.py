"""checks: what the core takes as a count, the same everywhere it asks for one."""

import json

import numpy as np
import pytest

from workbench.core.checks import batch_shape, is_int, is_positive_int, positive_int
from workbench.core.hardware.cluster import Cluster
from workbench.core.models import ModelConfig
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.programs import CompileCache


@pytest.mark.parametrize(("value", "integer", "count"), [
    (1, True, True), (7, True, True), (np.int64(3), True, True), (np.int32(1), True, True), (0, True, False),
    (-2, True, False), (True, False, False), (np.bool_(True), False, False), (2.0, False, False),
    ("2", False, False), (None, False, False)])
def test_a_count_is_an_int_of_at_least_one_never_a_bool(value, integer, count):
    assert is_int(value) is integer and is_positive_int(value) is count


def test_positive_int_names_what_to_change():
    assert positive_int("batch_size", np.int64(4)) == 4 and type(positive_int("n", np.int64(4))) is int
    assert positive_int("sinks", 0, least=0) == 0
    with pytest.raises(ValueError, match=r"^max_length must be a positive int; got 0$"):
        positive_int("max_length", 0)
    with pytest.raises(ValueError, match=r"^sinks must be a non-negative int; got -1$"):
        positive_int("sinks", -1, least=0, what="a non-negative int")


def test_batch_is_sequences_by_length():
    assert batch_shape([2, np.int64(128)]) == (2, 128)
    for bad in ((2,), (2, 0), (2, 128, 1), (2.0, 128), "2x128"):
        with pytest.raises(ValueError, match=r"batch is \(sequences, length\), two positive ints"):
            batch_shape(bad)


def _config(layers):
    return ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("make", [CompileCache, _config, lambda n: PipelineConfig(num_stages=n, num_microbatches=4)])
def test_the_same_rule_where_the_core_takes_a_count(make):
    make(np.int64(2))  # NumPy's ints count
    for bad in (True, 0, 2.0):  # a bool is no count, though Python calls it an int
        with pytest.raises(ValueError, match="must be a positive int"):
            make(bad)


def test_a_numpy_count_is_kept_as_a_python_int():
    """What the core keeps is a Python int, so a config read from NumPy still writes JSON (json refuses np.int64)."""
    config = _config(np.int64(2))
    assert type(config.num_hidden_layers) is int and json.loads(json.dumps(config.to_hf()))["num_hidden_layers"] == 2
    pipeline = PipelineConfig(num_stages=np.int64(2), num_microbatches=np.int64(4))
    assert {type(pipeline.num_stages), type(pipeline.num_microbatches), type(pipeline.virtual_stages)} == {int}
    cluster = Cluster.h100(nodes=np.int64(2))
    assert type(cluster.nodes) is int and type(cluster.num_devices) is int
    assert all(type(n) is int for n in cluster.check_mesh_shape((np.int64(2), np.int64(8))))
