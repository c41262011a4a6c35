"""Shared test setup."""

import os

# Triton kernels run on CPU tensors only under the interpreter, which must be chosen before triton is
# first imported (docs/environment.md). With a GPU the suite still tests interpreted kernels on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

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
