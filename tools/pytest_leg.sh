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
# TEST_XLA_FLAGS: XLA flags for the tests' phase only (not its subprocesses, which start with tests/xla_flags.py's, nor
# the notebooks, which run as a reader's would). Default: XLA:CPU's LLVM backend at -O0
# (--xla_backend_optimization_level=0), 34 % less CPU than XLA's default on test_lora + test_explicit_axes (115 CPU-s
# against 174, no compile cache; -O1 146). The whole tests phase ran at -O0 (2,335 passed; the 3 that failed were two
# notebooks saved in another JSON layout and one ledger figure the change below moves, fixed since; 2,639 CPU-s of user
# time on this machine, notebooks running beside it), and XLA:TPU's compiled memory is the same (the 2-layer Llama at
# 4,096 positions with remat="full": 1.247 GiB at -O0 and at the default). -O0 needed the softmax's shift to be a
# stop_gradient, as jax.nn.softmax makes it: with the gradient through the row maximum, which divides by the count of
# maxima, XLA:CPU at -O0 recomputed a logit in a second fusion one rounding apart (its FMA contraction differs), the
# count was 0 and the gradient inf in a fully visible row (test_flash.py::test_gradients_match_vanilla, test_flex.py's
# pallas-vs-native mods2).
# TEST_XLA_FLAGS= (empty) runs at XLA's default.
TEST_XLA_FLAGS=${TEST_XLA_FLAGS---xla_backend_optimization_level=0}
XLA_FLAGS="${XLA_FLAGS:-} ${TEST_XLA_FLAGS:-}" \
  "$pytest" -n "${JOBS:-2}" --dist loadfile --junitxml="$prefix.xml" "$@" tests workbench || status=1
"$pytest" -p no:xdist --junitxml="$prefix-notebooks.xml" "$@" notebooks || status=1
exit $status
