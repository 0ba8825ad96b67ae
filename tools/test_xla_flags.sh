#!/usr/bin/env bash
# test_xla_flags.sh PYTHON: the XLA flags the tests' phase of a leg runs with by default (TEST_XLA_FLAGS), for the XLA
# that PYTHON's jaxlib carries. They make XLA:CPU compile faster; what a test checks is unchanged (every test passes
# with them, XLA:TPU's compiled memory is the same). The tests' subprocesses keep them (tests/xla_flags.py); the
# notebooks never get them: run with them, notebook 07's real-model forwards took about 5.5 minutes against 102 s.
#   --xla_backend_optimization_level=0   LLVM at -O0: 34 % less CPU on test_lora + test_explicit_axes (115 CPU-s
#                                        against 174); on jax 0.12, test_explicit_axes' compiles 23.1 s against 31.7.
#   --xla_cpu_use_fusion_emitters=false  XLA:CPU's older elemental emitters for fusions: with -O0, test_explicit_axes'
#                                        174 compiles take 8.8 s against 24.6 (the newer MLIR emitters run their own
#                                        optimising pipeline whatever LLVM's level; alone, without -O0, the flag saves
#                                        nothing: 23.4 s). jaxlib 0.12 no longer has the flag and aborts on it, so it
#                                        is asked for where this XLA knows it (a probe: about 2 s).
# (measured on this 2-core machine, one process, no compile cache; jax 0.10.2 unless said.)
python=${1:?usage: test_xla_flags.sh PYTHON}
flags="--xla_backend_optimization_level=0"
emitters="--xla_cpu_use_fusion_emitters=false"
if XLA_FLAGS="${XLA_FLAGS:-} $emitters" JAX_PLATFORMS=cpu "$python" -c 'import jax; jax.devices()' >/dev/null 2>&1; then
  flags="$flags $emitters"
fi
echo "$flags"
