"""Which tokens of which requests the next forward computes.

The scheduler keeps two queues, ``waiting`` (first come, first served;
preempted requests go to its front) and ``running``. Each step it fills a
budget of ``max_num_batched_tokens`` tokens:

1. every running request, oldest first: its newest token (decoding) or the
   next chunk of its prompt (a prefill that an earlier step began). A
   decoding request that needs a new block and finds the pool empty
   preempts the newest running request: its blocks go back, it returns to
   the front of the waiting queue, and computes its tokens again when it is
   admitted again (vLLM's recomputation);
2. then waiting requests, while budget is left and the pool has blocks for
   every token of the request (its prompt; after a preemption, its prompt
   and what it had generated): admitted, they take those blocks (reusing
   cached ones, :class:`~mha.blocks.BlockAllocator`) and the
   first chunk of what is left to compute.

So one step mixes decode tokens with prefill chunks (chunked prefill,
vLLM's and Sarathi's); a long prompt never holds up the decoding of others
for more than a budget's worth of tokens.
"""

from __future__ import annotations

from collections import deque

from ..blocks import BlockAllocator, OutOfBlocks, block_hashes
from .sequence import Sequence, Status

__all__ = ["Scheduler"]


class Scheduler:
    """Waiting and running queues over one :class:`BlockAllocator`."""

    def __init__(self, allocator: BlockAllocator, max_num_batched_tokens: int):
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.preempted_now = 0  # in the step being scheduled
        self.prefix_tokens_reused = 0
        self.peak_blocks = 0  # the most blocks in use at once

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: (request, tokens to compute) in order."""
        budget, batch = self.max_num_batched_tokens, []
        self.preempted_now = 0
        for seq in list(self.running):  # oldest first
            if seq.status is not Status.RUNNING:  # preempted meanwhile
                continue
            count = min(seq.to_compute, budget)
            if count == 0:
                break
            if not self._make_room(seq, seq.num_computed + count):
                continue  # it preempted itself
            batch.append((seq, count))
            budget -= count
        while self.waiting and budget > 0 and not self.preempted_now:
            seq = self.waiting[0]
            if not self._admit(seq):
                break  # first come, first served: no overtaking
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            count = min(seq.to_compute, budget)
            batch.append((seq, count))
            budget -= count
        return batch

    @property
    def blocks_in_use(self) -> int:
        """Blocks that some request holds."""
        return self.allocator.num_blocks - self.allocator.num_free

    def _admit(self, seq: Sequence) -> bool:
        """Blocks for every token of ``seq``, cached ones first; False
        (nothing taken) if the pool is short."""
        try:
            blocks, cached = self.allocator.allocate_prompt(seq.tokens)
        except OutOfBlocks:
            return False
        seq.block_table, seq.num_computed = blocks, cached
        seq.hashes = block_hashes(
            seq.tokens[:cached], self.allocator.block_size
        )
        self.prefix_tokens_reused += cached
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)
        return True

    def _make_room(self, seq: Sequence, positions: int) -> bool:
        """Blocks for ``positions`` positions of ``seq``, preempting the
        newest running requests if needed; False if ``seq`` was the one."""
        size = self.allocator.block_size
        needed = -(-positions // size) - len(seq.block_table)
        while needed > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_table += [self.allocator.allocate() for _ in range(needed)]
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)
        return True

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table, seq.num_computed, seq.hashes = [], 0, []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.preempted_now += 1

    def abort(self, seq: Sequence) -> None:
        """Drop a waiting or running request; its blocks go back."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def finish(self, batch: list[tuple[Sequence, int]]) -> list[Sequence]:
        """After the forward: count the computed tokens, hash full blocks,
        free the blocks of finished requests; returns those."""
        done = []
        size = self.allocator.block_size
        for seq, count in batch:
            seq.num_computed += count
            for i in range(len(seq.hashes), seq.num_computed // size):
                parent = seq.hashes[-1] if seq.hashes else None
                tokens = seq.tokens[i * size : (i + 1) * size]
                block = seq.block_table[i]  # full and computed: findable
                seq.hashes.append(
                    self.allocator.register(block, parent, tokens)
                )
            if seq.status is Status.FINISHED:
                self.running.remove(seq)
                self._release(seq)
                done.append(seq)
        return done
