"""Shared fixtures and markers for the tests of the mha package."""

from __future__ import annotations

from collections.abc import Iterator

import mha.kernels  # noqa: F401
import numpy as np
import pytest

# Triton chooses interpreted or compiled when it decorates a function, its own standard library
# (tl.max, tl.sum, ...) included, when it is first imported. mha.kernels makes that choice
# (the interpreter where there is no GPU) before any test, or torch's compiler, imports triton.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cuda: needs an NVIDIA GPU; skipped, with the reason, where there is none"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's tests on one torch thread.

    On tiny tensors a second thread only adds waiting.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded NumPy generator, new for each test."""
    return np.random.default_rng(0)


@pytest.fixture
def torch_gen():
    """A seeded torch generator, new for each test."""
    import torch

    return torch.Generator().manual_seed(0)
