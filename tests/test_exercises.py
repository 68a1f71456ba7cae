"""The learner's checkers: each passes right code and names the typical mistakes.

Every wrong implementation below is written the way a learner writes it (not taken from the
checkers' own twins), and each test pins the item that fails and the words of the diagnosis.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mha
import numpy as np
import pytest
import torch
from mha import exercises as ex
from mha.exercises import failure

from helpers import KERNEL_DEVICE

# ---------------------------------------------------------------------------------------------
# Right implementations, written independently of the package


def loop_softmax(x, axis=-1):
    x = np.moveaxis(np.asarray(x, dtype=float), axis, -1)
    out = np.zeros_like(x)
    for index in np.ndindex(x.shape[:-1]):
        row = x[index]
        if np.isneginf(row).all():
            continue
        exps = np.exp(row - row.max())
        out[index] = exps / exps.sum()
    return np.moveaxis(out, -1, axis)


def torch_softmax(x, axis=-1):
    out = torch.softmax(x, dim=axis)
    return torch.nan_to_num(out, nan=0.0)  # torch gives NaN for an all -inf row


def loop_sdpa(q, k, v, mask=None):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    weights = loop_softmax(scores)
    return weights @ v, weights


def torch_sdpa(q, k, v, mask=None):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if mask is not None:  # torch gives NaN where a query sees no key
        out = torch.where(mask.any(-1, keepdim=True), out, 0.0)
    return out


def loop_mha(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
    """Chapter 3's form: one head at a time over column blocks."""
    d_k = w_q.shape[1] // num_heads
    outputs = []
    for h in range(num_heads):
        cols = slice(h * d_k, (h + 1) * d_k)
        out_h, _ = loop_sdpa(x @ w_q[:, cols], x @ w_k[:, cols], x @ w_v[:, cols], mask)
        outputs.append(out_h)
    return np.concatenate(outputs, axis=-1) @ w_o


def torch_mha(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
    *lead, t, d = x.shape
    heads = [(x @ w).reshape(*lead, t, num_heads, -1).transpose(-3, -2) for w in (w_q, w_k, w_v)]
    out = torch_sdpa(*heads, mask)
    return out.transpose(-3, -2).reshape(*lead, t, d) @ w_o


def rope_by_rotation_matrices(x, positions):
    """Build each pair's 2 x 2 rotation, dimension i with i + d_k/2."""
    d_k = x.shape[-1]
    out = np.empty_like(x)
    positions = np.broadcast_to(positions, x.shape[:1] + x.shape[2:3])  # (B, T)
    for b, h, t in np.ndindex(x.shape[:3]):
        for i in range(d_k // 2):
            angle = positions[b, t] * 10000.0 ** (-2 * i / d_k)
            c, s = np.cos(angle), np.sin(angle)
            a, bb = x[b, h, t, i], x[b, h, t, i + d_k // 2]
            out[b, h, t, i], out[b, h, t, i + d_k // 2] = c * a - s * bb, s * a + c * bb
    return out


def cache_update(keys, values, k, v, length):
    end = length + k.shape[2]
    if end > keys.shape[2]:
        raise ValueError(f"the cache holds {keys.shape[2]} positions, {end} asked")
    keys[:, :, length:end] = k
    values[:, :, length:end] = v
    return keys[:, :, :end], values[:, :, :end]


def online_step(m, ell, acc, scores, v):
    m_new = np.maximum(m, scores.max(axis=-1))
    rescale = np.exp(m - m_new)
    p = np.exp(scores - m_new[:, None])
    return m_new, rescale * ell + p.sum(-1), rescale[:, None] * acc + p @ v


def _item(message: str) -> int:
    match = re.search(r"item (\d+) of \d+ failed", " ".join(message.split()))
    assert match, message
    return int(match.group(1))


def assert_caught(check, fn, item: int, *words: str, **kwargs) -> str:
    message = failure(check, fn, **kwargs)
    assert message is not None, f"{check.__name__} let a wrong implementation pass"
    assert _item(message) == item, message
    flat = " ".join(message.split())
    for word in words:
        assert word in flat, f"{word!r} not in:\n{message}"
    assert_fits_a_phone(message)
    return message


# A phone's code cell shows about 60 characters; a traceback prints "AssertionError: " before the
# message's first line.
PHONE = 60


def assert_fits_a_phone(message: str) -> None:
    first, *rest = message.splitlines()
    assert len("AssertionError: " + first) <= PHONE, first
    assert all(len(line) <= PHONE for line in rest), message


# ---------------------------------------------------------------------------------------------
# Right code passes


@pytest.mark.parametrize(
    ("check", "fns", "kwargs"),
    [
        (ex.check_softmax, [mha.softmax, loop_softmax], {}),
        (ex.check_softmax, [torch_softmax], {"framework": "torch"}),
        (
            ex.check_scaled_dot_product_attention,
            [mha.scaled_dot_product_attention, loop_sdpa, lambda *a, **k: loop_sdpa(*a, **k)[0]],
            {},
        ),
        (ex.check_scaled_dot_product_attention, [torch_sdpa], {"framework": "torch"}),
        (ex.check_split_heads, [mha.split_heads], {}),
        (ex.check_merge_heads, [mha.merge_heads], {}),
        (ex.check_multi_head_attention, [mha.multi_head_attention, loop_mha], {}),
        (ex.check_multi_head_attention, [torch_mha], {"framework": "torch"}),
        (ex.check_causal_mask, [mha.causal_mask, lambda a, b: np.tri(a, b, dtype=bool)], {}),
        (
            ex.check_causal_mask,
            [lambda a, b: np.tri(a, b, k=b - a, dtype=bool)],
            {"align": "bottom-right"},
        ),
        (ex.check_rope, [rope_by_rotation_matrices], {}),
        (ex.check_rope, [mha.apply_rope], {"framework": "torch"}),
        (ex.check_padded_positions, [lambda keep: np.cumsum(keep, axis=-1) - 1], {}),
        (
            ex.check_padded_positions,
            [lambda keep: (keep.long().cumsum(-1) - 1).clamp(min=0)],
            {"framework": "torch"},
        ),
        (ex.check_kv_cache_update, [cache_update], {}),
        (ex.check_kv_cache_update, [cache_update], {"framework": "torch"}),
        (ex.check_online_softmax_step, [online_step], {}),
    ],
)
def test_right_code_passes(check, fns, kwargs):
    for fn in fns:
        assert failure(check, fn, **kwargs) is None


def test_a_pass_prints_the_checklist(capsys):
    assert ex.check_softmax(mha.softmax) is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "check_softmax: all 8 items pass"
    assert lines[1].startswith("  1. ") and len(lines) == 9
    assert ex.check_softmax(mha.softmax, verbose=False) is None
    assert capsys.readouterr().out == ""


def test_a_failure_raises_assertion_error():
    with pytest.raises(AssertionError, match=r"check_softmax: item \d+ of 8 failed"):
        ex.check_softmax(lambda x, axis=-1: x, verbose=False)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fn must be a function, got int"):
        ex.check_softmax(3)
    with pytest.raises(ValueError, match="framework must be one of 'numpy', 'torch', got 'jax'"):
        ex.check_softmax(mha.softmax, framework="jax")
    with pytest.raises(ValueError, match="align must be one of"):
        ex.check_causal_mask(mha.causal_mask, align="left")


def test_an_error_inside_the_learners_code_is_reported_with_the_shapes():
    def transposes_nothing(q, k, v, mask=None):
        return mha.softmax(q @ k / np.sqrt(q.shape[-1])) @ v

    message = assert_caught(ex.check_scaled_dot_product_attention, transposes_nothing, 1)
    flat = " ".join(message.split())
    assert "raised ValueError" in flat and "array (3, 5), array (4, 5)" in flat
    assert "transpose k's last two axes" in flat


# ---------------------------------------------------------------------------------------------
# softmax


def no_max(x, axis=-1):
    exps = np.exp(x)
    return exps / exps.sum(axis=axis, keepdims=True)


def test_softmax_mistakes():
    check = ex.check_softmax

    def whole_array(x, axis=-1):
        exps = np.exp(x - x.max())
        return exps / exps.sum()

    def max_without_keepdims(x, axis=-1):
        exps = np.exp(x - x.max(axis=axis))
        return exps / exps.sum(axis=axis, keepdims=True)

    def sum_without_keepdims(x, axis=-1):
        exps = np.exp(x - x.max(axis=axis, keepdims=True))
        return exps / exps.sum(axis=axis)

    def last_axis_always(x, axis=-1):
        return mha.softmax(x, axis=-1)

    def global_max(x, axis=-1):
        exps = np.exp(x - x.max())
        return exps / exps.sum(axis=axis, keepdims=True)

    def nan_on_empty_rows(x, axis=-1):
        exps = np.exp(x - x.max(axis=axis, keepdims=True))
        return exps / exps.sum(axis=axis, keepdims=True)

    def in_place(x, axis=-1):  # right in every other way
        x[...] = mha.softmax(x, axis=axis)
        return x

    assert_caught(check, whole_array, 2, "whole array sums to 1")
    assert_caught(check, max_without_keepdims, 1, "raised ValueError", "keepdims=True")
    assert_caught(check, sum_without_keepdims, 1, "raised ValueError", "keepdims=True")

    # on a square array the missing keepdims broadcasts without an error
    def on_squares(mistake):
        return lambda x, axis=-1: mistake(x, axis) if x.shape == (4, 4) else mha.softmax(x)

    assert_caught(
        check, on_squares(max_without_keepdims), 2, "row i's maximum was subtracted from column i"
    )
    assert_caught(check, on_squares(sum_without_keepdims), 2, "column j was divided by row j's")
    assert_caught(check, lambda x, axis=-1: mha.softmax(x, axis=0), 2, "down the columns")
    assert_caught(check, last_axis_always, 3, "axis was ignored")
    assert_caught(check, no_max, 4, "overflows", "Subtract each row's maximum")
    assert_caught(check, global_max, 5, "one maximum for the whole array")
    assert_caught(check, nan_on_empty_rows, 7, "-inf - (-inf) is NaN")
    assert_caught(check, in_place, 8, "x itself was changed")


# ---------------------------------------------------------------------------------------------
# scaled dot-product attention


def test_attention_mistakes():
    check = ex.check_scaled_dot_product_attention

    def attention(scale=None, axis=-1, fill=-np.inf, after=False, invert=False):
        def fn(q, k, v, mask=None):
            d_k = q.shape[-1]
            scores = q @ np.swapaxes(k, -1, -2) * (scale(d_k, v) if scale else d_k**-0.5)
            if mask is not None and invert:
                mask = ~mask
            if mask is not None and not after:
                scores = np.where(mask, scores, fill)
            exps = np.exp(scores - scores.max(axis=axis, keepdims=True))
            weights = exps / exps.sum(axis=axis, keepdims=True)
            if mask is not None and after:
                weights = weights * mask
            return weights @ v

        return fn

    assert_caught(check, attention(scale=lambda d, v: 1.0), 2, "were not scaled")
    assert_caught(check, attention(scale=lambda d, v: 1 / d), 2, "divided by d_k")
    assert_caught(
        check, attention(scale=lambda d, v: v.shape[-1] ** -0.5), 2, "sqrt(d_v), the width"
    )
    assert_caught(check, attention(axis=-2), 2, "over the queries (axis -2)")
    assert_caught(check, attention(invert=True), 5, "True was read as blocked")
    assert_caught(check, attention(after=True), 5, "masked after the softmax")
    assert_caught(check, attention(), 6, "0 / 0")
    assert_caught(check, attention(fill=-1e9), 6, "mean of the values", "-1e9")
    assert_caught(check, lambda q, k, v, mask=None: loop_sdpa(q[0], k[0], v[0])[0], 1, "shape")

    def only_two_dimensions(q, k, v, mask=None):
        return mha.softmax(q @ k.T / np.sqrt(q.shape[-1])) @ v

    assert_caught(check, only_two_dimensions, 4, "raised")

    def wrong_weights(q, k, v, mask=None):
        out, weights = mha.scaled_dot_product_attention(q, k, v, mask)
        return out, np.swapaxes(weights, -1, -2)[..., :3]

    assert_caught(check, wrong_weights, 3, "the weights")


# ---------------------------------------------------------------------------------------------
# split and merge


def test_split_mistakes():
    check = ex.check_split_heads

    def no_transpose(x, num_heads):
        *lead, t, d = x.shape
        return x.reshape(*lead, num_heads, t, d // num_heads)

    def heads_after_t(x, num_heads):
        *lead, t, d = x.shape
        return x.reshape(*lead, t, num_heads, d // num_heads)

    def every_hth_column(x, num_heads):
        *lead, t, d = x.shape
        heads = [x[..., h::num_heads] for h in range(num_heads)]
        return np.stack(heads, axis=-3)

    def batched_only(x, num_heads):
        b, t, d = x.shape
        return x.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)

    assert_caught(check, no_transpose, 2, "without a transpose", "(B, T, H, d_k)")
    assert_caught(check, heads_after_t, 1, "(B, T, H, d_k)", "swap the axes T and H")
    assert_caught(check, every_hth_column, 2, "every H-th column")
    assert_caught(check, batched_only, 3, "raised ValueError")


def test_merge_mistakes():
    check = ex.check_merge_heads

    def no_transpose(heads):
        *lead, h, t, d_k = heads.shape
        return heads.reshape(*lead, t, h * d_k)

    def interleaved(heads):
        *lead, h, t, d_k = heads.shape
        return np.stack([heads[..., i, :, :] for i in range(h)], axis=-1).reshape(*lead, t, -1)

    assert_caught(check, no_transpose, 2, "without moving them back behind T")
    assert_caught(check, interleaved, 2, "interleaved")


# ---------------------------------------------------------------------------------------------
# multi-head attention


def fused_mha(split="right", merge="right", scale="d_k", axis=-1, w_o=True, fill=-np.inf):
    """The fused layer as a learner writes it, with one knob per typical mistake."""

    def fn(x, w_q, w_k, w_v, w_o_matrix, num_heads, mask=None):
        *lead, t, d = x.shape
        d_k = d // num_heads

        def heads(y):
            if split == "no-transpose":
                return y.reshape(*lead, num_heads, t, d_k)
            if split == "interleaved":
                return np.stack([y[..., h::num_heads] for h in range(num_heads)], axis=-3)
            return np.swapaxes(y.reshape(*lead, t, num_heads, d_k), -3, -2)

        q, k, v = heads(x @ w_q), heads(x @ w_k), heads(x @ w_v)
        width = {"d_k": d_k, "D": d, "none": 1}[scale]
        scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(width)
        if mask is not None:
            scores = np.where(mask, scores, fill)
        if fill == -np.inf:  # a learner's softmax, NaN on an empty row
            exps = np.exp(scores - scores.max(axis=axis, keepdims=True))
            weights = exps / exps.sum(axis=axis, keepdims=True)
        else:
            weights = mha.softmax(scores, axis=axis)
        out = weights @ v  # (..., H, T, d_k)
        if merge == "no-transpose":
            merged = out.reshape(*lead, t, d)
        else:
            merged = np.swapaxes(out, -3, -2).reshape(*lead, t, d)
        return merged @ w_o_matrix if w_o else merged

    return fn


def test_multi_head_mistakes():
    check = ex.check_multi_head_attention
    assert_caught(check, fused_mha(split="no-transpose"), 2, "without a transpose")
    assert_caught(check, fused_mha(merge="no-transpose"), 2, "merged by a reshape")
    assert_caught(check, fused_mha(scale="D"), 2, "divided by sqrt(D)", "sqrt(D / H)")
    assert_caught(check, fused_mha(scale="none"), 2, "not scaled")
    assert_caught(check, fused_mha(axis=-2), 2, "over the queries")
    assert_caught(check, fused_mha(split="interleaved"), 2, "every H-th column")
    assert_caught(check, fused_mha(w_o=False), 2, "W_O was left out")
    assert_caught(check, fused_mha(), 8, "gave NaN")

    right = fused_mha(fill=-np.inf)

    def ignores_mask(x, *w, mask=None):
        return right(x, *w)

    def inverted(x, *w, mask=None):
        return right(x, *w, mask=None if mask is None else ~mask)

    assert_caught(check, ignores_mask, 7, "the mask was ignored")
    assert_caught(check, inverted, 7, "True was read as blocked")

    def batched_only(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        b, t, d = x.shape
        return mha.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads, mask)[0]

    assert_caught(check, batched_only, 4, "raised ValueError")


def test_multi_head_right_except_for_empty_rows_passes_until_the_last_item():
    # A layer with a learner's softmax is right everywhere else: only item 8 fails.
    message = failure(ex.check_multi_head_attention, fused_mha())
    assert _item(message) == 8


# ---------------------------------------------------------------------------------------------
# masks and positions


def test_causal_mask_mistakes():
    check = ex.check_causal_mask
    assert_caught(check, lambda a, b: ~np.tri(a, b, dtype=bool), 1, "True marks the future")
    assert_caught(check, lambda a, b: np.tri(a, b, k=-1, dtype=bool), 1, "attend to itself")
    assert_caught(check, lambda a, b: np.triu(np.ones((a, b), bool)), 1, "upper triangle")
    assert_caught(check, lambda a, b: np.tri(a, b), 1, "dtype float64", "boolean")
    assert_caught(
        check,
        lambda a, b: np.where(np.tri(a, b, dtype=bool), 0.0, -np.inf),
        1,
        "additive mask",
    )
    assert_caught(
        check,
        lambda a, b: np.tri(a, b, dtype=bool),
        2,
        "aligned top-left",
        "k=T_k - T_q",
        align="bottom-right",
    )
    assert_caught(check, lambda a, b: np.tri(a, b, k=b - a, dtype=bool), 2, "aligned bottom-right")
    assert_caught(check, lambda a, b: np.tri(a, a, dtype=bool)[:, :b], 2, "shape")


def test_rope_mistakes():
    check = ex.check_rope

    def halves(x, positions, sign=1.0, exponent=2.0):
        d_k = x.shape[-1]
        angles = positions[..., None] * 10000.0 ** (-exponent * np.arange(d_k // 2) / d_k)
        if angles.ndim == 3:
            angles = angles[:, None]
        cos, sin = np.cos(angles), sign * np.sin(angles)
        x1, x2 = x[..., : d_k // 2], x[..., d_k // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def neighbours(x, positions):
        d_k = x.shape[-1]
        angles = positions[..., None] * 10000.0 ** (-np.arange(0, d_k, 2) / d_k)
        if angles.ndim == 3:
            angles = angles[:, None]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * np.cos(angles) - odd * np.sin(angles)
        out[..., 1::2] = even * np.sin(angles) + odd * np.cos(angles)
        return out

    def first_row_only(x, positions):
        return halves(x, positions if positions.ndim == 1 else positions[0])

    def scaled(x, positions):  # not a rotation
        return 1.1 * halves(x, positions)

    def fixed_angle(x, positions):  # turns by the slot, not by the position
        return halves(x, np.arange(x.shape[2]))

    def turns_keys_only_by_slot_zero(x, positions):
        return halves(x, positions * 0 + 3)

    assert_caught(check, scaled, 2, "the lengths")
    assert_caught(check, fixed_angle, 3, "position 0")
    assert_caught(check, neighbours, 5, "(2i, 2i + 1)", "i + d_k/2")
    assert_caught(check, lambda x, p: halves(x, p, sign=-1.0), 5, "the other way")
    assert_caught(check, lambda x, p: halves(x, p, exponent=1.0), 5, "base^(-i/d_k)")
    assert_caught(check, first_row_only, 6, "positions of sequence 0")
    assert_caught(check, turns_keys_only_by_slot_zero, 3, "position 0")


def test_rope_properties_come_before_the_exact_comparison():
    # A reflection keeps lengths but is no rotation: position 0 already shows it. Turning by
    # the square of the position keeps lengths and position 0 but breaks the offset property.
    def reflect(x, positions):
        d_k = x.shape[-1]
        angles = positions[..., None] * 10000.0 ** (-2 * np.arange(d_k // 2) / d_k)
        cos, sin = np.cos(angles), np.sin(angles)
        x1, x2 = x[..., : d_k // 2], x[..., d_k // 2 :]
        return np.concatenate([x1 * cos + x2 * sin, x1 * sin - x2 * cos], axis=-1)

    def squared_positions(x, positions):
        return mha.apply_rope(x, positions * positions)

    assert_caught(ex.check_rope, reflect, 3, "position 0")
    assert_caught(
        ex.check_rope,
        squared_positions,
        4,
        "the same offset must give the same score",
        framework="torch",
    )


def test_padded_positions_mistakes():
    check = ex.check_padded_positions
    assert_caught(
        check,
        lambda keep: np.broadcast_to(np.arange(keep.shape[1]), keep.shape),
        2,
        "padding included",
        "np.cumsum(keep, axis=-1) - 1",
    )
    assert_caught(check, lambda keep: np.cumsum(keep, axis=-1), 2, "numbered from 1")
    assert_caught(check, lambda keep: np.cumsum(keep, axis=-1) - 1.0, 1, "integers")
    assert_caught(check, lambda keep: np.cumsum(keep[:, ::-1], -1)[:, ::-1] - 1, 2, "got")


# ---------------------------------------------------------------------------------------------
# decoding and tiled attention


def test_kv_cache_mistakes():
    check = ex.check_kv_cache_update

    def at_zero(keys, values, k, v, length):
        keys[:, :, : k.shape[2]] = k
        values[:, :, : v.shape[2]] = v
        return keys[:, :, : length + k.shape[2]], values[:, :, : length + k.shape[2]]

    def whole_buffer(keys, values, k, v, length):
        cache_update(keys, values, k, v, length)
        return keys, values

    def concatenates(keys, values, k, v, length):
        return (
            np.concatenate([keys[:, :, :length], k], axis=2),
            np.concatenate([values[:, :, :length], v], axis=2),
        )

    def copies(keys, values, k, v, length):
        k_all, v_all = cache_update(keys, values, k, v, length)
        return k_all.copy(), v_all.copy()

    def clips(keys, values, k, v, length):
        room = keys.shape[2] - length
        return cache_update(keys, values, k[:, :, :room], v[:, :, :room], length)

    assert_caught(check, whole_buffer, 1, "all max_len = 8 positions", "zeros")
    assert_caught(check, at_zero, 2, "position 0")
    assert_caught(check, concatenates, 2, "still zeros", "np.concatenate")
    assert_caught(check, copies, 4, "is a copy")
    assert_caught(check, clips, 5, "without an error")
    assert_caught(check, lambda *a: a[0], 1, "return the pair")

    def torch_copies(keys, values, k, v, length):
        k_all, v_all = cache_update(keys, values, k, v, length)
        return k_all.clone(), v_all.clone()

    assert_caught(check, torch_copies, 4, "is a copy", framework="torch")


def test_online_softmax_mistakes():
    check = ex.check_online_softmax_step

    def step(acc_rescaled=True, ell_rescaled=True, inverted=False, running=True, raw=False):
        def fn(m, ell, acc, scores, v):
            m_new = np.maximum(m, scores.max(axis=-1)) if running else scores.max(axis=-1)
            rescale = np.exp(m_new - m) if inverted else np.exp(m - m_new)
            p = np.exp(scores) if raw else np.exp(scores - m_new[:, None])
            ell = (rescale * ell if ell_rescaled else ell) + p.sum(-1)
            acc = (rescale[:, None] * acc if acc_rescaled else acc) + p @ v
            if raw:
                return m_new, ell, acc
            return m_new, ell, acc

        return fn

    assert_caught(check, step(acc_rescaled=False), 2, "acc was not rescaled")
    assert_caught(check, step(ell_rescaled=False), 2, "ell was not rescaled")
    assert_caught(check, step(inverted=True), 1, "inverted factor")
    assert_caught(check, step(running=False), 3, "the last block's own maximum")
    assert_caught(check, step(raw=True), 2, "raw scores")
    assert_caught(check, lambda m, ell, acc, s, v: (m, ell), 1, "return the triple")


def test_online_softmax_inverted_rescale_named_when_the_start_is_finite():
    # From m = -inf the inverted rescale is exp(+inf): NaN at once (item 1). The three-block
    # item names it when the learner's own step survives the first block.
    def inverted(m, ell, acc, scores, v):
        m_new = np.maximum(m, scores.max(axis=-1))
        rescale = np.where(np.isfinite(m), np.exp(m_new - m), 0.0)
        p = np.exp(scores - m_new[:, None])
        return m_new, rescale * ell + p.sum(-1), rescale[:, None] * acc + p @ v

    assert_caught(ex.check_online_softmax_step, inverted, 2, "rescale is inverted")


# ---------------------------------------------------------------------------------------------
# float32: a right version passes, a wrong one fails, the message shows the difference

F32 = np.float32


def softmax32(x, axis=-1):
    x = np.asarray(x).astype(F32)
    top = x.max(axis=axis, keepdims=True)
    exps = np.exp(x - np.where(np.isfinite(top), top, 0))
    total = exps.sum(axis=axis, keepdims=True)
    return np.divide(exps, total, out=np.zeros_like(exps), where=total > 0)


def einsum_attention32(q, k, v, mask=None):
    q, k, v = (a.astype(F32) for a in (q, k, v))
    scores = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(F32(q.shape[-1]))
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    weights = softmax32(scores)
    return np.einsum("...qk,...kd->...qd", weights, v), weights


def split32(x, num_heads):
    *lead, t, d = x.shape
    return np.swapaxes(x.astype(F32).reshape(*lead, t, num_heads, d // num_heads), -3, -2)


def merge32(heads):
    *lead, h, t, d_k = heads.shape
    return np.swapaxes(heads.astype(F32), -3, -2).reshape(*lead, t, h * d_k)


def mha32(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
    x, w_q, w_k, w_v, w_o = (a.astype(F32) for a in (x, w_q, w_k, w_v, w_o))
    q, k, v = (split32(x @ w, num_heads) for w in (w_q, w_k, w_v))
    out, weights = einsum_attention32(q, k, v, mask)
    return merge32(out) @ w_o, weights


def rope32(x, positions):
    x, d_k = x.astype(F32), x.shape[-1]
    freq = F32(10000.0) ** (-2 * np.arange(d_k // 2, dtype=F32) / F32(d_k))
    angles = positions[..., None].astype(F32) * freq
    if angles.ndim == 3:
        angles = angles[:, None]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., : d_k // 2], x[..., d_k // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def online_step32(m, ell, acc, scores, v):
    return tuple(
        part.astype(F32)
        for part in online_step(*(np.asarray(a, dtype=F32) for a in (m, ell, acc, scores, v)))
    )


def float32_torch(fn):
    """``fn`` on float32 copies of its float64 tensor arguments."""
    return lambda *a, **k: fn(
        *(x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in a), **k
    )


@pytest.mark.parametrize(
    ("check", "fn", "kwargs"),
    [
        (ex.check_softmax, softmax32, {}),
        (ex.check_softmax, float32_torch(torch_softmax), {"framework": "torch"}),
        (ex.check_scaled_dot_product_attention, einsum_attention32, {}),
        (ex.check_scaled_dot_product_attention, float32_torch(torch_sdpa), {"framework": "torch"}),
        (ex.check_split_heads, split32, {}),
        (ex.check_merge_heads, merge32, {}),
        (ex.check_multi_head_attention, mha32, {}),
        (ex.check_multi_head_attention, float32_torch(torch_mha), {"framework": "torch"}),
        (ex.check_rope, rope32, {}),
        (ex.check_rope, float32_torch(mha.apply_rope), {"framework": "torch"}),
        (ex.check_online_softmax_step, online_step32, {}),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_a_right_float32_version_passes(check, fn, kwargs):
    assert failure(check, fn, **kwargs) is None


def test_a_wrong_float32_version_fails_and_is_named():
    def scaled_by_sqrt_d32(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        # every head's scores divided by sqrt(D) instead of sqrt(d_k)
        return mha32(x, w_q / num_heads**0.25, w_k / num_heads**0.25, w_v, w_o, num_heads, mask)[0]

    assert_caught(ex.check_multi_head_attention, scaled_by_sqrt_d32, 2, "divided by sqrt(D)")
    no_w_o = lambda x, *w, mask=None: mha32(x, *w[:3], np.eye(x.shape[-1]), w[4], mask)[0]  # noqa: E731
    assert_caught(ex.check_multi_head_attention, no_w_o, 2, "W_O was left out")
    in_float16 = lambda x, axis=-1: softmax32(x, axis).astype(np.float16)  # noqa: E731
    assert_caught(ex.check_softmax, in_float16, 2, "float16")


def test_the_message_shows_the_failing_element_in_enough_digits():
    def off_by_a_little(q, k, v, mask=None):
        out = mha.scaled_dot_product_attention(q, k, v, mask)[0].copy()
        out[..., 1, 2] *= 1 + 3e-5  # float64's tolerance is 1e-6
        return out

    message = assert_caught(ex.check_scaled_dot_product_attention, off_by_a_little, 2)
    flat = " ".join(message.split())
    assert "at index (1, 2)" in flat, message
    match = re.search(r"it is (\S+), expected (\S+)", flat)
    assert match and match.group(1) != match.group(2).rstrip(), message
    assert "1 of 18 places" in flat, message


# ---------------------------------------------------------------------------------------------
# multi-head attention: the six mistakes learners made, each named


def learner_mha(
    transpose_weights=False,
    swap=False,
    diagonal_w_o=False,
    own_slice=False,
    heads_axis=False,
    fill=-np.inf,
):
    """The fused layer as a learner writes it, one knob for each mistake."""

    def fn(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        *lead, t, d = x.shape
        d_k = d // num_heads
        if transpose_weights:  # torch's nn.Linear: x @ weight.T
            w_q, w_k, w_v, w_o = w_q.T, w_k.T, w_v.T, w_o.T
        if own_slice:  # head h reads x[..., block h] through w's block h
            heads = []
            for h in range(num_heads):
                cols = slice(h * d_k, (h + 1) * d_k)
                heads.append([x[..., cols] @ w[cols, cols] for w in (w_q, w_k, w_v)])
            q, k, v = (np.stack([head[i] for head in heads], axis=-3) for i in range(3))
        else:
            shape = (*lead, t, d_k, num_heads) if swap else (*lead, t, num_heads, d_k)
            q, k, v = (np.swapaxes((x @ w).reshape(shape), -3, -2) for w in (w_q, w_k, w_v))
        scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_k)
        if mask is not None:
            scores = np.where(mask, scores, fill)
        weights = mha.softmax(scores, axis=1 if heads_axis else -1)
        out = weights @ v
        if diagonal_w_o:
            return np.concatenate(
                [
                    out[..., h, :, :] @ w_o[h * d_k : (h + 1) * d_k, h * d_k : (h + 1) * d_k]
                    for h in range(num_heads)
                ],
                axis=-1,
            )
        return np.swapaxes(out, -3, -2).reshape(*lead, t, d) @ w_o

    return fn


def test_multi_head_names_the_six_mistakes():
    check = ex.check_multi_head_attention
    assert failure(check, learner_mha()) is None  # the knobs' baseline is right
    assert_caught(check, learner_mha(fill=-1e9), 8, "-1e9", "mean of the values")
    assert_caught(check, learner_mha(heads_axis=True), 2, "softmax ran over the heads")
    assert_caught(
        check,
        learner_mha(transpose_weights=True),
        2,
        "w_q, w_k, w_v, w_o used as torch's",
        "(out, in)",
    )
    assert_caught(check, learner_mha(swap=True), 2, "H and d_k were swapped")
    assert_caught(check, learner_mha(diagonal_w_o=True), 2, "only W_O's diagonal blocks")
    assert_caught(check, learner_mha(own_slice=True), 2, "only its own slice of x")


def test_multi_head_names_which_weights_were_transposed():
    def linear_projections(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        return learner_mha()(x, w_q.T, w_k.T, w_v.T, w_o, num_heads, mask)

    assert_caught(ex.check_multi_head_attention, linear_projections, 2, "w_q, w_k, w_v used as")


def test_a_softmax_without_keepdims_gets_the_keepdims_hint():
    def attention(q, k, v, mask=None):
        scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        exps = np.exp(scores - scores.max(axis=-1))
        return exps / exps.sum(axis=-1, keepdims=True) @ v

    def layer(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        heads = [mha.split_heads(x @ w, num_heads) for w in (w_q, w_k, w_v)]
        return mha.merge_heads(attention(*heads)) @ w_o

    def torch_attention(q, k, v, mask=None):
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        exps = torch.exp(scores - scores.amax(dim=-1))
        return exps / exps.sum(dim=-1, keepdim=True) @ v

    for check, fn, kwargs in [
        (ex.check_scaled_dot_product_attention, attention, {}),
        (ex.check_multi_head_attention, layer, {}),
        (ex.check_scaled_dot_product_attention, torch_attention, {"framework": "torch"}),
    ]:
        assert_caught(check, fn, 1, "without keepdims=True", "keepdim", **kwargs)


# ---------------------------------------------------------------------------------------------
# Devices: torch tensors go where the Triton kernels run (chapter 13 checks a Triton softmax)


def test_torch_inputs_are_where_the_kernels_run_unless_told():
    from mha.exercises.checker import kernel_device

    seen = []

    def spy(x, axis=-1):
        seen.append(x.device.type)
        return torch_softmax(x, axis)

    assert failure(ex.check_softmax, spy, framework="torch") is None
    assert set(seen) == {KERNEL_DEVICE} and kernel_device() == KERNEL_DEVICE
    seen.clear()
    assert failure(ex.check_softmax, spy, framework="torch", device="cpu") is None
    assert set(seen) == {"cpu"}


def test_a_torch_function_that_changes_its_input_is_caught_on_any_device():
    def in_place(x, axis=-1):  # right in every other way
        return x.copy_(torch_softmax(x, axis))

    assert_caught(ex.check_softmax, in_place, 8, "x itself was changed", framework="torch")


def test_a_result_on_another_device_is_named():
    # meta: a device no input is on, on any machine
    def softmax_elsewhere(x, axis=-1):
        return torch_softmax(x, axis).to("meta")

    def weights_elsewhere(q, k, v, mask=None):
        weights = torch_softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5)
        return torch_sdpa(q, k, v, mask), weights.to("meta")

    where = f"but its inputs are on {KERNEL_DEVICE}"
    assert_caught(
        ex.check_softmax, softmax_elsewhere, 1, "its result is a tensor on meta", where,
        "device=x.device", framework="torch",
    )  # fmt: skip
    assert_caught(
        ex.check_scaled_dot_product_attention, weights_elsewhere, 1,
        "part 1 of its result is a tensor on meta", where, framework="torch",
    )  # fmt: skip


def test_an_error_of_a_tensor_on_the_wrong_device_names_the_device():
    def cpu_output(x, axis=-1):  # a Triton kernel compiled for the GPU, handed a CPU tensor
        raise ValueError("Pointer argument (at 1) cannot be accessed from Triton (cpu tensor?)")

    assert_caught(
        ex.check_softmax, cpu_output, 1, "(cpu tensor?)", f"Its inputs are on {KERNEL_DEVICE}",
        "torch.empty_like(x)", framework="torch",
    )  # fmt: skip


def test_an_interpreter_that_cannot_run_here_is_named(monkeypatch):
    # Triton 3.4-3.6's interpreter with NumPy 2.4: the learner's launch fails deep inside
    import mha.environment

    def launch(x, axis=-1):
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(mha.environment, "_triton_version", lambda: "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.4.6")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert_caught(
        ex.check_softmax, launch, 1, "only 0-dimensional arrays",
        "Triton 3.6.0's interpreter cannot run these kernels with NumPy 2.4.6",
        "install triton 3.7 or later", framework="torch",
    )  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels: the interpreter is not named
    message = " ".join(failure(ex.check_softmax, launch, framework="torch").split())
    assert "only 0-dimensional arrays" in message and "interpreter" not in message, message


def test_a_device_needs_torch_and_a_name_torch_knows():
    with pytest.raises(ValueError, match="device='cuda' needs framework='torch'"):
        ex.check_softmax(mha.softmax, device="cuda")
    with pytest.raises(ValueError, match="device must be a torch device"):
        ex.check_softmax(torch_softmax, framework="torch", device="gpu")
    assert failure(ex.check_softmax, mha.softmax, device="cpu") is None


# ---------------------------------------------------------------------------------------------
# What a notebook shows of a failure


def _shown_in_a_notebook(code: str) -> str:
    """What IPython prints when ``code`` runs in a cell, without colours."""
    import contextlib
    import io

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        shell.run_cell(code)
    return re.sub(r"\x1b\[[0-9;]*m", "", shown.getvalue())


def test_a_notebook_shows_the_learners_line_and_the_message_only():
    shown = _shown_in_a_notebook(
        "import numpy as np\n"
        "from mha.exercises import check_softmax\n"
        "def my_softmax(x, axis=-1):\n"
        "    exps = np.exp(x)  # no maximum subtracted\n"
        "    return exps / exps.sum(axis=axis, keepdims=True)\n"
        "check_softmax(my_softmax)\n"
    )
    assert "----> 6 check_softmax(my_softmax)" in shown, shown
    assert "AssertionError: check_softmax: item 4 of 8 failed" in shown, shown
    assert "exercises" not in shown.split("AssertionError: check_softmax")[0], (
        shown
    )  # no checker frame
    assert "hidden" not in shown, shown


def test_a_notebook_shows_the_line_of_the_learners_function_that_raised():
    shown = _shown_in_a_notebook(
        "import numpy as np\n"
        "from mha.exercises import check_scaled_dot_product_attention\n"
        "def my_attention(q, k, v, mask=None):\n"
        "    scores = q @ k / np.sqrt(q.shape[-1])  # k not transposed\n"
        "    return scores @ v\n"
        "check_scaled_dot_product_attention(my_attention)\n"
    )
    assert "----> 4     scores = q @ k / np.sqrt(q.shape[-1])" in shown, shown
    assert "----> 6 check_scaled_dot_product_attention(my_attention)" in shown, shown
    assert "exercises" not in shown.split("AssertionError: check_scaled")[0], shown


# ---------------------------------------------------------------------------------------------
# The chapters' solutions, in JupyterLab


ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


def _solution_cells(path: Path) -> tuple[int, list[tuple[int, dict]]]:
    """The number of solutions, and (index, cell) of every cell inside one."""
    inside, solutions, cells = False, 0, []
    for number, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"]).lstrip()
        if source.startswith("```{solution-start}"):
            inside, solutions = True, solutions + 1
        elif source.startswith("```{solution-end}"):
            inside = False
        elif inside:
            cells.append((number, cell))
    return solutions, cells


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_solutions_are_folded_in_jupyterlab(path):
    # The book folds a solution into a dropdown; JupyterLab (with jupyterlab-myst) draws the
    # solution-start box but shows the cells after it, unless each is marked hidden.
    solutions, cells = _solution_cells(path)
    open_cells = []
    for number, cell in cells:
        hidden = cell["metadata"].get("jupyter", {})
        if not hidden.get("source_hidden") or (
            cell["cell_type"] == "code" and not hidden.get("outputs_hidden")
        ):
            open_cells.append(number)
    assert solutions > 0, f"{path.name} has no solution"
    assert not open_cells, f"{path.name}: cells {open_cells} of a solution are not folded"


# What a solution's dropdown shows without scrolling sideways, at 1280 px (measured in Chromium:
# the dropdown's padding takes 9 of the 83 characters of the column's code boxes).
SOLUTION_CODE_WIDTH, SOLUTION_OUTPUT_WIDTH = 74, 75


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_solutions_fit_their_dropdown(path):
    wide = []
    for number, cell in _solution_cells(path)[1]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        printed = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
        wide += [
            f"cell {number}: {line!r}"
            for line in source.splitlines()
            if len(line) > SOLUTION_CODE_WIDTH
        ]
        wide += [
            f"cell {number} prints: {line!r}"
            for line in printed.splitlines()
            if len(line) > SOLUTION_OUTPUT_WIDTH
        ]
    assert not wide, f"{path.name}: lines wider than a solution's box:\n" + "\n".join(wide)
