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
# nor the notebooks). Empty by default. LLVM at -O0 (--xla_backend_optimization_level=0) takes about a third less
# CPU (test_lora + test_explicit_axes: 84 s against 130 s), but two attention gradient tests then disagree on where
# the native path's gradient is inf (test_flash.py::test_gradients_match_vanilla, test_flex.py's pallas-vs-native
# mods2): the optimised code and -O0 do not handle those overflows alike, so it is not the default until that is
# understood.
XLA_FLAGS="${XLA_FLAGS:-} ${TEST_XLA_FLAGS:-}" \
  "$pytest" -n "${JOBS:-2}" --dist loadfile --junitxml="$prefix.xml" "$@" tests workbench || status=1
"$pytest" -p no:xdist --junitxml="$prefix-notebooks.xml" "$@" notebooks || status=1
exit $status
