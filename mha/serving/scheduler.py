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
   cached ones, :class:`~mha.serving.allocator.BlockAllocator`) and the
   first chunk of what is left to compute.

So one step mixes decode tokens with prefill chunks (chunked prefill,
vLLM's and Sarathi's); a long prompt never holds up the decoding of others
for more than a budget's worth of tokens.
"""

from __future__ import annotations

from collections import deque

from .allocator import BlockAllocator
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
            if not self.allocator.can_allocate(seq):
                break  # first come, first served: no overtaking
            self.waiting.popleft()
            self.prefix_tokens_reused += self.allocator.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            count = min(seq.to_compute, budget)
            batch.append((seq, count))
            budget -= count
        return batch

    def _make_room(self, seq: Sequence, positions: int) -> bool:
        """Blocks for ``positions`` positions of ``seq``, preempting the
        newest running requests if needed; False if ``seq`` was the one."""
        while not self.allocator.can_append(seq, positions):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.allocator.append(seq, positions)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.preempted_now += 1

    def finish(self, batch: list[tuple[Sequence, int]]) -> list[Sequence]:
        """After the forward: count the computed tokens, hash full blocks,
        free the blocks of finished requests; returns those."""
        done = []
        for seq, count in batch:
            seq.num_computed += count
            self.allocator.register(seq)
            if seq.status is Status.FINISHED:
                self.running.remove(seq)
                self.allocator.release(seq)
                done.append(seq)
        return done
