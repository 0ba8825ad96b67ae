"""Point file descriptor 2 at a file for a test (the stand-in for the terminal), and back."""

import contextlib
import os
import pathlib


@contextlib.contextmanager
def stderr_into(path: pathlib.Path):
    saved = os.dup(2)
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
