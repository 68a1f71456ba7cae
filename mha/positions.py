"""Positions: what attention alone cannot see, and three ways to show it.

Attention treats its keys as a set: permute the tokens and the outputs are
permuted the same way (chapter 11 asserts it). Order has to be put in:

* :func:`sinusoidal_positions`: fixed sines and cosines added to the input,
  Vaswani et al. (2017), section 3.5.
* :class:`LearnedPositions`: one trained vector per position, added to the
  input (BERT, GPT-2).
* :func:`apply_rope`: rotary position embedding (RoPE, Su et al. 2021), which
  rotates the queries and keys inside each head, so that a score depends on
  the two positions only through their offset. The pairing is the "rotate
  half" one of Hugging Face ``transformers``' Llama code: dimension ``i`` of
  a head turns together with dimension ``i + d_k / 2``. (RoFormer and Meta's
  reference code pair neighbours, ``2i`` and ``2i + 1``: the same rotation
  after a fixed reordering of each head's query and key projection rows.)

Shapes: ``B`` batch, ``H`` heads, ``T`` positions, ``D`` model width, ``d_k``
the width of one head.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ._validate import check_float, check_int, check_tensor

__all__ = [
    "sinusoidal_positions",
    "LearnedPositions",
    "rope_angles",
    "rope_cos_sin",
    "rotate_pairs",
    "apply_rope",
]


def sinusoidal_positions(
    seq_len: int,
    d_model: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """(T, D) table of sines and cosines, one frequency per pair of columns.

    ``PE[p, 2i] = sin(p / base^(2i/D))``, ``PE[p, 2i+1] = cos(p /
    base^(2i/D))``.

    Vaswani et al. (2017), section 3.5; it is added to the token embeddings.
    ``d_model`` must be even (each frequency fills a sine and a cosine column).
    """
    _check_sinusoidal(seq_len, d_model, base)
    positions = torch.arange(seq_len, dtype=torch.float64)[:, None]  # (T, 1)
    frequencies = base ** (
        -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model
    )  # (D/2,): 1 down to about 1/base
    angles = positions * frequencies  # (T, D/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (T, D/2, 2)
    return table.flatten(-2).to(dtype or torch.get_default_dtype())  # (T, D)


class LearnedPositions(nn.Module):
    """One trained vector per position: (…, T) positions -> (…, T, D).

    ``max_len`` of them, added to the token embeddings, as in BERT and
    GPT-2. It knows nothing
    about positions it was not trained on, and nothing at all beyond
    ``max_len``.
    """

    def __init__(
        self,
        max_len: int,
        d_model: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.max_len = check_int("max_len", max_len)
        self.d_model = check_int("d_model", d_model)
        self.table = nn.Embedding(max_len, d_model, device=device, dtype=dtype)

    def forward(self, positions: Tensor) -> Tensor:
        """The vectors of ``positions`` (integers in ``[0, max_len)``)."""
        check_tensor("positions", positions, kind="integer")
        if positions.numel() and not (
            0 <= int(positions.min()) and int(positions.max()) < self.max_len
        ):
            raise ValueError(
                f"positions must lie in [0, max_len) = [0, {self.max_len}), "
                f"got values from {int(positions.min())} "
                f"to {int(positions.max())}"
            )
        return self.table(positions)  # (..., T, D)


def rope_angles(
    positions: Tensor,
    head_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(…, T) positions -> (…, T, d_k / 2) angles ``p * base^(-2i / d_k)``.

    Pair ``i`` turns by ``p`` times its frequency ``base^(-2i / d_k)``: one
    radian per position for ``i = 0``, slower and slower after it. Computed in
    ``dtype`` the way ``transformers`` computes them (float32 unless float64
    is asked for).
    """
    frequencies = _frequencies(head_dim, float(base), dtype, positions.device)
    return positions.to(dtype)[..., None] * frequencies  # (..., T, d_k/2)


def rope_cos_sin(
    positions: Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin of :func:`rope_angles`, in ``dtype``, shaped to turn
    (B, H, T, d_k) heads: (T, d_k/2), or (B, 1, T, d_k/2) for (B, T)
    positions. The angles are float64 for float64, float32 otherwise."""
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    angles = rope_angles(positions, head_dim, base, exact)  # (.., T, d_k/2)
    if angles.dim() == 3:  # (B, T, d_k/2) -> (B, 1, T, d_k/2): every head
        angles = angles[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Turn dimensions ``i`` and ``i + d_k/2`` of ``x`` (…, d_k) together by
    the angle whose ``cos`` and ``sin`` (…, d_k/2) are given."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., d_k/2) each: the pairs' halves
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def apply_rope(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """RoPE: rotate queries or keys ``x`` (B, H, T, d_k) by their positions.

    ``positions``: (T,) for every sequence alike, or (B, T). Dimension ``i``
    and dimension ``i + d_k / 2`` of each head form a pair, turned by the
    angle of :func:`rope_angles` (the "rotate half" layout of
    ``transformers``' Llama code). Rotations keep lengths, and
    ``R(a)^T R(b) = R(b - a)``: the score of a rotated query and key depends
    on ``b - a`` only.
    """
    _check_rope(x, positions, base)
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, x.dtype)
    return rotate_pairs(x, cos, sin)


@functools.lru_cache(maxsize=64)
def _frequencies(
    head_dim: int, base: float, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``base^(-2i / d_k)`` for i = 0 .. d_k/2 - 1, as ``transformers``
    computes them; made once per (d_k, base, dtype, device)."""
    with torch.inference_mode(False), torch.no_grad():
        exponents = torch.arange(
            0, head_dim, 2, dtype=torch.int64, device=device
        ).to(dtype)
        return 1.0 / (base ** (exponents / head_dim))  # (d_k/2,)


def _check_sinusoidal(seq_len: int, d_model: int, base: float) -> None:
    check_int("seq_len", seq_len)
    check_int("d_model", d_model)
    if d_model % 2:
        raise ValueError(
            "d_model must be even (a sine and a cosine per frequency), "
            f"got {d_model}"
        )
    check_float("base", base, above=1.0)


def _check_rope(x: object, positions: object, base: object) -> None:
    """x: (B, H, T, d_k) floats with d_k even; positions: (T,) or (B, T)."""
    check_tensor("x", x, ndim=4, shape="(B, H, T, d_k)")
    B, _, T, d_k = x.shape
    if d_k % 2:
        raise ValueError(
            "the head width d_k (last axis of x) must be even for RoPE "
            f"(dimension i turns with i + d_k/2), got d_k = {d_k}"
        )
    check_tensor("positions", positions, kind="integer")
    if tuple(positions.shape) not in ((T,), (B, T)):
        raise ValueError(
            f"positions must have shape (T,) = ({T},) or (B, T) = ({B}, {T}), "
            f"got shape {tuple(positions.shape)}"
        )
    check_float("base", base, above=1.0)
