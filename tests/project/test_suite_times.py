"""tests/suite_times.py, the generator of docs/testing.md's time table: a JUnit report's test ids become
pytest node ids, times are summed per tier and file, the commit and load `.ci/run` wrote beside the report are
named with the CPU it ran on, and the page holds a generated table."""

import re

import pytest
import suite_times

pytestmark = pytest.mark.unit

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3" time="90.5">
<testcase classname="tests.project.test_suite_times" name="test_report_to_table" time="1.25">
<properties><property name="cpu_s" value="1.00"/></properties></testcase>
<testcase classname="tests.project.test_readme" name="test_docs_commands_run[x]" time="60.0">
<properties><property name="cpu_s" value="150.50"/></properties></testcase>
<testcase classname="tests.test_gone" name="test_old" time="0.5"><skipped message="x"/>
<properties><property name="cpu_s" value="0.01"/></properties></testcase>
</testsuite></testsuites>
"""


def test_report_to_table(tmp_path, monkeypatch):
    report = tmp_path / "pytest.xml"
    report.write_text(REPORT)
    (tmp_path / "run.txt").write_text("commit=abc1234\nload_start=0.5\ncores=2\ncpu=AMD EPYC (avx2)\n"
                                      "load_end=1.5\n")
    monkeypatch.setattr(suite_times, "tiers", lambda: {
        "tests/project/test_suite_times.py::test_report_to_table": ("unit", False),
        "tests/project/test_readme.py::test_docs_commands_run[x]": ("e2e", True)})
    cases, wall = suite_times.read(report)
    assert wall == 90.5 and [c[0] for c in cases] == [
        "tests/project/test_suite_times.py::test_report_to_table",
        "tests/project/test_readme.py::test_docs_commands_run[x]",
        "tests/test_gone.py::test_old"] and cases[2][2]
    assert [c[3] for c in cases] == [1.0, 150.5, 0.01]  # conftest.py's cpu_s
    block = suite_times.table(report)
    assert block.startswith(suite_times.BEGIN) and block.endswith(suite_times.END)
    assert "`.ci/run` at commit abc1234: 3 tests in 1 min 30 s of pytest's wall time" in block
    assert "wall time on a 2-core AMD EPYC (avx2) (load average 0.5 at its start, 1.5 at its end)" in block
    # CPU time: 151.51 s in all, over 2 cores at least 76 s of wall time; shares of CPU
    assert "used 2 min 32 s of CPU time, 1 min 16 s of wall time at the least on its 2 cores" in block
    assert "| unit | 1 | 0 min 01 s | 0 min 01 s | 1% |" in block
    assert "| e2e, slow | 1 | 1 min 00 s | 2 min 30 s | 99% |" in block
    assert "| not collected now | 1 | 0 min 00 s | 0 min 00 s | 0% |" in block
    # the files that use the most CPU first, with their summed time
    assert "| `tests/project/test_readme.py` | 2 min 30 s | 1 min 00 s |" in block
    assert block.index("`tests/project/test_readme.py`") < block.index("`tests/project/test_suite_times.py`")
    # a report made without cpu_s: shares of the summed time, no CPU column values
    report.write_text(re.sub(r"<properties>.*?</properties>", "", REPORT, flags=re.S))
    assert [c[3] for c in suite_times.read(report)[0]] == [None] * 3
    block = suite_times.table(report)
    assert "CPU time was not recorded" in block and "| e2e, slow | 1 | 1 min 00 s | - | 97% |" in block
    assert suite_times.minutes(479.6) == "8 min 00 s" and suite_times.minutes(59.4) == "0 min 59 s"


def test_the_testing_page_holds_a_generated_table():
    """The page's table is the generator's output for some run: its header line and one row per tier."""
    page = suite_times.PAGE.read_text()
    block = page[page.index(suite_times.BEGIN):page.index(suite_times.END)]
    assert re.search(r"`\.ci/run` at commit [0-9a-f]{7,}: [\d,]+ tests in \d+ min \d+ s", block), (
        "docs/testing.md has no generated suite times: run .ci/run in a fresh clone, then "
        "`.venv/bin/python tests/suite_times.py REPORT --write`")
    rows = block.splitlines()
    assert all(any(row.startswith(f"| {tier} |") for row in rows) for tier in ("unit", "dist", "e2e")), block
