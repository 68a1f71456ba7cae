"""One step's mixed batch: which tokens run, where their keys go, what each
query sees.

The engine lays a step's tokens out in one row: the newest token of every
decoding request first, then each prefill chunk, (1, N) tokens in all.
:class:`StepPlan` holds that row, the pool slot of each token's keys and
values, and the groups of queries that one attention call serves: all
decode tokens together (T_q = 1 each), and each prefill chunk alone (its
request's T_q newest positions), each group with its block tables and
lengths as :func:`mha.kernels.triton_paged_attention` takes them. Every
layer reads the same plan (:mod:`.layer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from ..kernels.paged_torch import page_index

__all__ = ["StepPlan"]


@dataclass
class StepPlan:
    """A step's N tokens, where they go and what each attends to.

    ``ids``, ``positions`` (1, N): the tokens and their positions, decode
    tokens first; ``last`` (R,): the index of each request's last token;
    ``decodes``: how many are decode tokens; ``blocks``, ``offsets``
    (N,): the pool slot of each token's keys and values; ``groups``:
    (first, end, block_table (B, max_blocks) int32, seq_lens (B,) int32)
    for the tokens first .. end - 1, as
    :func:`mha.kernels.triton_paged_attention` takes them (the decode
    tokens form one group of B requests, T_q = 1; each chunk a group of
    one request, T_q = end - first); ``longest``: each group's longest
    length, known on the host (the kernels' ``max_seq_len``: no layer
    reads the lengths back from the device).
    """

    ids: Tensor
    positions: Tensor
    last: Tensor
    decodes: int
    blocks: Tensor
    offsets: Tensor
    groups: list[tuple[int, int, Tensor, Tensor]]
    block_size: int
    longest: list[int] = field(default_factory=list)
    _gathers: dict = field(default_factory=dict)

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
            slots += [
                (seq.block_table[p // block_size], p % block_size) for p in new
            ]
            last.append(len(ids) - 1)
            if not _decoding(seq):  # a chunk: its own group
                groups.append((len(ids) - count, len(ids), [seq], [new.stop]))
        if decodes:  # one group of all decode tokens, T_q = 1
            seqs = [seq for seq, _ in batch[:decodes]]
            groups.insert(0, (0, decodes, seqs, [len(s) for s in seqs]))
        tensor = partial(torch.tensor, device=device)
        return cls(
            tensor([ids]),
            tensor([positions]),
            tensor(last),
            decodes,
            *tensor(slots).T,  # blocks (N,), offsets (N,)
            [
                (
                    first,
                    end,
                    _table(seqs, tensor),
                    tensor(lens, dtype=torch.int32),
                )
                for first, end, seqs, lens in groups
            ],
            block_size,
            [max(lens) for _, _, _, lens in groups],
        )

    def gather(self, group: int):
        """Where group ``group``'s keys lie, for attention over gathered
        keys, right-aligned so that every request's newest key is the last
        (its queries the newest, as an attention backend takes them):
        blocks and slots (B, L) of the L = longest length key positions,
        ``padding`` (B, L), False at the slots before a shorter request's
        first key (a left-padded batch), and ``key_start`` (B,) int32, the
        index of that first key. Made once per step, without reading the
        device, and shared by every layer."""
        if group not in self._gathers:
            first, end, table, lens = self.groups[group]
            longest = self.longest[group]
            blocks, slots, padding = page_index(
                table, self.block_size, longest, lens, right_aligned=True
            )
            key_start = (longest - lens).to(torch.int32)
            self._gathers[group] = blocks, slots, padding, key_start
        return self._gathers[group]


def _decoding(seq) -> bool:
    """Whether ``seq`` computes its newest generated token alone."""
    return seq.to_compute == 1 and len(seq) > len(seq.prompt)


def _table(seqs: list, tensor) -> Tensor:
    """The block tables of ``seqs``, padded: (B, max_blocks) int32."""
    width = max(len(s.block_table) for s in seqs)
    return tensor(
        [s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
        dtype=torch.int32,
    )
