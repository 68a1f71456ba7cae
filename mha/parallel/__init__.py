"""Tensor-parallel multi-head attention over ``torch.distributed``.

Each process owns whole heads: the query, key and value projections are split
by output features (column-parallel), the output projection by input features
(row-parallel), and one all-reduce per forward sums the processes' shares
(Shoeybi et al. 2019, Megatron-LM).

* :mod:`mha.parallel.layers`: :class:`SelfAttention`, :func:`shard_heads`
  and :class:`HeadShard` (by hand), :func:`parallelize_heads` (DTensor).
* :mod:`mha.parallel.collectives`: :class:`CollectiveCounter`, memory
  saved for the backward pass.
* :mod:`mha.parallel.ring`: the sequence split instead of the heads (context
  parallelism): :func:`ring_attention` (contiguous or zigzag parts),
  :func:`shard_sequence`, :func:`unshard_sequence`, the work and bytes per
  process, PyTorch's own context parallel beside it.
* :mod:`mha.parallel.launch`: N local processes, stopped together on the
  first failure or at a timeout.
* :mod:`mha.parallel.cli`: ``python -m mha.parallel --nproc 2 --check``
  (or ``--ring``).

The launcher needs no torch (it only starts processes), so the names load on
first use, and ``python -m mha.parallel`` starts fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "SelfAttention": "layers",
    "HeadShard": "layers",
    "unfuse": "layers",
    "shard_heads": "layers",
    "query_heads": "layers",
    "kv_heads": "layers",
    "copy_to_ranks": "layers",
    "sum_over_ranks": "layers",
    "parallelize_heads": "layers",
    "Collective": "collectives",
    "CollectiveCounter": "collectives",
    "saved_tensor_bytes": "collectives",
    "ring_attention": "ring",
    "RingAttention": "ring",
    "RingStats": "ring",
    "LAYOUTS": "ring",
    "chunk_ranges": "ring",
    "sequence_positions": "ring",
    "shard_sequence": "ring",
    "unshard_sequence": "ring",
    "merge_parts": "ring",
    "pairs_per_rank": "ring",
    "imbalance": "ring",
    "ring_bytes": "ring",
    "dense_attention": "ring",
    "torch_context_parallel": "ring",
    "LaunchError": "launch",
    "launch": "launch",
    "run_check": "cli",
    "run_benchmark": "cli",
    "run_ring": "cli",
    "TOLERANCE": "cli",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
