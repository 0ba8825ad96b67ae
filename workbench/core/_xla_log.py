"""XLA's C++ log while compiling: kept from the terminal, its warnings returned as text."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import typing as tp


@contextlib.contextmanager
def stderr_lines() -> tp.Iterator[list[str]]:
    """The lines written to file descriptor 2 inside the block (XLA's C++ log), kept from the terminal."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines.extend(capture.read().decode(errors="replace").splitlines())


XLA_LOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\] (.*)$")


def xla_warnings(lines: tp.Iterable[str]) -> tp.Iterator[str]:
    """XLA's warnings and errors without their ``W1122 12:57:02.022634 11999 file.cc:656]`` prefix."""
    for line in lines:
        match = XLA_LOG.match(line)
        if match and match.group(1) in "WE":
            yield match.group(2)


def give_back(lines: tp.Iterable[str]) -> None:
    """Write the captured lines that are not XLA's log back to stderr (a user's prints, Python warnings)."""
    other = [line for line in lines if not XLA_LOG.match(line)]
    if other:
        os.write(2, ("\n".join(other) + "\n").encode())
