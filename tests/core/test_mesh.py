"""make_mesh and simulate_devices, checked against jax.devices() and real collectives."""

import itertools
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.mesh import MESH_AXES, axis_sizes, describe_mesh, make_mesh, mesh_factorizations, simulate_devices


def test_default_mesh_puts_every_device_on_fsdp():
    mesh = make_mesh()
    assert mesh.axis_names == MESH_AXES == ("pp", "dp", "fsdp", "ep", "tp", "sp")
    assert dict(mesh.shape) == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}
    assert set(mesh.axis_types) == {AxisType.Auto}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize("kwargs, expected", [
    (dict(dp=2, tp=4), (1, 2, 1, 1, 4, 1)),
    (dict(dp=2, fsdp=2, tp=2), (1, 2, 2, 1, 2, 1)),
    (dict(fsdp=2, ep=-1, tp=2), (1, 1, 2, 2, 2, 1)),
    (dict(fsdp=1, sp=-1), (1, 1, 1, 1, 1, 8)),
    (dict(pp=2, tp=2), (2, 1, 2, 1, 2, 1)),
])
def test_sizes_and_inference(kwargs, expected):
    assert tuple(make_mesh(**kwargs).shape.values()) == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=3, fsdp=1), r"pp\*dp\*fsdp\*ep\*tp\*sp = 3 but there are 8 devices.*e\.g\. make_mesh\(fsdp=-1, tp=2\)"),
    (dict(dp=3), "multiply to 3, which does not divide the 8 devices"),
    (dict(tp=-1), "fsdp and tp are both -1.*fsdp defaults to -1, so pass fsdp=1 with tp=-1"),
    (dict(dp=-1, tp=-1, fsdp=2), "dp and tp are both -1"),
    (dict(tp=0), "tp=0"),
    (dict(tp=2.0), "tp=2.0"),
])
def test_bad_sizes_raise_with_the_device_count_and_an_example(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(**kwargs)


def test_axis_type_is_selectable():
    mesh = make_mesh(dp=2, tp=4, axis_types=AxisType.Explicit)
    assert set(mesh.axis_types) == {AxisType.Explicit}


def test_a_psum_over_tp_is_a_real_collective():
    mesh = make_mesh(dp=2, tp=4)
    x_np = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    x = jax.device_put(x_np, NamedSharding(mesh, P(("dp", "tp"))))
    total = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "tp"), mesh=mesh,
                                  in_specs=P(("dp", "tp")), out_specs=P("dp")))(x)
    # reference: the 4 row blocks in each dp half summed
    expected = x_np.reshape(2, 4, 1, 3).sum(axis=1).reshape(2, 3)
    np.testing.assert_allclose(np.asarray(total), expected)


def test_describe_mesh():
    assert describe_mesh(make_mesh(dp=2, tp=4)) == (
        "Mesh(pp=1, dp=2, fsdp=1, ep=1, tp=4, sp=1): 8 cpu device(s), 1 process(es), Auto axes")


def test_simulate_devices_is_a_no_op_for_the_running_count_and_refuses_another():
    jnp.zeros(1).block_until_ready()  # the backend has started
    simulate_devices(8)
    with pytest.raises(RuntimeError, match=r"Restart the kernel.*simulate_devices\(4\)"):
        simulate_devices(4)
    with pytest.raises(ValueError, match="positive int"):
        simulate_devices(0)


def test_simulate_devices_in_a_fresh_process():
    code = ("import jax, workbench as wb; wb.simulate_devices(3); "
            "print(len(jax.devices()), wb.make_mesh(fsdp=1, tp=-1).shape['tp'])")
    env = {"JAX_PLATFORMS": "cpu", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "3"]


def test_describe_an_abstract_mesh():
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh((4, 64), ("fsdp", "ep"))
    assert describe_mesh(mesh) == "AbstractMesh(fsdp=4, ep=64): 256 devices, shapes only"


def test_factorizations_are_every_shape():
    shapes = mesh_factorizations(8)
    brute = [dict(zip(MESH_AXES, s, strict=True)) for s in itertools.product([1, 2, 4, 8], repeat=len(MESH_AXES))
             if math.prod(s) == 8]
    assert shapes == brute and len(shapes) == 56  # 2^3 over 6 axes: C(3 + 5, 5)
    assert mesh_factorizations(6, ("a", "b")) == [{"a": 1, "b": 6}, {"a": 2, "b": 3}, {"a": 3, "b": 2},
                                                  {"a": 6, "b": 1}]
    assert mesh_factorizations(1, ()) == [{}]
    with pytest.raises(ValueError):
        mesh_factorizations(0)


def test_axis_sizes_fill_every_workbench_axis_and_say_what_is_wrong():
    assert axis_sizes({"tp": 4, "fsdp": np.int64(16)}) == {"pp": 1, "dp": 1, "fsdp": 16, "ep": 1, "tp": 4, "sp": 1}
    assert list(axis_sizes(None)) == list(MESH_AXES)
    with pytest.raises(ValueError, match=r"dcn_shape names axes \['model'\]; the workbench's mesh axes are"):
        axis_sizes({"model": 4}, "dcn_shape")
    with pytest.raises(ValueError, match=r"mesh sizes are positive ints; got \{'tp': 0\}"):
        axis_sizes({"tp": 0, "dp": 2})
