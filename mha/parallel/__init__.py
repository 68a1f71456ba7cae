"""Tensor-parallel multi-head attention over ``torch.distributed``.

Each process owns whole heads: the query, key and value projections are split
by output features (column-parallel), the output projection by input features
(row-parallel), and one all-reduce per forward sums the processes' shares
(Shoeybi et al. 2019, Megatron-LM).

* :mod:`mha.parallel.layers`: :class:`SelfAttention`, :func:`shard_heads`
  and :class:`HeadShard` (by hand), :func:`parallelize_heads` (DTensor).
* :mod:`mha.parallel.collectives`: :class:`CollectiveCounter`, memory
  saved for the backward pass.
* :mod:`mha.parallel.launch`: N local processes, stopped together on the
  first failure or at a timeout.
* :mod:`mha.parallel.cli`: ``python -m mha.parallel --nproc 2 --check``.
"""

from .cli import TOLERANCE, run_benchmark, run_check
from .collectives import Collective, CollectiveCounter, saved_tensor_bytes
from .launch import LaunchError, launch
from .layers import (
    HeadShard,
    SelfAttention,
    copy_to_ranks,
    head_slice,
    parallelize_heads,
    shard_heads,
    sum_over_ranks,
    unfuse,
)

__all__ = [
    "SelfAttention",
    "HeadShard",
    "unfuse",
    "shard_heads",
    "head_slice",
    "copy_to_ranks",
    "sum_over_ranks",
    "parallelize_heads",
    "Collective",
    "CollectiveCounter",
    "saved_tensor_bytes",
    "LaunchError",
    "launch",
    "run_check",
    "run_benchmark",
    "TOLERANCE",
]
