"""The engine: requests in, one forward of the model per step, tokens out.

:class:`Engine` serves a :class:`mha.CausalLM`: :meth:`~Engine.add_request`
queues a prompt at any time, :meth:`~Engine.step` asks the scheduler for the
step's work (decode tokens and prefill chunks, :mod:`.scheduler`), lays it
out as one row of tokens with each token's own position, runs the model once
over it (every attention layer reading keys and values through the block
tables, :mod:`.layer`), samples the next token of every request whose
tokens are all computed, frees the blocks of finished requests, and returns
each request's new tokens (a stream). :meth:`~Engine.run` steps until every
request is done and returns what finished; :meth:`~Engine.abort` drops a
request. A finished request is forgotten once it has been returned, so a
long-running engine holds only the requests in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validate import check_int
from ..blocks import BlockAllocator
from ..model import CausalLM
from .batch import StepPlan
from .layer import PagedLayer
from .scheduler import Scheduler
from .sequence import Sequence, Status

__all__ = ["Engine", "EngineStats", "StepOutput"]


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request: its ``new_tokens`` (none for a
    prefill chunk that is not its prompt's last), whether it ``finished``,
    and every token it has ``generated``."""

    id: int
    new_tokens: list[int]
    finished: bool
    generated: list[int]


@dataclass
class EngineStats:
    """What the engine did: tokens computed in prefill chunks and decode
    steps, prompt positions reused from the prefix cache, preemptions,
    the most blocks in use at once, steps (forwards)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefix_tokens_reused: int = 0
    preemptions: int = 0
    peak_blocks_in_use: int = 0
    steps: int = 0


class Engine:
    """Continuous batching with a paged cache over ``num_blocks`` blocks.

    ``max_num_batched_tokens``: tokens one forward computes at most (decode
    tokens and prefill chunks together). Attention reads the pool through
    the backend's paged kernel (``triton``:
    :func:`mha.kernels.triton_paged_attention`), else gathers each step's
    keys (:mod:`.layer`).
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 256,
        prefix_caching: bool = True,
    ) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(
                f"model must be an mha.CausalLM, got {type(model).__name__}"
            )
        self.max_num_batched_tokens = check_int(
            "max_num_batched_tokens", max_num_batched_tokens
        )
        self.model = model  # its train/eval state is the caller's
        self.allocator = BlockAllocator(
            num_blocks, block_size, prefix_caching=prefix_caching
        )
        self.scheduler = Scheduler(self.allocator, max_num_batched_tokens)
        attn, weight = model.model.layers[0].self_attn, model.lm_head.weight
        self.layers = [
            PagedLayer(
                num_blocks,
                block_size,
                attn.num_kv_heads,
                attn.head_dim,
                dtype=weight.dtype,
                device=weight.device,
            )
            for _ in model.model.layers
        ]
        self.stats = EngineStats()
        self.requests: dict[int, Sequence] = {}
        self.last_batch: list[tuple[int, int]] = []  # (id, tokens)

    def add_request(self, prompt_ids, max_new_tokens: int, **sampling) -> int:
        """Queue ``prompt_ids`` (a list or 1-D tensor of token ids) for at
        most ``max_new_tokens`` new tokens; returns its id. ``sampling``:
        the settings :meth:`mha.CausalLM.generate` takes (greedy by
        default; ``eos_token_id`` its own stop tokens), and ``ignore_eos``
        (run to ``max_new_tokens``)."""
        seq = Sequence.request(
            prompt_ids, max_new_tokens, sampling, self.model.config
        )
        alloc = self.allocator
        needed = -(-(len(seq) + max_new_tokens - 1) // alloc.block_size)
        if needed > alloc.num_blocks:
            raise ValueError(
                f"a prompt of {len(seq)} tokens and max_new_tokens = "
                f"{max_new_tokens} need {needed} blocks of "
                f"{alloc.block_size} positions; the pool has num_blocks = "
                f"{alloc.num_blocks}: it could never fit"
            )
        self.requests[seq.id] = seq
        self.scheduler.add(seq)
        return seq.id

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One forward over the scheduled tokens: a :class:`StepOutput` for
        each request in it, in the step's order. The finished ones are
        forgotten."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        device = self.layers[0].k_pool.device
        plan = StepPlan.build(batch, self.allocator.block_size, device)
        self.last_batch = [(seq.id, count) for seq, count in batch]
        for layer in self.layers:
            layer.plan = plan
        training = self.model.training
        self.model.eval()  # no dropout while serving; then as it was
        try:
            logits = self.model(
                plan.ids,
                position_ids=plan.positions,
                caches=self.layers,
                logits_to_keep=plan.last,
            )
        finally:
            self.model.train(training)
        new = self._sample(batch, logits[0].float())  # (requests, V)
        self.scheduler.finish(batch)
        self._count(plan.decodes, plan.ids.shape[1])
        outputs = []
        for seq, _ in batch:
            finished = seq.status is Status.FINISHED
            outputs.append(
                StepOutput(
                    seq.id, new.get(seq.id, []), finished, list(seq.generated)
                )
            )
            if finished:
                self.requests.pop(seq.id, None)
        return outputs

    def abort(self, request_id: int) -> None:
        """Drop a waiting or running request: its blocks go back, it is
        forgotten. ValueError for an id not in flight."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            raise ValueError(
                f"request_id must be a request in flight, got {request_id!r}"
                f" (in flight: {sorted(self.requests)})"
            )
        self.scheduler.abort(seq)

    def _sample(self, batch, logits) -> dict[int, list[int]]:
        new = {}
        for (seq, count), scores in zip(batch, logits):
            if seq.num_computed + count < len(seq):
                continue  # a prefill chunk that is not the last
            chooser, tokens = seq.sampling, None
            if chooser.repetition_penalty != 1.0:  # every token so far
                tokens = torch.tensor([seq.tokens], device=scores.device)
            token = chooser.choose(scores[None], tokens, len(seq.generated))
            seq.append(int(token))
            new[seq.id] = [int(token)]
        return new

    def _count(self, decodes: int, tokens: int) -> None:
        stats, scheduler = self.stats, self.scheduler
        stats.steps += 1
        stats.decode_tokens += decodes
        stats.prefill_tokens += tokens - decodes
        stats.preemptions = scheduler.preemptions
        stats.prefix_tokens_reused = scheduler.prefix_tokens_reused
        stats.peak_blocks_in_use = scheduler.peak_blocks

    def run(self) -> dict[int, list[int]]:
        """Step until every request is done; {id: generated token ids} of
        the requests that finished in this call, in the order of their
        ids (of their arrival)."""
        done = {}
        while self.scheduler.has_work():
            for output in self.step():
                if output.finished:
                    done[output.id] = output.generated
        return dict(sorted(done.items()))
