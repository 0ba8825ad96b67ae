"""Two JAX processes on 127.0.0.1 join through ``initialize_distributed`` and share one 8-device mesh."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.core.multiprocess import load_module, run_workers

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 120


@pytest.mark.multiprocess
def test_two_processes_share_a_dp2_tp4_mesh(tmp_path):
    """psum over tp and dp and a dp x tp sharded matmul agree with NumPy in both processes."""
    worker = load_module(WORKER)  # for its input data
    results = run_workers(WORKER, tmp_path, num_processes=2, local_devices=4, timeout_s=TIMEOUT_S)

    a = worker.psum_input().astype(np.float64)
    x, w = worker.matmul_inputs()
    # Each device holds a (1, 2) block of a: psum over tp adds the 4 blocks of a row,
    # psum over dp the 2 blocks of a column.
    expected_psum_tp = a.reshape(2, 4, 2).sum(axis=1)
    expected_psum_dp = a.sum(axis=0, keepdims=True)
    expected_matmul = x.astype(np.float64) @ w.astype(np.float64)

    for i, result in enumerate(results):
        assert result["process_id"] == result["process_index"] == i
        assert result["process_count"] == 2
        assert result["local_device_count"] == 4
        assert result["device_count"] == 8
        assert result["mesh_shape"] == dict(pp=1, dp=2, fsdp=1, ep=1, tp=4, sp=1)
        assert result["dp_row_processes"] == [[0], [1]]  # so the dp psum crosses processes
        np.testing.assert_array_equal(np.array(result["psum_tp"]), expected_psum_tp,
                                      err_msg=f"psum over tp, process {i}")
        np.testing.assert_array_equal(np.array(result["psum_dp"]), expected_psum_dp,
                                      err_msg=f"psum over dp, process {i}")
        np.testing.assert_allclose(np.array(result["matmul"]), expected_matmul, rtol=0, atol=1e-5,
                                   err_msg=f"x @ w, process {i}")
