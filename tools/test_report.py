"""What `make test` prints last: each leg's install and pytest time and counts, the machine's matmul speed, and
one closing line with the counts of both legs.

    python tools/test_report.py build/legs

The legs leave ``<leg>-install.time`` / ``<leg>-pytest.time`` ("<exit status> <seconds>", tools/timed.sh),
``<leg>.xml`` and ``<leg>-notebooks.xml`` (pytest's junit reports of the leg's two phases, tools/pytest_leg.sh;
the newest leg's quick tier, ``newest-quick``, has no notebooks) and ``<leg>-skipped`` (why a leg did not run).
The machine's speed is numpy's float32 2048^3 matmul, best of five, so a run's time can be scaled to another
machine (CI machines of this kind differ by 2.5x). Exits 1 when a leg failed or left no report.
"""

from __future__ import annotations

import os
import platform
import sys
import time
import xml.etree.ElementTree as ET

LEGS = ("default", "newest-quick", "newest")  # make test runs the first two; NEWEST_IN_TEST=1 the first and last


def matmul_gflops(n: int = 2048, runs: int = 5) -> float:
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def read_time(path: str) -> tuple[int, float] | None:
    if not os.path.exists(path):
        return None
    status, seconds = open(path).read().split()
    return int(status), float(seconds)


def _suites(path: str) -> list[ET.Element]:
    root = ET.parse(path).getroot()
    return [root] if root.tag == "testsuite" else list(root)


def counts(*paths: str) -> dict[str, int] | None:
    """passed / failed / skipped / errors of junit reports, added up (pytest writes one <testsuite> per run);
    None when the first is missing. A leg writes two: its tests' and its notebooks' (tools/pytest_leg.sh)."""
    if not os.path.exists(paths[0]):
        return None
    suites = [s for path in paths if os.path.exists(path) for s in _suites(path)]
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return dict(passed=passed, failed=total["failures"], errors=total["errors"], skipped=total["skipped"])


def seconds_per_file(path: str) -> dict[str, float]:
    """Seconds per test file (per notebook: its cells added up) in a junit report; {} when it is missing."""
    if not os.path.exists(path):
        return {}
    out: dict[str, float] = {}
    for suite in _suites(path):
        for case in suite.iter("testcase"):
            name = case.get("classname") or case.get("file") or "?"
            out[name] = out.get(name, 0.0) + float(case.get("time", 0))
    return out


def minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def main(folder: str) -> int:
    ok, rows, notes, total = True, [], [], dict(passed=0, failed=0, errors=0, skipped=0)
    for leg in LEGS:
        install, pytest_run = read_time(f"{folder}/{leg}-install.time"), read_time(f"{folder}/{leg}-pytest.time")
        found = counts(f"{folder}/{leg}.xml", f"{folder}/{leg}-notebooks.xml")
        skipped_why = f"{folder}/{leg}-skipped"
        if os.path.exists(skipped_why):
            rows.append((leg, "-", "-", "skipped: " + open(skipped_why).read().strip()))
            continue
        if found is None:
            ok = False
            rows.append((leg, minutes(install and install[1]), minutes(pytest_run and pytest_run[1]),
                         "no report: the leg did not run to the end"))
            continue
        for k in total:
            total[k] += found[k]
        ok &= found["failed"] == found["errors"] == 0 and (pytest_run is None or pytest_run[0] == 0)
        result = f"{found['passed']} passed, {found['failed']} failed, {found['skipped']} skipped"
        if found["errors"]:
            result += f", {found['errors']} errors"
        rows.append((leg, minutes(install and install[1]), minutes(pytest_run and pytest_run[1]), result))
        if notebooks := seconds_per_file(f"{folder}/{leg}-notebooks.xml"):
            name, slowest = max(notebooks.items(), key=lambda kv: kv[1])
            notes.append(f"  {leg} leg: {len(notebooks)} notebooks run one at a time, the slowest "
                         f"{name.removeprefix('notebooks.')} in {slowest:.0f} s")
    seconds = sum(t[1] for leg in LEGS for part in ("install", "pytest")
                  if (t := read_time(f"{folder}/{leg}-{part}.time")) is not None)
    print()
    print("make test, per leg:")
    widths = [max(len(r[i]) for r in [("leg", "install", "pytest", "result"), *rows]) for i in range(4)]
    for row in [("leg", "install", "pytest", "result"), *rows]:
        print(("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))).rstrip())
    for note in notes:
        print(note)
    print(f"  the legs that ran, installs included: {minutes(seconds)}")
    print(f"  this machine: {os.cpu_count()} cores, numpy float32 2048^3 matmul {matmul_gflops():.0f} GFLOP/s "
          f"({platform.machine()}); scale the times by it for another machine")
    line = f"{total['passed']} passed, {total['failed'] + total['errors']} failed, {total['skipped']} skipped"
    print(f"make-test: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/legs"))
