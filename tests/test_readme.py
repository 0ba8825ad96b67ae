"""The README's code blocks marked ``python runnable`` run, in order, in one fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.xla_flags import child_xla_flags

README = Path(__file__).resolve().parents[1] / "README.md"


def runnable_blocks(text: str) -> list[str]:
    return re.findall(r"^```python runnable\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_runnable_blocks():
    assert len(runnable_blocks(README.read_text())) >= 5


def test_readme_runnable_blocks_run():
    blocks = runnable_blocks(README.read_text())
    script = "\n\n".join(f"# --- README block {i}\n{block}" for i, block in enumerate(blocks))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = child_xla_flags()  # the README's own simulate_devices(8) sets the device count
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                         cwd=README.parent)
    assert out.returncode == 0, f"a README block failed:\n{out.stderr[-4000:]}"
