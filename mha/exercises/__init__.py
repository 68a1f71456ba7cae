"""Checkers for code a learner writes, with messages that say what is wrong.

Each ``check_*`` takes your function, runs it on small inputs with a fixed
seed and goes through a checklist, comparing with the package's own code.
When every item passes it returns ``None`` (and prints the checklist unless
``verbose=False``). Otherwise it raises ``AssertionError`` naming the item
that failed and what came; where your result equals the result of a known
mistake (a split without a transpose, a scale by sqrt(D), a softmax over the
wrong axis, ...), the message names that mistake and how to put it right.

* :func:`check_softmax` - ``fn(x, axis=-1)``
* :func:`check_scaled_dot_product_attention` - ``fn(q, k, v, mask=None)``
* :func:`check_split_heads` - ``fn(x, num_heads)``;
  :func:`check_merge_heads` - ``fn(heads)``
* :func:`check_multi_head_attention` -
  ``fn(x, w_q, w_k, w_v, w_o, num_heads, mask=None)``
* :func:`check_causal_mask` - ``fn(t_q, t_k)``
* :func:`check_rope` - ``fn(x, positions)``
* :func:`check_padded_positions` - ``fn(keep)``
* :func:`check_kv_cache_update` - ``fn(keys, values, k, v, length)``
* :func:`check_online_softmax_step` - ``fn(m, ell, acc, scores, v)``
* :func:`check_flash_attention` - ``fn(q, k, v, causal)``, a FlashAttention
  kernel and its launcher (:mod:`.kernel`, loaded when first used)

Your function gets NumPy arrays, or float64 torch tensors with
``framework="torch"``; it may return either. The torch tensors are on the
device the package's Triton kernels run on (CUDA where Triton compiles for
the GPU, the CPU in its interpreter), so that a Triton kernel of yours can
read them; ``device="cpu"`` (or another) puts them elsewhere. A tensor you
return must be on the device of your inputs. Masks are boolean, ``True`` =
may attend, as everywhere in the package. :func:`failure` returns a
checker's message instead of raising it.

A Triton kernel your torch function launches gets its tensors inside guard
bands (:mod:`.guard`): a store or load outside a tensor is named, with the
tensor, the places and the mask that is missing, and never ends the Python
process.

The package's modules: :mod:`.checker` (the checklist, comparisons,
messages), :mod:`.guard` (guard bands around a kernel's tensors),
:mod:`.one_head`, :mod:`.many_heads`, :mod:`.masks_positions`, :mod:`.tiled`
and :mod:`.kernel` (the checkers of each part of the book).
"""

from __future__ import annotations

from .checker import WIDTH as WIDTH  # the width messages wrap at
from .checker import failure
from .many_heads import (
    check_merge_heads,
    check_multi_head_attention,
    check_split_heads,
)
from .masks_positions import (
    check_causal_mask,
    check_padded_positions,
    check_rope,
)
from .one_head import check_scaled_dot_product_attention, check_softmax
from .tiled import check_kv_cache_update, check_online_softmax_step

__all__ = [
    "check_softmax",
    "check_scaled_dot_product_attention",
    "check_split_heads",
    "check_merge_heads",
    "check_multi_head_attention",
    "check_causal_mask",
    "check_rope",
    "check_padded_positions",
    "check_kv_cache_update",
    "check_online_softmax_step",
    "check_flash_attention",
    "failure",
]


def __getattr__(name: str):
    # the kernel checker loads torch (and, with a GPU, Triton) when first
    # used, so that importing the checkers stays light
    if name == "check_flash_attention":
        from .kernel import check_flash_attention

        return check_flash_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
