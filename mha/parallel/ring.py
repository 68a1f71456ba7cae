"""Ring attention: a sequence split over processes, its keys passed around.

Each of P processes holds a part of one long sequence: its queries, keys and
values, (B, H, T_r, d) and (B, H_kv, T_r, d), T_r about T / P. Every query
needs every key, so the keys and values travel around a ring: at each of P
steps a process attends with its own queries to the keys and values in
hand, and passes them on to process rank + 1 while it receives rank - 1's
(Liu et al. 2023, Ring Attention). The transfer is started *before* the
computation on the part in hand, so the two overlap. Each step gives a
partial output and the logsumexp of the scores it saw; partials merge by
the online softmax's rule (:func:`merge_parts`, the two-part case of
:func:`mha.flash.merge_partials`). No process ever holds all the keys, nor a
(T, T) matrix of scores.

The backward pass runs the ring again. The keys and values travel as
before, and with them the gradients dK and dV of the part in hand, each
process adding its queries' share; after P hops an accumulator is back
with the process that owns those keys. The weights are recomputed from the
saved logsumexp, as FlashAttention's backward pass does.

Causal attention makes the work uneven. Cut into P consecutive parts
(``layout="contiguous"``), the last process's queries see every key and the
first's only their own. ``layout="zigzag"`` cuts the sequence into 2P
chunks and gives process r chunks r and 2P - 1 - r, an early one and a late
one (zigzag ring attention; the split of Llama 3's context parallelism and
of PyTorch's head-tail load balancer): every process then has the same
work. A length that P (2P) does not divide is cut as :func:`torch.tensor_split`
cuts it, the first chunks one position longer. The causal mask compares
global positions (:func:`sequence_positions`), never local indices.

* :func:`ring_attention` (autograd: :class:`RingAttention`), which fills in
  a :class:`RingStats`: bytes sent, (query, key) pairs computed;
* :func:`chunk_ranges`, :func:`sequence_positions`, :func:`shard_sequence`,
  :func:`unshard_sequence`: which positions each process holds;
* :func:`pairs_per_rank`, :func:`imbalance`, :func:`ring_bytes`: the work
  and the traffic, by formula;
* :func:`dense_attention`: the whole sequence on one process, the
  reference; :func:`torch_context_parallel`: PyTorch's own ring.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._validate import (
    check_choice,
    check_int,
    check_same,
    check_scale,
    check_tensor,
)
from ..flash import group_queries, ungroup_heads

__all__ = [
    "LAYOUTS",
    "RingStats",
    "RingAttention",
    "ring_attention",
    "merge_parts",
    "chunk_ranges",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
    "pairs_per_rank",
    "imbalance",
    "ring_bytes",
    "dense_attention",
    "torch_context_parallel",
]

#: Which positions each process holds: consecutive parts, or two chunks.
LAYOUTS = ("contiguous", "zigzag")
#: The dtypes the ring takes (the processes exchange them as an index).
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------
# Who holds which positions


def chunk_ranges(
    seq_len: int, world_size: int, rank: int, layout: str = "contiguous"
) -> tuple[range, ...]:
    """The global positions process ``rank`` holds, runs in local order.

    ``contiguous``: one run, part ``rank`` of P. ``zigzag``: chunks ``rank``
    and ``2P - 1 - rank`` of 2P (an empty chunk is left out). Parts and
    chunks are :func:`torch.tensor_split`'s: the first ``T mod n`` are one
    position longer.
    """
    seq_len, world_size = _check_split(seq_len, world_size, layout)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(
            f"rank must be below world_size ({world_size}), got {rank}"
        )
    if layout == "contiguous":
        pieces, owned = world_size, (rank,)
    else:
        pieces, owned = 2 * world_size, (rank, 2 * world_size - 1 - rank)
    size, longer = divmod(seq_len, pieces)
    start = [i * size + min(i, longer) for i in range(pieces + 1)]
    runs = (range(start[i], start[i + 1]) for i in owned)
    return tuple(run for run in runs if len(run))


def sequence_positions(
    seq_len: int,
    world_size: int,
    rank: int,
    layout: str = "contiguous",
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """(T_r,) int64: the global position of each of ``rank``'s tokens.

    What rotary embeddings and the causal mask need on that process.
    """
    runs = chunk_ranges(seq_len, world_size, rank, layout)
    return torch.cat(
        [torch.arange(r.start, r.stop, device=device) for r in runs]
    )


def shard_sequence(
    x: Tensor,
    rank: int,
    world_size: int,
    layout: str = "contiguous",
    *,
    dim: int = -2,
) -> Tensor:
    """Process ``rank``'s positions of ``x`` along ``dim`` (a copy).

    (B, H, T, d) -> (B, H, T_r, d) with the default ``dim=-2``.
    """
    check_tensor("x", x, kind=None, min_ndim=1, shape="(..., T, ...)")
    positions = sequence_positions(
        x.shape[dim], world_size, rank, layout, device=x.device
    )
    return x.index_select(dim, positions)


def unshard_sequence(
    parts: Sequence[Tensor], layout: str = "contiguous", *, dim: int = -2
) -> Tensor:
    """The whole sequence from every process's part (in rank order).

    The inverse of :func:`shard_sequence`: ``unshard_sequence([shard_sequence
    (x, r, P, layout) for r in range(P)], layout)`` is ``x``.
    """
    if not parts:
        raise ValueError("parts must hold one tensor per process, got none")
    world_size = len(parts)
    seq_len = sum(part.shape[dim] for part in parts)
    positions = []
    for rank, part in enumerate(parts):
        own = sequence_positions(seq_len, world_size, rank, layout)
        if part.shape[dim] != len(own):
            raise ValueError(
                f"parts[{rank}] must hold {len(own)} positions along dim "
                f"{dim} (layout {layout!r}, T = {seq_len}, {world_size} "
                f"processes), got shape {tuple(part.shape)}"
            )
        positions.append(own)
    order = torch.argsort(torch.cat(positions)).to(parts[0].device)
    return torch.cat(list(parts), dim).index_select(dim, order)


# ---------------------------------------------------------------------------
# The work and the traffic, by formula


def pairs_per_rank(
    seq_len: int,
    world_size: int,
    layout: str = "contiguous",
    *,
    causal: bool = True,
) -> list[int]:
    """(query, key) pairs each process's queries attend to (not masked).

    Causal: the query at position p sees p + 1 keys, so a run of positions
    a .. b - 1 sees ``b (b + 1) / 2 - a (a + 1) / 2`` pairs. Per batch row
    and head.
    """
    work = []
    for rank in range(world_size):
        runs = chunk_ranges(seq_len, world_size, rank, layout)
        if causal:
            pairs = (
                sum(
                    r.stop * (r.stop + 1) - r.start * (r.start + 1)
                    for r in runs
                )
                // 2
            )
        else:
            pairs = sum(len(r) for r in runs) * seq_len
        work.append(pairs)
    return work


def imbalance(work: Sequence[float]) -> float:
    """The busiest process's work over the mean: 1 when balanced.

    The ring waits for its slowest process at every step.
    """
    return max(work) * len(work) / sum(work)


def ring_bytes(
    batch: int,
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    world_size: int,
    *,
    bytes_per_element: int = 2,
    backward: bool = False,
    grad_bytes_per_element: int = 4,
) -> float:
    """Bytes one process sends per pass, averaged over the processes.

    Forward: its keys and values make P - 1 hops of a T / P part, ``2 (P -
    1) / P * B T H_kv d * bytes_per_element``. Backward: the same again,
    plus the gradients dK and dV, accumulated in ``grad_bytes_per_element``
    (float32, or float64 for float64), which make P hops (the last one home):
    ``+ 2 B T H_kv d * grad_bytes_per_element``. Exact for every process
    when each holds T / P positions; otherwise the mean.
    """
    sizes = {
        "batch": batch,
        "seq_len": seq_len,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "world_size": world_size,
        "bytes_per_element": bytes_per_element,
        "grad_bytes_per_element": grad_bytes_per_element,
    }
    for name, value in sizes.items():
        check_int(name, value)
    elements = 2 * batch * seq_len * num_kv_heads * head_dim  # K and V
    sent = elements * (world_size - 1) / world_size * bytes_per_element
    if backward:
        sent += elements * grad_bytes_per_element
    return sent


# ---------------------------------------------------------------------------
# The merge and the reference


def merge_parts(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """The softmax over two sets of keys from the softmax over each.

    ``out`` (..., T_q, d_v) and logsumexp ``lse`` (..., T_q) of each part;
    each part weighs ``exp(lse_part - lse)``, ``lse = log(exp(lse_a) +
    exp(lse_b))``: :func:`mha.flash.merge_partials` for two parts, in torch.
    A part that saw no key (``lse = -inf``) weighs nothing.
    """
    top = torch.maximum(lse_a, lse_b)  # (..., T_q)
    top = top.masked_fill(top == -math.inf, 0.0)  # both parts empty: no NaN
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    out = weight_a[..., None] * out_a + weight_b[..., None] * out_b
    out = out / total.where(total > 0, 1.0)[..., None]
    return out, top + torch.log(total)


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The whole sequence on one process, the weights written out.

    q (B, H, T, d_k); k, v (B, H_kv, T, d_k), (B, H_kv, T, d_v), each key/value
    head repeated for its H / H_kv query heads. ``causal``: the query at
    position i sees the keys at j <= i. Returns (B, H, T, d_v).
    """
    _check_inputs(q, k, v)
    scale = check_scale(scale, q.shape[-1])
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))  # (B, H, T, d)
    scores = q @ k.mT * scale  # (B, H, T, T)
    if causal:
        T = q.shape[2]
        later = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(later, -math.inf)
    return torch.softmax(scores, dim=-1) @ v  # (B, H, T, d_v)


# ---------------------------------------------------------------------------
# The ring


@dataclass
class RingStats:
    """What one process did in :func:`ring_attention`, filled in as it runs.

    Bytes are those passed to ``isend`` (keys and values, and in the
    backward pass the gradient accumulators); pairs are (query, key)
    positions whose score the forward pass computed, per batch row and head,
    and those of them that the causal mask keeps.
    """

    forward_bytes: int = 0
    backward_bytes: int = 0
    pairs_computed: int = 0
    pairs_unmasked: int = 0


_Runs = tuple[tuple[slice, range], ...]


@dataclass(frozen=True)
class _Ring:
    """One process's view of the ring: its neighbours, every part's runs."""

    group: Any  # None: every process
    rank: int
    world: int
    next: int  # global ranks of the neighbours, for isend and irecv
    prev: int
    runs: tuple[_Runs, ...]  # per process: (local rows, global positions)
    causal: bool
    scale: float

    def length(self, rank: int) -> int:
        """How many positions process ``rank`` (mod P) holds."""
        return self.runs[rank % self.world][-1][0].stop


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    layout: str = "contiguous",
    scale: float | None = None,
    group=None,
    stats: RingStats | None = None,
) -> Tensor:
    """Attention of this process's queries to the whole sequence's keys.

    Every process of ``group`` calls it at once, each with its own part of
    the sequence.

    Args:
        q: (B, H, T_r, d_k), this process's positions of the sequence:
            :func:`shard_sequence` of the whole (B, H, T, d_k) for
            ``layout``.
        k, v: (B, H_kv, T_r, d_k) and (B, H_kv, T_r, d_v), the same
            positions; H_kv divides H (query head h reads key/value head
            h // (H / H_kv)). One dtype and device for q, k and v.
        causal: the query at global position i sees the keys at j <= i.
        layout: ``"contiguous"`` or ``"zigzag"``: which positions each
            process holds (:func:`chunk_ranges`).
        scale: the scores' factor, ``1 / sqrt(d_k)`` by default.
        group: the processes of the ring (None: all of them).
        stats: a :class:`RingStats` to fill in, or None.

    Returns:
        (B, H, T_r, d_v): this process's rows of the output, differentiable.

    Before the ring starts, the processes exchange their shapes (one
    all-gather of 7 integers each): T is the sum of their lengths, and
    inputs that differ between processes, or lengths that do not fit
    ``layout``, raise ``ValueError`` on every process.
    """
    _check_inputs(q, k, v)
    check_choice("layout", layout, LAYOUTS)
    ring = _ring(q, k, v, bool(causal), layout, scale, group)
    return RingAttention.apply(q, k, v, ring, stats)


class RingAttention(torch.autograd.Function):
    """Ring attention for autograd: the backward pass runs the ring again.

    Saved for the backward pass: this process's q, k, v, output and
    logsumexp, (B, H, T_r); no weights, and no other process's keys.
    """

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, stats: RingStats | None):
        acc = torch.promote_types(q.dtype, torch.float32)
        queries = group_queries(q, k.shape[1]).to(acc)  # (B, H_kv, G, T_r, d)
        out = queries.new_zeros(queries.shape[:-1] + v.shape[-1:])
        lse = queries.new_full(queries.shape[:-1], -math.inf)  # (.., G, T_r)
        kv = (k.contiguous(), v.contiguous())
        for step in range(ring.world):
            source = ring.rank - step  # the process whose keys are in hand
            last = step == ring.world - 1
            if not last:  # pass them on before using them
                arriving = _buffers(kv, ring.length(source - 1))
                sending = _pass(ring, kv, arriving, 0, stats, "forward_bytes")
            keys, values = _grouped(kv, acc)
            for rows, cols, scores in _blocks(
                queries, keys, ring, source, stats
            ):
                part_lse = torch.logsumexp(scores, dim=-1)  # (..., G, T_q)
                weights = torch.exp(scores - _finite(part_lse)[..., None])
                part = weights @ values[..., cols, :]  # (..., G, T_q, d_v)
                out[..., rows, :], lse[..., rows] = merge_parts(
                    out[..., rows, :], lse[..., rows], part, part_lse
                )
            if not last:
                _wait(sending)
                kv = arriving
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.stats = ring, stats
        return ungroup_heads(out, True).to(q.dtype)  # (B, H, T_r, d_v)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, stats = ctx.ring, ctx.stats
        queries = group_queries(q, k.shape[1]).to(out.dtype)
        d_out = group_queries(d_out, k.shape[1]).to(out.dtype)
        delta = (d_out * out).sum(dim=-1)  # (B, H_kv, G, T_r)
        dq = torch.zeros_like(queries)
        kv = (k.contiguous(), v.contiguous())
        grads_in, grads_sent = (), None  # dK, dV arriving from rank - 1
        for step in range(ring.world):
            source = ring.rank - step
            last = step == ring.world - 1
            if not last:
                arriving = _buffers(kv, ring.length(source - 1))
                sending = _pass(ring, kv, arriving, 0, stats, "backward_bytes")
            dk, dv = _gradients(
                queries, kv, d_out, lse, delta, ring, source, dq
            )
            if grads_sent is not None:  # add the earlier processes' shares
                _wait(grads_sent)
                dk, dv = dk + grads_in[0], dv + grads_in[1]
            grads_in = _buffers((dk, dv), ring.length(source - 1))
            grads_sent = _pass(
                ring, (dk, dv), grads_in, 2, stats, "backward_bytes"
            )
            if not last:
                _wait(sending)
                kv = arriving
        _wait(grads_sent)  # this process's keys' gradients, home at last
        dk, dv = grads_in
        dq = ungroup_heads(dq, True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _grouped(kv, dtype) -> tuple[Tensor, Tensor]:
    """Keys and values (B, H_kv, T, d) as (B, H_kv, 1, T, d) in ``dtype``:
    each key/value head broadcasts over its group of query heads."""
    return tuple(t.to(dtype)[:, :, None] for t in kv)


def _blocks(queries, keys, ring: _Ring, source: int, stats=None) -> Iterator:
    """(rows, cols, scores) for each run of this process's queries and each
    run of ``source``'s keys that the causal mask does not wholly hide.

    ``scores`` (B, H_kv, G, T_q, T_k), -inf where a key comes after its
    query.
    """
    for rows, q_pos in ring.runs[ring.rank]:
        for cols, k_pos in ring.runs[source % ring.world]:
            seen = _visible(q_pos, k_pos, ring.causal)
            if seen == "none":
                continue  # the whole block lies above the diagonal
            scores = queries[..., rows, :] @ keys[..., cols, :].mT * ring.scale
            later = None
            if seen == "some":  # global positions, not local indices
                later = _later(q_pos, k_pos, queries.device)  # (T_q, T_k)
                scores = scores.masked_fill(later, -math.inf)
            if stats is not None:
                pairs = len(q_pos) * len(k_pos)
                stats.pairs_computed += pairs
                hidden = 0 if later is None else int(later.sum())
                stats.pairs_unmasked += pairs - hidden
            yield rows, cols, scores


def _gradients(queries, kv, d_out, lse, delta, ring, source, dq):
    """dK, dV of ``source``'s keys from this process's queries, and dq +=
    its share; (B, H_kv, T_s, d) in the accumulation dtype."""
    keys, values = _grouped(kv, queries.dtype)  # (B, H_kv, 1, T_s, d)
    dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
    for rows, cols, scores in _blocks(queries, keys, ring, source):
        weights = torch.exp(scores - _finite(lse[..., rows])[..., None])
        d_rows = d_out[..., rows, :]  # (B, H_kv, G, T_q, d_v)
        dv[..., cols, :] += (weights.mT @ d_rows).sum(2, keepdim=True)
        d_values = d_rows @ values[..., cols, :].mT  # (.., G, T_q, T_k)
        d_scores = weights * (d_values - delta[..., rows, None])
        dq[..., rows, :] += d_scores @ keys[..., cols, :] * ring.scale
        dk_part = d_scores.mT @ queries[..., rows, :] * ring.scale
        dk[..., cols, :] += dk_part.sum(2, keepdim=True)  # over the group
    return dk[:, :, 0], dv[:, :, 0]


def _visible(q_pos: range, k_pos: range, causal: bool) -> str:
    """Whether ``all``, ``some`` or ``none`` of the (query, key) pairs of
    two runs of positions are kept by the causal mask (key <= query)."""
    if not causal or k_pos[-1] <= q_pos[0]:
        return "all"
    if k_pos[0] > q_pos[-1]:
        return "none"
    return "some"


def _later(q_pos: range, k_pos: range, device) -> Tensor:
    """(T_q, T_k) booleans: True where the key comes after the query."""
    queries = torch.arange(q_pos.start, q_pos.stop, device=device)
    keys = torch.arange(k_pos.start, k_pos.stop, device=device)
    return keys[None, :] > queries[:, None]


def _finite(lse: Tensor) -> Tensor:
    """The logsumexp with -inf (no key seen) as 0, to subtract safely."""
    return lse.masked_fill(lse == -math.inf, 0.0)


def _buffers(tensors, length: int) -> tuple[Tensor, ...]:
    """Empty tensors shaped as ``tensors`` (B, H_kv, T, d) with T =
    ``length``: what arrives from the previous process."""
    return tuple(
        t.new_empty(t.shape[:2] + (length,) + t.shape[3:]) for t in tensors
    )


def _pass(ring: _Ring, tensors, into, tag: int, stats, field: str) -> list:
    """Start sending ``tensors`` to the next process and receiving
    ``into`` from the previous one; the requests, to wait for later."""
    if ring.world == 1:  # the next process is this one
        for tensor, buffer in zip(tensors, into):
            buffer.copy_(tensor)
        return []
    ops = []
    for i, (tensor, buffer) in enumerate(zip(tensors, into)):
        tensor = tensor.contiguous()
        ops.append(
            dist.P2POp(dist.isend, tensor, ring.next, ring.group, tag + i)
        )
        ops.append(
            dist.P2POp(dist.irecv, buffer, ring.prev, ring.group, tag + i)
        )
        if stats is not None:
            sent = tensor.numel() * tensor.element_size()
            setattr(stats, field, getattr(stats, field) + sent)
    return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


# ---------------------------------------------------------------------------
# Argument checks, and the shapes every process agrees on


def _check_inputs(q, k, v) -> None:
    """Local checks, made before any message is sent."""
    check_tensor("q", q, ndim=4, shape="(B, H, T, d_k)")
    check_tensor("k", k, ndim=4, shape="(B, H_kv, T, d_k)")
    check_tensor("v", v, ndim=4, shape="(B, H_kv, T, d_v)")
    check_same("q, k and v", (q, k, v))
    if q.dtype not in _DTYPES:
        names = ", ".join(map(str, _DTYPES))
        raise TypeError(
            f"q, k and v must have one of the dtypes {names}, got {q.dtype}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "k and v must have the same (B, H_kv, T), got k "
            f"{tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            "q and k must have the same batch B, positions T and d_k, got q "
            f"{tuple(q.shape)} (B, H, T, d_k) and k {tuple(k.shape)} "
            "(B, H_kv, T, d_k)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            "k and v must have a number of heads H_kv that divides q's H, "
            f"got H = {q.shape[1]} and H_kv = {k.shape[1]}"
        )


def _check_split(seq_len, world_size, layout) -> tuple[int, int]:
    seq_len = check_int("seq_len", seq_len)
    world_size = check_int("world_size", world_size)
    check_choice("layout", layout, LAYOUTS)
    if seq_len < world_size:
        raise ValueError(
            f"seq_len must be at least world_size ({world_size}), so that "
            f"every process holds a position, got {seq_len}"
        )
    return seq_len, world_size


def _ring(q, k, v, causal, layout, scale, group) -> _Ring:
    """Check that the processes agree, then lay out the ring."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_attention needs a torch.distributed process group: call "
            "torch.distributed.init_process_group (gloo on CPUs, nccl on "
            "GPUs) first; none is initialised"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group must contain this process, it does not")
    lengths = _exchange_shapes(q, k, v, group, world)

    def peer(r: int) -> int:  # isend and irecv take global ranks
        return r if group is None else dist.get_global_rank(group, r)

    return _Ring(
        group=group,
        rank=rank,
        world=world,
        next=peer((rank + 1) % world),
        prev=peer((rank - 1) % world),
        runs=_runs(lengths, layout),
        causal=causal,
        scale=check_scale(scale, q.shape[3]),
    )


_FIELDS = ("T_r", "B", "H", "H_kv", "d_k", "d_v", "dtype")


def _exchange_shapes(q, k, v, group, world: int) -> list[int]:
    """Every process's T_r, after checking that the rest agrees (the same
    error on every process, so that none is left waiting)."""
    mine = (q.shape[2], q.shape[0], q.shape[1], k.shape[1], q.shape[3])
    mine += (v.shape[3], _DTYPES.index(q.dtype))  # as _FIELDS
    device = "cpu" if dist.get_backend(group) == "gloo" else q.device
    sent = torch.tensor(mine, dtype=torch.int64, device=device)
    shapes = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(shapes, sent, group=group)
    shapes = [tuple(t.tolist()) for t in shapes]
    for other, theirs in enumerate(shapes):
        for field, a, b in zip(_FIELDS[1:], shapes[0][1:], theirs[1:]):
            if a != b:
                if field == "dtype":
                    a, b = _DTYPES[a], _DTYPES[b]
                raise ValueError(
                    f"every process must pass q, k, v with the same {field}: "
                    f"process 0 has {a}, process {other} has {b}"
                )
    return [shape[0] for shape in shapes]


def _runs(lengths: list[int], layout: str) -> tuple[_Runs, ...]:
    """Each process's (local rows, global positions) runs, after checking
    that its length fits ``layout``."""
    world, seq_len = len(lengths), sum(lengths)
    runs = []
    for rank, length in enumerate(lengths):
        own = chunk_ranges(seq_len, world, rank, layout)
        if length != sum(map(len, own)):
            raise ValueError(
                f"process {rank} must hold {sum(map(len, own))} positions "
                f"for layout {layout!r} (T = {seq_len} over {world} "
                f"processes; see shard_sequence), got T_r = {length}"
            )
        stops = list(itertools.accumulate(map(len, own)))
        rows = (slice(b - len(r), b) for r, b in zip(own, stops))
        runs.append(tuple(zip(rows, own)))
    return tuple(runs)


# ---------------------------------------------------------------------------
# PyTorch's own ring, to compare with


def torch_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mesh,
    grad_out: Tensor | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """PyTorch's context parallel: causal attention, ring over ``mesh``.

    Every process passes the *whole* q, k, v (B, H, T, d), H_kv = H, T
    divisible by 2P; ``torch.distributed.tensor.experimental
    .context_parallel`` keeps this process's part, laid out as zigzag
    (PyTorch's head-tail load balancer), and runs its own ring. Returns
    this process's rows of the output and, when ``grad_out`` (B, H, T, d)
    is given, of dq, dk, dv.

    PyTorch's context parallel runs only the GPU kernels of
    ``scaled_dot_product_attention`` (flash, memory-efficient, cuDNN). On
    a CPU, for the time of the call, the flash kernel's name is routed to
    PyTorch's CPU flash kernel (the same computation under another
    signature): PyTorch's sharding, rotation and merging run unchanged.
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import context_parallel

    _check_inputs(q, k, v)
    world = mesh.size()
    if k.shape[1] != q.shape[1] or q.shape[2] % (2 * world):
        raise ValueError(
            "torch_context_parallel needs H_kv = H and T divisible by 2 * "
            f"mesh size ({2 * world}), got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)}"
        )
    buffers = [t.detach().clone() for t in (q, k, v)]
    if grad_out is not None:
        buffers.append(grad_out.detach().clone())
    with (
        context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)
        ),
        _flash_kernel_on_cpu(q.device),
    ):
        local = [t.clone().requires_grad_() for t in buffers[:3]]
        if q.device.type == "cuda":
            out = torch.nn.functional.scaled_dot_product_attention(
                *local, is_causal=True
            )
        else:
            parts = [
                DTensor.from_local(t, mesh, [Shard(2)], run_check=False)
                for t in local
            ]
            flash = torch.ops.aten._scaled_dot_product_flash_attention
            out = flash(*parts, 0.0, True)[0].to_local()
        if grad_out is None:
            return out.detach(), None
        out.backward(buffers[3])
    return out.detach(), tuple(t.grad for t in local)


@contextlib.contextmanager
def _flash_kernel_on_cpu(device: torch.device):
    """On a CPU: the GPU flash kernel's name runs PyTorch's CPU one."""
    if device.type != "cpu":
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", _cpu_flash, "CPU")
    library.impl(
        "_scaled_dot_product_flash_attention_backward",
        _cpu_flash_backward,
        "CPU",
    )
    try:
        yield
    finally:
        library._destroy()


def _cpu_flash(
    query,
    key,
    value,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )
    unused = torch.zeros((), dtype=torch.int64)  # sequence offsets, seeds
    debug = torch.zeros((), dtype=query.dtype)
    T_q, T_k = query.shape[2], key.shape[2]
    return out, lse, unused, unused, T_q, T_k, unused, unused, debug


def _cpu_flash_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        dropout_p,
        is_causal,
        scale=scale,
    )
