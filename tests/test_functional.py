"""mha.functional: the torch building blocks, against the NumPy reference and by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mha import functional, reference
from mha.module import MultiHeadAttention

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_split_heads_by_hand() -> None:
    # (B, T, D) = (1, 2, 4), two heads of d_k = 2: head 0 holds features 0-1, head 1 features 2-3.
    x = torch.arange(8.0).reshape(1, 2, 4)
    heads = functional.split_heads(x, head_dim=2)
    expected = torch.tensor([[[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]]])
    assert torch.equal(heads, expected)  # (B, H, T, d_k) = (1, 2, 2, 2)
    assert heads.data_ptr() == x.data_ptr()  # a view, no copy
    assert torch.equal(functional.merge_heads(heads), x)


@pytest.mark.parametrize("shape", [(5, 12), (3, 5, 12), (2, 3, 5, 12)])
@pytest.mark.parametrize("head_dim", [1, 3, 4, 12])
def test_split_and_merge_match_the_reference(shape: tuple[int, ...], head_dim: int) -> None:
    x = randn(*shape)
    heads = functional.split_heads(x, head_dim)
    expected = reference.split_heads(x.numpy(), shape[-1] // head_dim)
    np.testing.assert_array_equal(heads.numpy(), expected)
    assert torch.equal(functional.merge_heads(heads), x)


def test_split_heads_reads_the_head_count_from_the_width() -> None:
    # The same call splits 4 query heads and 1 key/value head of the same size.
    q, kv = randn(2, 3, 8), randn(2, 3, 2)
    assert functional.split_heads(q, 2).shape == (2, 4, 3, 2)
    assert functional.split_heads(kv, 2).shape == (2, 1, 3, 2)


def test_causal_masks_by_hand() -> None:
    top_left = [[True, False, False, False], [True, True, False, False]]
    bottom_right = [[True, True, True, False], [True, True, True, True]]
    assert functional.causal_mask(2, 4).tolist() == top_left
    assert functional.causal_mask(2, 4, align="bottom-right").tolist() == bottom_right
    assert (
        functional.causal_mask(3).tolist()
        == functional.causal_mask(3, align="bottom-right").tolist()
    )
    np.testing.assert_array_equal(reference.causal_mask(2, 4, align="bottom-right"), bottom_right)
    with pytest.raises(ValueError, match="align must be one of 'top-left', 'bottom-right'"):
        functional.causal_mask(2, 4, align="bottom-left")
    with pytest.raises(TypeError, match="t_q must be an int, got float"):
        functional.causal_mask(2.0)


@pytest.mark.parametrize("align", ["top-left", "bottom-right"])
def test_causal_masks_equal_the_reference_for_every_shape(align: str) -> None:
    for t_q in range(1, 9):
        for t_k in range(1, 9):
            expected = reference.causal_mask(t_q, t_k, align=align)
            got = functional.causal_mask(t_q, t_k, align=align)
            assert got.dtype == torch.bool and got.shape == (t_q, t_k)
            np.testing.assert_array_equal(got.numpy(), expected, err_msg=f"{t_q}, {t_k}")


def test_torch_masks_are_built_in_torch(monkeypatch) -> None:
    # No mask is made in NumPy and copied over: torch.from_numpy is never called.
    from mha.flash import flash_attention_torch

    def refuse(*args):
        raise AssertionError("a mask was copied from NumPy")

    monkeypatch.setattr(torch, "from_numpy", refuse)
    assert functional.causal_mask(3, 5, align="bottom-right").shape == (3, 5)
    q, k, v = randn(1, 2, 70, 8, seed=1), randn(1, 2, 70, 8, seed=2), randn(1, 2, 70, 8, seed=3)
    out, _ = flash_attention_torch(q, k, v, causal=True, block_q=32, block_k=32)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_causal_mask_exports_with_symbolic_lengths() -> None:
    # Built from the inputs' shapes inside the graph, not captured as a constant: one exported
    # program masks every (T_q, T_k).
    class Masked(torch.nn.Module):
        def forward(self, scores: torch.Tensor) -> torch.Tensor:
            T_q, T_k = scores.shape
            keep = functional.causal_mask(T_q, T_k, align="bottom-right", device=scores.device)
            return scores.masked_fill(~keep, 0.0)

    dims = {"scores": {0: torch.export.Dim("T_q", max=64), 1: torch.export.Dim("T_k", max=64)}}
    program = torch.export.export(Masked(), (randn(3, 5),), dynamic_shapes=dims)
    assert not program.constants  # no mask tensor captured at export
    for t_q, t_k in ((2, 7), (6, 6), (9, 11)):
        scores = randn(t_q, t_k, seed=t_q)
        expected = np.where(reference.causal_mask(t_q, t_k, align="bottom-right"), scores, 0.0)
        np.testing.assert_array_equal(program.module()(scores).numpy(), expected)
    compiled = torch.compile(Masked(), fullgraph=True, dynamic=True, backend="eager")
    torch.testing.assert_close(compiled(randn(4, 9)), Masked()(randn(4, 9)))


def test_top_left_mask_is_sdpa_is_causal() -> None:
    q, k, v = randn(1, 2, 3, 4, seed=1), randn(1, 2, 5, 4, seed=2), randn(1, 2, 5, 4, seed=3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=functional.causal_mask(3, 5)
    )
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_attention_matches_the_reference(mask_kind: str | None) -> None:
    q, k, v = randn(2, 3, 4, 5, seed=1), randn(2, 3, 6, 5, seed=2), randn(2, 3, 6, 7, seed=3)
    keep = torch.rand(4, 6, generator=torch.Generator().manual_seed(4)) > 0.4
    keep[:, 0] = True
    mask = {
        None: None,
        "bool": keep,
        "float": torch.zeros(4, 6, dtype=torch.float64).masked_fill(~keep, float("-inf")),
    }
    out, weights = functional.attention(q, k, v, mask[mask_kind])
    ref_out, ref_weights = reference.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), None if mask_kind is None else keep.numpy()
    )
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights.numpy(), ref_weights, rtol=1e-12, atol=1e-14)


def test_attention_scale() -> None:
    q, k, v = randn(1, 3, 4, seed=1), randn(1, 3, 4, seed=2), randn(1, 3, 4, seed=3)
    _, weights = functional.attention(q, k, v, scale=1.0)
    torch.testing.assert_close(weights, torch.softmax(q @ k.transpose(-2, -1), dim=-1))


@pytest.mark.parametrize("layer_kind", ["torch_fused", "ours_fused", "ours_kdim_vdim"])
def test_reference_weights_are_the_transposed_projections(layer_kind: str) -> None:
    torch.manual_seed(0)
    D, H = 6, 2
    if layer_kind == "torch_fused":
        layer = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    elif layer_kind == "ours_fused":
        layer = MultiHeadAttention(D, H, dtype=torch.float64, batch_first=True)
    else:
        layer = MultiHeadAttention(D, H, kdim=4, vdim=5, dtype=torch.float64, batch_first=True)
    with torch.no_grad():
        layer.in_proj_bias.uniform_(-1, 1)
        layer.out_proj.bias.uniform_(-1, 1)
    w = functional.reference_weights(layer)
    x_q, x_k, x_v = (
        randn(1, 3, D),
        randn(1, 4, layer.kdim, seed=1),
        randn(1, 4, layer.vdim, seed=2),
    )
    # Row-vector layout: x @ W + b must equal torch's layer projections.
    if layer.in_proj_weight is not None:
        w_q, w_k, w_v = layer.in_proj_weight.detach().split(D)
    else:
        w_q, w_k, w_v = layer.q_proj_weight, layer.k_proj_weight, layer.v_proj_weight
    b_q, b_k, b_v = layer.in_proj_bias.detach().split(D)
    for x, w_np, b_np, w_t, b_t in (
        (x_q, w.w_q, w.b_q, w_q, b_q),
        (x_k, w.w_k, w.b_k, w_k, b_k),
        (x_v, w.w_v, w.b_v, w_v, b_v),
    ):
        expected = torch.nn.functional.linear(x, w_t, b_t).detach().numpy()
        np.testing.assert_allclose(x.numpy() @ w_np + b_np, expected, rtol=1e-12, atol=1e-12)
    assert w.w_o.shape == (D, D) and w.w_o.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(w.w_o, layer.out_proj.weight.detach().numpy().T)
    np.testing.assert_array_equal(w.b_o, layer.out_proj.bias.detach().numpy())


def test_reference_weights_dtype_and_no_bias() -> None:
    layer = MultiHeadAttention(4, 2, bias=False, batch_first=True)
    w = functional.reference_weights(layer, dtype=np.float64)
    assert w.w_q.dtype == np.float64 and w.b_q is None and w.b_o is None
