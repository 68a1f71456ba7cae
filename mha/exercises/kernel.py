"""The checker of a learner's FlashAttention: :func:`check_flash_attention`.

``fn(q, k, v, causal)`` gets float32 torch tensors, q (B, H, T_q, d) and k,
v (B, H_kv, T_k, d), on the CPU where the kernels run in Triton's
interpreter (on the GPU where they are compiled: ``device`` chooses
otherwise), and returns ``out`` or ``(out, lse)`` on the same device. The
checker runs a grid of shapes (key tiles enough for the running maximum to
grow, lengths that are not multiples of a tile, causal with T_q < T_k,
T_q = 1 and T_q > T_k, grouped and multi-query heads, head sizes 16 to
128, odd ones too, inputs that are views of (B, T, H, d) tensors), compares
with attention in float64 and, where a result equals a known mistake's,
names the mistake. With ``backward=True`` the gradients too, batch above
H / H_kv included. Every tensor a Triton kernel gets lies between guard
bands (:mod:`.guard`): a store or load outside it is named.

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

from .checker import DEVICE_ERRORS, Checker, Failed, OutOfBounds

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
    """One call: shapes, causal or not, whether the keys' size rises, and
    the inputs' memory layout."""

    batch: int
    heads: int
    kv_heads: int
    t_q: int
    t_k: int
    head_dim: int
    causal: bool
    rising: bool = False  # keys grow along T_k: the running maximum grows
    # "contiguous", or "views": q, k and d_out (B, H, T, d) views of
    # (B, T, H, d) tensors, as split heads give them, v contiguous
    layout: str = "contiguous"

    def inputs(self, seed: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v in float32, from a fixed seed."""
        gen = torch.Generator().manual_seed(seed)
        b, h, h_kv, d = self.batch, self.heads, self.kv_heads, self.head_dim
        if self.layout == "views":  # (B, T, H, d) -> (B, H, T, d) views
            q = torch.randn(b, self.t_q, h, d, generator=gen).transpose(1, 2)
            k = torch.randn(b, self.t_k, h_kv, d, generator=gen)
            k = k.transpose(1, 2)
        else:
            q = torch.randn(b, h, self.t_q, d, generator=gen)  # (B, H, T_q, d)
            k = torch.randn(b, h_kv, self.t_k, d, generator=gen)  # (B, H_kv..)
        v = torch.randn(b, h_kv, self.t_k, d, generator=gen)
        if self.rising:  # later keys larger: scores, and maxima, grow
            k = k * torch.linspace(0.5, 3.0, self.t_k)[:, None]
        return q, k, v

    def d_out(self, seed: int) -> Tensor:
        """The gradient the backward pass gets: float32 (B, H, T_q, d)."""
        gen = torch.Generator().manual_seed(seed)
        b, h, t_q, d = self.batch, self.heads, self.t_q, self.head_dim
        if self.layout == "views":
            return torch.randn(b, t_q, h, d, generator=gen).transpose(1, 2)
        return torch.randn(b, h, t_q, d, generator=gen)

    def bounds(self) -> dict[tuple[int, int, int], tuple[str, str]]:
        """What each dimension of the kernels' tensors is, and the mask
        that keeps an index below its size: (ndim, axis from the end,
        size) -> (name, mask), for the messages of :mod:`.guard`."""
        rows = (self.t_q, "T_q", "the row bound (rows < T_Q)")
        keys = (self.t_k, "T_k", "the key bound (cols < T_K)")
        head = (self.head_dim, "d", "the head-size bound (dims < HEAD_DIM)")
        bounds: dict[tuple[int, int, int], tuple[str, str]] = {}
        for key, (size, name, words) in (
            ((4, -1), head),  # q, k, v, out, d_out, dq, dk, dv
            ((4, -2), keys),
            ((4, -2), rows),
            ((3, -1), rows),  # lse, delta
        ):
            if (*key, size) in bounds:  # T_q = T_k: either
                known = bounds[(*key, size)]
                name, words = f"{name} = {known[0]}", f"{words} or {known[1]}"
            bounds[(*key, size)] = (name, words)
        return bounds

    def __str__(self) -> str:
        views = ", q and k views of (B, T, H, d)"
        return (
            f"B={self.batch}, H={self.heads}, H_kv={self.kv_heads}, "
            f"T_q={self.t_q}, T_k={self.t_k}, d={self.head_dim}, "
            f"causal={self.causal}" + (views if self.layout == "views" else "")
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
    (
        "inputs that are views: q and k transposed from (B, T, H, d)",
        (Case(1, 4, 2, 37, 70, 24, True, layout="views"),),
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
    (
        "gradients with more batches (3) than query heads per group (2)",
        (Case(3, 2, 1, 20, 35, 16, False),),
    ),
    (
        "gradients of views (transposed q, k, d_out); head sizes 24 and 80",
        (
            Case(1, 4, 2, 20, 37, 24, True, layout="views"),
            Case(1, 1, 1, 17, 30, 80, False),
        ),
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

    Catches: acc and ell not rescaled when the running maximum grows; acc
    divided by ell inside the loop; causal aligned top-left; the key tail
    not masked; the GQA head map ``h % H_kv``; no ``1/sqrt(d)``; exp2
    without the log2(e) factor; a float16 accumulator; NaN on a fully
    masked row; the logsumexp in base 2 or mixing log2 and natural units;
    strides ignored; a program on the wrong (batch, head). Backward: causal
    ignored or aligned top-left; delta left out; dq's or dk's scale left
    out; exp2 against the natural logsumexp; dk and dv of one query head
    of a group. Every Triton kernel ``fn`` launches runs in guard bands
    (:mod:`.guard`): a load or store outside a tensor is named with the
    tensor, the places and the missing mask, and never ends the process.

    Returns None when every item passes (printing the checklist unless
    ``verbose=False``); raises ``AssertionError`` naming the item otherwise.
    """
    checker = Checker("check_flash_attention", fn, "torch", device=device)
    device = checker.device
    returned_lse: list[bool] = []

    def forward(case: Case, seed: int, contiguous: bool = False) -> None:
        q, k, v = (_placed(t, device, contiguous) for t in case.inputs(seed))
        checker.bounds = case.bounds()
        result = checker.call(q, k, v, case.causal, copy=False)
        out, lse = _out_and_lse(result, case)
        returned_lse.append(lse is not None)
        _check_forward(case, out, lse, (q, k, v))

    for number, (title, cases) in enumerate(FORWARD_ITEMS):

        @checker.item(title)
        def _(cases=cases, number=number) -> None:
            for index, case in enumerate(cases):
                _strides_named(forward, case, 10 * number + index)

    if backward:
        for number, (title, cases) in enumerate(BACKWARD_ITEMS):

            @checker.item(title)
            def _(cases=cases, number=number) -> None:
                for index, case in enumerate(cases):
                    seed = 100 + 10 * number + index

                    def gradients(case, seed, contiguous=False):
                        _check_backward(checker, case, seed, contiguous)

                    _strides_named(gradients, case, seed)

    checker.run(verbose=False)
    if verbose:
        _print_checklist(checker, any(returned_lse), backward)


def _placed(tensor: Tensor, device: Any, contiguous: bool) -> Tensor:
    """``tensor`` on ``device``, its layout kept (or made contiguous)."""
    if contiguous:
        return tensor.to(device).contiguous()
    placed = torch.empty_strided(
        tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device
    )
    return placed.copy_(tensor)


def _strides_named(check: Callable, case: Case, seed: int) -> None:
    """``check(case, seed)``; where it fails on views and passes on the same
    values in contiguous tensors, name the strides."""
    try:
        check(case, seed)
    except OutOfBounds:
        raise
    except Failed:
        if case.layout == "contiguous":
            raise
        try:
            check(case, seed, contiguous=True)
        except Failed:
            pass
        else:
            raise Failed(
                f"for {case}: the result is wrong, and right for the same "
                "values in contiguous tensors: your launcher or kernel "
                "ignores the strides. q and k (and d_out, in the backward "
                "pass) are (B, H, T, d) views of (B, T, H, d) tensors here, "
                "as split heads give them, and v is contiguous: pass each "
                "tensor's own strides (q.stride(), k.stride(), v.stride(), "
                "...), or make each one contiguous in the launcher (q = "
                "q.contiguous(), ...)"
            ) from None
        raise


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
    twins = _forward_twins(case, q, k, v)
    _compare(got, expected, where + "out", twins, batched=True)
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
    row_max = _row_max(q, k, case)
    log_ell = expected_lse - row_max  # log of ell, the sum of exp(s - m)
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
            "the log of the sum of exp(s - m)": row_max[seen],
            "the logsumexp is log(ell) alone: add the running maximum m": (
                log_ell[seen]
            ),
            "the logsumexp mixes log2 and natural units: with exp2, m is in "
            "log2 units (the scores times log2(e)) and so is log2(ell); the "
            "natural logsumexp is (m + log2(ell)) * ln(2), not m + log(ell) "
            "nor m * ln(2) + log2(ell)": (
                (row_max * LOG2E + log_ell)[seen],  # m2 + ln(ell)
                (row_max + log_ell * LOG2E)[seen],  # m2 ln 2 + log2(ell)
            ),
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
        "acc was divided by ell inside the loop: a later tile rescales acc "
        "by alpha only, so every earlier division stays in it; keep acc "
        "unnormalised and divide once, after the last key tile (out = acc "
        "/ ell)": tuple(
            _tiled(q, k, v, case, size, divide_each=True, divide=divide)[0]
            for size in TILE_SIZES
            for divide in (False, True)
        ),
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


def _check_backward(
    checker: Checker, case: Case, seed: int, contiguous: bool = False
) -> None:
    device = checker.device
    leaves = [
        _placed(t, device, contiguous).requires_grad_()
        for t in case.inputs(seed)
    ]
    checker.bounds = case.bounds()
    result = checker.call(*leaves, case.causal, copy=False)
    out, _ = _out_and_lse(result, case)
    where = f"for {case}: "
    if not out.requires_grad:
        raise Failed(
            where + "out has no gradient: tie the forward and backward "
            "kernels together in a torch.autograd.Function"
        )
    d_out = _placed(case.d_out(seed), device, contiguous)
    try:
        with checker.guarded():
            grads = torch.autograd.grad(out, leaves, d_out, allow_unused=True)
    except Failed:
        raise
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
    d_out = d_out.cpu().double()
    expected = _dense_gradients(q, k, v, d_out, case.causal)
    twins = _backward_twins(case, q, k, v, d_out)
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
            {
                words: tuple(form[index] for form in forms)
                if isinstance(forms[0], tuple)
                else forms[index]
                for words, forms in twins.items()
            },
            batched=True,
        )


def _backward_twins(case: Case, q, k, v, d_out) -> dict[str, tuple]:
    """The known mistakes' (dq, dk, dv), in float64: one triple each, or a
    tuple of triples where a mistake has several forms."""
    causal = case.causal

    def grads(**options) -> tuple[Tensor, ...]:
        return _recomputed_gradients(q, k, v, d_out, causal, causal,
                                     **options)  # fmt: skip

    twins = {
        "the backward pass ignores causal (Triton issue #4541): mask the "
        "recomputed p with j <= i + T_k - T_q when, and only when, causal "
        "is True": _recomputed_gradients(q, k, v, d_out, causal, not causal),
        "delta was left out: dS = P * (dP - delta), with delta = "
        "rowsum(dO * O) ((d_out * out).sum(-1)), one number per query, "
        "subtracted from every dP of its row": grads(delta=False),
        "dq was not multiplied by the scale: dS is the gradient of the "
        "scaled scores, so dq = dS k / sqrt(d) (sm_scale), as dk = dS^T q "
        "/ sqrt(d)": grads(dq_scale=False),
        "dk was not multiplied by the scale: dS is the gradient of the "
        "scaled scores, so dk = dS^T q / sqrt(d) (sm_scale), as dq = dS k "
        "/ sqrt(d)": grads(dk_scale=False),
        "the weights were rebuilt with exp2 against the natural logsumexp, "
        "mixing log2 and natural units: P = exp(S - L) with L natural; for "
        "exp2 both terms in log2 units, exp2(S * log2(e) - L * log2(e))": (
            grads(units=(1.0, math.log(2))),  # exp2(s log2e - L)
            grads(units=(math.log(2), math.log(2))),  # exp2(s - L)
            grads(units=(LOG2E, 1.0)),  # exp(s log2e - L)
        ),
    }
    if causal and case.t_q != case.t_k:
        twins[
            "the backward pass aligns causal top-left: use the forward's "
            "bottom-right offset T_k - T_q in its masks and loop bounds"
        ] = _recomputed_gradients(q, k, v, d_out, True, True, align="top-left")
    group = case.heads // case.kv_heads
    if group > 1:
        twins[
            "dk and dv hold the gradient of one query head of each group: "
            "key/value head kv is read by the H / H_kv query heads kv * "
            "GROUP + g, and its dk and dv are the sum over all of them (for "
            "g in range(GROUP))"
        ] = tuple(grads(group_head=g) for g in range(group))
    return twins


def _dense_gradients(q, k, v, d_out, causal: bool) -> tuple[Tensor, ...]:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = dense(*leaves, causal=causal)
    return torch.autograd.grad(out, leaves, d_out)


def _recomputed_gradients(
    q, k, v, d_out, forward_causal, backward_causal, align="bottom-right",
    *, delta=True, dq_scale=True, dk_scale=True, units=(1.0, 1.0),
    group_head=None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """A backward pass that rebuilds p = exp(s - lse) from the forward's
    logsumexp, masking as ``backward_causal`` says (right or not), and with
    the mistakes the options switch on: ``delta`` left out, a scale left
    out, p = exp(a s - b lse) for ``units`` (a, b), dk and dv from query
    head ``group_head`` of each group alone."""
    out, lse = dense(q, k, v, causal=forward_causal)
    group = q.shape[1] // k.shape[1]
    k_all, v_all = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5
    scores = q @ k_all.transpose(-1, -2) * scale  # (B, H, T_q, T_k)
    lse = lse.masked_fill(torch.isneginf(lse), 0)[..., None]
    p = torch.exp(units[0] * scores - units[1] * lse)
    if backward_causal:
        keep = _keep(q.shape[2], k.shape[2], True, align)
        p = p.masked_fill(~keep, 0.0)
    row = (d_out * out).sum(-1, keepdim=True)  # delta: (B, H, T_q, 1)
    dv = p.transpose(-1, -2) @ d_out
    ds = p * (d_out @ v_all.transpose(-1, -2) - (row if delta else 0.0))
    dq = ds @ k_all * (scale if dq_scale else 1.0)
    dk = ds.transpose(-1, -2) @ q * (scale if dk_scale else 1.0)

    def per_kv_head(t):  # (B, H, T_k, d) -> (B, H_kv, T_k, d), group sums
        grouped = t.unflatten(1, (k.shape[1], group))
        return (
            grouped.sum(2) if group_head is None else grouped[:, :, group_head]
        )

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
    rescale_ell=True, mask_tail=True, divide=True, divide_each=False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The online softmax over key tiles of ``block_k`` (all keys at once
    for None), with the mistakes that depend on the tiles switched on
    (``divide_each``: acc divided by ell after each tile)."""
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
        if divide_each:
            acc = acc / ell.masked_fill(ell == 0, 1.0)[..., None]
        m = m_new
    out = acc / ell.masked_fill(ell == 0, 1.0)[..., None] if divide else acc
    return _ungroup(out, "divide"), _ungroup(m + torch.log(ell), "divide")


# ---------------------------------------------------------------------------
# Comparison


def _compare(
    got: Tensor,
    expected: Tensor,
    what: str,
    twins: dict | None = None,
    batched: bool = False,
) -> None:
    """Pass within :data:`TOLERANCE`; otherwise name the twin ``got``
    equals, if any, or say how far and where it is off. ``batched``: the
    first axis is the batch, and a result right for batch 0 only is named
    as a program that works on the wrong (batch, head)."""
    if _close(got, expected):
        return
    for words, results in (twins or {}).items():
        for twin in results if isinstance(results, tuple) else (results,):
            if twin.shape == got.shape and _close(got, twin):
                raise Failed(f"{what}: {words}")
    wrong = [
        b
        for b in range(got.shape[0] if batched else 0)
        if not _close(got[b], expected[b])
    ]
    if wrong and wrong[0] > 0:
        raise Failed(
            f"{what} is right for batch 0 and wrong for batch {wrong[0]}: a "
            "program works on another (batch, head) than its own. With one "
            "program per (batch, head), b = pid // heads and the head is "
            "pid % heads, where heads is the number of heads of the tensor "
            "it writes: H for out and dq, H_kv for dk and dv (b_kv // "
            "H_kv, not b_kv // H); and the batch's offset is b * stride_b"
        )
    if torch.isnan(got).any():
        where = tuple(int(i) for i in torch.nonzero(torch.isnan(got))[0])
        raise Failed(
            f"{what} holds NaN (first at index {where}). The checker puts "
            "NaN around every tensor it hands a kernel: a load past the end "
            "of q, k, v (or d_out, lse) that reaches the result makes NaN. "
            "Mask every load with the bounds of its tile (rows < T_Q, cols "
            "< T_K, dims < HEAD_DIM)"
        )
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
