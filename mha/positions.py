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
  after a fixed reordering of each head's query and key projection rows,
  which ``transformers``' conversion of Meta's checkpoints applies.)
* :class:`Rope`: RoPE's base and a rule that stretches its wavelengths for
  longer contexts, as ``transformers`` names them: ``"default"`` (none),
  ``"linear"`` (position interpolation), ``"llama3"`` (Llama 3.1's
  piecewise rule) and ``"yarn"`` (YaRN).

Shapes: ``B`` batch, ``H`` heads, ``T`` positions, ``D`` model width, ``d_k``
the width of one head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ._validate import (
    check_choice,
    check_float,
    check_int,
    check_positions,
    check_tensor,
)

__all__ = [
    "sinusoidal_positions",
    "LearnedPositions",
    "ROPE_TYPES",
    "Rope",
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


ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# The keys of transformers' ``rope_parameters`` that :class:`Rope` reads.
_ROPE_KEYS = {
    "rope_type": "rope_type",
    "type": "rope_type",
    "rope_theta": "base",
    "factor": "factor",
    "original_max_position_embeddings": "original_max_len",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "truncate": "truncate",
}


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE's base and the rule that scales its frequencies, if any.

    ``rope_type`` (the names of ``transformers``' ``rope_parameters``):

    * ``"default"``: ``theta_i = base^(-2i / d_k)``;
    * ``"linear"``: every ``theta_i / factor`` (position interpolation);
    * ``"llama3"``: pairs whose wavelength ``2 pi / theta_i`` is shorter
      than ``original_max_len / high_freq_factor`` keep ``theta_i``, longer
      than ``original_max_len / low_freq_factor`` take ``theta_i / factor``,
      and those between mix the two linearly in ``original_max_len / λ``;
    * ``"yarn"``: the same three bands, set by how many turns a pair makes
      over ``original_max_len`` (more than ``beta_fast``: kept; fewer than
      ``beta_slow``: divided by ``factor``; a linear ramp between), and
      queries and keys multiplied by ``attention_factor`` (by default
      ``0.1 ln(factor) + 1``).
    """

    base: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_len: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        _check_base(self.base)
        check_choice("rope_type", self.rope_type, ROPE_TYPES)
        if self.rope_type != "default" and not self.factor >= 1.0:
            raise ValueError(
                f"factor must be a float >= 1 for rope_type "
                f"{self.rope_type!r}, got {self.factor!r}"
            )
        if self.rope_type in ("llama3", "yarn"):
            check_int("original_max_len", self.original_max_len)
        if self.rope_type == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor
        ):
            raise ValueError(
                "llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )

    @classmethod
    def from_parameters(
        cls,
        parameters: Mapping,
        *,
        max_position_embeddings: int | None = None,
    ) -> Rope:
        """From ``transformers``' ``rope_parameters`` (version 5's format).

        ``max_position_embeddings`` stands in for a missing
        ``original_max_position_embeddings``, as in ``transformers``.
        """
        if not isinstance(parameters, Mapping):
            raise TypeError(
                "rope_parameters must be a dict, got "
                f"{type(parameters).__name__}"
            )
        if parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "partial_rotary_factor must be 1.0 (every pair turns), got "
                f"{parameters['partial_rotary_factor']!r}"
            )
        unknown = set(parameters) - set(_ROPE_KEYS) - {"partial_rotary_factor"}
        if unknown:
            raise ValueError(
                f"rope_parameters has keys that Rope does not know: "
                f"{sorted(unknown)}; it reads {sorted(_ROPE_KEYS)}"
            )
        fields = {
            _ROPE_KEYS[key]: value
            for key, value in parameters.items()
            if key in _ROPE_KEYS and value is not None
        }
        fields.setdefault("rope_type", "default")
        if fields["rope_type"] not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {fields['rope_type']!r} is not supported: it "
                f"must be one of {', '.join(map(repr, ROPE_TYPES))}"
            )
        if fields["rope_type"] in ("llama3", "yarn"):
            fields.setdefault("original_max_len", max_position_embeddings)
        if fields["rope_type"] == "yarn" and "factor" not in fields:
            fields["factor"] = max_position_embeddings / float(
                fields["original_max_len"]
            )
        return cls(**fields)

    @property
    def attention_scaling(self) -> float:
        """The factor on the rotated queries and keys (YaRN's; else 1)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def m_scale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return m_scale(self.factor, self.mscale) / m_scale(
                self.factor, self.mscale_all_dim
            )
        return m_scale(self.factor)

    def frequencies(
        self,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """``theta_i`` (d_k / 2,), after the scaling rule, in ``dtype``."""
        device = torch.device(device or "cpu")
        if torch.compiler.is_compiling():  # traced once into the graph
            return _scaled_frequencies(self, head_dim, dtype, device)
        return _frequencies(self, head_dim, dtype, device)


def as_rope(base: float | Rope) -> Rope:
    """``base`` as a :class:`Rope` (a number means no scaling)."""
    return base if isinstance(base, Rope) else Rope(_check_base(base))


def rope_angles(
    positions: Tensor,
    head_dim: int,
    base: float | Rope = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(…, T) positions -> (…, T, d_k / 2) angles ``p * base^(-2i / d_k)``.

    Pair ``i`` turns by ``p`` times its frequency ``base^(-2i / d_k)``: one
    radian per position for ``i = 0``, slower and slower after it. Computed in
    ``dtype`` the way ``transformers`` computes them (float32 unless float64
    is asked for). ``base`` may be a :class:`Rope`, with its scaling rule.
    """
    frequencies = as_rope(base).frequencies(head_dim, dtype, positions.device)
    return positions.to(dtype)[..., None] * frequencies  # (..., T, d_k/2)


def rope_cos_sin(
    positions: Tensor, head_dim: int, base: float | Rope, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin of :func:`rope_angles`, in ``dtype``, shaped to turn
    (B, H, T, d_k) heads: (T, d_k/2), or (B, 1, T, d_k/2) for (B, T)
    positions. The angles are float64 for float64, float32 otherwise; YaRN's
    ``attention_scaling`` multiplies both."""
    rope = as_rope(base)
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    angles = rope_angles(positions, head_dim, rope, exact)  # (.., T, d_k/2)
    if angles.dim() == 3:  # (B, T, d_k/2) -> (B, 1, T, d_k/2): every head
        angles = angles[:, None]
    scale = rope.attention_scaling
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Turn dimensions ``i`` and ``i + d_k/2`` of ``x`` (…, d_k) together by
    the angle whose ``cos`` and ``sin`` (…, d_k/2) are given."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., d_k/2) each: the pairs' halves
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def apply_rope(
    x: Tensor, positions: Tensor, base: float | Rope = 10000.0
) -> Tensor:
    """RoPE: rotate queries or keys ``x`` (B, H, T, d_k) by their positions.

    ``positions``: (T,) or (1, T) for every sequence alike, or (B, T).
    Dimension ``i`` and dimension ``i + d_k / 2`` of each head form a pair,
    turned by the angle of :func:`rope_angles` (the "rotate half" layout of
    ``transformers``' Llama code). Rotations keep lengths, and
    ``R(a)^T R(b) = R(b - a)``: the score of a rotated query and key depends
    on ``b - a`` only. ``base``: a number, or a :class:`Rope` with scaling.
    """
    _check_rope(x, positions, base)
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, x.dtype)
    return rotate_pairs(x, cos, sin)


@functools.lru_cache(maxsize=64)
def _frequencies(
    rope: Rope, head_dim: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """:func:`_scaled_frequencies`, made once per argument set (outside any
    inference mode, so that autograd may use them later)."""
    with torch.inference_mode(False), torch.no_grad():
        return _scaled_frequencies(rope, head_dim, dtype, device)


def _scaled_frequencies(
    rope: Rope, head_dim: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``theta_i`` for i = 0 .. d_k/2 - 1, scaled by ``rope``'s rule, with
    ``transformers``' operations in ``dtype``."""
    exponents = torch.arange(
        0, head_dim, 2, dtype=torch.int64, device=device
    ).to(dtype)
    theta = 1.0 / (rope.base ** (exponents / head_dim))  # (d_k/2,)
    if rope.rope_type == "linear":  # position p is read as p / factor
        return theta / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(theta, rope)
    if rope.rope_type == "yarn":
        return _yarn(theta, rope, head_dim)
    return theta


def _llama3(theta: Tensor, rope: Rope) -> Tensor:
    """Llama 3.1's rule: short wavelengths kept, long ones divided by
    ``factor``, a linear blend in ``original_max_len / wavelength`` between."""
    low, high = rope.low_freq_factor, rope.high_freq_factor
    wavelength = 2 * math.pi / theta  # (d_k/2,): positions per turn
    long = wavelength > rope.original_max_len / low
    short = wavelength < rope.original_max_len / high
    blend = (rope.original_max_len / wavelength - low) / (high - low)
    blended = (1 - blend) * theta / rope.factor + blend * theta
    scaled = torch.where(long, theta / rope.factor, theta)
    return torch.where(~short & ~long, blended, scaled)


def _yarn(theta: Tensor, rope: Rope, head_dim: int) -> Tensor:
    """YaRN's frequencies: pair ``i`` keeps ``theta_i`` if it turns more than
    ``beta_fast`` times over ``original_max_len`` positions, takes
    ``theta_i / factor`` if fewer than ``beta_slow``, and a linear ramp in
    ``i`` between."""

    def pair_of(turns: float) -> float:  # the (fractional) pair index
        # pair i turns original_max_len * theta_i / (2 pi) times
        span = math.log(rope.original_max_len / (turns * 2 * math.pi))
        return head_dim * span / (2 * math.log(rope.base))

    low, high = pair_of(rope.beta_fast), pair_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width: keep it finite
    pairs = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1).to(theta)  # (d_k/2,)
    kept = 1 - ramp  # 1 for fast pairs (kept), 0 for slow ones (divided)
    return theta / rope.factor * (1 - kept) + theta * kept


def _check_sinusoidal(seq_len: int, d_model: int, base: float) -> None:
    check_int("seq_len", seq_len)
    check_int("d_model", d_model)
    if d_model % 2:
        raise ValueError(
            "d_model must be even (a sine and a cosine per frequency), "
            f"got {d_model}"
        )
    _check_base(base)


def _check_base(base: object) -> float | Rope:
    if isinstance(base, Rope):
        return base
    return check_float("base", base, above=1.0)


def _check_rope(x: object, positions: object, base: object) -> None:
    """x: (B, H, T, d_k) floats with d_k even; positions: (T,), (1, T) or
    (B, T)."""
    check_tensor("x", x, ndim=4, shape="(B, H, T, d_k)")
    B, _, T, d_k = x.shape
    if d_k % 2:
        raise ValueError(
            "the head width d_k (last axis of x) must be even for RoPE "
            f"(dimension i turns with i + d_k/2), got d_k = {d_k}"
        )
    check_positions(positions, B, T)
    _check_base(base)
