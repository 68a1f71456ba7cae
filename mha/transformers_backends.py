"""The package's backends in ``transformers``' own models.

:func:`register_transformers_backends` registers ``mha_tiled``,
``mha_triton`` and ``mha_flex`` in ``transformers``' ``AttentionInterface``,
each with the mask function it takes, so that a model built by
``transformers`` runs the book's kernels; a mask that none of them can serve
is refused by name (:func:`_served`), never dropped.
"""

from __future__ import annotations

import warnings

import torch

from .backends import Masking, attend, get_backend

__all__ = ["TRANSFORMERS_NAMES", "register_transformers_backends"]


#: transformers' names of the backends it may run (no "flash" in a name:
#: transformers reads such a name as a kernel to fetch from its hub).
TRANSFORMERS_NAMES = {
    "mha_tiled": "tiled",
    "mha_triton": "triton",
    "mha_flex": "flex",
}


def register_transformers_backends() -> tuple[str, ...]:
    """Register ``mha_tiled``, ``mha_triton`` and ``mha_flex`` in
    transformers' ``AttentionInterface``, each with its mask function in
    ``AttentionMaskInterface``, so that ``AutoModelForCausalLM
    .from_config(config, attn_implementation="mha_triton")`` runs our
    kernels. The mask function writes out the mask transformers asks for
    (its ``mask_function``: causal, sliding window, chunked attention,
    packed sequences, padding), as its ``sdpa`` does; the attention function
    serves it as a causal mask with a window and a first key per row when it
    is one (:class:`Masking`), else as a dense mask where the backend takes
    one (``flex``), else refuses it by name: no mask is dropped. Returns the
    names."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for hf_name, name in TRANSFORMERS_NAMES.items():
        AttentionInterface.register(hf_name, _transformers_attention(name))
        AttentionMaskInterface.register(hf_name, _written_out_mask)
    return tuple(TRANSFORMERS_NAMES)


#: flash-attention's arguments for packed sequences, which these backends
#: do not read (transformers builds the packed mask from position_ids).
VARLEN_ARGUMENTS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def _transformers_attention(name: str):
    """transformers' attention signature around backend ``name``."""

    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        sliding_window=None,
        is_causal=None,
        **kwargs,
    ):
        d_k = query.shape[-1]
        refused = {
            "dropout": dropout if module.training and dropout else None,
            "scaling": None if scaling in (None, d_k**-0.5) else scaling,
            "softcap": kwargs.get("softcap"),
            "s_aux": kwargs.get("s_aux"),  # learned sinks
            **{k: kwargs[k] for k in VARLEN_ARGUMENTS if k in kwargs},
        }
        refused = {k: v for k, v in refused.items() if v is not None}
        if refused:
            raise ValueError(
                f"the {name!r} backend does not implement {sorted(refused)}"
            )
        if kwargs.get("output_attentions", False):  # as transformers' sdpa
            warnings.warn(
                f"the {name!r} backend computes no attention weights: "
                "output_attentions=True returns None for them; use "
                "attn_implementation='eager' for the weights",
                stacklevel=2,
            )
        causal = getattr(module, "is_causal", True)
        causal = causal if is_causal is None else bool(is_causal)
        masking = _served(
            name,
            attention_mask,
            causal,
            sliding_window,
            query.shape[2],
            key.shape[2],
        )
        out = attend(name, query, key, value, masking)  # (B, H, T, d_k)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, d_k)

    return attention


def _written_out_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    **kwargs,
):
    """transformers' mask function: the mask its ``mask_function`` asks
    for, (B, 1, T_q, T_k) bool, True = may attend (transformers'
    ``sdpa_mask``, every element written out)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function=mask_function or causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        device=kwargs.get("device", "cpu"),
    )


def _served(name, mask, causal, window, t_q, t_k) -> Masking:
    """The :class:`Masking` that serves transformers' written-out ``mask``
    (B, 1, T_q, T_k): causal (bottom-right), the window and a first key
    per row when it is exactly that; else the mask itself, where backend
    ``name`` takes dense masks; else a ValueError naming what it holds."""
    if mask is None:
        return Masking(causal=causal, window=window)
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (t_q, t_k):
        raise ValueError(
            f"the {name!r} backend takes its own mask function's (B, 1, T_q,"
            f" T_k) = (., 1, {t_q}, {t_k}) mask, got shape "
            f"{tuple(mask.shape)}"
        )
    cached = getattr(mask, "_mha_masking", None)  # one answer per mask
    if cached is not None and cached[0] == (name, causal, window):
        return cached[1]
    mask = mask.to(torch.bool)
    seen = mask[:, 0].any(dim=1)  # (B, T_k): keys some query sees
    first = torch.where(seen.any(-1), seen.float().argmax(-1), t_k)  # (B,)
    padding = torch.arange(t_k, device=mask.device) >= first[:, None]
    simple = Masking(causal=causal, window=window, padding=padding)
    keep = simple.keep(t_q, t_k, mask.device)
    keep = torch.ones_like(mask) if keep is None else keep
    if torch.equal(keep.expand_as(mask), mask):
        masking = (
            simple
            if not bool(padding.all())
            else (Masking(causal=causal, window=window))
        )
    elif "dense" in get_backend(name).masks:
        masking = Masking(causal=False, dense=mask)
    else:
        raise ValueError(
            f"transformers asked the {name!r} backend for a mask that is not"
            " causal attention with a sliding window and left padding "
            "(chunked attention, packed sequences or another mask "
            f"function): {name!r} takes none; use mha_flex, or transformers'"
            " own sdpa or eager"
        )
    mask._mha_masking = ((name, causal, window), masking)
    return masking
