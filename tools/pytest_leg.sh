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
# TEST_XLA_FLAGS: XLA flags for the tests' phase only (its subprocesses keep them through tests/xla_flags.py; the
# notebooks never get them: they run as a reader's would). Default: tools/test_xla_flags.sh's for this leg's XLA (LLVM at -O0,
# and XLA:CPU's older fusion emitters where this jaxlib has them; that script says what each saves). -O0 needed the
# softmax's shift to be a stop_gradient, as jax.nn.softmax makes it: with the gradient through the row maximum, which
# divides by the count of maxima, XLA:CPU at -O0 recomputed a logit in a second fusion one rounding apart (its FMA
# contraction differs), the count was 0 and the gradient inf in a fully visible row (test_flash.py's
# test_gradients_match_vanilla, test_flex.py's pallas-vs-native mods2). XLA:TPU's compiled memory is the same at -O0
# (the 2-layer Llama at 4,096 positions with remat="full": 1.247 GiB at -O0 and at the default).
# TEST_XLA_FLAGS= (empty) runs at XLA's default.
TEST_XLA_FLAGS=${TEST_XLA_FLAGS-$(bash "$(dirname "$0")/test_xla_flags.sh" "$(dirname "$pytest")/python")}
XLA_FLAGS="${XLA_FLAGS:-} ${TEST_XLA_FLAGS:-}" \
  "$pytest" -n "${JOBS:-2}" --dist loadfile --junitxml="$prefix.xml" "$@" tests workbench || status=1
"$pytest" -p no:xdist --junitxml="$prefix-notebooks.xml" "$@" notebooks || status=1
exit $status
