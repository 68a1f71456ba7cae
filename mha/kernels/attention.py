"""Tiled attention in Triton: the algorithm of :mod:`mha.flash` as kernels.

Import :mod:`mha.kernels` (which decides between the compiled kernels and
Triton's CPU interpreter) rather than this module directly.

A Triton kernel is written for one *program*: a block of work that the GPU
runs on one streaming multiprocessor, thousands of them in parallel. Here
one program computes one tile of ``BLOCK_Q`` queries of one (batch, head):
the same loop over key tiles as :func:`mha.flash.online_softmax`, with the
running maximum ``m``, sum ``ell`` and weighted values ``acc`` held on chip
(in registers). Tensors are addressed with plain pointer arithmetic: a base
pointer plus offsets times strides, so views such as the transposed heads of
:func:`mha.functional.split_heads` need no copy. Loads and stores of rows past
the end of the sequence are masked, so T need not be a multiple of the tile;
the head size is padded to a power of two (``PADDED_DIM``) the same way.
Causal attention is aligned bottom-right (query i sees keys 0..i + T_k -
T_q); query head h reads key/value head ``h // group``.

Key padding: a left-padded batch (transformers' ``attention_mask`` of 0/1,
shape (B, T_k), its zeros first) is described by one int32 per row,
``key_start`` (B,): row b's keys 0..key_start[b] - 1 are padding, hidden from
every query of the row and never loaded (NaN there changes nothing); the
key tiles wholly before ``key_start[b]`` are skipped. A query that sees no
key (a padded query of a causal prompt, or a row of padding only) gives
zeros and a logsumexp of -inf, never NaN. Left padding is what decoding
needs: the new tokens of every row go to the end, so one start per row
stays right for the whole generation, and it costs one load per program
where a (B, T_k) mask would cost one per key tile.
:func:`mha.functional.key_start_from_attention_mask` turns a left-padded
``attention_mask`` into ``key_start``. Without ``key_start`` the kernels are
compiled without that code (``HAS_KEY_START`` is a constexpr).

* :func:`attention_forward` - the forward kernel; returns output and
  logsumexp (one float32 per query). With learned sinks (gpt-oss), each
  head's sink logit is one more term in ``ell`` after the keys.
* :func:`attention_backward` - two kernels (one program per key tile of a
  key/value head for dk and dv, summed over the head's group of query heads;
  one per query tile for dq) that recompute the weights from the logsumexp,
  as :func:`mha.flash.flash_attention_backward` does. No atomic additions.
* :func:`split_kv_forward` - the split-KV ("Flash-Decoding") kernel and the
  merge of its partial results.
* :func:`triton_attention` - forward and backward, tied together for
  autograd.
* :func:`forward_launch`, :func:`backward_launches`, :func:`split_kv_launch`
  - each launch as data (:class:`Launch`), which :mod:`mha.kernels.aot`
  compiles ahead of time for a named GPU. The tile sizes, warps and stages
  per GPU, dtype and head size are in :mod:`mha.kernels.tiles`.

The kernels call Triton's built-in operations and the small ``@triton.jit``
helpers defined here, never the jitted helpers of ``triton.language``
(``tl.zeros``, ``tl.max``, ``tl.sum``): those were decorated when ``triton``
was imported, possibly before :mod:`mha.kernels` chose the interpreter, and
a compiled helper cannot be called from an interpreted kernel. Row maxima
and sums are therefore ``tl.reduce`` with the combine functions of
``tl.max`` and ``tl.sum`` (``_maximum``, ``_add``), which is how those two
are defined; a combine function is never called by the interpreter, which
recognises these two and reduces with NumPy.

Offsets are 32-bit: tensors up to 2**31 elements.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._validate import (
    check_bool,
    check_key_start,
    check_same,
    check_scale,
    check_tensor,
    check_window,
)
from . import INTERPRETED, MAX_HEAD_DIM, interpreter_problem
from .tiles import (
    H100_MULTIPROCESSORS,
    KERNELS,
    Techniques,
    Tiles,
    capability_of,
    check_techniques,
    default_num_splits,
    default_techniques,
    default_tiles,
    padded_head_dim,
    persistent_programs,
    split_sizes,
)

__all__ = [
    "attention_forward",
    "attention_backward",
    "split_kv_forward",
    "merge_partials",
    "finish_rows",
    "check_runs_here",
    "check_inputs",
    "multiprocessors",
    "TritonAttention",
    "triton_attention",
    "Tiles",
    "Techniques",
    "KERNELS",
    "default_tiles",
    "default_num_splits",
    "forward_launch",
    "backward_launches",
    "split_kv_launch",
]


# The combine functions of tl.max and tl.sum: the interpreter recognises them
# and reduces in one NumPy call (a combine function of our own would run
# element by element in Python, about 50 times slower).
_maximum = tl.standard._elementwise_max
_add = tl.standard._sum_combine


@triton.jit
def _tile(head, positions, dims, stride_t, stride_d):
    """Addresses (or offsets) of the (positions, dims) tile of a matrix."""
    return head + positions[:, None] * stride_t + dims[None, :] * stride_d


@triton.jit
def _attend(
    q, k_head, v_head, rows, dims, start, stop, offset, key_start, scale,
    stride_kt, stride_kd, stride_vt, stride_vd,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_START: tl.constexpr,
    window, HAS_WINDOW: tl.constexpr,
    q_first=0, q_last=0, EXP2: tl.constexpr = False,
    EDGE_MASKS: tl.constexpr = False, TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
):  # fmt: skip
    """The online softmax of one query tile over keys start..stop-1.

    :func:`mha.flash.online_softmax` for one program: returns the running
    maximum ``m``, sum ``ell`` and weighted values ``acc`` (float32). With
    ``HAS_KEY_START``, keys before ``key_start`` are hidden and not loaded;
    with ``HAS_WINDOW``, a query sees only its ``window`` newest keys.

    Two switches (:class:`mha.kernels.tiles.Techniques`): ``EXP2``, scores
    in base 2 (``m`` too): ``exp2(s * scale * log2 e - m)``, one multiply-add
    before the exponential; ``EDGE_MASKS``, the loop cut in three: the key
    tiles that every row of the tile (its first row is ``q_first``) sees
    whole run without masks, and only those at the edges (padding, the
    window's start, the causal diagonal, the ragged tail) are masked.
    ``start`` is a multiple of ``BLOCK_K``; ``q_first`` and ``q_last`` are
    the earliest and latest query of the tile's rows. With ``TMA`` too,
    the unmasked tiles are loaded through tensor descriptors (Hopper's
    TMA unit; the last stride 1, the others and the base 16-byte
    aligned: the caller checks). ``WARP_SPECIALIZE`` (with ``TMA``): one
    loop over every key tile, each loaded through the descriptors and
    masked, handed to Triton's warp specialisation.
    """
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running maximum
    ell = tl.full([BLOCK_Q], 0.0, tl.float32)  # running sum of exp(s - m)
    acc = tl.full([BLOCK_Q, PADDED_DIM], 0.0, tl.float32)  # running p @ v
    if EXP2:  # base 2: exp(x) = exp2(x log2 e), folded into the scale
        scale = scale * 1.4426950408889634
    if WARP_SPECIALIZE:  # a producer warp loads, the others compute
        k_load, v_load = _descriptors(
            k_head, v_head, stop, stride_kt, stride_vt, BLOCK_K, HEAD_DIM,
            PADDED_DIM,
        )  # fmt: skip
        for first in tl.range(start, stop, BLOCK_K, warp_specialize=True):
            m, ell, acc = _key_tile(
                m, ell, acc, q, k_load, v_load, rows, dims, first, stop,
                offset, key_start, scale, stride_kt, stride_kd, stride_vt,
                stride_vd, CAUSAL, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
                HAS_KEY_START, window, HAS_WINDOW, True, EXP2, True,
            )  # fmt: skip
    elif EDGE_MASKS:
        # [start, lo): padding or the window's start, masked; [lo, hi):
        # whole tiles every row sees, unmasked; [hi, stop): the diagonal
        # and the ragged tail, masked
        lo = start
        if HAS_KEY_START:
            lo = tl.maximum(lo, (tl.maximum(key_start, 0) + BLOCK_K - 1)
                            // BLOCK_K * BLOCK_K)  # fmt: skip
        if HAS_WINDOW:  # the tile's last row's window starts latest
            oldest = q_last + offset - window + 1
            lo = tl.maximum(lo, (tl.maximum(oldest, 0) + BLOCK_K - 1)
                            // BLOCK_K * BLOCK_K)  # fmt: skip
        lo = tl.minimum(lo, stop)
        hi = stop
        if CAUSAL:  # the tile's first row sees keys 0..q_first + offset
            hi = tl.minimum(hi, q_first + offset + 1)
        hi = lo + tl.maximum(hi - lo, 0) // BLOCK_K * BLOCK_K
        # the edges hold a tile or two: not pipelined (num_stages=1), which
        # spares the registers of a second pipeline (sm_90, d_k 64: 255
        # and spilling with it, 238 without)
        k_load, v_load = k_head, v_head  # the unmasked tiles': pointers,
        if TMA:  # or tensor descriptors (dims past HEAD_DIM read 0)
            k_load, v_load = _descriptors(
                k_head, v_head, stop, stride_kt, stride_vt, BLOCK_K,
                HEAD_DIM, PADDED_DIM,
            )  # fmt: skip
        for first in tl.range(start, lo, BLOCK_K, num_stages=1):
            m, ell, acc = _key_tile(
                m, ell, acc, q, k_head, v_head, rows, dims, first, stop,
                offset, key_start, scale, stride_kt, stride_kd, stride_vt,
                stride_vd, CAUSAL, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
                HAS_KEY_START, window, HAS_WINDOW, True, EXP2, False,
            )  # fmt: skip
        for first in range(lo, hi, BLOCK_K):
            m, ell, acc = _key_tile(
                m, ell, acc, q, k_load, v_load, rows, dims, first, stop,
                offset, key_start, scale, stride_kt, stride_kd, stride_vt,
                stride_vd, CAUSAL, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
                HAS_KEY_START, window, HAS_WINDOW, False, EXP2, TMA,
            )  # fmt: skip
        for first in tl.range(hi, stop, BLOCK_K, num_stages=1):
            m, ell, acc = _key_tile(
                m, ell, acc, q, k_head, v_head, rows, dims, first, stop,
                offset, key_start, scale, stride_kt, stride_kd, stride_vt,
                stride_vd, CAUSAL, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
                HAS_KEY_START, window, HAS_WINDOW, True, EXP2, False,
            )  # fmt: skip
    else:
        for first in range(start, stop, BLOCK_K):
            m, ell, acc = _key_tile(
                m, ell, acc, q, k_head, v_head, rows, dims, first, stop,
                offset, key_start, scale, stride_kt, stride_kd, stride_vt,
                stride_vd, CAUSAL, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
                HAS_KEY_START, window, HAS_WINDOW, True, EXP2, False,
            )  # fmt: skip
    return m, ell, acc


@triton.jit
def _descriptors(
    k_head, v_head, stop, stride_kt, stride_vt, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
):  # fmt: skip
    """Tensor descriptors of keys 0..stop-1 of one head of k and v, read a
    (BLOCK_K, PADDED_DIM) tile at a time (0 past stop and past HEAD_DIM)."""
    k_load = tl.make_tensor_descriptor(
        k_head, shape=[stop, HEAD_DIM], strides=[stride_kt, 1],
        block_shape=[BLOCK_K, PADDED_DIM],
    )  # fmt: skip
    v_load = tl.make_tensor_descriptor(
        v_head, shape=[stop, HEAD_DIM], strides=[stride_vt, 1],
        block_shape=[BLOCK_K, PADDED_DIM],
    )  # fmt: skip
    return k_load, v_load


@triton.jit
def _key_tile(
    m, ell, acc, q, k_head, v_head, rows, dims, first, stop, offset,
    key_start, scale, stride_kt, stride_kd, stride_vt, stride_vd,
    CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
    PADDED_DIM: tl.constexpr, PRECISION: tl.constexpr,
    HAS_KEY_START: tl.constexpr, window, HAS_WINDOW: tl.constexpr,
    MASKED: tl.constexpr, EXP2: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """The key tile first..first + BLOCK_K - 1 into the running ``m``,
    ``ell``, ``acc``; without ``MASKED`` every row sees every key of the
    tile (nothing masked but the head size's padding). With ``TMA``
    ``k_head`` and ``v_head`` are tensor descriptors."""
    cols = first + tl.arange(0, BLOCK_K)  # key positions
    if not TMA:
        k_tile = _tile(k_head, cols, dims, stride_kt, stride_kd)
        v_tile = _tile(v_head, cols, dims, stride_vt, stride_vd)
    if MASKED:
        visible = cols < stop  # (B_k,)
        if HAS_KEY_START:  # left padding: keys before key_start hidden
            visible = visible & (cols >= key_start)
        exists = visible[:, None] & (dims[None, :] < HEAD_DIM)
        if not TMA:
            k = tl.load(k_tile, exists, 0.0)  # (B_k, d_k), padding reads 0
            v = tl.load(v_tile, exists, 0.0)  # (B_k, d_v)
        else:  # the descriptors read 0 past stop and past HEAD_DIM
            k = k_head.load([first, 0])
            v = v_head.load([first, 0])
            if HAS_KEY_START:  # pads may hold anything, inf and NaN too:
                v = tl.where(visible[:, None], v, 0.0)  # 0 * NaN is NaN
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if not EXP2:  # scaled here; with EXP2 in the step's multiply-add
            scores = scores * scale
        keep = visible[None, :]  # (1, B_k), broadcast with rows below
        if CAUSAL:  # bottom-right: query i sees keys 0..i + T_k - T_q
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        if HAS_WINDOW:  # and none before its window
            keep = keep & (cols[None, :] > rows[:, None] + offset - window)
        scores = tl.where(keep, scores, float("-inf"))  # (B_q, B_k)
    else:
        if TMA:  # the TMA unit: a tile per descriptor, padding dims 0
            k = k_head.load([first, 0])
            v = v_head.load([first, 0])
        elif HEAD_DIM == PADDED_DIM:
            k = tl.load(k_tile)
            v = tl.load(v_tile)
        else:
            inside = (cols[:, None] >= 0) & (dims[None, :] < HEAD_DIM)
            k = tl.load(k_tile, inside, 0.0)
            v = tl.load(v_tile, inside, 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if not EXP2:
            scores = scores * scale
    return _online_step(m, ell, acc, scores, v, scale, PRECISION, EXP2)


@triton.jit
def _online_step(
    m, ell, acc, scores, v, scale, PRECISION: tl.constexpr,
    EXP2: tl.constexpr,
):  # fmt: skip
    """One tile of keys into the running maximum ``m``, sum ``ell`` and
    weighted values ``acc``: the online softmax's step, which every
    forward kernel (this module's and the paged one) takes. ``scores``
    are scaled (-inf where masked); with ``EXP2`` they are not: ``scale``
    then includes log2 e, and ``m`` is in base 2."""
    if EXP2:  # p = exp2(s * scale - m): one multiply-add
        m_new = tl.maximum(m, tl.reduce(scores, 1, _maximum) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m - m_safe)
        p = tl.exp2(scores * scale - m_safe[:, None])
    else:
        m_new = tl.maximum(m, tl.reduce(scores, 1, _maximum))  # row max
        # a row with no visible key yet: exponentiate against 0, no NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - m_safe)  # brings old sums to the new maximum
        p = tl.exp(scores - m_safe[:, None])  # (B_q, B_k)
    ell = rescale * ell + tl.reduce(p, 1, _add)  # row sum
    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, ell, rescale[:, None] * acc + pv  # acc: (B_q, d_v)


@triton.jit
def _finish(m, ell, acc, EXP2: tl.constexpr = False):
    """Output rows ``acc / ell`` (0 where no key was seen) and logsumexp
    (natural; from base 2 with ``EXP2``)."""
    seen = ell > 0.0
    out = acc / tl.where(seen, ell, 1.0)[:, None]
    if EXP2:  # ln(sum) = ln 2 (m + log2 ell), m in base 2
        total = (m + tl.log2(tl.where(seen, ell, 1.0))) * 0.6931471805599453
    else:
        total = m + tl.log(tl.where(seen, ell, 1.0))
    logsumexp = tl.where(seen, total, -float("inf"))
    return out, logsumexp


@triton.jit
def _add_sink(m, ell, acc, sink, EXP2: tl.constexpr = False):
    """A learned sink logit (gpt-oss): one more term in ``ell``, with no
    value, folded in after the keys (the order of the terms of a sum does
    not matter to the online softmax)."""
    if EXP2:  # m is in base 2: so is the sink
        sink = sink * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        rescale = tl.exp2(m - m_new)
        ell = rescale * ell + tl.exp2(sink - m_new)
    else:
        m_new = tl.maximum(m, sink)  # finite: the sink is
        rescale = tl.exp(m - m_new)  # 0 for a row that saw no key (m = -inf)
        ell = rescale * ell + tl.exp(sink - m_new)
    return m_new, ell, rescale[:, None] * acc


@triton.jit
def _forward_kernel(
    Q, K, V, Out, LSE,  # pointers to the first element of each tensor
    KeyStart,  # (B,) int32 first key of each row, or None
    stride_qb, stride_qh, stride_qt, stride_qd,  # q's strides, in elements
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    num_heads, group, t_q, t_k, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_START: tl.constexpr,
    Sinks=None, HAS_SINKS: tl.constexpr = False,  # (H,) learned sink logits
    window=None, HAS_WINDOW: tl.constexpr = False,  # a positive int
    EXP2: tl.constexpr = False, EDGE_MASKS: tl.constexpr = False,
    TMA: tl.constexpr = False,
    COSTLIEST_FIRST: tl.constexpr = False,
    batch=None, PERSISTENT: tl.constexpr = False,  # B, with PERSISTENT
    WARP_SPECIALIZE: tl.constexpr = False,
):  # fmt: skip
    """One program: the output rows of one query tile of one (batch, head).

    With ``COSTLIEST_FIRST``, the grid is (b * H + h, query tile), the last
    query tiles first: the GPU starts programs in the grid's order, so a
    causal pass starts those with the most key tiles first. With
    ``PERSISTENT`` too, a fixed number of programs (a few per
    multiprocessor) share the (query tile, batch, head) items in that
    order, dealt round by round in snake order (0, 1, ..., P - 1, then
    P - 1, ..., 0), so that each program's sum of key tiles is about the
    same (:func:`mha.kernels.tiles.persistent_items`).
    """
    if PERSISTENT:
        q_blocks = tl.cdiv(t_q, BLOCK_Q)
        batch_heads = batch * num_heads
        items, programs = q_blocks * batch_heads, tl.num_programs(0)
        program = tl.program_id(0)
        for deal in range(0, tl.cdiv(items, programs)):
            seat = program  # the program's turn in this round
            if deal % 2 == 1:
                seat = programs - 1 - program
            item = deal * programs + seat
            if item < items:  # the last round may be short
                _forward_tile(
                    q_blocks - 1 - item // batch_heads, item % batch_heads,
                    Q, K, V, Out, LSE, KeyStart,
                    stride_qb, stride_qh, stride_qt, stride_qd,
                    stride_kb, stride_kh, stride_kt, stride_kd,
                    stride_vb, stride_vh, stride_vt, stride_vd,
                    stride_ob, stride_oh, stride_ot, stride_od,
                    num_heads, group, t_q, t_k, scale,
                    CAUSAL, BLOCK_Q, BLOCK_K, HEAD_DIM, PADDED_DIM,
                    PRECISION, HAS_KEY_START, Sinks, HAS_SINKS, window,
                    HAS_WINDOW, EXP2, EDGE_MASKS, TMA, WARP_SPECIALIZE,
                )  # fmt: skip
    else:
        q_block, batch_head = tl.program_id(0), tl.program_id(1)
        if COSTLIEST_FIRST:  # grid (b * H + h, query tile), last tile first
            q_block = tl.num_programs(1) - 1 - tl.program_id(1)
            batch_head = tl.program_id(0)
        _forward_tile(
            q_block, batch_head, Q, K, V, Out, LSE, KeyStart,
            stride_qb, stride_qh, stride_qt, stride_qd,
            stride_kb, stride_kh, stride_kt, stride_kd,
            stride_vb, stride_vh, stride_vt, stride_vd,
            stride_ob, stride_oh, stride_ot, stride_od,
            num_heads, group, t_q, t_k, scale,
            CAUSAL, BLOCK_Q, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
            HAS_KEY_START, Sinks, HAS_SINKS, window, HAS_WINDOW,
            EXP2, EDGE_MASKS, TMA, WARP_SPECIALIZE,
        )  # fmt: skip


@triton.jit
def _forward_tile(
    q_block, batch_head,  # the item: a query tile of one (batch, head)
    Q, K, V, Out, LSE, KeyStart,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    num_heads, group, t_q, t_k, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_START: tl.constexpr,
    Sinks, HAS_SINKS: tl.constexpr, window, HAS_WINDOW: tl.constexpr,
    EXP2: tl.constexpr, EDGE_MASKS: tl.constexpr, TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):  # fmt: skip
    """The output rows and logsumexps of query tile ``q_block`` of
    ``batch_head`` (b * H + h)."""
    b, h = batch_head // num_heads, batch_head % num_heads
    kv = h // group  # the key/value head that query head h reads
    q_head = Q + b * stride_qb + h * stride_qh  # q[b, h], (T_q, d_k)
    k_head = K + b * stride_kb + kv * stride_kh  # k[b, kv], (T_k, d_k)
    v_head = V + b * stride_vb + kv * stride_vh
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query positions
    dims = tl.arange(0, PADDED_DIM)  # d_k, padded to a power of two
    real = (rows[:, None] < t_q) & (dims[None, :] < HEAD_DIM)
    if WARP_SPECIALIZE:  # every load a descriptor's, or Triton does not
        q = tl.make_tensor_descriptor(  # specialise the loop
            q_head, shape=[t_q, HEAD_DIM], strides=[stride_qt, 1],
            block_shape=[BLOCK_Q, PADDED_DIM],
        ).load([q_block * BLOCK_Q, 0])  # fmt: skip
    else:
        q = tl.load(_tile(q_head, rows, dims, stride_qt, stride_qd), real, 0.0)
    offset = t_k - t_q  # query i is the token at position i + offset
    stop = t_k
    if CAUSAL:  # key tiles after the tile's last query: skipped
        stop = tl.minimum(t_k, tl.maximum(0, (q_block + 1) * BLOCK_Q + offset))
    start = 0
    key_start = 0
    if HAS_KEY_START:  # key tiles of padding only: skipped
        key_start = tl.load(KeyStart + b)
        start = tl.maximum(key_start, 0) // BLOCK_K * BLOCK_K
    if HAS_WINDOW:  # key tiles before the tile's first query's window
        first = tl.maximum(q_block * BLOCK_Q + offset - window + 1, 0)
        start = tl.maximum(start, first // BLOCK_K * BLOCK_K)
    m, ell, acc = _attend(
        q, k_head, v_head, rows, dims, start, stop, offset, key_start, scale,
        stride_kt, stride_kd, stride_vt, stride_vd,
        CAUSAL, BLOCK_Q, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
        HAS_KEY_START, window, HAS_WINDOW, q_block * BLOCK_Q,
        q_block * BLOCK_Q + BLOCK_Q - 1, EXP2, EDGE_MASKS, TMA,
        WARP_SPECIALIZE,
    )  # fmt: skip
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32)
        m, ell, acc = _add_sink(m, ell, acc, sink, EXP2)
    out, logsumexp = _finish(m, ell, acc, EXP2)
    out_tile = _tile(Out + b * stride_ob + h * stride_oh, rows, dims,
                     stride_ot, stride_od)  # fmt: skip
    tl.store(out_tile, out.to(Out.dtype.element_ty), real)
    tl.store(LSE + batch_head * t_q + rows, logsumexp, rows < t_q)


@triton.jit
def _split_kv_kernel(
    Q, K, V, Partial, PartialLSE, KeyStart,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    num_heads, group, t_q, t_k, keys_per_split, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_START: tl.constexpr,
    window=None, HAS_WINDOW: tl.constexpr = False,  # a positive int
    EXP2: tl.constexpr = False, EDGE_MASKS: tl.constexpr = False,
    PACK_GROUP: tl.constexpr = False, TMA: tl.constexpr = False,
):  # fmt: skip
    """One program: one query tile against one split of the keys.

    Writes the split's own softmax output (float32) and logsumexp; the
    splits are merged afterwards by :func:`merge_partials`. With
    ``PACK_GROUP`` a tile's rows are the query heads of one group times
    the queries (row r: query ``r % T_q`` of head ``kv * G + r // T_q``),
    as in :mod:`mha.kernels.paged`: each key tile is read once per group.
    """
    split, q_block = tl.program_id(0), tl.program_id(1)
    batch_head = tl.program_id(2)  # (b, h), or (b, kv) with PACK_GROUP
    num_splits = tl.num_programs(0)
    dims = tl.arange(0, PADDED_DIM)
    offset = t_k - t_q
    start = split * keys_per_split  # this program's keys: start..stop-1
    stop = tl.minimum(t_k, start + keys_per_split)
    if PACK_GROUP:
        num_kv_heads = num_heads // group
        b, kv = batch_head // num_kv_heads, batch_head % num_kv_heads
        r = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)  # packed rows
        head, rows = kv * group + r // t_q, r % t_q
        real = (r[:, None] < group * t_q) & (dims[None, :] < HEAD_DIM)
        q_tile = (
            Q
            + b * stride_qb
            + head[:, None] * stride_qh
            + rows[:, None] * stride_qt
            + dims[None, :] * stride_qd
        )
        q = tl.load(q_tile, real, 0.0)  # fmt: skip
        # the tile's earliest and latest queries: all of them if it runs on
        # into the next head, else a run of BLOCK_Q
        first_query = (q_block * BLOCK_Q) % t_q
        wraps = first_query + BLOCK_Q > t_q
        q_first = tl.where(wraps, 0, first_query)
        q_last = tl.where(wraps, t_q - 1, first_query + BLOCK_Q - 1)
        if CAUSAL:
            stop = tl.minimum(stop, tl.maximum(0, q_last + 1 + offset))
    else:
        b, h = batch_head // num_heads, batch_head % num_heads
        kv = h // group
        q_head = Q + b * stride_qb + h * stride_qh
        rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        real = (rows[:, None] < t_q) & (dims[None, :] < HEAD_DIM)
        q = tl.load(_tile(q_head, rows, dims, stride_qt, stride_qd), real, 0.0)
        q_first = q_block * BLOCK_Q
        q_last = q_first + BLOCK_Q - 1
        if CAUSAL:
            stop = tl.minimum(
                stop, tl.maximum(0, (q_block + 1) * BLOCK_Q + offset)
            )
    k_head = K + b * stride_kb + kv * stride_kh
    v_head = V + b * stride_vb + kv * stride_vh
    key_start = 0
    if HAS_KEY_START:  # splits start on a tile: so does the padding's end
        key_start = tl.load(KeyStart + b)
        start = tl.maximum(
            start, tl.maximum(key_start, 0) // BLOCK_K * BLOCK_K
        )
    if HAS_WINDOW:  # key tiles before the tile's first query's window
        first = tl.maximum(q_first + offset - window + 1, 0)
        start = tl.maximum(start, first // BLOCK_K * BLOCK_K)
    m, ell, acc = _attend(
        q, k_head, v_head, rows, dims, start, stop, offset, key_start, scale,
        stride_kt, stride_kd, stride_vt, stride_vd,
        CAUSAL, BLOCK_Q, BLOCK_K, HEAD_DIM, PADDED_DIM, PRECISION,
        HAS_KEY_START, window, HAS_WINDOW, q_first, q_last, EXP2,
        EDGE_MASKS, TMA,
    )  # fmt: skip
    out, logsumexp = _finish(m, ell, acc, EXP2)
    if PACK_GROUP:  # each row to its own head's partial[b, head, split]
        part = (b * num_heads + head) * num_splits + split  # (B_q,)
        out_tile = (Partial + part[:, None] * t_q * HEAD_DIM
                    + rows[:, None] * HEAD_DIM + dims[None, :])  # fmt: skip
        tl.store(out_tile, out, real)
        tl.store(PartialLSE + part * t_q + rows, logsumexp,
                 r < group * t_q)  # fmt: skip
    else:
        part = batch_head * num_splits + split  # partial[b, h, split]
        out_tile = _tile(
            Partial + part * t_q * HEAD_DIM, rows, dims, HEAD_DIM, 1
        )
        tl.store(out_tile, out, real)
        tl.store(PartialLSE + part * t_q + rows, logsumexp, rows < t_q)


@triton.jit
def _backward_dk_dv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, KeyStart,
    stride_b, stride_h, stride_t, stride_d,  # of q and d_out
    stride_kb, stride_kh, stride_kt, stride_kd,  # of k, v, dk and dv
    num_heads, group, t_q, t_k, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_START: tl.constexpr,
    window=None, HAS_WINDOW: tl.constexpr = False,  # a positive int
    SPLIT_GROUP: tl.constexpr = False,
    stride_sb=None, stride_sh=None, stride_st=None, stride_sd=None,
):  # fmt: skip
    """One program: dk and dv of one key tile of one key/value head.

    Sums over every query tile of every query head in the head's group, so
    no two programs write the same rows: no atomic additions. With
    ``SPLIT_GROUP``, one program per key tile of one *query* head, which
    writes that head's share of dk and dv (float32, (B, H, T_k, d_k), the
    ``stride_s*``) for the caller to sum over the group: G times the
    programs for a group of G heads, still no atomic addition.
    """
    k_block, batch_kv = tl.program_id(0), tl.program_id(1)
    if SPLIT_GROUP:  # batch_kv is b * H + h: one query head
        b, first_head = batch_kv // num_heads, batch_kv % num_heads
        kv, members = first_head // group, 1
    else:
        num_kv_heads = num_heads // group
        b, kv = batch_kv // num_kv_heads, batch_kv % num_kv_heads
        first_head, members = kv * group, group
    cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, PADDED_DIM)
    visible = cols < t_k
    if HAS_KEY_START:  # padding: not loaded, no query sees it
        visible = visible & (cols >= tl.load(KeyStart + b))
    exists = visible[:, None] & (dims[None, :] < HEAD_DIM)
    kv_tile = _tile(b * stride_kb + kv * stride_kh, cols, dims,
                    stride_kt, stride_kd)  # fmt: skip
    k = tl.load(K + kv_tile, exists, 0.0)  # (B_k, d_k)
    v = tl.load(V + kv_tile, exists, 0.0)
    dk = tl.full([BLOCK_K, PADDED_DIM], 0.0, tl.float32)
    dv = tl.full([BLOCK_K, PADDED_DIM], 0.0, tl.float32)
    offset = t_k - t_q
    first = 0
    if CAUSAL:  # query tiles before the first query that sees this tile
        first = tl.maximum(0, k_block * BLOCK_K - offset) // BLOCK_Q * BLOCK_Q
    last = t_q  # query tiles after the last query whose window holds it
    if HAS_WINDOW:
        last = tl.minimum(t_q, (k_block + 1) * BLOCK_K - 1 - offset + window)
    for member in range(0, members):  # the query heads that read head kv
        h = first_head + member
        batch_head = b * num_heads + h
        q_offset = b * stride_b + h * stride_h  # of q[b, h], d_out[b, h]
        for start in range(first, last, BLOCK_Q):
            rows = start + tl.arange(0, BLOCK_Q)
            real = (rows[:, None] < t_q) & (dims[None, :] < HEAD_DIM)
            q_tile = _tile(q_offset, rows, dims, stride_t, stride_d)
            # q^T loaded transposed from memory, (d_k, B_q): every product
            # below is computed in the key-major layout, so no operand of a
            # tl.dot is a transposed tensor computed in registers (a pattern
            # some Triton releases miscompile on Hopper, racing on shared
            # memory); tl.trans only of tiles loaded from memory
            real_t = (dims[:, None] < HEAD_DIM) & (rows[None, :] < t_q)
            q_t = tl.load(Q + _tile(q_offset, dims, rows, stride_d, stride_t),
                          real_t, 0.0)  # (d_k, B_q)  # fmt: skip
            do = tl.load(DO + q_tile, real, 0.0)  # (B_q, d_v)
            lse = tl.load(LSE + batch_head * t_q + rows, rows < t_q, 0.0)
            delta = tl.load(Delta + batch_head * t_q + rows, rows < t_q, 0.0)
            scores_t = tl.dot(k, q_t, input_precision=PRECISION) * scale
            keep_t = visible[:, None] & (rows[None, :] < t_q)  # (B_k, B_q)
            if CAUSAL:
                keep_t = keep_t & (cols[:, None] <= rows[None, :] + offset)
            if HAS_WINDOW:
                keep_t = keep_t & (
                    cols[:, None] > rows[None, :] + offset - window
                )
            p_t = tl.where(keep_t, tl.exp(scores_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])  # (B_k, B_q)
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t),
                         input_precision=PRECISION)  # fmt: skip
    dk = dk * scale
    inside = (cols[:, None] < t_k) & (dims[None, :] < HEAD_DIM)  # padding: 0
    if SPLIT_GROUP:  # the head's share, in its own rows
        kv_tile = _tile(b * stride_sb + first_head * stride_sh, cols, dims,
                        stride_st, stride_sd)  # fmt: skip
    tl.store(DK + kv_tile, dk.to(DK.dtype.element_ty), inside)
    tl.store(DV + kv_tile, dv.to(DV.dtype.element_ty), inside)


@triton.jit
def _backward_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, KeyStart,
    stride_b, stride_h, stride_t, stride_d,  # of q, d_out and dq
    stride_kb, stride_kh, stride_kt, stride_kd,  # of k and v
    num_heads, group, t_q, t_k, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_START: tl.constexpr,
    window=None, HAS_WINDOW: tl.constexpr = False,  # a positive int
):  # fmt: skip
    """One program: dq of one tile of queries, summed over key tiles."""
    q_block, batch_head = tl.program_id(0), tl.program_id(1)
    b, h = batch_head // num_heads, batch_head % num_heads
    kv = h // group
    q_offset = b * stride_b + h * stride_h  # of q, d_out and dq [b, h]
    kv_offset = b * stride_kb + kv * stride_kh
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, PADDED_DIM)
    real = (rows[:, None] < t_q) & (dims[None, :] < HEAD_DIM)
    q_tile = _tile(q_offset, rows, dims, stride_t, stride_d)
    q = tl.load(Q + q_tile, real, 0.0)  # (B_q, d_k)
    do = tl.load(DO + q_tile, real, 0.0)
    lse = tl.load(LSE + batch_head * t_q + rows, rows < t_q, 0.0)
    delta = tl.load(Delta + batch_head * t_q + rows, rows < t_q, 0.0)
    dq = tl.full([BLOCK_Q, PADDED_DIM], 0.0, tl.float32)
    offset = t_k - t_q
    stop = t_k
    if CAUSAL:
        stop = tl.minimum(t_k, tl.maximum(0, (q_block + 1) * BLOCK_Q + offset))
    first = 0
    key_start = 0
    if HAS_KEY_START:  # key tiles of padding only: skipped
        key_start = tl.load(KeyStart + b)
        first = tl.maximum(key_start, 0) // BLOCK_K * BLOCK_K
    if HAS_WINDOW:  # key tiles before the tile's first query's window
        lowest = tl.maximum(q_block * BLOCK_Q + offset - window + 1, 0)
        first = tl.maximum(first, lowest // BLOCK_K * BLOCK_K)
    for start in range(first, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        visible = cols < t_k
        if HAS_KEY_START:
            visible = visible & (cols >= key_start)
        exists = visible[:, None] & (dims[None, :] < HEAD_DIM)
        kv_tile = _tile(kv_offset, cols, dims, stride_kt, stride_kd)
        k = tl.load(K + kv_tile, exists, 0.0)  # (B_k, d_k)
        v = tl.load(V + kv_tile, exists, 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = (rows[:, None] < t_q) & visible[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        if HAS_WINDOW:
            keep = keep & (cols[None, :] > rows[:, None] + offset - window)
        p = tl.where(keep, tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * scale
    tl.store(DQ + q_tile, dq.to(DQ.dtype.element_ty), real)


# ---------------------------------------------------------------------------
# Launches


@dataclass(frozen=True)
class Launch:
    """One kernel launch: a grid of programs, its arguments, its settings."""

    kernel: object  # a triton.JITFunction
    grid: tuple[int, ...]
    args: tuple
    constants: dict  # the constexpr arguments, num_warps and num_stages

    def __call__(self) -> None:
        if self.constants.get("TMA") and not INTERPRETED:
            # a program writes its tensor descriptors in global scratch
            # memory, which Triton asks of the allocator set here, at every
            # launch (a launch made without attention_forward's checks too)
            triton.set_allocator(_scratch)
        self.kernel[self.grid](*self.args, **self.constants)


def _constants(
    q: Tensor,
    tiles: Tiles,
    causal: bool,
    key_start=None,
    window=None,
    techniques: Techniques | None = None,
) -> dict:
    d_k = q.shape[-1]
    window = {} if window is None else {"window": window, "HAS_WINDOW": True}
    switches = {} if techniques is None else techniques.constants()
    return {
        **window,
        **switches,
        "CAUSAL": bool(causal),
        "HAS_KEY_START": key_start is not None,
        "BLOCK_Q": tiles.block_q,
        "BLOCK_K": tiles.block_k,
        "HEAD_DIM": d_k,
        "PADDED_DIM": padded_head_dim(d_k),
        # float32 products in full float32, not in the tensor cores' TF32
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
        # a * b + c as one multiply-add (Triton's default until 3.10, whose
        # default is off): the exp2 switch's folded scale needs it
        "enable_fp_fusion": True,
    }


def _tiles(q, kernel, block_q, block_k, capability) -> Tiles:
    if capability is None:
        capability = capability_of(q.device)
    tiles = default_tiles(kernel, q.shape[-1], q.dtype, capability)
    return replace(
        tiles,
        block_q=tiles.block_q if block_q is None else block_q,
        block_k=tiles.block_k if block_k is None else block_k,
    )


def forward_launch(
    q, k, v, out, logsumexp, *, causal, scale, tiles, key_start=None,
    sinks=None, window=None, techniques=None,
):  # fmt: skip
    """The forward kernel's launch: one program per (query tile, b, h),
    or with ``techniques.persistent`` :func:`persistent_programs` of them;
    ``key_start`` (B,) int32 or None (no padding); ``sinks`` (H,) float32
    or None; ``techniques``, a :class:`Techniques` (None: all off)."""
    (batch, heads, t_q, _), (kv_heads, t_k) = q.shape, k.shape[1:3]
    grid = (triton.cdiv(t_q, tiles.block_q), batch * heads)
    args = (
        q, k, v, out, logsumexp, key_start,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        heads, heads // kv_heads, t_q, t_k, scale,
    )  # fmt: skip
    constants = _constants(q, tiles, causal, key_start, window, techniques)
    if sinks is not None:
        constants.update(Sinks=sinks, HAS_SINKS=True)
    if techniques is not None and techniques.costliest_first:
        grid = (grid[1], grid[0])
    if techniques is not None and techniques.persistent:
        items = grid[0] * grid[1]
        grid = (min(items, persistent_programs(
            _multiprocessors(q.device), tiles.num_warps)),)  # fmt: skip
        constants.update(batch=batch)
    if techniques is not None and techniques.warp_specialize:
        # Triton (3.9, sm_90) specialises the loop of a kernel of one warp
        # group only: with 8 warps it leaves the loop as it is
        constants.update(num_warps=4)
    return Launch(_forward_kernel, grid, args, constants)


def split_kv_launch(
    q, k, v, partial, partial_lse, *, causal, scale, tiles, keys_per_split,
    key_start=None, window=None, techniques=None,
):  # fmt: skip
    """The split-KV kernel's launch: one program per (split, query tile, b,
    h); ``partial`` is (B, H, splits, T_q, d_k) float32."""
    (batch, heads, t_q, _), (kv_heads, t_k) = q.shape, k.shape[1:3]
    splits = partial.shape[2]
    grid = (splits, triton.cdiv(t_q, tiles.block_q), batch * heads)
    if techniques is not None and techniques.pack_group:  # rows: a group's
        group = heads // kv_heads
        grid = (splits, triton.cdiv(group * t_q, tiles.block_q),
                batch * kv_heads)  # fmt: skip
    args = (
        q, k, v, partial, partial_lse, key_start,
        *q.stride(), *k.stride(), *v.stride(),
        heads, heads // kv_heads, t_q, t_k, keys_per_split, scale,
    )  # fmt: skip
    constants = _constants(q, tiles, causal, key_start, window, techniques)
    return Launch(_split_kv_kernel, grid, args, constants)


#: The dk_dv kernel's strides of the per-head shares (``SPLIT_GROUP``).
SHARE_STRIDES = ("stride_sb", "stride_sh", "stride_st", "stride_sd")


def backward_launches(
    q, k, v, d_out, logsumexp, delta, dq, dk, dv, *, causal, scale, tiles,
    key_start=None, window=None,
):  # fmt: skip
    """The two backward kernels' launches; ``tiles`` maps each kernel's
    name to its :class:`Tiles`. q, d_out, dq share one layout, and k, v,
    dk, dv another, or dk and dv are float32 (B, H, T_k, d_k): each query
    head's share, one program per key tile of one query head
    (``Techniques.split_group``), for the caller to sum over each group."""
    (batch, heads, t_q, _), (kv_heads, t_k) = q.shape, k.shape[1:3]
    sizes = (heads, heads // kv_heads, t_q, t_k, scale)
    by_keys = tiles["backward_dk_dv"]
    constants = _constants(q, by_keys, causal, key_start, window)
    grid = (triton.cdiv(t_k, by_keys.block_k), batch * kv_heads)
    if dk.shape[1] != kv_heads:  # shares per query head
        grid = (grid[0], batch * heads)
        constants.update(
            SPLIT_GROUP=True, **dict(zip(SHARE_STRIDES, dk.stride()))
        )
    args = (q, k, v, d_out, logsumexp, delta, dk, dv, key_start,
            *q.stride(), *k.stride(), *sizes)  # fmt: skip
    dk_dv = Launch(_backward_dk_dv_kernel, grid, args, constants)
    by_queries = tiles["backward_dq"]
    grid = (triton.cdiv(t_q, by_queries.block_q), batch * heads)
    args = (q, k, v, d_out, logsumexp, delta, dq, key_start,
            *q.stride(), *k.stride(), *sizes)  # fmt: skip
    dq_launch = Launch(
        _backward_dq_kernel, grid, args,
        _constants(q, by_queries, causal, key_start, window),
    )  # fmt: skip
    return dk_dv, dq_launch


# ---------------------------------------------------------------------------
# Running the kernels


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    key_start: Tensor | None = None,
    sinks: Tensor | None = None,
    window: int | None = None,
    techniques: Techniques | None = None,
) -> tuple[Tensor, Tensor]:
    """The forward kernel: ``(out, logsumexp)``, (B, H, T_q, d_k), (B, H, T_q).

    The logsumexp is float32 whatever the inputs' dtype; -inf for a query
    that sees no key (its output row is zeros). With ``sinks`` (H,) the
    sinks' terms are in the logsumexp (then ``s_h`` for a query that sees
    no key). ``techniques``: the kernel's switches (:class:`Techniques`;
    None: :func:`default_techniques` for the GPU).
    """
    scale = _check_inputs(q, k, v, scale, block_q, block_k)
    causal = check_bool("causal", causal)
    key_start = check_key_start(key_start, q)
    window = check_window(window)
    if sinks is not None:
        sinks = _check_sinks(sinks, q).float().contiguous()
    tiles = _tiles(q, "forward", block_q, block_k, None)
    techniques = _techniques(q, techniques, k, v)
    if techniques.pack_group:
        raise ValueError(
            "techniques.pack_group is a switch of the split-KV kernel only "
            "(split_kv_forward, triton_split_kv_attention); the forward "
            "kernel's tiles are one head's queries"
        )
    out = torch.empty_like(q)
    logsumexp = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    forward_launch(
        q, k, v, out, logsumexp, causal=causal, scale=scale, tiles=tiles,
        key_start=key_start, sinks=sinks, window=window,
        techniques=techniques,
    )()  # fmt: skip
    return out, logsumexp


def attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    d_out: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
    techniques: Techniques | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the backward kernels: ``(dq, dk, dv)`` of ``sum(d_out * out)``;
    ``techniques.split_group``: dk and dv of a GQA group's heads computed
    by programs of their own and summed after (:class:`Techniques`)."""
    scale = _check_inputs(q, k, v, scale, block_q, block_k)
    causal = check_bool("causal", causal)
    key_start = check_key_start(key_start, q)
    window = check_window(window)
    techniques = _techniques(q, techniques, k, v)
    tiles = {
        name: _tiles(q, name, block_q, block_k, None)
        for name in ("backward_dk_dv", "backward_dq")
    }
    # One layout for q, d_out and dq, and one for k, v, dk and dv.
    q, d_out = q.contiguous(), d_out.contiguous()
    k, v = k.contiguous(), v.contiguous()
    delta = (d_out.float() * out.float()).sum(dim=-1)  # (B, H, T_q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    (batch, heads, _, d_k), (kv_heads, t_k) = q.shape, k.shape[1:3]
    split = techniques.split_group and heads > kv_heads
    if split:  # each query head's share, float32, summed below
        dk, dv = (torch.empty((batch, heads, t_k, d_k), **_like(delta))
                  for _ in range(2))  # fmt: skip
    for launch in backward_launches(
        q, k, v, d_out, logsumexp, delta, dq, dk, dv,
        causal=causal, scale=scale, tiles=tiles, key_start=key_start,
        window=window,
    ):  # fmt: skip
        launch()
    if split:
        dk, dv = (
            share.view(batch, kv_heads, -1, t_k, d_k).sum(2).to(k.dtype)
            for share in (dk, dv)
        )  # fmt: skip
    return dq, dk, dv


def split_kv_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    num_splits: int | None = None,
    block_k: int | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
    techniques: Techniques | None = None,
) -> tuple[Tensor, Tensor]:
    """Split-KV attention ("Flash-Decoding"): ``(out, logsumexp)``.

    The keys are cut into ``num_splits`` ranges (default
    :func:`default_num_splits`); one program per (split, query tile, batch,
    head) writes its range's output and logsumexp, and
    :func:`merge_partials` merges them. Meant for few queries and a long
    cache. No gradient. ``key_start``, ``window``, ``techniques``: as in
    :func:`attention_forward`.
    """
    scale = _check_inputs(q, k, v, scale, None, block_k)
    causal = check_bool("causal", causal)
    key_start = check_key_start(key_start, q)
    window = check_window(window)
    tiles = _tiles(q, "split_kv", None, block_k, None)
    techniques = _techniques(q, techniques, k, v)
    if not techniques.runs_in("split_kv"):
        names = ", ".join(techniques.not_in("split_kv"))
        raise ValueError(
            f"techniques {names}: switches of the forward kernel and its "
            "backward only (attention_forward, triton_attention), not of "
            "the split-KV kernel, whose programs all read about as many "
            "keys and which has no backward"
        )
    (batch, heads, t_q, d_k), t_k = q.shape, k.shape[2]
    if num_splits is None:
        programs = batch * heads * triton.cdiv(t_q, tiles.block_q)
        if techniques.pack_group:  # one tile of rows per group
            group = heads // k.shape[1]
            programs = (
                batch * k.shape[1] * triton.cdiv(group * t_q, tiles.block_q)
            )
        num_splits = default_num_splits(
            programs, t_k, tiles.block_k, _multiprocessors(q.device)
        )
    keys_per_split, splits = split_sizes(t_k, num_splits, tiles.block_k)
    partial = torch.empty(
        (batch, heads, splits, t_q, d_k), dtype=torch.float32, device=q.device
    )
    partial_lse = torch.empty(partial.shape[:-1], **_like(partial))
    with torch.no_grad():
        split_kv_launch(
            q, k, v, partial, partial_lse, causal=causal, scale=scale,
            tiles=tiles, keys_per_split=keys_per_split, key_start=key_start,
            window=window, techniques=techniques,
        )()  # fmt: skip
        out, logsumexp = merge_partials(partial, partial_lse)
    return out.to(q.dtype), logsumexp


def merge_partials(partial: Tensor, partial_lse: Tensor):
    """:func:`mha.flash.merge_partials` in torch, over axis 2 (the splits).

    ``partial`` (B, H, S, T_q, d), ``partial_lse`` (B, H, S, T_q).
    """
    top = partial_lse.amax(dim=2, keepdim=True)  # (B, H, 1, T_q)
    top = top.masked_fill(top == -math.inf, 0.0)  # every split empty
    weights = torch.exp(partial_lse - top)  # (B, H, S, T_q)
    total = weights.sum(dim=2)  # (B, H, T_q)
    out = (weights[..., None] * partial).sum(dim=2)
    out = out / total.masked_fill(total == 0, 1.0)[..., None]
    return out, top[:, :, 0] + torch.log(total)


def _techniques(q: Tensor, techniques: object, k=None, v=None) -> Techniques:
    """The switches asked for, or the defaults; with ``tma``, the layout
    checked (:class:`Launch` gives Triton the descriptors' scratch memory
    on a GPU)."""
    if check_techniques(techniques) is None:
        techniques = default_techniques(capability_of(q.device))
    if techniques.tma:  # with warp_specialize, q's tile through one too
        _check_tma_layout(
            {"q": q, "k": k, "v": v} if techniques.warp_specialize
            else {"k": k, "v": v}
        )  # fmt: skip
    return techniques


def _check_tma_layout(tensors: dict[str, Tensor]) -> None:
    """A tensor descriptor's rules: the last stride 1, the other strides
    and each head's first element at multiples of 16 bytes."""
    for name, t in tensors.items():
        size = t.element_size()
        if t.stride(-1) != 1 or any(
            stride * size % 16 for stride in t.stride()[:-1]
        ) or t.data_ptr() % 16:  # fmt: skip
            raise ValueError(
                f"techniques.tma loads {name} through tensor descriptors: its "
                "last stride must be 1 and its other strides and address "
                f"multiples of 16 bytes, got strides {tuple(t.stride())} of "
                f"{size}-byte elements (d_k a multiple of {16 // size} and a "
                "contiguous last dimension make them so)"
            )


def _scratch(size: int, alignment: int, stream) -> Tensor:
    """Global memory for the tensor descriptors programs create."""
    del alignment, stream  # torch's allocations are 256-byte aligned
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _like(t: Tensor) -> dict:
    return {"dtype": t.dtype, "device": t.device}


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H100_MULTIPROCESSORS


#: Public names of the helpers that :mod:`mha.kernels.paged` shares.
online_step = _online_step
finish_rows = _finish
multiprocessors = _multiprocessors


class TritonAttention(torch.autograd.Function):
    """The kernels for autograd; saves q, k, v, output and logsumexp."""

    @staticmethod
    def forward(
        ctx, q, k, v, causal, scale, block_q, block_k, key_start, sinks=None,
        window=None, techniques=None,
    ):  # fmt: skip
        settings = dict(
            causal=causal, scale=scale, block_q=block_q, block_k=block_k,
            # the checked copy: the backward sees the forward's key starts
            key_start=check_key_start(key_start, q), window=window,
            techniques=techniques,
        )  # fmt: skip
        out, logsumexp = attention_forward(q, k, v, **settings, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, logsumexp, sinks)
        ctx.settings = settings
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, logsumexp, sinks = ctx.saved_tensors
        grads = attention_backward(
            q, k, v, out, logsumexp, d_out, **ctx.settings
        )  # the sinks' terms are in the logsumexp: the weights come right
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[8]:
            d_sinks = _sink_gradient(sinks, out, logsumexp, d_out)
        return (*grads, None, None, None, None, None, d_sinks, None, None)


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    key_start: Tensor | None = None,
    sinks: Tensor | None = None,
    window: int | None = None,
    techniques: Techniques | None = None,
) -> Tensor:
    """softmax(q k^T * scale) v by the Triton kernels, differentiable.

    Args:
        q: (B, H, T_q, d_k); k, v: (B, H_kv, T_k, d_k), H_kv dividing H
            (query head h reads key/value head ``h // (H / H_kv)``);
            float32 or float16, or bfloat16 on a GPU; any d_k up to 256.
            CUDA tensors for the compiled kernels, CPU tensors in the
            interpreter.
        causal: bottom-right aligned: query i attends to keys 0..i + T_k -
            T_q (top-left and bottom-right agree when T_q = T_k).
        scale: default ``1 / sqrt(d_k)``.
        block_q, block_k: tile sizes, powers of two from 16 to 256;
            default :func:`default_tiles`.
        key_start: (B,) integer tensor on q's device, or None: row b's
            keys 0..key_start[b] - 1 are padding (a left-padded batch; see
            :func:`mha.functional.key_start_from_attention_mask`), hidden
            from its queries and never read. A query that sees no key gets
            zeros. Any integer is meaningful: <= 0 hides nothing, >= T_k
            every key.
        sinks: (H,) learned sink logits (gpt-oss), one more term in each
            row's softmax with no value (:func:`mha.flash.flash_attention`);
            differentiable. None: no sinks.
        window: a positive int, or None: query i sees only its ``window``
            newest keys, its own included (keys j > i + T_k - T_q -
            window; a sliding window); the key tiles before every query's
            window are skipped, forward and backward.
        techniques: the kernels' switches, a :class:`Techniques`; None:
            :func:`default_techniques` (every switch off until a GPU
            measurement shows it pays). Only ``split_group`` changes the
            backward.

    Returns:
        (B, H, T_q, d_k), in the inputs' dtype.
    """
    return TritonAttention.apply(
        q, k, v, check_bool("causal", causal), scale, block_q, block_k,
        key_start, sinks, window, techniques,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# Argument checks (see mha._validate).


def _sink_gradient(sinks, out, logsumexp, d_out) -> Tensor:
    """d loss / d s_h = -sum over head h's rows of p_sink * delta, with
    ``p_sink = exp(s_h - logsumexp)`` and ``delta = sum(d_out * out)``: the
    sink's column carries no value (as in :mod:`mha.flash`)."""
    delta = (d_out.float() * out.float()).sum(dim=-1)  # (B, H, T_q)
    p_sink = torch.exp(sinks.float()[:, None] - logsumexp)  # (B, H, T_q)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)


def _check_sinks(sinks: object, q: Tensor) -> Tensor:
    check_tensor("sinks", sinks, ndim=1, shape=f"(H,) = ({q.shape[1]},)")
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(
            f"sinks must have shape (H,) = ({q.shape[1]},), one logit per "
            f"query head, got shape {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(
            f"sinks must be on q's device {q.device}, got {sinks.device}"
        )
    # -inf is no sink; NaN and +inf would pass as a row that saw no key
    # (one read of the values, which a decoding step's backends never pay:
    # none of them hands sinks to these kernels)
    bad = torch.isnan(sinks) | (sinks == math.inf)
    if bad.any():
        raise ValueError(
            "sinks must be finite logits, or -inf for a head with no sink, "
            f"got {sinks[bad][0].item()} at head "
            f"{int(bad.nonzero()[0, 0])}"
        )
    return sinks


def check_runs_here(q: Tensor) -> None:
    """Where the kernels run: bfloat16 only compiled on a GPU (the
    interpreter's bfloat16 ``tl.dot`` is wrong), and compiled kernels only
    on CUDA tensors. Shared by every kernel's checks."""
    if INTERPRETED and q.dtype == torch.bfloat16:
        raise ValueError(
            "bfloat16 runs on a GPU only: tl.dot in bfloat16 is wrong in "
            "Triton's interpreter (TRITON_INTERPRET=1)"
        )
    if INTERPRETED and (problem := interpreter_problem()) is not None:
        raise RuntimeError(problem)
    if not INTERPRETED and q.device.type != "cuda":
        raise ValueError(
            f"the compiled kernels need CUDA tensors, got {q.device}; set "
            "TRITON_INTERPRET=1 before importing mha.kernels to run them "
            "on the CPU"
        )


def check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise if the kernels cannot take q, k and v (shapes, dtype, head
    size, device): the checks of :func:`triton_attention` on its tensors,
    for a caller that must know before it changes anything (a cache)."""
    _check_inputs(q, k, v, None, None, None)


#: The largest tile side ``block_q`` and ``block_k`` take (the defaults are
#: at most 128; a 256 x 256 float32 tile of scores is already 256 KiB, more
#: than a multiprocessor's shared memory).
MAX_BLOCK = 256


def _check_inputs(q, k, v, scale, block_q, block_k) -> float:
    """The kernels' requirements, each with a clear error; returns scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, kind=None, ndim=4, shape="(B, H, T, d_k)")
    check_same("q, k and v", (q, k, v))
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if q.dtype not in dtypes:
        raise TypeError(
            f"q, k and v must be float32, float16 or bfloat16, got {q.dtype}"
        )
    if (
        k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            "q must have shape (B, H, T_q, d_k) and k, v (B, H_kv, T_k, d_k), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            "k and v must have a number of heads H_kv that divides q's H, got "
            f"H = {q.shape[1]} and H_kv = {k.shape[1]}"
        )
    if not 0 < q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(
            f"d_k (the last dimension of q) must be from 1 to {MAX_HEAD_DIM}"
            f", got {q.shape[-1]}"
        )
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(
            "q and k must hold at least one position each, got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    check_runs_here(q)
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block is None:
            continue
        if isinstance(block, bool) or not isinstance(block, numbers.Integral):
            raise TypeError(
                f"{name} must be an int or None, got "
                f"{type(block).__name__} {block!r}"
            )
        if not 16 <= block <= MAX_BLOCK or block & (block - 1):
            raise ValueError(
                f"{name} must be a power of two from 16 (tl.dot's smallest "
                f"tile) to {MAX_BLOCK}, got {block}"
            )
    return check_scale(scale, q.shape[-1])
