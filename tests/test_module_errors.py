"""Bad input to mha.MultiHeadAttention: the right exception, and a message naming the argument,
what was expected and what came."""

from __future__ import annotations

import math
import re

import pytest
import torch
from mha.module import MultiHeadAttention

B, T_Q, T_K, E, H = 2, 3, 4, 8, 2


def esc(text: str) -> str:
    return re.escape(text)


@pytest.fixture
def module() -> MultiHeadAttention:
    return MultiHeadAttention(E, H, kdim=5, vdim=6, batch_first=True)


@pytest.fixture
def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(B, T_Q, E),
        torch.randn(B, T_K, 5),
        torch.randn(B, T_K, 6),
    )


# --- the constructor ---------------------------------------------------------------------------


def test_embed_dim_not_divisible_by_num_heads() -> None:
    with pytest.raises(
        ValueError,
        match=r"embed_dim \(10\) must be divisible by num_heads \(4\)",
    ):
        MultiHeadAttention(10, 4, batch_first=True)


@pytest.mark.parametrize("name", ["embed_dim", "num_heads", "kdim", "vdim"])
@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_sizes(name: str, bad: int) -> None:
    kwargs = {"embed_dim": 8, "num_heads": 2, name: bad}
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got {bad}"):
        MultiHeadAttention(**kwargs, batch_first=True)


@pytest.mark.parametrize("bad", [8.0, "8", True])
def test_non_integer_embed_dim(bad: object) -> None:
    with pytest.raises(TypeError, match=rf"embed_dim must be an int, got {type(bad).__name__}"):
        MultiHeadAttention(bad, 2, batch_first=True)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_dropout_outside_unit_interval(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"dropout must lie in \[0, 1\), got {bad}"):
        MultiHeadAttention(8, 2, dropout=bad, batch_first=True)


# --- query, key, value -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(E,), (1, B, T_Q, E)])
def test_query_with_wrong_number_of_dimensions(
    module: MultiHeadAttention, qkv, shape: tuple[int, ...]
) -> None:
    _, key, value = qkv
    with pytest.raises(
        ValueError,
        match=esc(f"query must have 3 dimensions (batched) or 2 (unbatched), got shape {shape}"),
    ):
        module(torch.randn(shape), key, value)


def test_key_with_wrong_number_of_dimensions(module: MultiHeadAttention, qkv) -> None:
    query, key, value = qkv
    with pytest.raises(
        ValueError,
        match=esc(
            f"key must have shape (B, T, kdim=5) (like query, {(B, T_Q, E)}), got shape {(T_K, 5)}"
        ),
    ):
        module(query, key[0], value)


def test_unbatched_value_with_batched_query(module: MultiHeadAttention, qkv) -> None:
    query, key, value = qkv
    with pytest.raises(
        ValueError,
        match=esc(
            f"value must have shape (T, vdim=6) (like query, {(T_Q, E)}), got shape {(B, T_K, 6)}"
        ),
    ):
        module(query[0], key[0], value)


def test_query_feature_size(module: MultiHeadAttention, qkv) -> None:
    _, key, value = qkv
    with pytest.raises(
        ValueError,
        match=esc(f"query must have shape (B, T, embed_dim=8), got shape {(B, T_Q, 7)}"),
    ):
        module(torch.randn(B, T_Q, 7), key, value)


def test_key_feature_size(module: MultiHeadAttention, qkv) -> None:
    query, _, value = qkv
    with pytest.raises(
        ValueError,
        match=esc(
            f"key must have shape (B, T, kdim=5) (like query, {(B, T_Q, E)}), "
            f"got shape {(B, T_K, 8)}"
        ),
    ):
        module(query, torch.randn(B, T_K, 8), value)


def test_value_feature_size(module: MultiHeadAttention, qkv) -> None:
    query, key, _ = qkv
    with pytest.raises(
        ValueError,
        match=esc(
            f"value must have shape (B, T, vdim=6) (like query, {(B, T_Q, E)}), "
            f"got shape {(B, T_K, 5)}"
        ),
    ):
        module(query, key, torch.randn(B, T_K, 5))


def test_batch_sizes_differ(module: MultiHeadAttention, qkv) -> None:
    query, key, value = qkv
    with pytest.raises(
        ValueError,
        match=esc(
            "query, key and value must have the same batch size, "
            f"got shapes {(B, T_Q, E)}, {(B + 1, T_K, 5)} and {(B, T_K, 6)}"
        ),
    ):
        module(query, torch.randn(B + 1, T_K, 5), value)


def test_batch_sizes_differ_batch_first_false() -> None:
    module = MultiHeadAttention(E, H, batch_first=False)
    query, key = (
        torch.randn(T_Q, B, E),
        torch.randn(T_K, B + 1, E),
    )  # (T, B, D)
    with pytest.raises(ValueError, match="the same batch size"):
        module(query, key, key)


def test_key_and_value_lengths_differ(module: MultiHeadAttention, qkv) -> None:
    query, key, _ = qkv
    with pytest.raises(
        ValueError,
        match=esc(
            "key and value must have the same length T_k, "
            f"got shapes {(B, T_K, 5)} and {(B, T_K + 1, 6)}"
        ),
    ):
        module(query, key, torch.randn(B, T_K + 1, 6))


def test_integer_query() -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    tokens = torch.ones(B, T_Q, E, dtype=torch.long)
    with pytest.raises(
        TypeError,
        match="query must be a floating-point tensor, got dtype torch.int64",
    ):
        module(tokens, tokens, tokens)


# --- masks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        (T_K, T_Q),
        (T_Q, T_K + 1),
        (B, T_Q, T_K),
        (H, T_Q, T_K),
        (B, H, T_Q, T_K),
        (T_K,),
    ],
    ids=[
        "2-D transposed",
        "2-D wrong T_k",
        "3-D B not B*H",
        "3-D H not B*H",
        "4-D",
        "1-D",
    ],
)
def test_attn_mask_shape(module: MultiHeadAttention, qkv, shape: tuple[int, ...]) -> None:
    expected = (
        f"attn_mask must have shape (T_q, T_k) = {(T_Q, T_K)} or "
        f"(B * num_heads, T_q, T_k) = {(B * H, T_Q, T_K)}, got shape {shape}"
    )
    with pytest.raises(ValueError, match=esc(expected)):
        module(*qkv, attn_mask=torch.zeros(shape, dtype=torch.bool))


def test_attn_mask_shape_unbatched(module: MultiHeadAttention, qkv) -> None:
    query, key, value = (x[0] for x in qkv)
    expected = f"(num_heads, T_q, T_k) = {(H, T_Q, T_K)}, got shape {(B * H, T_Q, T_K)}"
    with pytest.raises(ValueError, match=esc(expected)):
        module(
            query,
            key,
            value,
            attn_mask=torch.zeros(B * H, T_Q, T_K, dtype=torch.bool),
        )


@pytest.mark.parametrize("shape", [(B, T_Q), (T_K,), (B, 1, T_K), (1, T_K)])
def test_key_padding_mask_shape(module: MultiHeadAttention, qkv, shape: tuple[int, ...]) -> None:
    with pytest.raises(
        ValueError,
        match=esc(f"key_padding_mask must have shape (B, T_k) = {(B, T_K)}, got shape {shape}"),
    ):
        module(*qkv, key_padding_mask=torch.zeros(shape, dtype=torch.bool))


def test_key_padding_mask_shape_unbatched(module: MultiHeadAttention, qkv) -> None:
    query, key, value = (x[0] for x in qkv)
    with pytest.raises(
        ValueError,
        match=esc(f"key_padding_mask must have shape (T_k,) = {(T_K,)}, got shape {(1, T_K)}"),
    ):
        module(
            query,
            key,
            value,
            key_padding_mask=torch.zeros(1, T_K, dtype=torch.bool),
        )


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_integer_mask(module: MultiHeadAttention, qkv, name: str, dtype: torch.dtype) -> None:
    shape = (T_Q, T_K) if name == "attn_mask" else (B, T_K)
    with pytest.raises(
        TypeError,
        match=esc(
            f"{name} must be a bool tensor (True = not allowed) "
            f"or a float tensor (added to the scores), got dtype {dtype}"
        ),
    ):
        module(*qkv, **{name: torch.zeros(shape, dtype=dtype)})


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_float_mask_with_nan_or_plus_inf(
    module: MultiHeadAttention, qkv, name: str, bad: float
) -> None:
    shape = (T_Q, T_K) if name == "attn_mask" else (B, T_K)
    mask = torch.zeros(shape)
    mask[-1, 1] = bad
    with pytest.raises(
        ValueError,
        match=esc(f"{name} must not contain NaN or +inf (use -inf to block a key)"),
    ):
        module(*qkv, **{name: mask})
    mask[-1, 1] = -math.inf  # -inf is how a float mask blocks a key: accepted
    output, _ = module(*qkv, **{name: mask})
    assert torch.isfinite(output).all()


def test_mask_not_a_tensor(module: MultiHeadAttention, qkv) -> None:
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor, got list"):
        module(*qkv, attn_mask=[[False] * T_K] * T_Q)


@pytest.mark.parametrize("shape", [(H + 1,), (B + 1, H), (B, H, 1), (B, H + 1)])
def test_head_mask_shape(module: MultiHeadAttention, qkv, shape: tuple[int, ...]) -> None:
    expected = (
        f"head_mask must have shape (num_heads,) = {(H,)} or "
        f"(B, num_heads) = {(B, H)}, got shape {shape}"
    )
    with pytest.raises(ValueError, match=esc(expected)):
        module(*qkv, head_mask=torch.ones(shape))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_head_mask_not_float(module: MultiHeadAttention, qkv, dtype: torch.dtype) -> None:
    with pytest.raises(
        TypeError,
        match=esc(
            "head_mask must be a float tensor of multipliers "
            f"(1 keeps a head, 0 removes it), got dtype {dtype}"
        ),
    ):
        module(*qkv, head_mask=torch.ones(H, dtype=dtype))
