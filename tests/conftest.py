"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The suite's tensors are tiny: on a shared 2-core machine, intra-op threads spend more time
    # synchronising than computing (measured 40x slower with 2 threads under load).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
