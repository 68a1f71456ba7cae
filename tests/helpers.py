"""Random data for the tests: seeded, so every run draws the same numbers."""

from __future__ import annotations

import torch


def generator(seed: int = 0) -> torch.Generator:
    """A torch generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Standard-normal numbers of ``shape``, drawn from a generator seeded with ``seed``."""
    return torch.randn(*shape, generator=generator(seed), dtype=dtype)
