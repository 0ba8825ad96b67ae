"""Widget latency: how long the kernel takes to answer an edit, against the targets of the issue.

    python benchmarks/widgets.py [--edits 20] [--collectives 3]

Tiny Llama (`workbench.models.tiny("llama")`) on 8 simulated CPU devices, `make_mesh(dp=2, fsdp=2, tp=2)`.

- **Sharding explorer, one rule edit**: the `tensor_parallel_axis` dropdown set to another mesh axis (as the
  browser does), until every panel is re-rendered: layout resolved, diff, table, memory chart. Median (and
  90th percentile) of `--edits` warm edits, alternating `dp` and `tp`, after 3 warm-up edits. Widget
  messages are serialised to JSON as the kernel would send them (the socket and the browser's drawing are
  not timed). Target <= 300 ms.
- **Sharding explorer, collectives panel**: the "collectives" button, forward and train step (batch 8 x 64):
  one compile each from abstract inputs (nothing is cached between presses). Median of `--collectives`
  presses. Target <= 5 s.

Each section is a function returning table rows ``(quantity, measured, target, status)``; a new widget's
latency (e.g. the attention lab's) joins as one more function in ``SECTIONS``.
"""

import argparse
import json
import os
import statistics
import sys
import time
import typing as tp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import workbench  # cheap: nothing of JAX runs before simulate_devices

workbench.simulate_devices(8)  # before any JAX computation

import comm  # noqa: E402
from _header import header, print_rows  # noqa: E402

Row = tuple[str, str, str, str]
SENT = {"messages": 0, "bytes": 0}


class JsonComm(comm.DummyComm):
    """A comm that serialises each message as the kernel's session would, and counts the bytes."""

    def publish_msg(self, msg_type: str, data: tp.Any = None, metadata: tp.Any = None, buffers: tp.Any = None,
                    **keys: tp.Any) -> None:
        SENT["messages"] += 1
        SENT["bytes"] += len(json.dumps({"data": data, "metadata": metadata}, default=str))


comm.create_comm = lambda *args, **kwargs: JsonComm(*args, **kwargs)


def status(value: float, target: float) -> str:
    return "met" if value <= target else "MISSED"


def timed(fn: tp.Callable[[], tp.Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def explorer_section(args: argparse.Namespace) -> list[Row]:
    from workbench.widgets.sharding_explorer import ShardingExplorer

    model = workbench.models.tiny("llama")
    mesh = workbench.make_mesh(dp=2, fsdp=2, tp=2)
    build_s = timed(lambda: ShardingExplorer(model, mesh))
    explorer = ShardingExplorer(model, mesh)
    dropdown = explorer.editor.fields["tensor_parallel_axis"]
    axes = ["dp", "tp"]

    def edit(i: int) -> None:
        dropdown.value = axes[i % 2]
        if explorer.error or explorer.partition_axis.tensor_parallel_axis != axes[i % 2]:
            raise RuntimeError(f"the edit did not apply: {explorer.error}")

    for i in range(3):
        edit(i)
    SENT.update(messages=0, bytes=0)
    edits = [timed(lambda i=i: edit(i)) * 1e3 for i in range(args.edits)]
    per_edit_kib = SENT["bytes"] / args.edits / 1024
    median, p90 = statistics.median(edits), statistics.quantiles(edits, n=10)[-1]

    rows: list[Row] = [
        ("explorer: build (21 parameters)", f"{build_s * 1e3:.0f} ms", "-", "-"),
        (f"explorer: one rule edit, median of {args.edits} (p90 {p90:.0f} ms; {per_edit_kib:.0f} KiB of "
         f"widget messages)", f"{median:.0f} ms", "<= 300 ms", status(median, 300)),
    ]
    for kind in ("forward", "train"):
        explorer._kind.value = kind
        presses, compiles = [], []
        for _ in range(args.collectives):
            seconds = timed(explorer.compute_collectives)
            if explorer.collectives is None or explorer.collectives.kind != kind:
                raise RuntimeError(f"the collectives panel failed: {explorer._collectives_out.value}")
            presses.append(seconds)
            compiles.append(explorer.collectives.compile_seconds)
        median_s, compile_s = statistics.median(presses), statistics.median(compiles)
        rows.append((f"explorer: collectives panel, {kind} step (compile {compile_s:.2f} s of it), median of "
                     f"{args.collectives}", f"{median_s:.2f} s", "<= 5 s", status(median_s, 5)))
    return rows


def cluster_explorer_section(args: argparse.Namespace) -> list[Row]:
    """The explorer on a virtual cluster: Llama-3-70B (bfloat16, abstract) on 8 nodes x 8 H100, fsdp=8 x tp=8.
    A rule edit re-renders the memory ledger against HBM as well as the table and diff; a mesh choice
    re-resolves every parameter on another shape of the 64 devices."""
    import jax.numpy as jnp

    from workbench.core.hardware.cluster import Cluster
    from workbench.core.models.presets import full_config
    from workbench.widgets.sharding_explorer import ShardingExplorer

    model = workbench.models.CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16,
                                                param_dtype=jnp.bfloat16).with_options(remat="full")
    cluster = Cluster.h100(nodes=8)
    build_s = timed(lambda: ShardingExplorer(model, {"fsdp": 8, "tp": 8}, cluster=cluster, batch=(16, 2048)))
    explorer = ShardingExplorer(model, {"fsdp": 8, "tp": 8}, cluster=cluster, batch=(16, 2048))
    dropdown = explorer.editor.fields["tensor_parallel_axis"]
    axes, shapes = ["fsdp", "tp"], ["fsdp=64", "fsdp=8 × tp=8"]

    def edit(i: int) -> None:
        dropdown.value = axes[i % 2]
        if explorer.error or "wb-ledger-verdict" not in explorer._ledger_out.value:
            raise RuntimeError(f"the edit did not apply: {explorer.error}")

    def choose(i: int) -> None:
        explorer._mesh_choice.value = shapes[i % 2]
        if explorer.error or dict(explorer.mesh.shape)["tp"] != (1, 8)[i % 2]:
            raise RuntimeError(f"the mesh choice did not apply: {explorer.error}")

    rows: list[Row] = [("cluster explorer: build (Llama-3-70B, 8 x 8 H100)", f"{build_s * 1e3:.0f} ms", "-", "-")]
    for what, action in (("one rule edit", edit), ("one mesh choice", choose)):
        for i in range(3):
            action(i)
        times = [timed(lambda i=i, act=action: act(i)) * 1e3 for i in range(args.edits)]
        median = statistics.median(times)
        rows.append((f"cluster explorer: {what} (ledger re-rendered), median of {args.edits}", f"{median:.0f} ms",
                     "<= 300 ms", status(median, 300)))
    return rows


def attention_lab_section(args: argparse.Namespace) -> list[Row]:
    """Attention lab: cold switch per implementation (compile included), warm switch (see its module)."""
    from _attention_lab_latency import attention_lab_latency

    return attention_lab_latency(args.edits)


SECTIONS: dict[str, tp.Callable[[argparse.Namespace], list[Row]]] = {
    "sharding explorer": explorer_section,
    "cluster explorer": cluster_explorer_section,
    "attention lab": attention_lab_section,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edits", type=int, default=20, help="timed warm edits (median reported)")
    parser.add_argument("--collectives", type=int, default=3, help="presses of the collectives button per step kind")
    parser.add_argument("--only", choices=sorted(SECTIONS), default=None, help="run one section")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(header("widgets: kernel-side latency of an edit (tiny Llama, 8 simulated devices, dp=2 fsdp=2 tp=2)"))
    rows: list[Row] = []
    for name, section in SECTIONS.items():
        if args.only in (None, name):
            rows += section(args)
    print_rows(["quantity", "measured", "target", "status"], rows)
    print(f"\n(1-minute load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
          f"{os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
