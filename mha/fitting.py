"""Two relationships that compete for one softmax.

A constructed task, and fits of attention to it.

The task (chapter 02). A sequence has ``T = 8`` tokens of ``4`` kinds, each
kind exactly twice, placed so that no two neighbours (on a circle: token 0
follows token 7) are of the same kind. Every token carries a random *payload*,
a vector of 4 standard-normal numbers. Token ``i`` must report two things:

* the payload of the **previous** token, ``(i - 1) mod T``;
* the payload of its **partner**, the other token of the same kind.

Each is a sharp, one-key attention pattern, and they never point at the same
key. A model is one layer of self-attention without biases, ``D`` columns wide,
cut into ``H`` heads of ``d_k = D / H``; it is fitted by Adam on the mean
squared error. Everything is float64 and every random number comes from an
explicit ``torch.Generator``, so a fit is reproducible.

Shapes: ``B`` sequences, ``T`` positions, ``D_in`` input features,
``D`` = d_model, ``H`` heads, ``d_k = D / H``, ``P`` payload size, ``D_out``
target size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import functional
from ._validate import check_choice, check_divisible, check_int
from .functional import merge_heads, split_heads

__all__ = [
    "NUM_KINDS",
    "SEQ_LEN",
    "PAYLOAD_DIM",
    "INPUT_DIM",
    "TARGETS",
    "KIND_LETTERS",
    "TwoRelationBatch",
    "sample_kinds",
    "make_batch",
    "target_dim",
    "token_labels",
    "one_hot_pattern",
    "init_weights",
    "attention",
    "weight_on",
    "FitResult",
    "fit",
    "evaluate",
    "best_readout_loss",
]

NUM_KINDS = 4
SEQ_LEN = 8
PAYLOAD_DIM = 4
# kind one-hot, position one-hot, payload
INPUT_DIM = NUM_KINDS + SEQ_LEN + PAYLOAD_DIM
KIND_LETTERS = "ABCD"
DTYPE = torch.float64

TARGETS = ("separate", "sum", "previous_twice")
"""What each token must output:

* ``"separate"``: ``[payload(previous), payload(partner)]``, ``D_out = 2 P``:
  the two reads kept apart;
* ``"sum"``: ``(payload(previous) + payload(partner)) / sqrt(2)``,
  ``D_out = P``: only their sum;
* ``"previous_twice"``: ``[payload(previous), payload(previous)]``,
  ``D_out = 2 P``: one relationship, read twice.

Every target entry has mean 0 and variance 1, so predicting zeros gives a loss
of 1.
"""


@dataclass(frozen=True)
class TwoRelationBatch:
    """A batch of the task.

    Attributes:
        x: inputs, ``(B, T, D_in)``: kind one-hot (4), position one-hot (8),
            payload (4).
        target: ``(B, T, D_out)``, see :data:`TARGETS`.
        kinds: ``(B, T)`` ints in ``[0, 4)``.
        payload: ``(B, T, P)``.
        previous: ``(B, T)`` index of each token's previous token,
            ``(i - 1) mod T``.
        partner: ``(B, T)`` index of the other token of the same kind.
    """

    x: Tensor
    target: Tensor
    kinds: Tensor
    payload: Tensor
    previous: Tensor
    partner: Tensor


def _check_target(target: str) -> None:
    check_choice("target", target, TARGETS)


def target_dim(target: str) -> int:
    """D_out for a target name (see :data:`TARGETS`)."""
    _check_target(target)
    return PAYLOAD_DIM if target == "sum" else 2 * PAYLOAD_DIM


def sample_kinds(batch_size: int, generator: torch.Generator) -> Tensor:
    """``(B, T)`` kinds: each of the 4 kinds twice, no two neighbours alike.

    Neighbours are circular (token 0 follows token T - 1). Arrangements are
    drawn by rejection sampling.
    """
    check_int("batch_size", batch_size)
    # (T,) = 0 0 1 1 2 2 3 3
    pairs = torch.arange(NUM_KINDS).repeat_interleave(2)
    accepted: list[Tensor] = []
    count = 0
    while count < batch_size:
        order = torch.argsort(
            torch.rand(
                4 * batch_size, SEQ_LEN, generator=generator, dtype=DTYPE
            ),
            dim=1,
        )
        kinds = pairs[order]  # (4B, T): random arrangements
        # token i differs from token i - 1, circularly
        apart = (kinds != kinds.roll(1, dims=1)).all(dim=1)
        accepted.append(kinds[apart])
        count += int(apart.sum())
    return torch.cat(accepted)[:batch_size]  # (B, T)


def make_batch(
    batch_size: int, generator: torch.Generator, target: str = "separate"
) -> TwoRelationBatch:
    """Draw ``batch_size`` sequences of the task and their ``target``.

    ``target`` is one of :data:`TARGETS`.
    """
    _check_target(target)
    kinds = sample_kinds(batch_size, generator)  # (B, T)
    # (B, T, P)
    payload = torch.randn(
        batch_size, SEQ_LEN, PAYLOAD_DIM, generator=generator, dtype=DTYPE
    )
    # (T, T): row i is the one-hot of position i
    position = torch.eye(SEQ_LEN, dtype=DTYPE)
    x = torch.cat(
        [
            # (B, T, 4)
            torch.nn.functional.one_hot(kinds, NUM_KINDS).to(DTYPE),
            position.expand(batch_size, SEQ_LEN, SEQ_LEN),  # (B, T, T)
            payload,  # (B, T, P)
        ],
        dim=-1,
    )  # (B, T, D_in)
    # (B, T)
    previous = ((torch.arange(SEQ_LEN) - 1) % SEQ_LEN).expand(
        batch_size, SEQ_LEN
    )
    same_kind = kinds[:, :, None] == kinds[:, None, :]  # (B, T, T)
    # not itself: exactly one key per row remains
    same_kind &= ~torch.eye(SEQ_LEN, dtype=torch.bool)
    partner = same_kind.to(torch.int64).argmax(dim=-1)  # (B, T)
    read_previous = torch.gather(
        payload, 1, previous[..., None].expand(-1, -1, PAYLOAD_DIM)
    )  # (B, T, P)
    read_partner = torch.gather(
        payload, 1, partner[..., None].expand(-1, -1, PAYLOAD_DIM)
    )  # (B, T, P)
    if target == "separate":
        y = torch.cat([read_previous, read_partner], dim=-1)  # (B, T, 2P)
    elif target == "sum":
        y = (read_previous + read_partner) / math.sqrt(2.0)  # (B, T, P)
    else:
        y = torch.cat([read_previous, read_previous], dim=-1)  # (B, T, 2P)
    return TwoRelationBatch(
        x, y, kinds, payload, previous.contiguous(), partner
    )


def token_labels(kinds: Tensor) -> list[str]:
    """Labels like ``"C0", "A1", ...`` (kind letter, position) for a sequence.

    ``kinds`` holds one sequence's ``(T,)`` kinds.
    """
    return [f"{KIND_LETTERS[int(k)]}{i}" for i, k in enumerate(kinds)]


def one_hot_pattern(index: Tensor) -> Tensor:
    """``(B, T) -> (B, T, T)``: the attention map with one key per row.

    Row i puts all of its weight on key ``index[b, i]``.
    """
    return torch.nn.functional.one_hot(index, SEQ_LEN).to(DTYPE)


def init_weights(
    d_model: int, d_out: int, generator: torch.Generator, d_in: int = INPUT_DIM
) -> dict[str, Tensor]:
    """Random ``w_q, w_k, w_v``, ``(D_in, D)``, and ``w_o``, ``(D, D_out)``.

    The entries are normal with std ``1/sqrt(fan_in)``. The draw does not
    depend on the number of heads: the same seed gives the same matrices
    whether their ``D`` columns later form one head or several.
    """
    for name, value in (
        ("d_model", d_model),
        ("d_out", d_out),
        ("d_in", d_in),
    ):
        check_int(name, value)
    shapes = {
        "w_q": (d_in, d_model),
        "w_k": (d_in, d_model),
        "w_v": (d_in, d_model),
        "w_o": (d_model, d_out),
    }
    return {
        name: torch.randn(*shape, generator=generator, dtype=DTYPE)
        / math.sqrt(shape[0])
        for name, shape in shapes.items()
    }


def attention(
    x: Tensor, weights: dict[str, Tensor], num_heads: int
) -> tuple[Tensor, Tensor]:
    """Multi-head self-attention without biases, in torch (differentiable).

    Args:
        x: ``(B, T, D_in)``.
        weights: ``w_q, w_k, w_v`` of shape ``(D_in, D)``, ``w_o`` of shape
            ``(D, D_out)``; head ``h`` uses columns
            ``h * d_k : (h + 1) * d_k``, as in
            :func:`mha.reference.multi_head_attention`.
        num_heads: H; D must be divisible by H.

    Returns:
        ``(output, attn)`` of shapes ``(B, T, D_out)`` and ``(B, H, T, T)``.
    """
    d_k = _check_attention_inputs(x, weights, num_heads)
    # (B, H, T, d_k) each
    q, k, v = (split_heads(x @ weights[w], d_k) for w in ("w_q", "w_k", "w_v"))
    heads, attn = functional.attention(q, k, v)  # (B, H, T, d_k), (B, H, T, T)
    # (B, T, D_out), (B, H, T, T)
    return merge_heads(heads) @ weights["w_o"], attn


def _check_attention_inputs(
    x: Tensor, weights: dict[str, Tensor], num_heads: int
) -> int:
    """d_k, after checking x (B, T, D_in) and that num_heads divides D."""
    check_int("num_heads", num_heads)
    if x.ndim != 3:
        raise ValueError(
            f"x must have shape (B, T, D_in), got shape {tuple(x.shape)}"
        )
    return check_divisible(
        "d_model", weights["w_q"].shape[1], "num_heads", num_heads
    )


def weight_on(attn: Tensor, index: Tensor) -> Tensor:
    """``(H,)``: each head's weight on key ``index[b, i]`` for query ``i``.

    The weight is averaged over ``b`` and ``i``.

    Args:
        attn: ``(B, H, T, T)`` attention weights.
        index: ``(B, T)`` one key per query, e.g. ``batch.previous`` or
            ``batch.partner``.
    """
    if attn.ndim != 4 or index.shape != (attn.shape[0], attn.shape[2]):
        raise ValueError(
            "attn must have shape (B, H, T, T) and index (B, T), "
            f"got {tuple(attn.shape)} and {tuple(index.shape)}"
        )
    picked = torch.gather(
        attn, 3, index[:, None, :, None].expand(-1, attn.shape[1], -1, 1)
    )  # (B, H, T, 1)
    return picked.mean(dim=(0, 2, 3))  # (H,)


@dataclass
class FitResult:
    """One fit: its settings, the training loss of every step, its weights.

    The fitted weights are detached.
    """

    num_heads: int
    d_model: int
    target: str
    seed: int
    losses: np.ndarray  # (steps,)
    weights: dict[str, Tensor]


def fit(
    num_heads: int,
    d_model: int = 16,
    *,
    target: str = "separate",
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 0.03,
    seed: int = 0,
) -> FitResult:
    """Fit one attention layer to ``target`` with Adam.

    The layer has ``num_heads`` heads and ``d_model`` columns. Each step draws
    a fresh batch, so there is no fixed training set to memorise. The seed
    fixes the initial weights and every batch; with the same seed, models with
    different numbers of heads start from the same matrices and see the same
    batches.
    """
    _check_target(target)
    for name, value in (
        ("num_heads", num_heads),
        ("d_model", d_model),
        ("steps", steps),
        ("batch_size", batch_size),
    ):
        check_int(name, value)
    check_divisible("d_model", d_model, "num_heads", num_heads)
    generator = torch.Generator().manual_seed(seed)
    weights = init_weights(d_model, target_dim(target), generator)
    for w in weights.values():
        w.requires_grad_(True)
    optimizer = torch.optim.Adam(weights.values(), lr=lr)
    losses = np.empty(steps)
    for step in range(steps):
        batch = make_batch(batch_size, generator, target)
        output, _ = attention(batch.x, weights, num_heads)  # (B, T, D_out)
        loss = torch.mean((output - batch.target) ** 2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
    fitted = {name: w.detach().clone() for name, w in weights.items()}
    return FitResult(num_heads, d_model, target, seed, losses, fitted)


def evaluate(
    result: FitResult, batch: TwoRelationBatch
) -> tuple[float, Tensor]:
    """A fitted model's mean squared error on ``batch``, and its attention.

    The attention weights have shape ``(B, H, T, T)``.
    """
    if batch.target.shape[-1] != result.weights["w_o"].shape[1]:
        raise ValueError(
            f"batch.target has D_out = {batch.target.shape[-1]}, "
            f"but the model was fitted to target {result.target!r} "
            f"with D_out = {result.weights['w_o'].shape[1]}"
        )
    with torch.no_grad():
        output, attn = attention(batch.x, result.weights, result.num_heads)
        return float(torch.mean((output - batch.target) ** 2)), attn


def best_readout_loss(maps: Tensor, batch: TwoRelationBatch) -> float:
    """The lowest mean squared error any linear read-out can reach.

    The attention maps are fixed. Each map ``m`` averages the whole input,
    ``maps[:, m] @ x``; the averages are concatenated and a least-squares fit
    maps them to the target. Values and output projections of a real layer are
    linear maps of the same averages (of narrower width), so no layer with
    these maps can do better.

    Args:
        maps: ``(B, M, T, T)`` row-stochastic attention maps (``M`` heads).
        batch: the batch whose inputs and target are used.
    """
    b, t, d_in = batch.x.shape
    if maps.ndim != 4 or maps.shape[0] != b or maps.shape[2:] != (t, t):
        raise ValueError(
            f"maps must have shape ({b}, M, {t}, {t}), "
            f"got shape {tuple(maps.shape)}"
        )
    averaged = maps @ batch.x[:, None]  # (B, M, T, D_in)
    # (B, T, M, D_in) -> (B*T, M*D_in)
    features = averaged.transpose(1, 2).reshape(b * t, -1)
    target = batch.target.reshape(b * t, -1)  # (B*T, D_out)
    # (M*D_in, D_out)
    solution = torch.linalg.lstsq(features, target, driver="gelsd").solution
    return float(torch.mean((features @ solution - target) ** 2))
