"""Attention variants as functions, in FlexAttention's signatures.

``torch.nn.attention.flex_attention`` takes two small functions instead of a
dense mask or bias (Dong et al. 2024):

* a **mask_mod** ``(b, h, q_idx, kv_idx) -> bool``: may query ``q_idx`` of
  batch row ``b``, head ``h`` attend to key ``kv_idx``;
* a **score_mod** ``(score, b, h, q_idx, kv_idx) -> score``: a new value for
  one scaled score ``q . k / sqrt(d_k)``, applied before the mask.

``create_block_mask`` evaluates a mask_mod at every (query, key) pair, once,
when the block mask is built, and records for each tile of 128 x 128 scores
whether it is empty (skipped), full (no mask needed) or partly masked (the
kernel evaluates the mask_mod again inside those tiles);
``torch.compile(flex_attention)`` turns the functions into one fused kernel
that visits only the tiles that are not empty.

Here: mask_mods :func:`causal`, :func:`sliding_window`, :func:`sink_window`,
:func:`document`, :func:`prefix_lm`; score_mods :func:`alibi`,
:func:`softcap`; :func:`flex`, which checks its inputs, builds the block mask
and calls FlexAttention (with learned sinks, gpt-oss's, as one more key
column: :func:`sink_column`); :func:`tile_states`, what a block mask skips;
:class:`RollingKVCache`, the ``window`` newest keys and values of a
sliding-window decoder. Each function has a dense NumPy twin in
:mod:`mha.reference` (``sliding_window_mask``, ``sink_window_mask``,
``document_mask``, ``prefix_lm_mask``, ``alibi_bias``, ``softcap``).

Every parameter (a window, document ids, slopes, a cap) is held as a tensor
that the function reads, not as a Python number baked into its code, so that
one compiled kernel serves every window or document layout: a new value is a
new input, not a recompilation.

``q_idx`` and ``kv_idx`` are *positions* in the sequence, as in transformers'
mask functions. FlexAttention passes indices 0 .. T_q - 1 and 0 .. T_k - 1;
with fewer queries than keys (a decoding step, a chunk of a prompt),
:func:`flex`, :func:`block_mask`, :func:`dense_mask` and
:func:`apply_score_mod` place the T_q queries at the last positions,
``q_offset = T_k - T_q`` (bottom-right, as chapters 12 and 13 align causal
attention), unless ``q_offset`` says where the first query stands.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from torch import Tensor
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    create_mask,
    flex_attention,
)

from . import reference
from ._validate import check_divisible, check_int, check_positive, check_scale
from .caches import RollingKVCache

__all__ = [
    "MaskMod",
    "ScoreMod",
    "causal",
    "sliding_window",
    "sink_window",
    "document",
    "prefix_lm",
    "alibi",
    "softcap",
    "dense_mask",
    "apply_score_mod",
    "block_mask",
    "flex",
    "sink_column",
    "flex_compiles",
    "tile_states",
    "RollingKVCache",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

# ---------------------------------------------------------------------------
# mask_mods: (b, h, q_idx, kv_idx) -> True where the query may attend


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The query at position i sees the keys at positions j <= i."""
    return q_idx >= kv_idx


def _held(function, device: torch.device):
    """Mark a mask_mod with the device of the tensors it reads (checked
    against the queries' by :func:`flex` and :func:`block_mask`)."""
    function.device = device
    return function


def _scalar(value: int, device) -> Tensor:
    """A number a mask_mod reads as a 0-d tensor on ``device``: a tensor,
    not a constant in the kernel's code, so that one compiled kernel serves
    every value; on the queries' device, as the compiled kernel (its
    backward too) reads it from there."""
    return torch.tensor(value, device=device)


def sliding_window(
    window: int, *, device: torch.device | str | None = None
) -> MaskMod:
    """Query i sees the ``window`` keys j with i - window < j <= i.

    ``device``: the queries' (default the CPU); the window is a tensor
    there."""
    window = _scalar(check_int("window", window), device)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return _held(sliding_window_mask, window.device)


def sink_window(
    window: int, sinks: int, *, device: torch.device | str | None = None
) -> MaskMod:
    """A sliding window plus the first ``sinks`` keys (attention sinks).

    Query i sees keys j <= i with i - window < j or j < sinks. ``device``:
    as :func:`sliding_window`'s.
    """
    window = _scalar(check_int("window", window), device)
    sinks = _scalar(check_int("sinks", sinks, minimum=0), device)

    def sink_window_mask(b, h, q_idx, kv_idx):
        near = q_idx - kv_idx < window
        return (q_idx >= kv_idx) & (near | (kv_idx < sinks))

    return _held(sink_window_mask, window.device)


def document(
    doc_ids: ArrayLike | Tensor, *, device: torch.device | str | None = None
) -> MaskMod:
    """Causal attention within each document of a packed row.

    ``doc_ids[t]`` (T ints) names the document of token t; query i sees key j
    when both lie in the same document and j <= i. The mask only fits rows of
    ``len(doc_ids)`` tokens (:func:`block_mask` and :func:`flex` check), and
    every row of a batch shares it. The ids live on ``device`` (default: the
    tensor's own, or the CPU), which must be the device of the queries.
    """
    ids = _check_doc_ids(doc_ids, device)  # (T,) int64

    def document_mask(b, h, q_idx, kv_idx):
        same = ids[q_idx] == ids[kv_idx]
        return same & (q_idx >= kv_idx)

    document_mask.num_tokens = len(ids)
    document_mask.device = ids.device
    return document_mask


def prefix_lm(
    prefix_len: int, *, device: torch.device | str | None = None
) -> MaskMod:
    """Every query sees the first ``prefix_len`` keys; causal after them.
    ``device``: as :func:`sliding_window`'s."""
    prefix = _scalar(check_int("prefix_len", prefix_len, minimum=0), device)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return _held(prefix_lm_mask, prefix.device)


# ---------------------------------------------------------------------------
# score_mods: (score, b, h, q_idx, kv_idx) -> the new score


def alibi(
    num_heads: int, *, device: torch.device | str | None = None
) -> ScoreMod:
    """ALiBi: head h adds slope_h * (j - i) (Press et al. 2022).

    The slopes are :func:`mha.reference.alibi_slopes`: 2^(-8h/H) for
    h = 1 .. H when H is a power of two. Needs exactly ``num_heads`` heads,
    and a causal mask: ALiBi was made for causal models, and a key ahead of
    the query (j > i, under :func:`prefix_lm` or no mask) would get a
    positive bias. The slopes live on ``device`` (default: the CPU), which
    must be the device of the queries.
    """
    slopes = torch.tensor(reference.alibi_slopes(num_heads), device=device)

    def alibi_bias(score, b, h, q_idx, kv_idx):
        bias = slopes[h] * (kv_idx - q_idx)  # 0 on the diagonal, < 0 behind
        return score + bias.to(score.dtype)

    alibi_bias.num_heads = num_heads
    alibi_bias.device = slopes.device
    return alibi_bias


def softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap): every score kept within [-cap, cap].

    (Inside (-cap, cap) in exact arithmetic; tanh rounds to 1 in floating
    point for scores many times the cap.)

    Gemma 2 caps its attention scores at 50 (Gemma Team 2024).
    """
    # a Python number, not a tensor: a tensor captured by a score_mod is a
    # buffer of the compiled kernel, and a CPU one in a GPU kernel's
    # backward is one Inductor fails to compile (torch 2.11)
    cap = float(check_positive("cap", cap))

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_score


# ---------------------------------------------------------------------------
# Masks from mask_mods, and attention through FlexAttention


def dense_mask(
    mask_mod: MaskMod,
    t_q: int,
    t_k: int | None = None,
    *,
    q_offset: int | None = None,
) -> Tensor:
    """The mask_mod at every (query, key): a boolean (T_q, T_k) tensor.

    What ``F.scaled_dot_product_attention`` needs as ``attn_mask``: T_q x T_k
    booleans in memory, read whole by every call. The first query stands at
    position ``q_offset`` (default T_k - T_q: the queries are the newest).
    Made on the device of the tensors the mask_mod reads (its ``device``,
    as the variants here mark it), the CPU for one that reads none.
    """
    t_q, t_k = _check_mask_lengths(mask_mod, t_q, t_k)
    device = getattr(mask_mod, "device", None) or "cpu"
    mask_mod = _queries_at(mask_mod, _offset(q_offset, t_q, t_k))
    return create_mask(mask_mod, 1, 1, t_q, t_k, device=device)[0, 0]


def apply_score_mod(
    score_mod: ScoreMod, scores: Tensor, *, q_offset: int | None = None
) -> Tensor:
    """The score_mod at every entry of scores (B, H, T_q, T_k), at once.

    The indices come as broadcasting tensors, b (B, 1, 1, 1), h (1, H, 1, 1),
    q_idx (1, 1, T_q, 1) and kv_idx (1, 1, 1, T_k): the scores FlexAttention
    would compute, written out (and differentiable, where its CPU kernel has
    no backward pass). The first query stands at position ``q_offset``
    (default T_k - T_q).
    """
    if not isinstance(scores, Tensor) or scores.dim() != 4:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else scores
        raise ValueError(
            f"scores must be a (B, H, T_q, T_k) tensor, got {got}"
        )
    B, H, t_q, t_k = scores.shape
    _check_score_heads(score_mod, "scores", scores)
    offset = _offset(q_offset, t_q, t_k)
    index = functools.partial(torch.arange, device=scores.device)
    return score_mod(
        scores,
        index(B).view(B, 1, 1, 1),
        index(H).view(1, H, 1, 1),
        (index(t_q) + offset).view(1, 1, t_q, 1),
        index(t_k).view(1, 1, 1, t_k),
    )


def block_mask(
    mask_mod: MaskMod,
    t_q: int,
    t_k: int | None = None,
    *,
    block_size: int = 128,
    device: torch.device | str = "cpu",
    q_offset: int | None = None,
) -> BlockMask:
    """FlexAttention's block mask of ``mask_mod``, one entry per tile.

    The tiles are ``block_size`` queries x ``block_size`` keys; one mask for
    every batch row and head (``B = H = None`` in ``create_block_mask``).
    The first query stands at position ``q_offset`` (default T_k - T_q: the
    queries are the newest). Build it once and pass it to :func:`flex` as
    ``block_mask`` for every call with the same mask and lengths: at long T
    the build can take as long as the attention itself.
    """
    t_q, t_k = _check_mask_lengths(mask_mod, t_q, t_k)
    _check_device(mask_mod, "mask_mod", torch.device(device))
    mask_mod = _queries_at(mask_mod, _offset(q_offset, t_q, t_k))
    block_size = check_int("block_size", block_size)
    return create_block_mask(
        mask_mod, None, None, t_q, t_k, device=device, BLOCK_SIZE=block_size
    )


_block_mask = block_mask  # flex's argument of the same name hides it


def flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    q_offset: int | None = None,
    block_size: int = 128,
    compiled: bool = True,
    sinks: Tensor | None = None,
) -> Tensor:
    """FlexAttention of q (B, H, T_q, d_k), k (B, H_kv, T_k, d_k) and v
    (B, H_kv, T_k, d_v).

    ``H_kv`` may divide ``H`` (query head h reads key/value head h // (H /
    H_kv)). The mask is ``mask_mod`` (its block mask built here, each call)
    or a ``block_mask`` built once with :func:`block_mask`; the scores are
    scaled by ``scale`` (default 1/sqrt(d_k)) before ``score_mod``. The
    first query stands at position ``q_offset`` (default T_k - T_q: a
    decoding step's query is the newest position). ``compiled=True`` runs
    ``torch.compile(flex_attention)``: one fused kernel that skips the
    empty tiles of the block mask, compiled on the first call for each kind
    of mask_mod and score_mod, dtype and shape.
    ``compiled=False`` runs FlexAttention's unfused form, which computes
    every score and then applies the same functions: the same result, for
    small checks that should not wait for a compiler. Returns (B, H, T_q,
    d_v). (torch keeps at most ``torch._dynamo.config.recompile_limit``
    compiled versions of one function, 8 by default; past them it runs
    FlexAttention unfused, with a warning.)

    ``sinks`` (H,): learned sink logits (gpt-oss), one more term in each
    row's softmax with no value: a key at position T_k whose value is zero
    and whose score is ``s_h`` (:func:`sink_column`), seen by every query.
    """
    _check_flex(q, k, v, score_mod)
    if sinks is not None:
        _check_sinks(sinks, q)
        if block_mask is not None:
            raise ValueError(
                "sinks add a key column: pass mask_mod, not a block_mask "
                "built for T_k keys"
            )
        t_k = k.shape[2]
        if mask_mod is not None:  # checked for the real keys
            _check_mask_lengths(mask_mod, q.shape[2], t_k)
            _check_device(mask_mod, "mask_mod", q.device)
        mask_mod, score_mod = sink_column(sinks, t_k, mask_mod, score_mod)
        zero = k.new_zeros(k.shape[:2] + (1,))  # (B, H_kv, 1)
        k = torch.cat((k, zero[..., None].expand(-1, -1, 1, k.shape[3])), 2)
        v = torch.cat((v, zero[..., None].expand(-1, -1, 1, v.shape[3])), 2)
        q_offset = _offset(q_offset, q.shape[2], t_k)  # the keys' own T_k
    t_q, t_k = q.shape[2], k.shape[2]
    scale = check_scale(scale, q.shape[3])
    offset = _offset(q_offset, t_q, t_k)
    if score_mod is not None:
        _check_device(score_mod, "score_mod", q.device)
        score_mod = _queries_at(score_mod, offset, score=True)
    mask = block_mask
    if mask_mod is not None:
        if block_mask is not None:
            raise ValueError(
                "pass mask_mod or block_mask, not both: a block mask holds "
                "its own mask_mod"
            )
        mask = _block_mask(
            mask_mod,
            t_q,
            t_k,
            block_size=block_size,
            device=q.device,
            q_offset=offset,
        )
    elif mask is not None:
        _check_block_mask(mask, t_q, t_k, q.device)
    if compiled and not flex_compiles(q.device):
        here = torch.backends.cpu.get_cpu_capability()
        held = os.environ.get("ATEN_CPU_CAPABILITY")
        raise RuntimeError(
            "flex(compiled=True): torch cannot compile FlexAttention on this "
            "CPU; it needs AVX2 and ATEN_CPU_CAPABILITY other than 'default' "
            f"(here: capability {here!r}, ATEN_CPU_CAPABILITY={held!r}); pass "
            "compiled=False for FlexAttention's unfused form, the same result "
            "with every score computed"
        )
    run = _compiled_flex_attention() if compiled else _unfused_flex_attention
    return run(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def sink_column(
    sinks: Tensor,
    num_keys: int,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
) -> tuple[MaskMod | None, ScoreMod]:
    """A mask_mod and a score_mod for ``num_keys`` keys and one more, the
    learned sinks' column at ``kv_idx = num_keys``.

    The column is seen by every query and scores ``sinks[h]`` whatever the
    query; its key and value are zeros (:func:`flex` appends them), so it
    takes its share of each row's softmax and adds nothing. The given
    functions decide for the real keys (they never see the column).
    """
    last = torch.tensor(num_keys, device=sinks.device)  # the sink's index

    def real(kv_idx: Tensor) -> Tensor:
        return torch.clamp(kv_idx, max=last - 1)  # the column: never passed

    def sink_score(score, b, h, q_idx, kv_idx):
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, real(kv_idx))
        return torch.where(kv_idx >= last, sinks[h].to(score.dtype), score)

    if mask_mod is None:
        return None, sink_score

    def sink_mask(b, h, q_idx, kv_idx):
        return (kv_idx >= last) | mask_mod(b, h, q_idx, real(kv_idx))

    return sink_mask, sink_score


def flex_compiles(device: torch.device | str = "cpu") -> bool:
    """Whether ``torch.compile(flex_attention)`` can compile for ``device``.

    Always on a GPU. On a CPU, torch's Inductor compiles FlexAttention only
    where the CPU has AVX2 (so on no ARM CPU), and not when
    ``ATEN_CPU_CAPABILITY=default`` holds torch to its portable kernels, nor
    on macOS: the rule of
    ``torch._inductor.kernel.flex.flex_cpu.check_cpu_supported``.
    """
    if torch.device(device).type != "cpu":
        return True
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return (
        torch.cpu._is_avx2_supported()
        and capability != "default"
        and sys.platform != "darwin"
    )


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    # dynamic=False: a kernel per shape. With dynamic shapes, Inductor's CPU
    # code for a document mask after a sliding window fails to compile.
    return torch.compile(flex_attention, dynamic=False)


def _unfused_flex_attention(*args, **kwargs) -> Tensor:
    with warnings.catch_warnings():  # chosen here: no kernel for a check
        warnings.filterwarnings(
            "ignore", message="flex_attention called without torch.compile"
        )
        return flex_attention(*args, **kwargs)


def tile_states(mask: BlockMask) -> NDArray[np.int8]:
    """What a kernel does with each tile: (query blocks, key blocks).

    0 = skipped (every score masked), 1 = computed whole (no score masked),
    2 = computed and masked in part: the codes of
    :func:`mha.flash.tile_schedule`. Batch row 0, head 0.
    """
    n_q = mask.kv_num_blocks.shape[-1]
    n_k = -(-mask.seq_lengths[1] // mask.BLOCK_SIZE[1])  # ceil
    states = np.zeros((n_q, n_k), dtype=np.int8)
    for code, counts, indices in (
        (2, mask.kv_num_blocks, mask.kv_indices),
        (1, mask.full_kv_num_blocks, mask.full_kv_indices),
    ):
        if counts is None:  # a block mask without a list of full tiles
            continue
        for row in range(n_q):
            count = int(counts[0, 0, row])
            states[row, indices[0, 0, row, :count].cpu().numpy()] = code
    return states


# ---------------------------------------------------------------------------
# Argument checks


def _check_mask_lengths(
    mask_mod: MaskMod, t_q: int, t_k: int | None
) -> tuple[int, int]:
    if not callable(mask_mod):
        raise TypeError(
            "mask_mod must be a function (b, h, q_idx, kv_idx) -> bool, "
            f"got {type(mask_mod).__name__}"
        )
    t_q = check_int("t_q", t_q)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    tokens = getattr(mask_mod, "num_tokens", None)  # document's length
    if tokens is not None and (t_q, t_k) != (tokens, tokens):
        raise ValueError(
            f"doc_ids has {tokens} tokens: the document mask needs "
            f"T_q = T_k = {tokens}, got T_q = {t_q}, T_k = {t_k}"
        )
    return t_q, t_k


def _check_flex(
    q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod | None
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(
                f"{name} must be a floating-point tensor, got {got}"
            )
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (B, H, T, d_k), got shape "
                f"{tuple(t.shape)}"
            )
    if (
        k.shape[:3] != v.shape[:3]
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            "k must be (B, H_kv, T_k, d_k) and v (B, H_kv, T_k, d_v), with "
            f"the B and d_k of q {tuple(q.shape)}, got k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            "q, k and v must have one dtype, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    check_divisible("num_heads of q", q.shape[1], "num_heads of k", k.shape[1])
    _check_score_heads(score_mod, "q", q)


def _check_sinks(sinks: object, q: Tensor) -> None:
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = (
            sinks.dtype if isinstance(sinks, Tensor) else type(sinks).__name__
        )
        raise TypeError(f"sinks must be a floating-point tensor, got {got}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"sinks must have shape (H,) = ({q.shape[1]},), one logit per "
            f"query head, got shape {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(
            f"sinks must be on q's device {q.device}, got {sinks.device}"
        )


def _check_score_heads(
    score_mod: ScoreMod | None, name: str, t: Tensor
) -> None:
    heads = getattr(score_mod, "num_heads", None)  # alibi's slopes
    if heads is not None and heads != t.shape[1]:
        raise ValueError(
            f"the alibi score_mod has slopes for {heads} heads, {name} has "
            f"{t.shape[1]} (shape {tuple(t.shape)})"
        )


def _offset(q_offset: int | None, t_q: int, t_k: int) -> int:
    """The position of the first query: T_k - T_q unless given."""
    if q_offset is None:
        return t_k - t_q
    # negative only where the default is: more queries than keys
    return check_int("q_offset", q_offset, minimum=min(0, t_k - t_q))


def _queries_at(function, offset: int, *, score: bool = False):
    """``function`` with each query index moved to its position, + offset."""
    if offset == 0:
        return function
    shift = torch.tensor(offset)  # a tensor, like the variants' parameters

    if score:

        def at_positions(score, b, h, q_idx, kv_idx):
            return function(score, b, h, q_idx + shift, kv_idx)
    else:

        def at_positions(b, h, q_idx, kv_idx):
            return function(b, h, q_idx + shift, kv_idx)

    return at_positions


def _check_device(function, name: str, device: torch.device) -> None:
    """A variant that reads a tensor (doc ids, slopes) needs it on device."""
    held = getattr(function, "device", None)
    if held is not None and held.type != device.type:
        raise ValueError(
            f"{name} reads a tensor on {held}, the queries are on {device}: "
            f"build it with device={str(device)!r}"
        )


def _check_block_mask(
    mask: BlockMask, t_q: int, t_k: int, device: torch.device
) -> None:
    if not isinstance(mask, BlockMask):
        raise TypeError(
            "block_mask must be a BlockMask (mha.variants.block_mask), got "
            f"{type(mask).__name__}"
        )
    if tuple(mask.seq_lengths) != (t_q, t_k):
        raise ValueError(
            f"block_mask was built for T_q, T_k = {tuple(mask.seq_lengths)}, "
            f"q and k have {t_q}, {t_k}"
        )
    if mask.kv_num_blocks.device.type != device.type:
        raise ValueError(
            f"block_mask lives on {mask.kv_num_blocks.device}, the queries "
            f"on {device}"
        )


def _check_doc_ids(
    doc_ids: ArrayLike | Tensor, device: torch.device | str | None
) -> Tensor:
    if isinstance(doc_ids, Tensor):
        ids = doc_ids.detach().to(device=device)
    else:
        ids = torch.as_tensor(np.asarray(doc_ids), device=device)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(
            "doc_ids must be a non-empty 1-D array (T,) of ints, got shape "
            f"{tuple(ids.shape)}"
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be ints, got dtype {ids.dtype}")
    return ids.long()
