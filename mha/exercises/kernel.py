"""The checker of a learner's FlashAttention: :func:`check_flash_attention`.

``fn(q, k, v, causal)`` gets float32 torch tensors, q (B, H, T_q, d) and k,
v (B, H_kv, T_k, d), on the CPU where the kernels run in Triton's
interpreter (on the GPU where they are compiled: ``device`` chooses
otherwise), and returns ``out`` or ``(out, lse)`` on the same device. The
checker runs a grid of shapes (key tiles enough for the running maximum to
grow, lengths that are not multiples of a tile, causal with T_q < T_k,
T_q = 1 and T_q > T_k, grouped and multi-query heads, head sizes 16 to
128, odd ones too), compares with attention in float64 and,
where a result equals a known mistake's, names the mistake.

The known mistakes are computed here in float64, from the same inputs: the
*twins*. Those that depend on the learner's tiles (acc not rescaled, a key
tail left unmasked) are computed for every tile size from 16 to 128.

Loaded only when used: importing :mod:`mha.exercises` never imports
Triton.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .checker import DEVICE_ERRORS, Checker, Failed

__all__ = ["check_flash_attention", "TOLERANCE", "FORWARD_ITEMS"]

#: Results agree when ``|got - expected| <= TOLERANCE * (1 + |expected|)``,
#: in float32: about 10 times the largest error of the book's kernel,
#: :func:`mha.kernels.triton_attention`, over the grid below, and some 30
#: times below the error of a float16 accumulator (the tests pin both).
TOLERANCE = 1e-5

LOG2E = math.log2(math.e)
#: Key tile sizes a learner's kernel may use (powers of two, tl.dot's >= 16).
TILE_SIZES = (16, 32, 64, 128)


@dataclass(frozen=True)
class Case:
    """One call: shapes, causal or not, and whether the keys' size rises."""

    batch: int
    heads: int
    kv_heads: int
    t_q: int
    t_k: int
    head_dim: int
    causal: bool
    rising: bool = False  # keys grow along T_k: the running maximum grows

    def inputs(self, seed: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v in float32, from a fixed seed."""
        gen = torch.Generator().manual_seed(seed)
        b, h, h_kv, d = self.batch, self.heads, self.kv_heads, self.head_dim
        q = torch.randn(b, h, self.t_q, d, generator=gen)  # (B, H, T_q, d)
        k = torch.randn(b, h_kv, self.t_k, d, generator=gen)  # (B, H_kv, ..)
        v = torch.randn(b, h_kv, self.t_k, d, generator=gen)
        if self.rising:  # later keys larger: scores, and maxima, grow
            k = k * torch.linspace(0.5, 3.0, self.t_k)[:, None]
        return q, k, v

    def __str__(self) -> str:
        return (
            f"B={self.batch}, H={self.heads}, H_kv={self.kv_heads}, "
            f"T_q={self.t_q}, T_k={self.t_k}, d={self.head_dim}, "
            f"causal={self.causal}"
        )


#: The forward checklist: (title, cases).
FORWARD_ITEMS: tuple[tuple[str, tuple[Case, ...]], ...] = (
    (
        "one tile: out = softmax(q k^T / sqrt(d)) v",
        (Case(1, 2, 2, 16, 16, 16, False),),
    ),
    (
        "many key tiles, the running maximum growing (T_k = 256)",
        (Case(1, 2, 2, 32, 256, 32, False, rising=True),),
    ),
    (
        "lengths that are not multiples of a tile (T_q = 77, T_k = 111)",
        (Case(2, 2, 2, 77, 111, 32, False),),
    ),
    (
        "head sizes 16 to 128, odd ones too (16, 40, 80, 96, 128)",
        tuple(Case(1, 1, 1, 40, 70, d, False) for d in (16, 40, 80, 96, 128)),
    ),
    ("causal, T_q = T_k = 97", (Case(1, 2, 2, 97, 97, 32, True),)),
    (
        "causal with T_q < T_k, aligned bottom-right (T_q = 50 and 1)",
        (Case(1, 2, 2, 50, 130, 32, True), Case(1, 2, 2, 1, 70, 32, True)),
    ),
    (
        "causal with T_q > T_k: a query that sees no key gives 0",
        (Case(1, 2, 2, 80, 30, 32, True),),
    ),
    (
        "grouped heads: H = 4, H_kv = 2 (GQA) and H_kv = 1 (MQA)",
        (Case(2, 4, 2, 33, 65, 40, True), Case(1, 4, 1, 33, 65, 32, False)),
    ),
)

#: The backward checklist (``backward=True``): (title, cases).
BACKWARD_ITEMS: tuple[tuple[str, tuple[Case, ...]], ...] = (
    (
        "gradients dq, dk, dv, not causal (T_q = 45, T_k = 70, d = 40)",
        (Case(1, 2, 2, 45, 70, 40, False),),
    ),
    (
        "gradients, causal, T_q = T_k and T_q < T_k (bottom-right)",
        (Case(1, 2, 2, 64, 64, 32, True), Case(1, 2, 2, 40, 100, 32, True)),
    ),
    (
        "gradients with grouped heads: dk, dv summed over each group",
        (Case(1, 4, 2, 48, 48, 32, True),),
    ),
)


def check_flash_attention(
    fn: Callable,
    *,
    backward: bool = False,
    verbose: bool = True,
    device: Any = None,
) -> None:
    """Check ``fn(q, k, v, causal)``: attention, tile by tile.

    q is (B, H, T_q, d), k and v (B, H_kv, T_k, d), float32 torch tensors;
    ``causal`` is aligned bottom-right (query i sees keys 0..i + T_k -
    T_q); query head h reads key/value head ``h // (H / H_kv)``; the scale
    is ``1 / sqrt(d)``. ``fn`` returns ``out`` (B, H, T_q, d) or ``(out,
    lse)`` with the natural logsumexp of each query's scores (B, H, T_q),
    ``-inf`` where a query sees no key. With ``backward=True`` the
    gradients of ``out`` with respect to q, k and v are checked too.

    The tensors are on ``device``; None: where the Triton kernels run
    (:func:`~mha.exercises.checker.kernel_device`: CUDA where Triton compiles
    for the GPU, the CPU in its interpreter). ``out`` and ``lse`` must be on
    the device of q; the comparisons are made on the CPU, in float64.

    Catches: acc and ell not rescaled when the running maximum grows; causal
    aligned top-left; the key tail not masked; the GQA head map ``h % H_kv``;
    no ``1/sqrt(d)``; exp2 without the log2(e) factor; a float16
    accumulator; NaN on a fully masked row; the logsumexp in base 2; a
    backward that ignores ``causal``.

    Returns None when every item passes (printing the checklist unless
    ``verbose=False``); raises ``AssertionError`` naming the item otherwise.
    """
    checker = Checker("check_flash_attention", fn, "torch", device=device)
    device = checker.device
    returned_lse: list[bool] = []

    def run(case: Case, seed: int) -> tuple[Tensor, Tensor | None, tuple]:
        q, k, v = (t.to(device) for t in case.inputs(seed))
        result = checker.call(q, k, v, case.causal, copy=False)
        out, lse = _out_and_lse(result, case)
        returned_lse.append(lse is not None)
        return out, lse, (q, k, v)

    for number, (title, cases) in enumerate(FORWARD_ITEMS):

        @checker.item(title)
        def _(cases=cases, number=number) -> None:
            for index, case in enumerate(cases):
                out, lse, inputs = run(case, seed=10 * number + index)
                _check_forward(case, out, lse, inputs)

    if backward:
        for number, (title, cases) in enumerate(BACKWARD_ITEMS):

            @checker.item(title)
            def _(cases=cases, number=number) -> None:
                for index, case in enumerate(cases):
                    _check_backward(checker, case, 100 + 10 * number + index)

    checker.run(verbose=False)
    if verbose:
        _print_checklist(checker, any(returned_lse), backward)


def _print_checklist(checker: Checker, lse: bool, backward: bool) -> None:
    total = len(checker.items)
    print(f"check_flash_attention: all {total} items pass")
    for number, (title, _) in enumerate(checker.items, 1):
        print(f"  {number}. {title}")
    print(
        f"  the logsumexp was checked in items 1 to {len(FORWARD_ITEMS)}"
        if lse
        else "  (no logsumexp returned: return (out, lse) to check it too)"
    )
    if not backward:
        print("  (the gradients: check_flash_attention(fn, backward=True))")


# ---------------------------------------------------------------------------
# The forward pass


def _out_and_lse(result: Any, case: Case) -> tuple[Tensor, Tensor | None]:
    out, lse = result, None
    if isinstance(result, tuple | list):
        if len(result) != 2:
            raise Failed(
                f"it returned {len(result)} values: return out, or (out, lse)"
            )
        out, lse = result
    b, h, t_q, d = case.batch, case.heads, case.t_q, case.head_dim
    for name, got, shape in (("out", out, (b, h, t_q, d)), ("lse", lse, None)):
        if got is None:
            continue
        if not isinstance(got, Tensor):
            raise Failed(
                f"{name} is {type(got).__name__}, expected a torch tensor"
            )
        shape = shape or (b, h, t_q)
        if tuple(got.shape) != shape:
            raise Failed(
                f"for {case}: {name} has shape {tuple(got.shape)}, expected "
                f"{shape}"
                + (
                    " (one logsumexp per query)"
                    if name == "lse"
                    else " (B, H, T_q, d)"
                )
            )
    if out.dtype != torch.float32:
        raise Failed(
            f"out is {out.dtype}, expected float32 like q: accumulate in "
            "float32 and store in the output's dtype "
            "(out.to(Out.dtype.element_ty))"
        )
    return out, lse


def _check_forward(case: Case, out: Tensor, lse: Tensor | None, inputs):
    q, k, v = (t.detach().cpu().double() for t in inputs)
    expected, expected_lse = dense(q, k, v, causal=case.causal)
    got = out.detach().cpu().double()
    where = f"for {case}: "
    empty = torch.isneginf(expected_lse)  # queries that see no key
    if empty.any() and torch.isnan(got[empty]).any():
        raise Failed(
            where + "the rows of queries that see no key are NaN: their "
            "maximum stays -inf and exp(-inf - (-inf)) is NaN, then 0 / 0. "
            "Exponentiate against 0 where m is -inf (tl.where(m_new == "
            "float('-inf'), 0.0, m_new)) and divide by ell only where it is "
            "above 0, so that such a row gives 0"
        )
    _compare(got, expected, where + "out", _forward_twins(case, q, k, v))
    if lse is None:
        return
    got_lse = lse.detach().cpu().double()
    if empty.any() and not torch.isneginf(got_lse[empty]).all():
        found = got_lse[empty][~torch.isneginf(got_lse[empty])][0].item()
        raise Failed(
            where + f"a query that sees no key has logsumexp {found:.4g}, "
            "expected -inf (the log of an empty sum): set it to -inf where "
            "ell is 0"
        )
    seen = ~empty
    _compare(
        got_lse[seen],
        expected_lse[seen],
        where + "lse",
        {
            "the logsumexp is in base 2 (m2 + log2(ell), with scores "
            "multiplied by log2(e) for exp2): the backward pass and a merge "
            "of splits need the natural one; multiply by ln(2), or add "
            "tl.log(ell) to m / log2(e)": expected_lse[seen] * LOG2E,
            "the logsumexp is the running maximum m alone: add log(ell), "
            "the log of the sum of exp(s - m)": _row_max(q, k, case)[seen],
            "the logsumexp is log(ell) alone: add the running maximum m": (
                expected_lse - _row_max(q, k, case)
            )[seen],
        },
    )


def _forward_twins(case: Case, q, k, v) -> dict[str, Tensor | tuple]:
    """The known mistakes' outputs for this case, in float64."""
    causal = case.causal
    scale = q.shape[-1] ** -0.5
    twins: dict[str, Tensor | tuple] = {
        "the scores were not divided by sqrt(d): scale them by "
        "1 / sqrt(d) (sm_scale = d ** -0.5)": dense(
            q, k, v, causal=causal, scale=1.0
        )[0],
        "exp2 was used without the log2(e) factor: exp2(x) = exp(x ln 2), "
        "so multiply the scores (or the scale) by log2(e) = 1.4427 before "
        "tl.exp2, or use tl.exp": dense(
            q, k, v, causal=causal, scale=scale / LOG2E
        )[0],
        "the scores were multiplied by log2(e) but exponentiated with exp, "
        "not exp2: use tl.exp2 with the log2(e) factor, or tl.exp without "
        "it": dense(q, k, v, causal=causal, scale=scale * LOG2E)[0],
        "the output was not divided by ell: after the last key tile, out = "
        "acc / ell": _tiled(q, k, v, case, None, divide=False)[0],
    }
    if case.heads != case.kv_heads and case.kv_heads > 1:
        twins[
            "query head h read key/value head h % H_kv: the heads of one "
            "group are neighbours, so head h reads h // (H / H_kv) (the "
            "order of transformers' repeat_kv)"
        ] = dense(q, k, v, causal=causal, kv_map="modulo")[0]
    if causal:
        twins[
            "causal is aligned top-left (query i sees keys 0..i): align it "
            "bottom-right, key j visible when j <= i + T_k - T_q, so that "
            "the last query sees every key"
        ] = dense(q, k, v, causal=True, align="top-left")[0]
        twins[
            "the diagonal is masked too (j < i + offset): query i also sees "
            "its own key, j <= i + T_k - T_q"
        ] = dense(q, k, v, causal=True, align="strict")[0]
        twins[
            "causal was ignored: mask the scores with j <= i + T_k - T_q "
            "when causal is True"
        ] = dense(q, k, v, causal=False)[0]
    for words, options in (
        (
            "acc and ell were not rescaled when the running maximum grew: "
            "multiply both by alpha = exp(m_old - m_new) before adding the "
            "new tile",
            dict(rescale_acc=False, rescale_ell=False),
        ),
        (
            "acc was not rescaled when the running maximum grew: multiply "
            "it by alpha = exp(m_old - m_new) before adding p @ v",
            dict(rescale_acc=False),
        ),
        (
            "ell was not rescaled when the running maximum grew: multiply "
            "it by alpha = exp(m_old - m_new) before adding the tile's sum",
            dict(rescale_ell=False),
        ),
        (
            "the key tail is not masked: keys past T_k were loaded as 0 and "
            "kept, each with score 0; set their scores to -inf "
            "(tl.where(cols < T_k, s, float('-inf')))",
            dict(mask_tail=False),
        ),
    ):
        twins[words] = tuple(
            _tiled(q, k, v, case, size, **options)[0] for size in TILE_SIZES
        )
    return twins


def _row_max(q, k, case: Case) -> Tensor:
    scores = _scores(q, k, q.shape[-1] ** -0.5, "divide")
    scores = scores.masked_fill(
        ~_keep(case.t_q, case.t_k, case.causal), -math.inf
    )
    return scores.amax(-1).flatten(1, 2)  # (B, H, T_q)


# ---------------------------------------------------------------------------
# The backward pass


def _check_backward(checker: Checker, case: Case, seed: int) -> None:
    device = checker.device
    leaves = [t.to(device).requires_grad_() for t in case.inputs(seed)]
    result = checker.call(*leaves, case.causal, copy=False)
    out, _ = _out_and_lse(result, case)
    where = f"for {case}: "
    if not out.requires_grad:
        raise Failed(
            where + "out has no gradient: tie the forward and backward "
            "kernels together in a torch.autograd.Function"
        )
    d_out = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(seed)
    )
    try:
        grads = torch.autograd.grad(
            out, leaves, d_out.to(device), allow_unused=True
        )
    except Exception as error:
        hint = ""
        if any(words in str(error) for words in DEVICE_ERRORS):
            hint = (
                f"\nThe tensors are on {device}, and one the backward pass "
                "made is not: make new tensors where the inputs are "
                "(torch.empty_like(q), or device=q.device)."
            )
        raise Failed(
            f"{where}the backward pass raised {type(error).__name__}: {error}"
            + hint
        ) from None
    q, k, v = (t.detach().cpu().double() for t in leaves)
    expected = _dense_gradients(q, k, v, d_out.double(), case.causal)
    twins = {
        "the backward pass ignores causal (Triton issue #4541): mask the "
        "recomputed p with j <= i + T_k - T_q when, and only when, causal "
        "is True": _recomputed_gradients(
            q, k, v, d_out.double(), case.causal, not case.causal
        ),
    }
    if case.causal and case.t_q != case.t_k:
        twins[
            "the backward pass aligns causal top-left: use the forward's "
            "bottom-right offset T_k - T_q in its masks and loop bounds"
        ] = _recomputed_gradients(
            q, k, v, d_out.double(), True, True, align="top-left"
        )
    for name, got, want, index in zip(
        ("dq", "dk", "dv"), grads, expected, range(3)
    ):
        if got is None:
            raise Failed(where + f"{name} is None: the backward returned no "
                          "gradient for it")  # fmt: skip
        _compare(
            got.detach().cpu().double(),
            want,
            where + name,
            {words: grads3[index] for words, grads3 in twins.items()},
        )


def _dense_gradients(q, k, v, d_out, causal: bool) -> tuple[Tensor, ...]:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = dense(*leaves, causal=causal)
    return torch.autograd.grad(out, leaves, d_out)


def _recomputed_gradients(q, k, v, d_out, forward_causal, backward_causal,
                          align="bottom-right"):  # fmt: skip
    """A backward pass that rebuilds p = exp(s - lse) from the forward's
    logsumexp, masking as ``backward_causal`` says (right or not)."""
    out, lse = dense(q, k, v, causal=forward_causal)
    group = q.shape[1] // k.shape[1]
    k_all, v_all = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5
    scores = q @ k_all.transpose(-1, -2) * scale  # (B, H, T_q, T_k)
    p = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0)[..., None])
    if backward_causal:
        keep = _keep(q.shape[2], k.shape[2], True, align)
        p = p.masked_fill(~keep, 0.0)
    delta = (d_out * out).sum(-1, keepdim=True)  # (B, H, T_q, 1)
    dv = p.transpose(-1, -2) @ d_out
    ds = p * (d_out @ v_all.transpose(-1, -2) - delta)
    dq = ds @ k_all * scale
    dk = ds.transpose(-1, -2) @ q * scale

    def per_kv_head(t):  # (B, H, T_k, d) -> (B, H_kv, T_k, d), group sums
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    return dq, per_kv_head(dk), per_kv_head(dv)


# ---------------------------------------------------------------------------
# Attention in float64, right and with the known mistakes


def _keep(t_q: int, t_k: int, causal: bool, align: str = "bottom-right"):
    """(T_q, T_k) boolean, True = may attend."""
    if not causal:
        return torch.ones(t_q, t_k, dtype=torch.bool)
    query = torch.arange(t_q)[:, None]
    key = torch.arange(t_k)[None, :]
    offset = 0 if align == "top-left" else t_k - t_q
    if align == "strict":
        return key < query + offset
    return key <= query + offset


def _scores(q, k, scale: float, kv_map: str) -> Tensor:
    """(B, H_kv, G, T_q, T_k): query head h = kv * G + g, or h = g * H_kv +
    kv with ``kv_map="modulo"`` (the h % H_kv mistake)."""
    b, h, t_q, d = q.shape
    h_kv = k.shape[1]
    if kv_map == "modulo":  # (B, G, H_kv, T_q, d) -> (B, H_kv, G, ...)
        grouped = q.reshape(b, h // h_kv, h_kv, t_q, d).transpose(1, 2)
    else:
        grouped = q.reshape(b, h_kv, h // h_kv, t_q, d)
    return grouped @ k[:, :, None].transpose(-1, -2) * scale


def _ungroup(x: Tensor, kv_map: str) -> Tensor:
    """(B, H_kv, G, T_q, ...) back to (B, H, T_q, ...)."""
    if kv_map == "modulo":
        x = x.transpose(1, 2)
    return x.flatten(1, 2)


def dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    align: str = "bottom-right",
    kv_map: str = "divide",
) -> tuple[Tensor, Tensor]:
    """Attention with every score written out: ``(out, lse)`` (float64).

    A query that sees no key gets a zero output and logsumexp ``-inf``.
    ``align`` ("bottom-right", "top-left", "strict") and ``kv_map``
    ("divide", "modulo") also give the mistakes' results.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = _scores(q, k, scale, kv_map)  # (B, H_kv, G, T_q, T_k)
    keep = _keep(q.shape[2], k.shape[2], causal, align)
    scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf where no key is seen
    weights = torch.exp(
        scores - lse.masked_fill(torch.isneginf(lse), 0)[..., None]
    )
    out = weights @ v[:, :, None]  # (B, H_kv, G, T_q, d)
    return _ungroup(out, kv_map), _ungroup(lse, kv_map)


def _tiled(
    q, k, v, case: Case, block_k: int | None, *, rescale_acc=True,
    rescale_ell=True, mask_tail=True, divide=True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The online softmax over key tiles of ``block_k`` (all keys at once
    for None), with the mistakes that depend on the tiles switched on."""
    t_q, t_k = q.shape[2], k.shape[2]
    block_k = block_k or t_k
    padded = -(-t_k // block_k) * block_k
    if not mask_tail:  # keys past T_k read as 0 and kept
        pad = (0, 0, 0, padded - t_k)
        k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
    keep = _keep(t_q, k.shape[2], case.causal)
    if not mask_tail and case.causal:
        keep = keep | (torch.arange(k.shape[2]) >= t_k)
    scores = _scores(q, k, q.shape[-1] ** -0.5, "divide")
    scores = scores.masked_fill(~keep, -math.inf)  # (B, H_kv, G, T_q, T_k)
    m = torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype)
    ell = torch.zeros_like(m)
    acc = torch.zeros(scores.shape[:-1] + v.shape[-1:], dtype=scores.dtype)
    for start in range(0, k.shape[2], block_k):
        tile = scores[..., start : start + block_k]
        m_new = torch.maximum(m, tile.amax(-1))
        m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(tile - m_safe[..., None])
        ell = (alpha if rescale_ell else 1.0) * ell + p.sum(-1)
        pv = p @ v[:, :, None, start : start + block_k]
        acc = (alpha[..., None] if rescale_acc else 1.0) * acc + pv
        m = m_new
    out = acc / ell.masked_fill(ell == 0, 1.0)[..., None] if divide else acc
    return _ungroup(out, "divide"), _ungroup(m + torch.log(ell), "divide")


# ---------------------------------------------------------------------------
# Comparison


def _compare(
    got: Tensor, expected: Tensor, what: str, twins: dict | None = None
) -> None:
    """Pass within :data:`TOLERANCE`; otherwise name the twin ``got``
    equals, if any, or say how far and where it is off."""
    if _close(got, expected):
        return
    for words, results in (twins or {}).items():
        for twin in results if isinstance(results, tuple) else (results,):
            if twin.shape == got.shape and _close(got, twin):
                raise Failed(f"{what}: {words}")
    if torch.isnan(got).any():
        where = tuple(int(i) for i in torch.nonzero(torch.isnan(got))[0])
        raise Failed(f"{what} holds NaN (first at index {where})")
    error = (got - expected).abs() / (1 + expected.abs())
    worst = int(torch.argmax(torch.nan_to_num(error, nan=math.inf)))
    index = tuple(
        int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape)
    )
    worst_error = error.flatten()[worst].item()
    if 5 * TOLERANCE < worst_error < 0.02:  # rounding, not a formula
        raise Failed(
            f"{what} is off by up to {worst_error:.1g} (relative; tolerance "
            f"{TOLERANCE:g}): the rounding of numbers with 10 bits of "
            "mantissa (2^-11 = 4.9e-4), not float32's. Either the "
            "accumulator, or p @ v, was kept in float16: keep m, ell and acc "
            "in float32 (tl.zeros(..., dtype=tl.float32)); or, on a GPU, "
            "tl.dot rounded float32 inputs to TF32: pass "
            "input_precision='ieee'"
        )
    message = (
        f"{what} differs from attention in float64 by up to "
        f"{worst_error:.3g} (relative): at index {index} it is "
        f"{got[index].item():.6g}, expected {expected[index].item():.6g}"
    )
    raise Failed(message)


def _close(got: Tensor, expected: Tensor) -> bool:
    infinite = torch.isinf(expected)
    if not torch.equal(torch.isinf(got) & (got == expected), infinite):
        return False
    finite = ~infinite
    diff = (got[finite] - expected[finite]).abs()
    return bool((diff <= TOLERANCE * (1 + expected[finite].abs())).all())
