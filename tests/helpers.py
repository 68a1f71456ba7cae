"""Random data for the tests: seeded, so every run draws the same numbers."""

from __future__ import annotations

import torch


def generator(seed: int = 0) -> torch.Generator:
    """A torch generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Standard-normal numbers of ``shape``, drawn from a generator seeded with ``seed``."""
    return torch.randn(*shape, generator=generator(seed), dtype=dtype)


#: transformers 5's rope_parameters, one of each rope type mha.Rope reads.
ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {  # Llama 3.1's published values
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    },
}


def _kernel_device() -> str:
    """Where the Triton kernels run: CUDA tensors when they are compiled for a GPU, CPU
    tensors in Triton's interpreter (or where Triton is missing)."""
    from mha import kernels

    return "cuda" if kernels.TRITON_AVAILABLE and not kernels.INTERPRETED else "cpu"


#: The device every test hands the Triton kernels (and what runs them) its tensors on.
KERNEL_DEVICE = _kernel_device()
