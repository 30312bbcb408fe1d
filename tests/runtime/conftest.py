"""Runtime tests run many tiny torch ops (toy and tiny models): on a shared 2-core machine thread
hand-offs cost more than the math, so these tests run torch on one thread."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
