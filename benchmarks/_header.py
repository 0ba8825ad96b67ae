"""The header every benchmark prints: platform, device and versions, so tables are never confused."""

import os
import platform
import sys


def header(title: str) -> str:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return "\n".join([
        f"# {title}",
        f"python {sys.version.split()[0]} on {platform.machine()} ({os.cpu_count()} cores), "
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        f"backend {jax.default_backend()}: {jax.device_count()} x {device.device_kind}",
        "",
    ])


def print_rows(heads: list[str], rows: list[tuple[str, ...]]) -> None:
    """A markdown table, columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    print(line(heads))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(list(r)))
