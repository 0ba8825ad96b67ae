"""make test's last lines (tools/test_report.py) and its two-phase leg (tools/pytest_leg.sh), on hand-written
junit reports and a stand-in for pytest."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import test_report  # noqa: E402

TESTS_XML = """<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1">
<testcase classname="tests.test_a" name="t1" time="1.5"/><testcase classname="tests.test_a" name="t2" time="2"/>
</testsuite></testsuites>"""
NOTEBOOKS_XML = """<testsuites><testsuite tests="4" failures="0" errors="1" skipped="0">
<testcase classname="notebooks.00_tour.ipynb" name="Cell 0" time="3"/>
<testcase classname="notebooks.11_layout_advisor.ipynb" name="Cell 1" time="40"/>
<testcase classname="notebooks.11_layout_advisor.ipynb" name="Cell 2" time="25.5"/>
</testsuite></testsuites>"""

QUICK_XML = """<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1">
<testcase classname="tests.test_a" name="t1" time="1"/></testsuite></testsuites>"""


def legs(tmp_path):
    (tmp_path / "default.xml").write_text(TESTS_XML)
    (tmp_path / "default-notebooks.xml").write_text(NOTEBOOKS_XML)
    (tmp_path / "default-install.time").write_text("0 60.0\n")
    (tmp_path / "default-pytest.time").write_text("0 600.0\n")
    (tmp_path / "newest-skipped").write_text("its quick tier ran (make test-newest runs the whole leg)\n")
    (tmp_path / "newest-quick.xml").write_text(QUICK_XML)
    (tmp_path / "newest-quick-install.time").write_text("0 50.0\n")
    (tmp_path / "newest-quick-pytest.time").write_text("0 300.0\n")
    return tmp_path


def test_counts_add_up_the_tests_and_the_notebooks(tmp_path):
    folder = legs(tmp_path)
    assert test_report.counts(f"{folder}/default.xml", f"{folder}/default-notebooks.xml") == dict(
        passed=6, failed=1, errors=1, skipped=1)
    assert test_report.counts(f"{folder}/newest.xml") is None


def test_a_missing_report_has_no_seconds(tmp_path):
    assert test_report.seconds_per_file(str(tmp_path / "newest-notebooks.xml")) == {}


def test_the_report_names_the_slowest_notebook_and_fails_on_a_failure(tmp_path, capsys):
    folder = legs(tmp_path)
    assert test_report.seconds_per_file(f"{folder}/default-notebooks.xml") == {
        "notebooks.00_tour.ipynb": 3.0, "notebooks.11_layout_advisor.ipynb": 65.5}
    assert test_report.main(str(folder)) == 1  # one failure, one error
    out = capsys.readouterr().out
    assert "2 notebooks run one at a time, the slowest 11_layout_advisor.ipynb in 66 s" in out
    assert "make-test: 8 passed, 2 failed, 2 skipped" in out  # the newest quick tier's 2 passed, 1 skipped too
    assert re.search(r"newest-quick +0 min 50.0 s +5 min 00.0 s +2 passed, 0 failed, 1 skipped", out), out
    assert re.search(r"newest +- +- +skipped: its quick tier ran", out), out
    assert "the legs that ran, installs included: 16 min 50.0 s" in out


def test_a_leg_runs_its_notebooks_even_when_its_tests_fail(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "pytest"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\nprintf "%s\\n" "$XLA_FLAGS" >> {calls}.flags\n'
                    f'case "$*" in *no:xdist*) exit 0;; *) exit 1;; esac\n')
    fake.chmod(0o755)
    seconds = tmp_path / "seconds.json"
    seconds.write_text("{}")  # a last run's: removed before the leg starts
    env = dict(os.environ, JOBS="2", WORKBENCH_FILE_SECONDS=str(seconds), XLA_FLAGS="--xla_cpu_max_isa=AVX2",
               TEST_XLA_FLAGS="--xla_backend_optimization_level=0")
    run = subprocess.run(["bash", os.path.join(ROOT, "tools", "pytest_leg.sh"), str(fake), str(tmp_path / "leg"),
                          "--extra"], env=env)
    assert run.returncode == 1 and not seconds.exists()
    first, second = calls.read_text().splitlines()
    assert first == f"-n 2 --dist loadfile --junitxml={tmp_path}/leg.xml --extra tests workbench"
    assert second == f"-p no:xdist --junitxml={tmp_path}/leg-notebooks.xml --extra notebooks"
    # TEST_XLA_FLAGS reach the tests' phase only (the run's own flags kept in both)
    tests_flags, notebooks_flags = (tmp_path / "calls.flags").read_text().splitlines()
    assert tests_flags.split() == ["--xla_cpu_max_isa=AVX2", "--xla_backend_optimization_level=0"]
    assert notebooks_flags == "--xla_cpu_max_isa=AVX2"


def _stand_in_python(tmp_path, knows_emitters: bool):
    """A python that aborts, as jaxlib 0.12 does, on an XLA flag it does not know (or accepts it)."""
    fake = tmp_path / "python"
    status = 0 if knows_emitters else 134
    fake.write_text(f'#!/bin/sh\ncase "$XLA_FLAGS" in *xla_cpu_use_fusion_emitters*) exit {status};; esac\nexit 0\n')
    fake.chmod(0o755)
    return str(fake)


def test_a_legs_default_flags_ask_for_the_older_emitters_only_where_its_xla_knows_them(tmp_path):
    script = os.path.join(ROOT, "tools", "test_xla_flags.sh")
    for knows, expected in ((True, ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]),
                            (False, ["--xla_backend_optimization_level=0"])):
        out = subprocess.run(["bash", script, _stand_in_python(tmp_path, knows)], capture_output=True, text=True,
                             check=True).stdout
        assert out.split() == expected


def test_a_leg_without_test_xla_flags_takes_its_pythons_defaults(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "pytest"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$XLA_FLAGS" >> {calls}\nexit 0\n')
    fake.chmod(0o755)
    _stand_in_python(tmp_path, knows_emitters=False)  # beside the stand-in pytest, as a venv's bin/ has them
    env = {k: v for k, v in os.environ.items() if k not in ("TEST_XLA_FLAGS", "WORKBENCH_FILE_SECONDS")}
    env |= {"JOBS": "2", "XLA_FLAGS": ""}
    subprocess.run(["bash", os.path.join(ROOT, "tools", "pytest_leg.sh"), str(fake), str(tmp_path / "leg")], env=env,
                   check=True)
    tests_flags, notebooks_flags = calls.read_text().splitlines()
    assert tests_flags.split() == ["--xla_backend_optimization_level=0"] and notebooks_flags.split() == []
