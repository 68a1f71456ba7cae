"""mha: multi-head attention from one head to the GPU.

The package behind the book. Each module has one purpose; CONTRIBUTING.md's
table of rooms lists every module with the chapters that import it and the
tests that pin it (``tests/test_rooms.py`` keeps the table true):

* :mod:`mha.reference` - the math, in NumPy
* :mod:`mha._validate` - the one error policy and the shared checks
* :mod:`mha.functional` - torch building blocks
* :mod:`mha.worked_example` - the 2-head worked example
* :mod:`mha.fitting` - heads fitted to patterns
* :mod:`mha.counting` - every count, real configurations
* :mod:`mha.module` - MultiHeadAttention, torch's layer
* :mod:`mha.plotting` - maps, grids, benchmark plots
* :mod:`mha.bench` - ``python -m mha.bench``
* :mod:`mha.exercises` - checkers for a learner's own code
* :mod:`mha.head_view` - an interactive head view, offline HTML
* :mod:`mha.tiny` - the tiny induction model and the training loop
* :mod:`mha.positions` - sinusoidal, learned, rotary
* :mod:`mha.decoding` - GQA, key/value caches, generation
* :mod:`mha.flash` - tiled online-softmax attention
* :mod:`mha.kernels` - Triton attention kernels
* :mod:`mha.parallel` - heads across processes
* :mod:`mha.variants` - masks and scores as functions, FlexAttention
* :mod:`mha.caches` - the key/value cache protocol and its caches
* :mod:`mha.blocks` - the block allocator of the paged caches
* :mod:`mha.configs` - one reader of transformers' configurations
* :mod:`mha.environment` - what measured figures depend on
* :mod:`mha.backends` - attention backends by name, each with its masks
* :mod:`mha.model` - a whole Llama-family model, its attention a switch
* :mod:`mha.latent` - multi-head latent attention (MLA) and its cache
* :mod:`mha.serving` - many requests: a paged pool, a scheduler, an engine

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
    "GroupedQueryAttention": "mha.layer",
    "KVCache": "mha.caches",
    "ConcatKVCache": "mha.caches",
    "PagedKVCache": "mha.caches",
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
    "RollingKVCache": "mha.caches",
    "CausalLM": "mha.model",
    "attention_backends": "mha.backends",
    "register_transformers_backends": "mha.transformers_backends",
    "MultiHeadLatentAttention": "mha.latent",
    "LatentKVCache": "mha.latent",
    "Engine": "mha.serving",
}

__all__ = [*reference.__all__, *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")
