"""The notebooks here are driven by the browser tests (tests/browser/test_*.py) and kept without outputs,
so nbval (which collects every .ipynb under tests/) must not compare them."""

collect_ignore_glob = ["*.ipynb"]
