"""The next token, chosen as transformers' ``generate`` chooses it.

:class:`Sampling` holds one request's settings, resolved as transformers
resolves them: an argument given, else the ``generation_config`` (a
``generation_config.json`` dict or a ``GenerationConfig``), else
transformers' own defaults (``temperature`` 1.0, ``top_k`` 50, ``top_p``
1.0: with ``do_sample=True`` and nothing else, the 50 likeliest tokens);
the stop tokens from the model's config unless given. ``top_k=0`` and
``top_p=1.0`` switch those cuts off, as in transformers and vLLM.
:meth:`Sampling.choose` applies transformers' order: its logits processors
(``repetition_penalty``, then ``min_new_tokens``, which holds the stop
tokens back) to greedy and sampled decoding alike, then, when sampling, its
warpers (temperature, top-k, top-p, min-p) and one draw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from ._validate import check_float, check_int

__all__ = ["Sampling", "sample", "GENERATION_DEFAULTS", "SAMPLING_ARGUMENTS"]

#: transformers' defaults for what neither the call nor the generation
#: config sets (``GenerationConfig._get_default_generation_params``).
GENERATION_DEFAULTS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}

#: The settings a request takes, as keyword arguments.
SAMPLING_ARGUMENTS = (
    *GENERATION_DEFAULTS,
    "eos_token_id",
    "pad_token_id",
    "generator",
)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request chooses its tokens (see the module)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    generator: torch.Generator | None = None

    @classmethod
    def resolve(
        cls, model_config, generation_config=None, **given
    ) -> Sampling:
        """The settings: ``given`` (None: not given), else
        ``generation_config``'s, else transformers' defaults; the stop and
        pad tokens else ``model_config``'s. Each checked by name."""
        unknown = set(given) - set(SAMPLING_ARGUMENTS)
        if unknown:
            raise ValueError(
                f"sampling takes {SAMPLING_ARGUMENTS}, got {sorted(unknown)}"
            )
        saved = _fields(generation_config)
        settings = {}
        for name in (*GENERATION_DEFAULTS, "eos_token_id", "pad_token_id"):
            value = given.get(name)
            if value is None:
                value = saved.get(name)
            if value is None and name in GENERATION_DEFAULTS:
                value = GENERATION_DEFAULTS[name]
            settings[name] = value
        eos = settings.pop("eos_token_id")
        eos = model_config.eos_token_ids if eos is None else _ids(eos)
        pad = settings.pop("pad_token_id")
        pad = model_config.pad_token_id if pad is None else pad
        sampling = cls(
            **settings,
            eos_token_ids=tuple(eos),
            pad_token_id=pad,
            generator=given.get("generator"),
        )
        sampling._check()
        return sampling

    def _check(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise TypeError(
                f"do_sample must be a bool, got {self.do_sample!r}"
            )
        check_float("temperature", self.temperature)  # positive, finite
        check_int("top_k", self.top_k, minimum=0)  # 0: no top-k
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.min_p is not None and not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p!r}")
        check_float("repetition_penalty", self.repetition_penalty)
        check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.pad_token_id is not None:
            check_int("pad_token_id", self.pad_token_id, minimum=0)

    def choose(
        self, scores: Tensor, tokens: Tensor | None, new: int
    ) -> Tensor:
        """The next token of each row: ``scores`` (B, V) the last
        position's logits, ``tokens`` (B, T) every token so far (prompt
        and new), ``new`` how many were generated so far."""
        scores = scores.float()
        if self.repetition_penalty != 1.0:  # every token seen so far
            if tokens is None:
                raise ValueError("repetition_penalty needs the tokens so far")
            seen = torch.gather(scores, 1, tokens)
            seen = torch.where(
                seen < 0,
                seen * self.repetition_penalty,
                seen / self.repetition_penalty,
            )
            scores = scores.scatter(1, tokens, seen)
        if new < self.min_new_tokens and self.eos_token_ids:
            stop = torch.tensor(self.eos_token_ids, device=scores.device)
            scores = scores.index_fill(1, stop, -torch.inf)
        if not self.do_sample:
            return scores.argmax(dim=-1)
        return sample(
            scores,
            self.temperature,
            self.top_k,
            self.top_p,
            self.generator,
            min_p=self.min_p,
        )


def sample(
    scores: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    *,
    min_p: float | None = None,
) -> Tensor:
    """One token per row of ``scores`` (B, V): transformers' warpers in its
    order (temperature, top-k, top-p, min-p), then a draw from the softmax.
    ``top_k`` None or 0, ``top_p`` None or 1.0, ``min_p`` None: no cut."""
    scores = scores / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        ascending, order = scores.sort(dim=-1)  # (B, V)
        mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = mass <= 1 - top_p  # the unlikeliest tokens, mass 1 - top_p
        drop[:, -1] = False  # keep at least the likeliest
        scores = scores.masked_fill(drop.scatter(1, order, drop), -torch.inf)
    if min_p is not None:  # below min_p times the likeliest's probability
        probabilities = scores.softmax(dim=-1)
        floor = min_p * probabilities.amax(dim=-1, keepdim=True)
        drop = probabilities < floor
        drop.scatter_(1, probabilities.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(drop, -torch.inf)
    probabilities = scores.softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator)[:, 0]


def _fields(config) -> dict:
    """A generation config's settings: a dict, an object with attributes
    (``GenerationConfig``), or None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(
        "generation_config must be a dict (generation_config.json) or a "
        f"GenerationConfig, got {type(config).__name__}"
    )


def _ids(value) -> tuple[int, ...]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(check_int("eos_token_id", v, minimum=0) for v in values)
