"""Run a test's worker script as several JAX processes on 127.0.0.1 and collect their JSON results.

A worker is a script run as ``python WORKER PORT PROCESS_ID OUT_JSON [ARGS...]``: it joins the job
at ``127.0.0.1:PORT`` (``workbench.core.mesh.initialize_distributed``), computes, and writes one JSON
object to ``OUT_JSON``. Each process sees ``local_devices`` simulated CPU devices, and can import
``tests.*`` (the repository root is on its ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from tests.xla_flags import child_xla_flags

ROOT = Path(__file__).resolve().parents[2]


def load_module(path: Path) -> ModuleType:
    """A worker script imported by path (for its input data), without running its ``__main__`` part."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(local_devices: int) -> dict[str, str]:
    """This environment, with CPU JAX, ``local_devices`` simulated devices and the repository importable."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = child_xla_flags(local_devices)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return env


def run_workers(worker: Path, tmp_path: Path, num_processes: int, *, local_devices: int = 4,
                timeout_s: float = 120, args: tuple[str, ...] = ()) -> list[dict]:
    """Start ``num_processes`` copies of ``worker``, wait for all, and return their JSON results in process order.

    If one fails, the others are killed at once (they would otherwise wait for it); all are killed
    at the deadline. Their output goes to files under ``tmp_path``, shown when the assertion fails.
    """
    port = free_port()
    outs = [tmp_path / f"process{i}.json" for i in range(num_processes)]
    logs = [tmp_path / f"process{i}.log" for i in range(num_processes)]
    env = child_env(local_devices)
    procs = []
    try:
        for i in range(num_processes):
            with open(logs[i], "w") as log:
                procs.append(subprocess.Popen([sys.executable, str(worker), str(port), str(i), str(outs[i]), *args],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
            if any(proc.poll() not in (None, 0) for proc in procs):
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    report = "\n".join(f"--- process {i}: exit code {proc.returncode} ---\n{log.read_text()[-4000:]}"
                       for i, (proc, log) in enumerate(zip(procs, logs, strict=True)))
    assert all(proc.returncode == 0 for proc in procs), \
        f"a worker of {worker.name} failed or ran past {timeout_s} s (exit code -9: killed):\n{report}"
    assert all(out.exists() for out in outs), f"a worker of {worker.name} wrote no result:\n{report}"
    return [json.loads(out.read_text()) for out in outs]
