"""XLA's C++ log while compiling: kept from the terminal, its warnings returned as text.

XLA logs from C++ to file descriptor 2, from its own threads, so the only way to read its warnings is
to point fd 2 somewhere else for a while, for the whole process. :func:`xla_log_lines` does it without
taking other threads' output: while it is active, a reader thread passes every line that is not XLA's
log straight on to the real stderr, and keeps XLA's log lines for the blocks that asked. An XLA line
cannot be told apart by the thread that caused it (XLA logs from its own threads), so a compile on
another thread in the same moment adds its warnings to the block's too.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import typing as tp


@contextlib.contextmanager
def xla_log_lines() -> tp.Iterator[list[str]]:
    """XLA's log lines written inside the block (kept from the terminal); everything else written to fd 2
    meanwhile, by any thread, goes on to stderr as it comes. Blocks may overlap, from any threads."""
    lines: list[str] = []
    _ROUTER.enter(lines)
    try:
        yield lines
    finally:
        _ROUTER.exit(lines)


@contextlib.contextmanager
def stderr_lines() -> tp.Iterator[list[str]]:
    """Every line written to file descriptor 2 inside the block, kept from the terminal (whoever wrote it:
    use it only where nothing else runs, e.g. a compile worker process; else :func:`xla_log_lines`)."""
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
# What libtpu prints when it loads on a host that is not a TPU VM (compiling ahead of time for a TPU slice):
# true and harmless, kept from the terminal with XLA's log.
LIBTPU_NOISE = re.compile(r"^(=== Source Location Trace: ===\s*|learning/\S+:\d+"
                          r"|WARNING: Logging before InitGoogle\(\) is written to STDERR"
                          r"|Failed to find host bounds for accelerator type: .*)$")


# how libtpu's lines start: a partial line that may be one of them is held until its end (libtpu writes
# "Failed to find host bounds ..." in pieces, and the pipe may hand the reader the first alone)
_NOISE_HEADS = ("=== Source Location Trace", "learning/", "WARNING: Logging before InitGoogle",
                "Failed to find host bounds")


def _noise_head(text: str) -> bool:
    """Whether ``text`` (a partial line) starts one of libtpu's lines, or could as more of it arrives."""
    return any(text.startswith(head) or head.startswith(text) for head in _NOISE_HEADS)


def xla_warnings(lines: tp.Iterable[str]) -> tp.Iterator[str]:
    """XLA's warnings and errors without their ``W1122 12:57:02.022634 11999 file.cc:656]`` prefix."""
    for line in lines:
        match = XLA_LOG.match(line)
        if match and match.group(1) in "WE":
            yield match.group(2)


_XLA_HEAD = re.compile(r"[IWEF](\d{0,4}( [\d:.]*( +\d*( [\w./-]*(:\d*)?)?)?)?)?")


class _Router:
    """fd 2 -> a pipe while any :func:`xla_log_lines` block is open; a reader thread sorts the lines."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sinks: list[list[str]] = []
        self._synced: dict[bytes, threading.Event] = {}
        self._write_fd: int | None = None
        self._out_fd: int | None = None

    def enter(self, lines: list[str]) -> None:
        sys.stderr.flush()
        with self._lock:
            if self._write_fd is None:
                read_fd, self._write_fd = os.pipe()
                self._out_fd = os.dup(2)  # the real stderr; the reader closes it at the pipe's end
                os.dup2(self._write_fd, 2)
                threading.Thread(target=self._read, args=(read_fd, self._out_fd), daemon=True,
                                 name="workbench-xla-log").start()
            self._sinks.append(lines)

    def exit(self, lines: list[str]) -> None:
        sys.stderr.flush()
        token = f"\x00workbench-sync-{id(lines)}".encode()
        done = self._synced[token] = threading.Event()
        os.write(self._write_fd, token + b"\n")  # what was written before reaches ``lines`` first
        done.wait(10)
        with self._lock:
            self._sinks.remove(lines)
            if not self._sinks:  # the last block: fd 2 back, then the reader ends at the pipe's end
                os.dup2(self._out_fd, 2)
                os.close(self._write_fd)
                self._write_fd = self._out_fd = None

    def _read(self, read_fd: int, out_fd: int) -> None:
        pending = b""
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                *complete, pending = (pending + chunk).split(b"\n")
                for line in complete:
                    self._route(line, out_fd)
                text = pending.decode(errors="replace")
                if pending and not _XLA_HEAD.fullmatch(text[:40]) and not XLA_LOG.match(text) and not _noise_head(
                        text):
                    os.write(out_fd, pending)  # a partial line that is neither XLA's nor libtpu's (a progress bar)
                    pending = b""
        if pending:
            os.write(out_fd, pending)
        os.close(out_fd)

    def _route(self, line: bytes, out_fd: int) -> None:
        sync = line.find(b"\x00workbench-sync-")
        if sync >= 0:  # after a held partial line, perhaps
            if sync:
                os.write(out_fd, line[:sync])
            event = self._synced.pop(line[sync:], None)
            if event is not None:
                event.set()
            return
        text = line.decode(errors="replace")
        if XLA_LOG.match(text) or LIBTPU_NOISE.match(text):
            with self._lock:
                for sink in self._sinks:
                    sink.append(text)
        else:
            os.write(out_fd, line + b"\n")


_ROUTER = _Router()
