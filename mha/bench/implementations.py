"""What ``python -m mha.bench layer`` times: one registry entry each.

Every entry computes the same function with the same weights (one seeded
``torch.nn.MultiheadAttention``), without autograd; the entries of a family
share one builder (the NumPy reference, torch's layer, :func:`core`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import reference
from ..flash import flash_attention_torch
from ..functional import (
    causal_mask,
    merge_heads,
    reference_weights,
    split_heads,
)
from ..module import MultiHeadAttention
from .registry import IMPLEMENTATIONS, Runner, Unsupported, register

__all__ = ["BACKENDS", "project_heads", "textbook_attention"]
__all__ += ["sdpa_attention", "core"]

#: ``sdpa_<name>`` entries and the backend each one forces.
BACKENDS: dict[str, SDPBackend] = {
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def project_heads(
    layer: nn.MultiheadAttention, x: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of ``layer`` for ``x`` (B, T, D), each (B, H, T, d_k)."""
    d_k = x.shape[-1] // layer.num_heads
    qkv = F.linear(x, layer.in_proj_weight, layer.in_proj_bias)  # (B, T, 3D)
    q, k, v = (split_heads(t, d_k) for t in qkv.chunk(3, dim=-1))
    return q, k, v  # (B, H, T, d_k) each


def textbook_attention(
    x: Tensor, layer: nn.MultiheadAttention, keep: Tensor | None = None
) -> Tensor:
    """Self-attention of ``x`` (B, T, D) written out, the (B, H, T, T) scores
    materialised; ``keep`` (T, T) is True where a query may attend."""
    q, k, v = project_heads(layer, x)  # (B, H, T, d_k) each
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
    heads = weights @ v  # (B, H, T, d_k)
    return layer.out_proj(merge_heads(heads))  # (B, T, D)


def sdpa_attention(
    x: Tensor, layer: nn.MultiheadAttention, is_causal: bool = False
) -> Tensor:
    """The same layer, its core handed to ``F.scaled_dot_product_attention``.

    Nothing else is done. The floor of the module's approach: the
    projections, views and the one fused attention call.
    """
    q, k, v = project_heads(layer, x)  # (B, H, T, d_k) each
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return layer.out_proj(merge_heads(heads))  # (B, T, D)


# -----------------------------------------------------------------------------
# The NumPy reference (CPU, float32/64, no biases)


def _numpy(loop: bool) -> Callable:
    """The reference head by head (``loop``) or all heads at once."""

    def build(layer: nn.MultiheadAttention, x: Tensor, causal: bool):
        w = reference_weights(layer)  # (D, D) each, the reference's layout
        for name, bias in (("in_proj_bias", w.b_q), ("out_proj.bias", w.b_o)):
            if bias is not None and bool(np.any(bias)):
                raise Unsupported(
                    "the NumPy reference has no biases, "
                    f"and the layer's {name} is not zero"
                )
        x_np, H = x.cpu().numpy(), layer.num_heads
        mask = reference.causal_mask(x.shape[1]) if causal else None
        if not loop:
            return lambda: reference.multi_head_attention(
                x_np, w.w_q, w.w_k, w.w_v, w.w_o, H, mask
            )[0]
        d_k = x.shape[-1] // H
        columns = [slice(i * d_k, (i + 1) * d_k) for i in range(H)]
        per_head = [
            [np.ascontiguousarray(m[:, c]) for c in columns]
            for m in (w.w_q, w.w_k, w.w_v)
        ]
        return lambda: reference.multi_head_attention_loop(
            x_np, *per_head, w.w_o, mask
        )[0]

    return build


for _name, _loop, _summary in (
    (
        "numpy_loop",
        True,
        ":func:`mha.reference.multi_head_attention_loop`, head by head (CPU)",
    ),
    (
        "numpy_fused",
        False,
        ":func:`mha.reference.multi_head_attention`, all heads at once (CPU)",
    ),
):
    register(
        IMPLEMENTATIONS,
        _name,
        scope="layer",
        devices=("cpu",),
        dtypes=(torch.float32, torch.float64),
        summary=_summary,
        library="numpy",
    )(_numpy(_loop))


# -----------------------------------------------------------------------------
# Whole layers in torch


@register(IMPLEMENTATIONS, "torch_textbook", scope="layer")
def torch_textbook(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:func:`textbook_attention`: writes out the (B, H, T, T) scores."""
    keep = causal_mask(x.shape[1], device=x.device) if causal else None
    return lambda: textbook_attention(x, layer, keep)


@register(IMPLEMENTATIONS, "mha_module", scope="layer")
def mha_module(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:class:`mha.MultiHeadAttention`, ``need_weights=False``."""
    module = MultiHeadAttention(
        layer.embed_dim,
        layer.num_heads,
        batch_first=True,
        device=x.device,
        dtype=x.dtype,
    )
    module.load_state_dict(layer.state_dict())
    module.eval().requires_grad_(False)
    # The module builds the causal mask itself and hands SDPA its
    # is_causal flag.
    return lambda: module(x, x, x, need_weights=False, is_causal=causal)[0]


def _torch_layer(train: bool) -> Callable:
    def build(layer: nn.MultiheadAttention, x: Tensor, causal: bool):
        if train:  # dropout 0: the same result, without the fast path
            layer = copy.deepcopy(layer).train()
        # Same tensor as query, key and value: the condition for torch's
        # self-attention fast path. torch takes is_causal only as a hint that
        # attn_mask is causal, so the mask is given too.
        blocked = ~causal_mask(x.shape[1], device=x.device) if causal else None
        return lambda: layer(
            x, x, x, need_weights=False, attn_mask=blocked, is_causal=causal
        )[0]

    return build


for _name, _train, _how in (
    ("torch_mha", False, "(its fast path: eval mode, no autograd)"),
    (
        "torch_mha_general",
        True,
        "on its general path (train mode, dropout "
        "0): ``F.multi_head_attention_forward``",
    ),
):
    register(
        IMPLEMENTATIONS,
        _name,
        scope="layer",
        summary=f"``torch.nn.MultiheadAttention``, ``need_weights=False`` "
        f"{_how}",
    )(_torch_layer(_train))


@register(
    IMPLEMENTATIONS,
    "sdpa_bare",
    scope="layer",
    summary=":func:`sdpa_attention`: four ``F.linear`` around "
    "``F.scaled_dot_product_attention``.",
)
def sdpa_bare(layer: nn.MultiheadAttention, x: Tensor, causal: bool) -> Runner:
    """The layer as :func:`sdpa_attention` computes it."""
    return lambda: sdpa_attention(x, layer, is_causal=causal)


@register(IMPLEMENTATIONS, "projections", scope="projections")
def projections(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """The four projections of ``sdpa_bare`` without the attention core."""

    def run() -> Tensor:
        qkv = F.linear(x, layer.in_proj_weight, layer.in_proj_bias)
        v = qkv.chunk(3, dim=-1)[2]  # (B, T, D)
        return layer.out_proj(v.contiguous())  # the copy stands for the merge

    return run


# -----------------------------------------------------------------------------
# The attention core alone, on projected heads made outside the timing


def core(name: str, **options) -> Callable:
    """Register an attention core: ``build(q, k, v, causal) -> runner``.

    The decorated builder gets the layer's projected q, k, v (B, H, T, d_k),
    made once outside the timing, and returns a runner that computes the
    attention output (B, H, T, d_k). ``options`` go to :func:`register`.
    """

    def add(build_core: Callable[..., Runner]) -> Callable[..., Runner]:
        def build(layer: nn.MultiheadAttention, x: Tensor, causal: bool):
            q, k, v = project_heads(layer, x)  # (B, H, T, d_k) each
            return build_core(q, k, v, causal)

        build.__doc__ = build_core.__doc__
        register(IMPLEMENTATIONS, name, scope="core", **options)(build)
        return build_core

    return add


def _sdpa_core(backend: SDPBackend) -> Callable[..., Runner]:
    def build(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Runner:
        def run() -> Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal
                )  # (B, H, T, d_k)

        return run

    return build


# On the CPU, torch has a math and a flash kernel only: the other two run
# by default on GPUs.
for _short, _backend in BACKENDS.items():
    core(
        f"sdpa_{_short}",
        default_on=("cpu", "cuda")
        if _short in ("math", "flash")
        else ("cuda",),
        summary="``F.scaled_dot_product_attention`` alone, "
        f"forced to the {_short} backend",
    )(_sdpa_core(_backend))


@core("flash_torch")
def flash_torch(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Runner:
    """:func:`mha.flash.flash_attention_torch`: tiles of 64 x 64 scores."""
    return lambda: flash_attention_torch(q, k, v, causal=causal)[0]


@core(
    "triton_attention",
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    default_on=("cuda",),
)
def triton_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Runner:
    """:func:`mha.kernels.triton_attention` (CPU: in Triton's interpreter)."""
    from .. import kernels  # sets TRITON_INTERPRET where there is no GPU

    if not kernels.TRITON_AVAILABLE:
        raise Unsupported("triton_attention needs triton, not installed here")
    if q.shape[-1] not in kernels.HEAD_DIMS:
        raise Unsupported(
            f"triton_attention takes d_k in {kernels.HEAD_DIMS}, "
            f"not {q.shape[-1]}"
        )
    if kernels.INTERPRETED != (q.device.type == "cpu"):
        mode = "interpreted" if kernels.INTERPRETED else "compiled"
        raise Unsupported(
            "triton_attention runs compiled on CUDA tensors and in the "
            f"interpreter on CPU tensors; here it is {mode} and the device "
            f"is {q.device.type}"
        )
    if kernels.INTERPRETED and q.dtype == torch.bfloat16:
        raise Unsupported("the Triton interpreter has no correct bfloat16")
    return lambda: kernels.triton_attention(q, k, v, causal=causal)
