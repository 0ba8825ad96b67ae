"""xla_log_lines: XLA's log lines kept for the blocks open, everything else on to stderr; blocks may overlap."""

import os
import threading
import time

from tests.core.stderr_file import stderr_into
from workbench.core.xla_log import xla_log_lines

XLA_LINE = "W1122 12:57:02.022634   11999 spmd_partitioner.cc:656] [SPMD] warned"


def test_overlapping_blocks_from_threads_get_xla_lines_and_pass_the_rest(tmp_path):
    target = tmp_path / "stderr.txt"
    inside, results = threading.Barrier(2), {}

    def block(name):
        with xla_log_lines() as log:
            inside.wait(10)  # both blocks open
            os.write(2, f"{XLA_LINE} {name}\nplain {name}\n".encode())
            inside.wait(10)
        results[name] = list(log)

    with stderr_into(target):
        threads = [threading.Thread(target=block, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        os.write(2, b"after\n")
    written = target.read_text().splitlines()
    assert sorted(written[:-1]) == ["plain a", "plain b"] and written[-1] == "after"
    for name in ("a", "b"):  # XLA's log does not say which thread caused it: both blocks see both
        assert sorted(results[name]) == [f"{XLA_LINE} a", f"{XLA_LINE} b"]


def test_libtpu_noise_is_kept_and_other_threads_stderr_goes_through(tmp_path):
    """What libtpu prints when it loads on a host that is not a TPU VM (compiling for a TPU slice) is kept
    with XLA's log; another thread's line written meanwhile reaches stderr."""
    target = tmp_path / "stderr.txt"
    with stderr_into(target), xla_log_lines() as log:
        writer = threading.Thread(target=lambda: os.write(2, b"a line from another thread\n"))
        writer.start()
        os.write(2, b"=== Source Location Trace: === \nlearning/45eac/tfrc/runtime/libtpu_init_utils.cc:327\n"
                    b"WARNING: Logging before InitGoogle() is written to STDERR\n")
        writer.join(10)
    assert target.read_text().splitlines() == ["a line from another thread"]
    assert any(line.startswith("learning/45eac") for line in log) and len(log) == 3


def test_libtpu_noise_written_in_pieces_is_kept(tmp_path):
    """libtpu writes its host-bounds warning in pieces; the reader may see the first piece alone and must hold it
    (a partial line that is not libtpu's, a progress bar, goes through at once)."""
    target = tmp_path / "stderr.txt"
    with stderr_into(target), xla_log_lines() as log:
        os.write(2, b"Failed to find host bounds for accelerator type: ")
        time.sleep(0.2)  # the reader has the partial line
        os.write(2, b"WARNING: could not determine TPU accelerator type\n")
        os.write(2, b"50% done\r")
        time.sleep(0.2)
        os.write(2, b"100% done\n")
    assert target.read_bytes() == b"50% done\r100% done\n"
    assert log == ["Failed to find host bounds for accelerator type: WARNING: could not determine TPU accelerator "
                   "type"]
