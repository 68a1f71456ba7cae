"""mha: multi-head attention from one head to the GPU.

The package behind the book. Each module has one purpose; the chapters that
read it and the tests that pin it are listed with it (README.md has the table):

* :mod:`mha.reference` - the math, in NumPy (chapters 01-07, 15;
  test_reference, test_variants)
* :mod:`mha._validate` - the one error policy (all; every error test)
* :mod:`mha.functional` - torch building blocks (08, 09; test_functional)
* :mod:`mha.worked_example` - the 2-head worked example (04)
* :mod:`mha.fitting` - heads fitted to patterns (02; test_fitting)
* :mod:`mha.counting` - every count, real configurations (06, 09, 12, 13,
  15)
* :mod:`mha.module` - MultiHeadAttention, torch's layer (08-10; test_module_*)
* :mod:`mha.plotting` - maps, grids, benchmark plots (all)
* :mod:`mha.bench` - ``python -m mha.bench`` (09, 12, 13, 15; test_bench,
  test_variants)
* :mod:`mha.exercises` - checkers for a learner's own code (01, 03, 05, 07,
  appendix; test_exercises)
* :mod:`mha.head_view` - an interactive head view, offline HTML (04, 10;
  test_head_view)
* :mod:`mha.tiny` - the tiny induction model (10; test_tiny)
* :mod:`mha.positions` - sinusoidal, learned, rotary (11, 12; test_positions)
* :mod:`mha.decoding` - GQA, key/value caches, generation (12; test_decoding)
* :mod:`mha.flash` - tiled online-softmax attention (13, 15; test_flash)
* :mod:`mha.kernels` - Triton attention kernels (13; test_kernels)
* :mod:`mha.parallel` - heads across processes (14; test_parallel)
* :mod:`mha.variants` - masks and scores as functions, FlexAttention (15;
  test_variants)

The order inside a topic: the NumPy reference first, then the torch or fast
version, tests that pin one to the other, a benchmark entry, the chapter.
New code writes boolean masks as ``True`` = may attend, and raises errors
through :mod:`mha._validate`.

``import mha`` needs only NumPy; the PyTorch parts load when first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from . import reference
from .reference import *  # noqa: F403  the NumPy reference: mha.softmax, ...

__version__ = "0.1.0"

# Names that live in modules importing torch, loaded on first access.
_LAZY = {
    "MultiHeadAttention": "mha.module",
    "sinusoidal_positions": "mha.positions",
    "LearnedPositions": "mha.positions",
    "apply_rope": "mha.positions",
    "Rope": "mha.positions",
    "GroupedQueryAttention": "mha.decoding",
    "KVCache": "mha.decoding",
    "ConcatKVCache": "mha.decoding",
    "PagedKVCache": "mha.decoding",
    "grouped_from_multi_head": "mha.decoding",
    "generate": "mha.decoding",
    "generate_batch": "mha.decoding",
    "flash_attention": "mha.flash",
    "flash_attention_backward": "mha.flash",
    "flash_attention_torch": "mha.flash",
    "FlashAttention": "mha.flash",
    "tile_schedule": "mha.flash",
    "split_kv_attention": "mha.flash",
    "HeadShard": "mha.parallel",
    "shard_heads": "mha.parallel",
    "parallelize_heads": "mha.parallel",
    "copy_to_ranks": "mha.parallel",
    "sum_over_ranks": "mha.parallel",
    "RollingKVCache": "mha.variants",
}

__all__ = [*reference.__all__, *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")
