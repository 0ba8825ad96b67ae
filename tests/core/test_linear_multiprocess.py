"""A column -> row parallel MLP across two JAX processes (4 simulated CPU devices each) equals NumPy.

This file is also the worker: ``python test_linear_multiprocess.py PORT PROCESS_ID OUT_JSON`` joins
the job on 127.0.0.1, runs the MLP with every matmul method on two ``make_mesh(dp=2, tp=4)`` meshes
over the 8 global devices, and writes the gathered outputs to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.core.multiprocess import run_workers

NUM_PROCESSES, LOCAL_DEVICES = 2, 4
METHODS = ("gspmd", "shard_map", "collective_matmul")
# "dp2_tp4": make_mesh's own order, each process one dp row, so tp stays inside a process and dp crosses.
# "tp_across": the devices of the two processes interleaved, so every tp group spans both processes.
MESHES = ("dp2_tp4", "tp_across")
B, T, D, F = 4, 8, 16, 32  # collective_matmul splits T over tp=4; dp=2 splits B
TIMEOUT_S = 90


def mlp_params() -> dict[str, np.ndarray]:
    """Deterministic float32 input and weights (scaled so outputs are O(1))."""
    rng = np.random.default_rng(0)
    normal = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)
    return dict(x=normal(B, T, D), w_up=normal(D, F, scale=D**-0.5), b_up=normal(F, scale=0.1),
                w_down=normal(F, D, scale=F**-0.5), b_down=normal(D, scale=0.1))


def numpy_mlp(p: dict[str, np.ndarray]) -> np.ndarray:
    p = {k: v.astype(np.float64) for k, v in p.items()}
    return np.maximum(p["x"] @ p["w_up"] + p["b_up"], 0) @ p["w_down"] + p["b_down"]


@pytest.mark.multiprocess
def test_column_row_mlp_across_two_processes(tmp_path):
    from workbench.core.linear import MATMUL_METHODS

    assert METHODS == MATMUL_METHODS
    results = run_workers(Path(__file__), tmp_path, NUM_PROCESSES, local_devices=LOCAL_DEVICES, timeout_s=TIMEOUT_S)
    expected = numpy_mlp(mlp_params())
    for i, result in enumerate(results):
        assert (result["process_index"], result["process_count"], result["device_count"]) == (i, 2, 8)
        assert result["mesh_shape"] == dict(pp=1, dp=2, fsdp=1, ep=1, tp=4, sp=1)
        # The two meshes put the process boundary across dp, then across tp.
        assert result["tp_group_processes"] == {"dp2_tp4": [[0], [1]], "tp_across": [[0, 1], [0, 1]]}
        for mesh_name in MESHES:
            for method in METHODS:
                out = result["outputs"][mesh_name][method]
                where = f"process {i}, mesh {mesh_name}, matmul_method={method}"
                assert out["x_spec"] == ["dp"], where  # x enters sharded over dp
                np.testing.assert_allclose(np.array(out["y"]), expected, rtol=0, atol=1e-5, err_msg=where)


# -- the worker -------------------------------------------------------------------------------------
def worker_main(port: int, process_id: int, out_path: str) -> None:
    start = time.perf_counter()
    from workbench.core.mesh import initialize_distributed, make_mesh

    initialize_distributed(f"127.0.0.1:{port}", NUM_PROCESSES, process_id, local_device_count=LOCAL_DEVICES)

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from workbench.core.linear import ColumnParallelLinear, RowParallelLinear, TensorParallelConfig

    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(NUM_PROCESSES)]
    meshes = {"dp2_tp4": make_mesh(dp=2, tp=4),
              "tp_across": make_mesh(dp=2, tp=4, devices=[d for ds in zip(*by_process, strict=True) for d in ds])}
    p = mlp_params()
    const = lambda value: (lambda key, shape, dtype: jnp.asarray(value, dtype))
    mlp = nnx.jit(lambda up, down, x: down(jax.nn.relu(up(x))))

    outputs = {}
    for mesh_name, mesh in meshes.items():
        x = jax.make_array_from_callback(p["x"].shape, NamedSharding(mesh, P("dp")), lambda index: p["x"][index])
        for method in METHODS:
            config = TensorParallelConfig(mesh, matmul_method=method)
            common = dict(parallel_config=config, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))
            up = ColumnParallelLinear(D, F, kernel_init=const(p["w_up"]), bias_init=const(p["b_up"]), **common)
            down = RowParallelLinear(F, D, kernel_init=const(p["w_down"]), bias_init=const(p["b_down"]), **common)
            y = mlp(up, down, x)
            outputs.setdefault(mesh_name, {})[method] = dict(
                x_spec=list(x.sharding.spec),
                y=np.asarray(multihost_utils.process_allgather(y, tiled=True), np.float64).tolist())

    tp_groups = lambda mesh: [sorted({d.process_index for d in row}) for row in mesh.devices.reshape(2, 4)]
    result = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                  device_count=jax.device_count(), mesh_shape=dict(meshes["dp2_tp4"].shape),
                  tp_group_processes={name: tp_groups(mesh) for name, mesh in meshes.items()},
                  outputs=outputs, seconds=time.perf_counter() - start)
    jax.distributed.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
