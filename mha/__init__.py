"""mha: multi-head attention from one head to the GPU.

The package behind the book. Each module has one purpose; the chapters that
read it and the tests that pin it are listed with it (README.md has the table).

==========================  ==========================  ========  ======================
module                      what it holds               chapters  tests
==========================  ==========================  ========  ======================
:mod:`mha.reference`        NumPy reference: the math   01-07     test_reference
:mod:`mha._validate`        the one error policy        all       (every error test)
:mod:`mha.functional`       torch building blocks       08, 09    test_functional
:mod:`mha.worked_example`   the 2-head worked example   04        test_worked_example
:mod:`mha.fitting`          fitting heads to patterns   02        test_fitting
:mod:`mha.counting`         every count and config      06, 09    test_counting
:mod:`mha.module`           MultiHeadAttention (torch)  08-10     test_module_*
:mod:`mha.plotting`         maps, grids, benchmarks     all       (drawn in chapters)
:mod:`mha.bench`            ``python -m mha.bench``     09        test_bench
:mod:`mha.tiny`             the tiny induction model    10        test_tiny
:mod:`mha.positions`        sinusoidal, learned, RoPE   11, 12    test_positions
:mod:`mha.decoding`         GQA, KV caches, generation  12        test_decoding
:mod:`mha.parallel`         heads across processes      14        test_parallel
==========================  ==========================  ========  ======================

The order inside a topic: the NumPy reference first, then the torch or fast
version, tests that pin one to the other, a benchmark entry, the chapter.
New code writes boolean masks as ``True`` = may attend, and raises errors
through :mod:`mha._validate`.

``import mha`` needs only NumPy; the PyTorch parts load when first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .reference import (
    causal_mask,
    merge_heads,
    multi_head_attention,
    multi_head_attention_loop,
    multi_head_cross_attention,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    split_heads,
)

__version__ = "0.1.0"

# Names that live in modules importing torch, loaded on first access.
_LAZY = {
    "MultiHeadAttention": "mha.module",
    "sinusoidal_positions": "mha.positions",
    "LearnedPositions": "mha.positions",
    "apply_rope": "mha.positions",
    "GroupedQueryAttention": "mha.decoding",
    "KVCache": "mha.decoding",
    "ConcatKVCache": "mha.decoding",
    "grouped_from_multi_head": "mha.decoding",
    "generate": "mha.decoding",
    "HeadShard": "mha.parallel",
    "shard_heads": "mha.parallel",
    "parallelize_heads": "mha.parallel",
    "copy_to_ranks": "mha.parallel",
    "sum_over_ranks": "mha.parallel",
}

__all__ = [
    "softmax",
    "scaled_dot_product_attention",
    "split_heads",
    "merge_heads",
    "multi_head_attention_loop",
    "multi_head_attention",
    "multi_head_cross_attention",
    "causal_mask",
    "padding_mask",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")
