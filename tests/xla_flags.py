"""The XLA flags a test's fresh process (a subprocess, a JupyterLab kernel) starts with: an instruction-set cap the
run was given (``XLA_FLAGS=--xla_cpu_max_isa=AVX2 make test`` codegens as an AVX2-only CPU does, in every process),
and ``devices`` simulated CPU devices when given."""

import os

# flags that hold for every process of a run (not the device count, which each child sets): the instruction-set cap,
# and the tests' phase's compile-time flags (tools/test_xla_flags.sh: a browser test's kernel, the x64 and multi-process
# tests compile as the tests do; the notebooks' own phase never has them)
SUITE_FLAGS = ("--xla_cpu_max_isa", "--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters")


def child_xla_flags(devices: int | None = None) -> str:
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.startswith(SUITE_FLAGS)]
    if devices is not None:
        kept.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(kept)
