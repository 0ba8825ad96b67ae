"""profile / read_trace on real jax.profiler traces of small programs (no timed asserts: structure only)."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from workbench.core.hlo.op_profile import profile, read_trace


def test_a_dot_is_found_and_its_time_is_within_the_wall_time(tmp_path):
    a = jnp.ones((256, 256))
    compiled = jax.jit(jnp.dot).lower(a, a).compile()
    p = profile(compiled, a, a, runs=3, log_dir=tmp_path)
    assert p.module == "jit_dot" and p.runs == 3 and not p.control
    (op,) = p.ops  # one instruction: the matmul (a dot, or XLA:CPU's YNNPACK fusion of it)
    assert op.kind in ("dot", "fusion (dot)") and op.count == 3 and op.total_s > 0
    assert p.busy_s <= p.device_s + 1e-9 and p.op_s <= p.wall_s
    assert "% of step" in p._repr_html_() and op.name in p._repr_html_()
    again = read_trace(p.trace_path, hlo_text=compiled.as_text())  # the file is kept under log_dir
    assert again.ops == p.ops and again.device_s == p.device_s


def test_loops_are_control_flow_and_carry_feeds_the_output_back():
    def body(x, _):
        return jnp.tanh(x @ x), None

    step = jax.jit(lambda x, n: (jax.lax.scan(body, x, None, length=4)[0], n + 1))
    x = jnp.eye(64)
    p = profile(step.lower(x, 0).compile(), x, 0, runs=2, carry=True)
    assert [o.kind for o in p.control] == ["while"] and p.control[0].count == 2
    dots = [o for o in p.ops if "dot" in o.kind]
    assert dots and all(o.count == 2 * 4 for o in dots)  # once per trip of each run
    assert p.trace_path == ""  # a temporary directory, removed


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="runs"):
        profile(jnp.sin, 1.0, runs=0)
    empty = tmp_path / "t.json.gz"
    with gzip.open(empty, "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "name": "python", "ts": 0, "dur": 1}]}, f)
    with pytest.raises(ValueError, match="no device op events"):
        read_trace(empty)
