#!/usr/bin/env bash
# pytest_leg.sh PYTEST PREFIX [PYTEST ARGS...]: one leg of make test, in two phases.
#   1. tests/ and the doctests of workbench/, two workers (pytest-xdist, a file stays on one worker);
#   2. the notebooks, one at a time with every core: a notebook's time is then what a reader running it waits
#      (what issue 34 holds under 90 s). Their CPU time is what it was when two shared the cores, but a kernel
#      leaves part of the second core idle: up to about 3 minutes more a leg, by the runs here.
# Junit reports go to PREFIX.xml and PREFIX-notebooks.xml (tools/test_report.py adds them up); the seconds per
# file to $WORKBENCH_FILE_SECONDS when it is set (conftest.py adds both phases' into it). Both phases run; the
# exit status is 1 when either failed.
pytest=$1
prefix=$2
shift 2
[ -n "${WORKBENCH_FILE_SECONDS:-}" ] && rm -f "$WORKBENCH_FILE_SECONDS"
status=0
# TEST_XLA_FLAGS: XLA flags for the tests' phase only (not its subprocesses, which start with tests/xla_flags.py's,
# nor the notebooks, which run as a reader's would). Default: LLVM at -O1 (--xla_backend_optimization_level=1), 16 %
# less CPU than XLA's default on test_lora + test_explicit_axes (146 CPU-s against 174, no compile cache); the whole
# tests phase passes at -O1 (2,337 passed), and XLA:TPU's compiled memory is the same (test_reconcile's 2-layer
# Llama at 4,096 positions: 1.871 GiB with remat full, 4.268 with none, at both levels). -O0 would take 34 % less
# (115 CPU-s), but two attention gradient tests then fail (test_flash.py::test_gradients_match_vanilla,
# test_flex.py's pallas-vs-native mods2). The cause, found: vanilla attention's gradient flows through the
# softmax's max, which divides by the count of maxima, and at -O0 XLA:CPU recomputes a logit in a second fusion one
# rounding apart (its FMA contraction differs), so the count is 0 and the gradient inf in a fully visible row.
# jax.lax.stop_gradient on the max (as jax.nn.softmax does) makes both tests pass at -O0, but it changes the
# workbench's own attention program: its compiled peak on v5p falls (test_reconcile's 2-layer Llama: 4.27 to 3.04
# GiB without remat, 2.43 to 2.20 with dots_saveable, 1.87 to 1.25 with full), and the ledger's kept score bytes and
# SCORE_BYTES would have to be measured again first. TEST_XLA_FLAGS= (empty) runs at XLA's default.
TEST_XLA_FLAGS=${TEST_XLA_FLAGS---xla_backend_optimization_level=1}
XLA_FLAGS="${XLA_FLAGS:-} ${TEST_XLA_FLAGS:-}" \
  "$pytest" -n "${JOBS:-2}" --dist loadfile --junitxml="$prefix.xml" "$@" tests workbench || status=1
"$pytest" -p no:xdist --junitxml="$prefix-notebooks.xml" "$@" notebooks || status=1
exit $status
