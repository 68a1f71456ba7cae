"""A benchmark configuration, and the weights and inputs.

Every implementation shares the same weights and inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["DTYPES", "BenchConfig", "make_layer", "make_input"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: B sequences of T tokens, H heads of width d_k."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    dtype: str = "float32"
    device: str = "cpu"
    causal: bool = False

    @property
    def embed_dim(self) -> int:
        """D = H d_k."""
        return self.heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def make_layer(config: BenchConfig, seed: int = 0) -> nn.MultiheadAttention:
    """The weights every implementation uses.

    They are a seeded ``torch.nn.MultiheadAttention`` in eval mode. torch
    initialises the projection weights Xavier-uniform and the biases to
    zero.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.MultiheadAttention(
            config.embed_dim, config.heads, batch_first=True
        )
    return (
        layer.to(device=config.device, dtype=config.torch_dtype)
        .eval()
        .requires_grad_(False)
    )


def make_input(config: BenchConfig, seed: int = 1) -> Tensor:
    """Standard-normal inputs, (B, T, D), drawn in float32 and then cast."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(
        config.batch, config.seq_len, config.embed_dim, generator=generator
    )
    return x.to(device=config.device, dtype=config.torch_dtype)  # (B, T, D)
