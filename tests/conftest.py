"""Shared test setup: the test tiers (every test has exactly one of the markers unit, dist, e2e; slow combines
with any of them; pyproject.toml and docs/testing.md say what each holds) and the fixtures several modules
use."""

import os

# Triton kernels run on CPU tensors only under the interpreter, which must be chosen before triton is
# first imported (docs/environment.md). With a GPU the suite still tests interpreted kernels on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread in every process a test starts too (bench scripts, trainers, torchrun ranks), as
# _one_thread below sets for this one: a child with two threads on a core the other pytest worker keeps busy
# waits at every parallel region (the GPU check's dry run: 218 s with two threads, 169 s with one, the
# optimizer step 24 s against 7). A value already exported is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The suite's tensors are tiny: on a shared 2-core machine, intra-op threads spend more time
    # synchronising than computing (measured 40x slower with 2 threads under load).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- tiers ----------------------------------------------------------------------------------------------

TIERS = ("unit", "dist", "e2e")


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is checked
def pytest_collection_modifyitems(config, items):
    from count_tests import SUITE_COUNTS, tally, whole_suite

    if whole_suite(config):
        config.stash[SUITE_COUNTS] = tally(items)
    wrong = []
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: "
                         f"{'no test tier' if not tiers else 'several tiers: ' + ', '.join(tiers)}; "
                         "mark it (or its module: pytestmark = pytest.mark.unit) with exactly one of "
                         "unit, dist, e2e (docs/testing.md)")
    if wrong:
        raise pytest.UsageError("\n".join(wrong))


# ---- CPU time per test ----------------------------------------------------------------------------------
# Each test's CPU seconds (its worker's own and those of every process it started and waited for, torchrun's
# ranks included) go into the JUnit report as the property cpu_s, which tests/suite_times.py sums: the suite
# is CPU-bound on 2 cores, and unlike wall time, CPU time hardly grows when the other worker or another job
# shares the cores. A module's fixtures count in the test that sets them up or tears them down; what SLURM's
# daemons run for a test (tests/parallel/test_slurm.py) is not counted.

CPU_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    import resource

    own, waited = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up
def pytest_runtest_setup(item):
    item.stash[CPU_START] = _cpu_seconds()


@pytest.hookimpl(tryfirst=True)  # the teardown report carries it: after the fixtures are torn down
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and CPU_START in item.stash:
        item.user_properties.append(("cpu_s", f"{_cpu_seconds() - item.stash[CPU_START]:.2f}"))


# ---- fixtures shared by several modules (one of each per module, as when each module defined its own) ---

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """helpers.make_corpus's generated documents (24 English-like .txt files)."""
    from helpers import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """An empty directory for data.cache_dir (the token cache)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The data.* overrides of a generated corpus and a token cache of its own (helpers.corpus_overrides),
    with train.py's config schema registered for composing them."""
    from helpers import corpus_overrides

    from kimi.config import register_configs

    register_configs()
    return corpus_overrides(tmp_path_factory)


@pytest.fixture(scope="module")
def references(tmp_path_factory, data):
    """references(optim, *overrides) -> the run dir of one process of the torch engine on `data`, trained
    on first use (tests/layout_runs.py reference_runs)."""
    from layout_runs import reference_runs

    return reference_runs(tmp_path_factory.mktemp("single"), data)


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """No network, and every cache (HF and kimi) inside a temporary directory (helpers.offline_caches)."""
    from helpers import offline_caches

    yield from offline_caches(tmp_path_factory.mktemp("hf"))
