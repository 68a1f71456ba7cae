"""mha: multi-head attention from one head to the GPU.

The package behind the book. Each module has one purpose:

* :mod:`mha.reference` - NumPy reference: softmax, scaled dot-product attention, heads, masks.
* :mod:`mha.worked_example` - the 2-head worked example's matrices, in one place.
* :mod:`mha.fitting` - fitting attention heads to target patterns (chapter 02).
* :mod:`mha.module` - :class:`MultiHeadAttention`, a drop-in for ``torch.nn.MultiheadAttention``.
* :mod:`mha.counting` - parameter and FLOP counts; real model configurations.
* :mod:`mha.plotting` - attention maps, head grids, shape diagrams, benchmark plots.
* :mod:`mha.bench` - ``python -m mha.bench``, the benchmark harness.
* :mod:`mha.tiny` - the induction task and the tiny two-layer model of chapter 10.

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
