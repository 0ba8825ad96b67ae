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
# The tests compile their in-process programs with LLVM at -O0 (TEST_XLA_FLAGS): the same XLA programs after the
# same HLO passes, machine code generated in about a third less CPU time (tests/core/models/test_lora.py and
# test_explicit_axes.py: 84 s against 130 s). Their subprocesses, the compile worker and JupyterLab's kernels start
# with tests/xla_flags.py's flags, which drop it; the notebooks' phase runs without it, as a reader's kernel does.
XLA_FLAGS="${XLA_FLAGS:-} ${TEST_XLA_FLAGS---xla_backend_optimization_level=0}" \
  "$pytest" -n "${JOBS:-2}" --dist loadfile --junitxml="$prefix.xml" "$@" tests workbench || status=1
"$pytest" -p no:xdist --junitxml="$prefix-notebooks.xml" "$@" notebooks || status=1
exit $status
