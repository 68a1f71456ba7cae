"""Shared fixtures for the tests of the mha package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's tests on one torch thread: on tiny tensors a second thread only adds waiting."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
