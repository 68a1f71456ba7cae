"""Attention backends: one signature, registered by name, each with its masks.

A backend computes softmax(q k^T / sqrt(d_k)) v for q (B, H, T_q, d_k) and
k, v (B, H_kv, T_k, d_k), ``H_kv`` dividing ``H`` (query head h reads
key/value head h // (H / H_kv)), under a :class:`Masking`: what the call
must hide, written once for every backend. The model (:mod:`mha.model`)
never knows which backend runs (transformers' ``AttentionInterface`` works
so). Unlike a registration that forgets the mask (transformers PR #45811),
every backend here declares the kinds of mask it takes, and
:func:`attend` refuses, by name, a call that needs another: a backend never
runs without a mask it was given.

The kinds (:data:`MASK_KINDS`): ``causal`` (query i sees keys up to its own
position), ``window`` (and only the ``window`` newest of them),
``padding`` (a (B, T_k) key-padding mask: False at a pad; or one first key
per row, a left-padded batch), ``dense`` (any boolean mask broadcastable to
(B, H, T_q, T_k)), ``offset`` (the queries' position and the keys written
are tensors: a compiled decode step over a whole preallocated cache) and
``sinks`` (a learned logit per head, one more term in each row's softmax,
gpt-oss's). A mask that hides nothing is no kind: a single newest query
needs no causal mask, a window wider than every distance no window.

One road: an attention layer makes one call, :func:`attend` with its
backend's name, q, k, v, the masking and its cache (or none). The backend
decides where the keys come from: a paged cache is only written and its
blocks read in place by a backend with a paged kernel, gathered for any
other; a preallocated cache is handed whole to a backend that wants one
shape every step; a serving step's pools split the step by request
(:mod:`mha.serving.layer`).

Backends: ``eager`` (the written-out softmax, :func:`grouped_attention`, which
:mod:`mha.decoding` re-exports), ``sdpa`` (``F.scaled_dot_product_attention``),
``tiled`` (:func:`mha.flash_attention_torch`), ``triton`` (the Triton
kernels, :mod:`mha.kernels`; split-KV for a single query) and ``flex``
(FlexAttention with chapter 15's mask functions, :mod:`mha.variants`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._validate import check_same, check_tensor, check_window
from .caches import Cache, KVCache, PagedKVCache, cached_so_far

__all__ = [
    "MASK_KINDS",
    "Masking",
    "Backend",
    "BACKENDS",
    "register",
    "attention_backends",
    "get_backend",
    "attend",
    "check_qkv",
    "grouped_attention",
]

MASK_KINDS = ("causal", "window", "padding", "dense", "offset", "sinks")


@dataclasses.dataclass(frozen=True)
class Masking:
    """What one attention call hides, in the keys' index (0 .. T_k - 1).

    The queries are the newest: query i stands at key index ``q_offset +
    i`` (default ``T_k - T_q``, aligned bottom-right). ``causal``: it sees
    keys up to its own index; ``window``: only keys j with ``i' - j <
    window`` (i' its index; Mistral's sliding window); ``padding`` (B, T_k)
    bool, False at a pad key; ``key_start`` (B,) int32, each row's first
    key, where the padding is a left-padded batch's (:meth:`padded`, once
    per forward: the kernels take it so); ``dense`` bool broadcastable to
    (B, H, T_q, T_k or more), True = may attend; ``key_end``: keys from this
    index on are not written yet (a compiled step reads a whole preallocated
    cache); ``sinks`` (H,): a learned logit per head, a key of its own with
    a zero value.
    """

    causal: bool = True
    window: int | None = None
    q_offset: int | Tensor | None = None
    key_end: int | Tensor | None = None
    padding: Tensor | None = None
    dense: Tensor | None = None
    key_start: Tensor | None = None
    sinks: Tensor | None = None

    def __post_init__(self) -> None:
        check_window(self.window)  # None, or a positive int

    @classmethod
    def padded(cls, padding: Tensor | None, **fields) -> Masking:
        """The masking of a batch with ``padding`` (B, T_k), 1 or True at a
        token: None where every key is a token; with ``key_start`` too where
        it is left-padded (zeros, then ones). Reads the mask on the host
        once, for every layer of a forward."""
        if padding is None:
            return cls(**fields)
        padding = padding.to(torch.bool)
        if torch.compiler.is_compiling():
            return cls(padding=padding, **fields)
        ones = padding.to(torch.int32)  # (B, T_k)
        left = (ones[:, 1:] >= ones[:, :-1]).all()  # zeros, then ones
        kept = ones.sum(dim=1)  # (B,) tokens per row
        left, every = (
            bool(x)
            for x in torch.stack(
                (left, (kept == padding.shape[1]).all())
            ).tolist()
        )
        if every:
            return cls(**fields)
        key_start = (padding.shape[1] - kept).to(torch.int32) if left else None
        return cls(padding=padding, key_start=key_start, **fields)

    def offset(self, t_q: int, t_k: int) -> int | Tensor:
        """The key index of the first query."""
        return t_k - t_q if self.q_offset is None else self.q_offset

    def kinds(self, t_q: int, t_k: int) -> set[str]:
        """The kinds of mask this call needs (see the module)."""
        offset = self.offset(t_q, t_k)
        kinds = set()
        if isinstance(offset, Tensor) or isinstance(self.key_end, Tensor):
            kinds.add("offset")
        elif self.key_end is not None and self.key_end < t_k:
            kinds.add("offset")
        newest = not isinstance(offset, Tensor) and offset + t_q == t_k
        if self.causal and not (newest and t_q == 1):
            kinds.add("causal")
        span = t_k if isinstance(offset, Tensor) else offset + t_q
        if self.window is not None and self.window < span:
            kinds.add("window")
        if self.padding is not None or self.key_start is not None:
            kinds.add("padding")
        if self.dense is not None:
            kinds.add("dense")
        if self.sinks is not None:
            kinds.add("sinks")
        return kinds

    def keep(self, t_q: int, t_k: int, device: torch.device) -> Tensor | None:
        """The mask written out: bool (B or 1, 1 or H, T_q, T_k), True = may
        attend; None where nothing is hidden."""
        kinds = self.kinds(t_q, t_k)
        if not kinds:
            return None
        key = torch.arange(t_k, device=device)  # (T_k,)
        query = self.offset(t_q, t_k) + torch.arange(t_q, device=device)
        keep = torch.ones(t_q, t_k, dtype=torch.bool, device=device)
        if "causal" in kinds:
            keep = keep & (key[None, :] <= query[:, None])  # (T_q, T_k)
        if "window" in kinds:
            keep = keep & (query[:, None] - key[None, :] < self.window)
        if self.key_end is not None:
            keep = keep & (key < self.key_end)[None, :]
        keep = keep[None, None]  # (1, 1, T_q, T_k)
        if self.padding is not None:
            keep = keep & self.padding[:, None, None, :t_k]  # (B, 1, ., T_k)
        elif self.key_start is not None:  # (B, 1, 1, T_k)
            keep = keep & (key >= self.key_start[:, None])[:, None, None]
        if self.dense is not None:
            keep = keep & self.dense[..., :t_k]
        return keep

    def first_keys(self, t_k: int) -> Tensor | None:
        """(B,) int32, each row's first key, for a kernel that takes left
        padding so; None without padding."""
        if self.key_start is not None or self.padding is None:
            return self.key_start
        from .functional import key_start_from_attention_mask

        return key_start_from_attention_mask(self.padding[:, :t_k])


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered backend: its function and the kinds of mask it takes."""

    name: str
    function: Callable[[Tensor, Tensor, Tensor, Masking], Tensor]
    masks: frozenset[str]
    summary: str
    #: ``paged(q, k_pool, v_pool, block_table, seq_lens, *, key_start,
    #: window, max_seq_len=None) -> out``: attention over a paged cache
    #: read where its blocks lie (:meth:`mha.PagedKVCache.pages`), or None
    #: (the blocks gathered); ``max_seq_len`` given: nothing read back
    paged: Callable[..., Tensor] | None = None
    #: True: handed a preallocated cache whole (:class:`mha.KVCache`'s
    #: max_len keys, the unwritten ones after the queries, hidden by the
    #: causal mask), so that a kernel compiled for one shape serves every
    #: decoding step
    whole_cache: bool = False
    #: True: drops attention weights in training (``dropout_p``)
    dropout: bool = False
    #: ``check(q, k, v)``: raises if the backend cannot take such inputs at
    #: all (dtype, head size, device), called before a cache stores k and v
    check: Callable[[Tensor, Tensor, Tensor], None] | None = None


#: name -> :class:`Backend`, in the order of registration.
BACKENDS: dict[str, Backend] = {}


def register(
    name: str,
    *,
    masks: tuple[str, ...],
    summary: str,
    paged: Callable[..., Tensor] | None = None,
    whole_cache: bool = False,
    dropout: bool = False,
    check: Callable[[Tensor, Tensor, Tensor], None] | None = None,
):
    """Decorator: ``function(q, k, v, masking) -> out`` as backend ``name``,
    taking the kinds of mask ``masks`` (of :data:`MASK_KINDS`); ``paged``:
    its kernel for a paged cache, if it has one; ``whole_cache``: see
    :class:`Backend`; ``dropout``: ``function`` takes ``dropout_p``;
    ``check``: see :class:`Backend`."""
    unknown = set(masks) - set(MASK_KINDS)
    if unknown:
        raise ValueError(f"masks must be among {MASK_KINDS}, got {unknown}")

    def add(function):
        BACKENDS[name] = Backend(
            name,
            function,
            frozenset(masks),
            summary,
            paged,
            whole_cache,
            dropout,
            check,
        )
        return function

    return add


def attention_backends() -> tuple[str, ...]:
    """The names of the registered backends."""
    return tuple(BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ValueError naming the others."""
    if name not in BACKENDS:
        raise ValueError(
            f"attn_backend must be one of {', '.join(map(repr, BACKENDS))}, "
            f"got {name!r}"
        )
    return BACKENDS[name]


def attend(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking = Masking(),  # noqa: B008 (frozen: shared safely)
    cache: Cache | None = None,
    *,
    dropout_p: float = 0.0,
) -> Tensor:
    """Attention by backend ``name``: (B, H, T_q, d_k), after one check of
    q, k, v (:func:`check_qkv`) and of the mask kinds the backend takes.

    With a ``cache``, k and v (B, H_kv, T_q, d_k) are the new keys and
    values: the cache stores them, and the backend reads every key, where
    it lies or gathered (see the module). ``dropout_p``: attention weights
    dropped, by a backend that can (``eager``, ``sdpa``)."""
    backend = get_backend(name)
    if cache is not None:  # what can be checked before the cache stores k, v
        check_qkv(q, k, v)
        kinds = masking.kinds(q.shape[2], k.shape[2])
        _check_kinds(backend, kinds & {"padding", "dense", "sinks"})
        if backend.check is not None:
            backend.check(q, k, v)
        served = read_cache(backend, q, k, v, masking, cache)
        if isinstance(served, Tensor):  # read in place
            return served
        k, v, masking = served
    check_qkv(q, k, v)
    _check_kinds(backend, masking.kinds(q.shape[2], k.shape[2]))
    if dropout_p:
        if not backend.dropout:
            raise ValueError(
                f"the {name!r} attention backend drops no attention weights,"
                f" got dropout_p = {dropout_p} (call model.eval(), or choose"
                " 'eager' or 'sdpa')"
            )
        return backend.function(q, k, v, masking, dropout_p=dropout_p)
    return backend.function(q, k, v, masking)


def _check_kinds(backend: Backend, kinds: set[str]) -> None:
    """ValueError if the call needs a kind of mask the backend lacks."""
    needed = kinds - backend.masks
    if needed:
        raise ValueError(
            f"the {backend.name!r} attention backend takes no "
            f"{sorted(needed)} mask (it takes "
            f"{sorted(backend.masks) or 'none'}): choose another backend, "
            f"of {attention_backends()}"
        )


def read_cache(backend: Backend, q, k, v, masking: Masking, cache):
    """The new k, v through ``cache`` (:func:`attend`'s road): the
    attention itself, where the backend reads the cache in place; else
    every key and value, and the masking that reads them."""
    serve = getattr(cache, "serve", None)
    if serve is not None:  # a serving step: its plan splits it by request
        return serve(backend, q, k, v, masking)
    compiling = torch.compiler.is_compiling()
    in_place = masking.dense is None and masking.sinks is None
    t_q = q.shape[2]
    if (
        in_place
        and backend.paged is not None
        and isinstance(cache, PagedKVCache)
        and not compiling
    ):  # only the new keys written: the kernel reads the pool
        cache.write(k, v)
        return backend.paged(  # the cache's own table: no read, no check
            q,
            *cache.pages(),
            key_start=masking.first_keys(len(cache)),
            window=masking.window,
            max_seq_len=len(cache),
        )
    start = cached_so_far(cache)  # the first new query's index
    k, v = cache.update(k, v)  # (B, H_kv, T_k, d_k)
    if compiling:  # every slot of the cache; those after the new, hidden
        end = start + t_q
        return k, v, dataclasses.replace(masking, q_offset=start, key_end=end)
    if len(cache) < cache.seen:  # a cache that forgets keeps the window
        return k, v, dataclasses.replace(masking, window=None)
    if in_place and backend.whole_cache and isinstance(cache, KVCache):
        padding = masking.padding  # the slots not written: causal hides
        if padding is not None:
            padding = F.pad(
                padding, (0, cache.max_len - padding.shape[1]), value=True
            )
        masking = dataclasses.replace(masking, q_offset=start, padding=padding)
        return cache.keys, cache.values, masking  # (B, H_kv, max_len, d_k)
    return k, v, masking


def check_qkv(q: object, k: object, v: object) -> None:
    """The one check of attention's inputs, for every backend: q (B, H,
    T_q, d_k), k and v (B, H_kv, T_k, d_k), H_kv dividing H; one floating
    dtype, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, shape="(B, H, T, d_k)")
    check_same("q, k and v", (q, k, v))
    if (
        k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
        or q.shape[1] % k.shape[1]
    ):
        raise ValueError(
            "q must have shape (B, H, T_q, d_k) and k, v (B, H_kv, T_k, "
            f"d_k) with H_kv dividing H, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )


# ---------------------------------------------------------------------------
# The backends


def grouped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None = None,
    *,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax(q k^T / sqrt(d_k)) v, each key/value head serving G query heads.

    q (B, H, T_q, d_k); k, v (B, H_kv, T_k, d_k); ``keep`` a boolean mask
    broadcastable to (B, H, T_q, T_k), ``True`` where a query may attend.
    Query head ``h`` reads key/value head ``h // G`` (``transformers``'
    ``repeat_kv`` order), without copying the keys and values G times.
    A query with no key to attend gets zeros. Returns (B, H, T_q, d_k).
    """
    H_kv, G = k.shape[1], q.shape[1] // k.shape[1]
    q = q.unflatten(1, (H_kv, G))  # (B, H_kv, G, T_q, d_k)
    scores = torch.einsum("bkgqd,bksd->bkgqs", q, k) / math.sqrt(q.shape[-1])
    if keep is not None:  # scores: (B, H_kv, G, T_q, T_k)
        scores = scores.masked_fill(~_grouped(keep, H_kv, G), -math.inf)
    weights = torch.softmax(scores, dim=-1)  # (B, H_kv, G, T_q, T_k)
    if keep is not None:  # a row without keys is 0/0: make it zeros
        weights = weights.nan_to_num(0.0)
    weights = F.dropout(weights, p=dropout_p)
    heads = torch.einsum("bkgqs,bksd->bkgqd", weights, v)
    return heads.flatten(1, 2)  # (B, H, T_q, d_k)


def _grouped(keep: Tensor, num_kv_heads: int, group: int) -> Tensor:
    """A mask broadcastable to (B, H, T_q, T_k) -> (B or 1, H_kv, G, ...)."""
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    if keep.shape[1] == 1:  # the same for every head
        return keep.unsqueeze(2)  # (B or 1, 1, 1, T_q or 1, T_k)
    return keep.unflatten(1, (num_kv_heads, group))  # (., H_kv, G, ., T_k)


@register(
    "eager",
    masks=MASK_KINDS[:5],
    summary="softmax(QK^T/sqrt(d))V",
    dropout=True,
)
def eager(
    q: Tensor, k: Tensor, v: Tensor, masking: Masking, dropout_p=0.0
) -> Tensor:
    """The book's written-out attention; a row with no key gets zeros."""
    keep = masking.keep(q.shape[2], k.shape[2], q.device)
    return grouped_attention(q, k, v, keep, dropout_p=dropout_p)


@register(
    "sdpa",
    masks=MASK_KINDS,
    summary="F.scaled_dot_product_attention",
    dropout=True,
)
def sdpa(
    q: Tensor, k: Tensor, v: Tensor, masking: Masking, dropout_p=0.0
) -> Tensor:
    """torch's fused attention; a row with no key gets zeros (SDPA alone
    would give NaN, which a pad's keys would carry into later layers)."""
    t_q, t_k = q.shape[2], k.shape[2]
    kinds = masking.kinds(t_q, t_k)
    if kinds == {"causal"} and t_q == t_k:  # SDPA's own (top-left) flag
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=True
        )
    keep = masking.keep(t_q, t_k, q.device)
    if "sinks" in kinds:
        return _with_sinks(q, k, v, keep, masking.sinks, dropout_p)
    seen = None
    if kinds & {"padding", "dense", "offset"}:  # rows may have no key
        seen = keep.any(dim=-1, keepdim=True)  # (B or 1, ., T_q, 1)
        keep = keep | ~seen
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, dropout_p=dropout_p, enable_gqa=True
    )
    return out if seen is None else out * seen


def _with_sinks(q, k, v, keep, sinks: Tensor, dropout_p: float) -> Tensor:
    """Attention with a sink per head: a last key of zeros whose score is
    the head's logit, and whose value is zeros (gpt-oss's ``sinks``), as a
    float mask (B or 1, H, T_q, T_k + 1): 0 or -inf, the sink's logit in
    the last column."""
    t_q, t_k = q.shape[2], k.shape[2]
    if keep is None:
        keep = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device)
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~keep, -math.inf)  # (B or 1, H or 1, T, T_k)
    bias = bias.expand(keep.shape[0], q.shape[1], t_q, t_k)
    sink = sinks.to(q.dtype).view(1, -1, 1, 1)  # (1, H, 1, 1)
    bias = torch.cat((bias, sink.expand(bias.shape[0], -1, t_q, 1)), -1)
    k, v = (F.pad(t, (0, 0, 0, 1)) for t in (k, v))  # the sink's: zeros
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout_p, enable_gqa=True
    )


@register(
    "tiled",
    masks=("causal", "window", "padding"),
    summary="mha.flash_attention_torch",
)
def tiled(q: Tensor, k: Tensor, v: Tensor, masking: Masking) -> Tensor:
    """The tiled online softmax in torch (chapter 13)."""
    from .flash import flash_attention_torch

    def run(q, k, v, causal, key_start, window):
        out, _ = flash_attention_torch(
            q, k, v, causal=causal, key_start=key_start, window=window
        )
        return out

    return _sliced(run, q, k, v, masking)


def _triton_paged(*pools, **masks) -> Tensor:
    """The paged kernel (chapter 17): keys and values read in the pool,
    :func:`mha.kernels.triton_paged_attention`."""
    from . import kernels

    return kernels.triton_paged_attention(*pools, **masks)


def _triton_check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """What the Triton kernels take (dtype, head size, where they run)."""
    from .kernels import attention

    attention.check_inputs(q, k, v)


@register(
    "triton",
    masks=("causal", "window", "padding"),
    summary="mha.kernels (Triton)",
    paged=_triton_paged,
    check=_triton_check,
)
def triton(q: Tensor, k: Tensor, v: Tensor, masking: Masking) -> Tensor:
    """The Triton kernels (chapter 13): the tiled forward, the split-KV
    kernel for a single query; Triton's interpreter on CPU tensors (there
    with two splits: the interpreter runs one program after the other, and
    two already merge partial results)."""
    from . import kernels

    def run(q, k, v, causal, key_start, window):
        if q.shape[2] == 1 and not _needs_grad(q, k, v):  # a decoding step:
            # the keys split across programs (forward only)
            return kernels.triton_split_kv_attention(
                q,
                k,
                v,
                causal=causal,
                key_start=key_start,
                window=window,
                num_splits=2 if kernels.INTERPRETED else None,
            )
        return kernels.triton_attention(
            q, k, v, causal=causal, key_start=key_start, window=window
        )

    return _sliced(run, q, k, v, masking)


def _needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd will want the gradient of a result of these."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _sliced(run, q: Tensor, k: Tensor, v: Tensor, masking: Masking):
    """A kernel that takes bottom-right causal attention, a key start per
    row (left padding) and a sliding window, whose tiles before a query
    tile's window it skips. ``run(q, k, v, causal, key_start, window)``."""
    t_q, t_k = q.shape[2], k.shape[2]
    kinds = masking.kinds(t_q, t_k)
    offset = masking.offset(t_q, t_k)
    if offset != t_k - t_q:
        raise ValueError(
            "q_offset must be T_k - T_q (the queries are the newest) for a "
            f"tiled kernel, got {offset} with T_q, T_k = {t_q}, {t_k}"
        )
    key_start = masking.first_keys(t_k)  # (B,) int32, or None
    if key_start is not None:
        key_start = key_start.to(q.device)
    window = masking.window if "window" in kinds else None
    return run(q, k, v, "causal" in kinds, key_start, window)


@register(
    "flex",
    masks=MASK_KINDS[:4],
    summary="FlexAttention, mask_mods",
    whole_cache=True,
)
def flex(q: Tensor, k: Tensor, v: Tensor, masking: Masking) -> Tensor:
    """FlexAttention under one mask_mod built from the masking, with
    chapter 15's functions (:func:`mha.variants.causal`,
    :func:`mha.variants.sliding_window`): compiled on a GPU, its unfused
    form on the CPU (the same functions on every score).

    Compiled, one kernel serves one shape: a static cache is read whole
    (``whole_cache``), and other keys (a paged cache's, gathered) are padded
    to a power of two, at least 128, the pads hidden, so that decoding
    compiles once per doubling of the context, not once per token."""
    from torch.nn.attention.flex_attention import create_block_mask

    from . import variants

    t_q, t_k = q.shape[2], k.shape[2]
    kinds = masking.kinds(t_q, t_k)
    offset = torch.tensor(masking.offset(t_q, t_k), device=q.device)
    parts = []
    padded = max(128, 1 << (t_k - 1).bit_length())
    compiled = _flex_compiled(q)
    if compiled and masking.q_offset is None and masking.dense is None:
        # one layout and one mask_mod whether or not a pad was needed
        k, v = (F.pad(x, (0, 0, 0, padded - t_k)).contiguous() for x in (k, v))
        real = torch.tensor(t_k, device=q.device)  # keys from here: pads
        parts.append(lambda b, h, q_idx, kv_idx: kv_idx < real)
        if masking.padding is not None:
            masking = dataclasses.replace(
                masking,
                padding=F.pad(masking.padding[:, :t_k], (0, padded - t_k)),
            )
        t_k = padded
    if "window" in kinds:
        parts.append(variants.sliding_window(masking.window, device=q.device))
    elif "causal" in kinds:
        parts.append(variants.causal)
    if masking.padding is not None:
        padding = masking.padding[:, :t_k].to(q.device)
        parts.append(lambda b, h, q_idx, kv_idx: padding[b, kv_idx])
    elif masking.key_start is not None:
        first = masking.key_start.to(q.device)
        parts.append(lambda b, h, q_idx, kv_idx: kv_idx >= first[b])
    if masking.dense is not None:
        dense = masking.dense[..., :t_k]
        dense = dense.expand(q.shape[0], q.shape[1], t_q, t_k)
        parts.append(
            lambda b, h, q_idx, kv_idx: dense[b, h, q_idx - offset, kv_idx]
        )

    def mask_mod(b, h, q_idx, kv_idx):
        at = q_idx + offset  # the query's key index
        keep = kv_idx >= 0
        for part in parts:
            keep = keep & part(b, h, at, kv_idx)
        return keep

    per_row = "padding" in kinds or masking.dense is not None
    heads = q.shape[1] if masking.dense is not None else None
    mask = create_block_mask(
        mask_mod,
        q.shape[0] if per_row else None,
        heads,
        t_q,
        t_k,
        device=q.device,
        BLOCK_SIZE=128,
    )
    return variants.flex(
        q, k, v, block_mask=mask, q_offset=0, compiled=compiled
    )


def _flex_compiled(q: Tensor) -> bool:
    """The flex backend compiles FlexAttention on a GPU; on a CPU it runs
    the unfused form (no compiler to wait for)."""
    return q.is_cuda
