"""One step's mixed batch, as each attention layer reads it from the pool.

The engine lays a step's tokens out in one row: the newest token of every
decoding request first, then each prefill chunk, (1, N) tokens in all. Each
layer has a :class:`PagedLayer`: its pools ``k_pool``, ``v_pool``
(num_blocks, block_size, H_kv, d_k), shared by every request through their
block tables. Given the step's :class:`StepPlan`, its :meth:`attend`
writes the new keys and values into their slots (the only bytes it moves)
and computes attention through the block tables, where the blocks lie: one
call for all decode tokens (T_q = 1 each), one per prefill chunk (the
chunk's T_q newest positions of its request). The model's attention layer
calls :meth:`attend` in place of a cache's ``update`` (:mod:`mha.model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

__all__ = ["StepPlan", "PagedLayer"]


@dataclass
class StepPlan:
    """A step's N tokens, where they go and what each attends to.

    ``ids``, ``positions`` (1, N): the tokens and their positions, decode
    tokens first; ``last``: the index of each request's last token;
    ``decodes``: how many are decode tokens; ``blocks``, ``offsets``
    (N,): the pool slot of each token's keys and values; ``groups``:
    (first, end, block_table (B, max_blocks) int32, seq_lens (B,) int32)
    for the tokens first .. end - 1, as
    :func:`mha.kernels.triton_paged_attention` takes them (the decode
    tokens form one group of B requests, T_q = 1; each chunk a group of
    one request, T_q = end - first).
    """

    ids: Tensor
    positions: Tensor
    last: list[int]
    decodes: int
    blocks: Tensor
    offsets: Tensor
    groups: list[tuple[int, int, Tensor, Tensor]]

    @classmethod
    def build(cls, batch: list, block_size: int, device) -> StepPlan:
        """From the scheduler's [(request, tokens to compute)], which it
        sorts (decode tokens first)."""
        batch.sort(key=lambda work: not _decoding(work[0]))
        decodes = sum(_decoding(seq) for seq, _ in batch)
        ids, positions, slots, last, groups = [], [], [], [], []
        for seq, count in batch:  # the step's tokens in one row
            new = range(seq.num_computed, seq.num_computed + count)
            ids += seq.tokens[new.start : new.stop]
            positions += new
            slots += [(seq.block_table[p // block_size], p % block_size)
                      for p in new]  # fmt: skip
            last.append(len(ids) - 1)
            if not _decoding(seq):  # a chunk: its own group
                groups.append((len(ids) - count, len(ids), [seq], [new.stop]))
        if decodes:  # one group of all decode tokens, T_q = 1
            seqs = [seq for seq, _ in batch[:decodes]]
            groups.insert(0, (0, decodes, seqs, [len(s) for s in seqs]))
        tensor = partial(torch.tensor, device=device)
        return cls(
            tensor([ids]), tensor([positions]), last, decodes,
            *tensor(slots).T,  # blocks (N,), offsets (N,)
            [(first, end, _table(seqs, tensor),
              tensor(lens, dtype=torch.int32))
             for first, end, seqs, lens in groups],
        )  # fmt: skip


class PagedLayer:
    """One layer's key and value pools, read through block tables."""

    max_len = None  # positions live in the pool, not in a fixed row
    seen = 0  # each token's position comes with the step (position_ids)

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim,
                 *, dtype, device, attention) -> None:  # fmt: skip
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.attention = attention  # (q, k_pool, v_pool, table, lens)
        self.plan: StepPlan | None = None

    def check_update(self, batch, num_kv_heads, new_tokens, head_dim,
                     dtype, device, *, v=None) -> None:  # fmt: skip
        """Raise unless the new keys fit the pool: (1, H_kv, N, d_k)."""
        pool = self.k_pool
        if (batch, num_kv_heads, head_dim) != (1, *pool.shape[2:]) or (
            dtype != pool.dtype
        ):
            raise ValueError(
                f"a paged step takes keys (1, H_kv, N, d_k) with (H_kv, d_k)"
                f" = {tuple(pool.shape[2:])} in {pool.dtype}, got "
                f"{(batch, num_kv_heads, new_tokens, head_dim)} in {dtype}"
            )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window=None) -> Tensor:
        """q (1, H, N, d_k), new k, v (1, H_kv, N, d_k) -> (1, H, N, d_k)."""
        if window is not None:
            raise ValueError(
                f"the paged kernel takes no sliding window, got {window}"
            )
        plan = self.plan
        # token n's keys and values into its slot: (N, H_kv, d_k)
        self.k_pool[plan.blocks, plan.offsets] = k[0].transpose(0, 1)
        self.v_pool[plan.blocks, plan.offsets] = v[0].transpose(0, 1)
        parts = []
        for first, end, table, lens in plan.groups:
            if len(lens) > 1:  # decode tokens, one per request
                rows = q[0, :, first:end].transpose(0, 1)[:, :, None]
            else:  # a chunk of one request
                rows = q[:, :, first:end]  # (1, H, T_q, d_k)
            out = self.attention(
                rows.contiguous(), self.k_pool, self.v_pool, table, lens
            )
            if len(lens) > 1:
                out = out[:, :, 0].transpose(0, 1)[None]  # (1, H, B, d_k)
            parts.append(out)
        return torch.cat(parts, dim=2)  # (1, H, N, d_k)


def _decoding(seq) -> bool:
    """Whether ``seq`` computes its newest generated token alone."""
    return seq.to_compute == 1 and len(seq) > len(seq.prompt)


def _table(seqs: list, tensor) -> Tensor:
    """The block tables of ``seqs``, padded: (B, max_blocks) int32."""
    width = max(len(s.block_table) for s in seqs)
    return tensor([s.block_table + [0] * (width - len(s.block_table))
                   for s in seqs], dtype=torch.int32)  # fmt: skip
