#!/usr/bin/env bash
# timed.sh PREFIX COMMAND...: run COMMAND, write "<exit status> <seconds>" to PREFIX.time, exit with its status.
# make test's legs use it; tools/test_report.py reads the files.
prefix=$1
shift
start=$(date +%s.%N)
"$@"
status=$?
end=$(date +%s.%N)
awk -v s="$start" -v e="$end" -v rc="$status" 'BEGIN { printf "%d %.1f\n", rc, e - s }' > "$prefix.time"
exit $status
