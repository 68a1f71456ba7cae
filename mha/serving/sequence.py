"""A request as the engine holds it: its tokens, its blocks, its state.

A :class:`Sequence` is one request: the prompt, the tokens generated so far,
the pool blocks that hold its keys and values (its block table), how many of
its tokens have their keys and values in those blocks (``num_computed``),
its sampling settings and its state (waiting, running, finished). Every
token of ``tokens`` but the newest is computed once the sequence decodes;
a waiting sequence (new, or preempted) computes its tokens again from
``num_computed`` on, in chunks (nano-vllm's ``Sequence``, one idea less:
no separate prompt and completion caches).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from .._validate import check_int
from ..configs import check_context
from ..sampling import SAMPLING_ARGUMENTS, Sampling

__all__ = ["Status", "Sequence", "SAMPLING"]

#: The settings a request takes: :meth:`mha.CausalLM.generate`'s, and
#: ``ignore_eos`` (vLLM's: run to ``max_new_tokens`` whatever is sampled).
SAMPLING = (*SAMPLING_ARGUMENTS, "generation_config", "ignore_eos")

_ids = itertools.count()


class Status(enum.Enum):
    """Where a sequence is: waiting for blocks, running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: ``prompt`` token ids, at most ``max_new_tokens`` more.

    ``sampling``: how it chooses its tokens (:class:`mha.sampling.Sampling`;
    greedy by default). ``eos``: token ids that end it (its sampling's stop
    tokens, none with ``ignore_eos``).
    """

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    eos: tuple[int, ...] = ()
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(init=False)
    block_table: list[int] = field(default_factory=list, init=False)
    hashes: list[int] = field(default_factory=list, init=False)  # full blocks
    num_computed: int = field(default=0, init=False)
    status: Status = field(default=Status.WAITING, init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @classmethod
    def request(
        cls, prompt_ids, max_new_tokens: int, sampling: dict, config
    ) -> Sequence:
        """A checked request for a model of ``config`` (its vocabulary and
        eos tokens): ``prompt_ids`` a list or 1-D tensor of token ids."""
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.is_floating_point():
                raise ValueError(
                    "prompt_ids must be a 1-D integer tensor or a list of "
                    f"ints, got {prompt_ids.dtype} of shape "
                    f"{tuple(prompt_ids.shape)}"
                )
            prompt_ids = prompt_ids.tolist()
        prompt = [check_int("prompt_ids[i]", t, minimum=0) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token id")
        if max(prompt) >= config.vocab_size:
            raise ValueError(
                f"prompt_ids must lie in [0, vocab_size = "
                f"{config.vocab_size}), got {max(prompt)} among "
                f"{prompt[:8]}{' ...' if len(prompt) > 8 else ''}"
            )
        check_int("max_new_tokens", max_new_tokens)
        check_context(len(prompt), max_new_tokens, config)
        sampling = dict(sampling)
        unknown = set(sampling) - set(SAMPLING)
        if unknown:
            raise ValueError(f"sampling takes {SAMPLING}, got {unknown}")
        ignore_eos = sampling.pop("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {ignore_eos!r}")
        chooser = Sampling.resolve(
            config, sampling.pop("generation_config", None), **sampling
        )
        eos = () if ignore_eos else chooser.eos_token_ids
        return cls(prompt, max_new_tokens, chooser, eos)

    def __len__(self) -> int:
        """Tokens so far: prompt and generated."""
        return len(self.tokens)

    @property
    def generated(self) -> list[int]:
        """The tokens generated so far."""
        return self.tokens[len(self.prompt) :]

    @property
    def to_compute(self) -> int:
        """Tokens whose keys and values are not in the pool yet (1 while
        decoding: the newest token)."""
        return len(self.tokens) - self.num_computed

    @property
    def prefilling(self) -> bool:
        """True while more than the newest token waits to be computed."""
        return self.to_compute > 1

    def append(self, token: int) -> None:
        """Add a generated token; finish at ``max_new_tokens`` or an eos."""
        self.tokens.append(token)
        if len(self.generated) >= self.max_new_tokens or token in self.eos:
            self.status = Status.FINISHED
