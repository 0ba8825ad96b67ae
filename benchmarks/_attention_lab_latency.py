"""AttentionLab latency: how long the kernel takes to re-render after a change of implementation.

    python benchmarks/_attention_lab_latency.py [--switches 10]

``AttentionLab()`` at T=256 (B=1, H=8, KV=2, D=64, float32, causal; reference ``vanilla``) on 8 simulated
CPU devices. One switch is the implementation menu set to another name (as the browser does) until the
lab has re-rendered: both implementations compared (``compare``: 5 timed rounds each, round-robin),
results table, weights and difference heatmaps built and serialised.

- **cold**: the first switch to each implementation, so its compile is included (the reference's and the
  weights' are not: the lab, built on ``vanilla``, compiled them). Target <= 2 s. ``ring`` and ``ulysses``
  run on a mesh with ``sp`` over the 8 devices.
- **warm**: switching back and forth between two implementations already compiled. Median (and 90th
  percentile) of ``--switches``. Target <= 200 ms.

``attention_lab_latency()`` returns the rows ``(quantity, measured, target, status)`` that
``benchmarks/widgets.py`` prints; run as a script, this file prints them alone.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import typing as tp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import workbench  # cheap: nothing of JAX runs before simulate_devices

Row = tuple[str, str, str, str]
COLD_TARGET_S, WARM_TARGET_MS = 2.0, 200.0
COLD = ("flash", "sdpa", "paged", "ulysses", "ring")  # the first switch to each (vanilla compiles at build)
WARM = ("flash", "sdpa")


def _status(ok: bool) -> str:
    return "met" if ok else "MISSED"


def attention_lab_latency(switches: int = 10, seq_len: int = 256) -> list[Row]:
    """Rows ``(quantity, measured, target, status)``: build, cold switch per implementation, warm switch."""
    from workbench.widgets.attention_lab import AttentionLab

    start = time.perf_counter()
    lab = AttentionLab(seq_len=seq_len, impl="vanilla")  # vanilla vs vanilla: its call and its weights compiled
    build_s = time.perf_counter() - start
    if lab.error:
        raise RuntimeError(f"the lab did not build: {lab.error}")

    def switch(name: str) -> float:
        start = time.perf_counter()
        lab._impl.value = name  # what choosing it in the menu does
        seconds = time.perf_counter() - start
        if lab.error or lab.comparison.impl.name != name:
            raise RuntimeError(f"switching to {name} did not re-render: {lab.error}")
        return seconds

    rows: list[Row] = [(f"attention lab: build at T={seq_len} (vanilla and its weights compiled, heatmaps)",
                        f"{build_s:.2f} s", "-", "-")]
    cold = {}
    for name in COLD:
        if name in lab.implementations:
            cold[name] = switch(name)
            run = lab.comparison.impl
            detail = f"compile {run.compile_ms / 1e3:.2f} s" if run.ok else run.note[:60]
            rows.append((f"attention lab: cold switch to {name} ({detail})", f"{cold[name]:.2f} s",
                         f"<= {COLD_TARGET_S:g} s", _status(cold[name] <= COLD_TARGET_S)))
    single = {n: s for n, s in cold.items() if n not in ("ring", "ulysses")}
    if single:
        worst = max(single, key=single.get)
        rows.append((f"attention lab: cold switch, worst single-device implementation ({worst})",
                     f"{single[worst]:.2f} s", f"<= {COLD_TARGET_S:g} s", _status(single[worst] <= COLD_TARGET_S)))

    for name in WARM:  # compiled, and warmed up once
        switch(name)
    warm = [switch(WARM[i % 2]) * 1e3 for i in range(switches)]
    median = statistics.median(warm)
    p90 = statistics.quantiles(warm, n=10)[-1] if len(warm) > 1 else warm[0]
    rows.append((f"attention lab: warm switch {WARM[0]} <-> {WARM[1]}, median of {switches} (p90 {p90:.0f} ms)",
                 f"{median:.0f} ms", f"<= {WARM_TARGET_MS:g} ms", _status(median <= WARM_TARGET_MS)))
    heads = []
    for i in range(switches):
        start = time.perf_counter()
        lab._head.value = (i + 1) % 8
        heads.append((time.perf_counter() - start) * 1e3)
    rows.append((f"attention lab: head change (weights + difference heatmaps), median of {switches}",
                 f"{statistics.median(heads):.0f} ms", "-", "-"))
    return rows


def _serialising_comms() -> None:
    """Widget messages serialised to JSON as the kernel's session would (there is no front end here)."""
    import json

    import comm

    class JsonComm(comm.DummyComm):
        def publish_msg(self, msg_type: str, data: tp.Any = None, metadata: tp.Any = None, buffers: tp.Any = None,
                        **keys: tp.Any) -> None:
            json.dumps({"data": data, "metadata": metadata}, default=str)

    comm.create_comm = lambda *args, **kwargs: JsonComm(*args, **kwargs)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switches", type=int, default=10, help="timed warm switches (median reported)")
    args = parser.parse_args()
    workbench.simulate_devices(8)  # before any JAX computation
    _serialising_comms()
    from _header import header, print_rows

    load = os.getloadavg()[0]
    print(header("attention lab: kernel-side latency of switching implementation (T=256, 8 simulated devices)"))
    print_rows(["quantity", "measured", "target", "status"], attention_lab_latency(args.switches))
    print(f"\n(1-minute load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
          f"{os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
