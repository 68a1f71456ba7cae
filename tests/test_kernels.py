"""Tests of mha.kernels: the Triton attention kernels, forward and backward.

Without a GPU they run in Triton's interpreter (mha.kernels sets TRITON_INTERPRET=1), which
executes the kernels' exact code on CPU tensors; with a GPU the same tests run the compiled
kernels on it. Expected values: the NumPy reference in float64 (every score written out) and
torch autograd through the materialising attention. Shapes are small: the interpreter runs one
program after the other.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from mha import kernels, reference
from mha.functional import attention, causal_mask, split_heads

from helpers import randn

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed"),
]

DEVICE = "cpu" if kernels.INTERPRETED else "cuda"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(*shape, dtype=torch.float32, seeds=(0, 1, 2)):
    return [randn(*shape, seed=s, dtype=torch.float32).to(dtype).to(DEVICE) for s in seeds]


def _reference(q, k, v, causal: bool) -> np.ndarray:
    """Float64 reference output from the (rounded) inputs, every score written out."""
    arrays = [t.detach().cpu().double().numpy() for t in (q, k, v)]
    mask = reference.causal_mask(q.shape[-2], k.shape[-2]) if causal else None
    return reference.scaled_dot_product_attention(*arrays, mask)[0]


def _check(out, q, k, v, causal: bool) -> None:
    assert out.dtype == q.dtype and out.shape == q.shape[:-2] + (q.shape[-2], v.shape[-1])
    tolerance = TOLERANCE[q.dtype]
    np.testing.assert_allclose(
        out.detach().cpu().double().numpy(),
        _reference(q, k, v, causal),
        rtol=tolerance,
        atol=tolerance,
    )


# ---------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_k", [16, 32, 64, 128])
def test_forward_equals_reference(d_k: int, causal: bool, dtype: torch.dtype) -> None:
    # T = 50 with tiles of 32 queries and 16 keys: 2 query tiles (the last one 18 rows) and 4 key
    # tiles (the last one 2 keys), so every load and store at the end is masked.
    q, k, v = _inputs(1, 2, 50, d_k, dtype=dtype)
    out = kernels.triton_attention(q, k, v, causal=causal, block_q=32, block_k=16)
    _check(out, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t_q, t_k", [(20, 45), (45, 20)])
def test_cross_attention_lengths(t_q: int, t_k: int, causal: bool) -> None:
    q = _inputs(2, 1, t_q, 16, seeds=(3,))[0]
    k, v = _inputs(2, 1, t_k, 16, seeds=(4, 5))
    out = kernels.triton_attention(q, k, v, causal=causal, block_q=16, block_k=16)
    _check(out, q, k, v, causal)


def test_default_tiles_and_a_scale() -> None:
    # float16 defaults to 128 x 64 tiles: T = 70 is one partial query tile and 2 key tiles.
    from mha.kernels.attention import default_blocks

    assert default_blocks(32, torch.float16) == (128, 64)
    assert default_blocks(32, torch.float16, backward=True) == (64, 64)
    q, k, v = _inputs(1, 1, 70, 32, dtype=torch.float16)
    out = kernels.triton_attention(q, k, v, causal=True, scale=0.05)
    arrays = [t.cpu().double().numpy() for t in (q, k, v)]
    expected = reference.scaled_dot_product_attention(
        *arrays, reference.causal_mask(70), scale=0.05
    )[0]
    np.testing.assert_allclose(out.cpu().double().numpy(), expected, rtol=2e-3, atol=2e-3)


def test_strided_views_need_no_copy() -> None:
    # Heads split from (B, T, D) are a transposed view: strides (T*D, d_k, D, 1).
    x = _inputs(2, 24, 64, seeds=(6,))[0]  # (B, T, D)
    q = split_heads(x, 16)  # (B, H, T, d_k) = (2, 4, 24, 16)
    assert not q.is_contiguous()
    out = kernels.triton_attention(q, q, q, causal=True, block_q=16, block_k=16)
    _check(out, q, q, q, True)


def test_causal_kernel_never_reads_the_tiles_above_the_diagonal() -> None:
    # NaN in values 32..63 poisons every row that loads them, even with weight 0 (0 * NaN).
    # With tiles of 16, query tiles 0 and 1 (rows 0..31) must never load key tiles 2 and 3.
    q, k, v = _inputs(1, 1, 64, 16)
    v[..., 32:, :] = math.nan
    out = kernels.triton_attention(q, k, v, causal=True, block_q=16, block_k=16)
    assert torch.isfinite(out[..., :32, :]).all() and torch.isnan(out[..., 32:, :]).all()
    _check(out[..., :32, :], q[..., :32, :], k[..., :32, :], v[..., :32, :], True)


def test_logsumexp_of_every_row() -> None:
    q, k, v = _inputs(1, 2, 37, 16)
    from mha.kernels.attention import attention_forward

    _, lse = attention_forward(q, k, v, causal=True, block_q=16, block_k=16)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(16)  # (1, 2, 37, 37)
    scores = scores.masked_fill(~causal_mask(37, device=DEVICE), -math.inf)
    expected = torch.logsumexp(scores, dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 37)
    torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Backward


def _autograd_gradients(q, k, v, d_out, causal: bool):
    """Gradients by torch autograd through the materialising attention, in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = causal_mask(q.shape[-2], k.shape[-2], device=q.device) if causal else None
    out, _ = attention(*leaves, mask)
    return torch.autograd.grad(out, leaves, d_out.double())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t_q, t_k", [(50, 50), (20, 45)])
def test_backward_equals_autograd(t_q: int, t_k: int, causal: bool) -> None:
    q = _inputs(1, 2, t_q, 32, seeds=(7,))[0].requires_grad_()
    k, v = (t.requires_grad_() for t in _inputs(1, 2, t_k, 32, seeds=(8, 9)))
    out = kernels.triton_attention(q, k, v, causal=causal, block_q=32, block_k=16)
    d_out = _inputs(*out.shape, seeds=(10,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, causal)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_backward_with_default_tiles() -> None:
    # float32 defaults: forward tiles 64 x 64, backward tiles 32 x 32; T = 40 is partial in both.
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 40, 16, seeds=(13, 14, 15)))
    out = kernels.triton_attention(q, k, v, causal=True)
    d_out = _inputs(*out.shape, seeds=(16,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, True)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_backward_in_float16() -> None:
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 40, 16, dtype=torch.float16))
    out = kernels.triton_attention(q, k, v, causal=True, block_q=16, block_k=16)
    d_out = _inputs(*out.shape, dtype=torch.float16, seeds=(11,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, True)):
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2, msg=f"d{name}")


# ---------------------------------------------------------------------------------------------
# bfloat16: on a GPU only (bfloat16 tl.dot is wrong in the interpreter)


COMPILED = pytest.mark.skipif(  # a GPU, but TRITON_INTERPRET=1 was set by hand
    bool(kernels.INTERPRETED) and torch.cuda.is_available(),
    reason="TRITON_INTERPRET=1: the kernels are interpreted here",
)


@pytest.mark.cuda
@COMPILED
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_on_the_gpu(causal: bool) -> None:
    q, k, v = (t.requires_grad_() for t in _inputs(2, 4, 300, 128, dtype=torch.bfloat16))
    out = kernels.triton_attention(q, k, v, causal=causal)
    _check(out, q, k, v, causal)
    d_out = _inputs(*out.shape, dtype=torch.bfloat16, seeds=(12,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, causal)):
        torch.testing.assert_close(got.double(), expected, rtol=5e-2, atol=5e-2, msg=f"d{name}")


@pytest.mark.cuda
@COMPILED
def test_long_sequence_on_the_gpu() -> None:
    q, k, v = _inputs(1, 8, 4099, 64, dtype=torch.float16)
    out = kernels.triton_attention(q, k, v, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True
    )
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


def test_bfloat16_is_refused_by_the_interpreter() -> None:
    if not kernels.INTERPRETED:
        pytest.skip("the compiled kernels take bfloat16 (tested above)")
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 runs on a GPU only"):
        kernels.triton_attention(q, q, q)


# ---------------------------------------------------------------------------------------------
# Bad input, and a machine without Triton or without a GPU


def test_bad_arguments_raise_clear_errors() -> None:
    q = torch.zeros(1, 1, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"d_k \(the last dimension of q\) must be one of"):
        kernels.triton_attention(q[..., :8], q[..., :8], q[..., :8])
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
        kernels.triton_attention(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match="one dtype"):
        kernels.triton_attention(q, q.half(), q)
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, T, d_k\)"):
        kernels.triton_attention(q[0], q, q)
    with pytest.raises(ValueError, match="k, v"):
        kernels.triton_attention(q, q, torch.zeros(1, 1, 15, 16, device=DEVICE))
    with pytest.raises(
        ValueError,
        match=r"block_q must be a power of two >= 16 \(tl.dot's smallest tile\), got 24",
    ):
        kernels.triton_attention(q, q, q, block_q=24)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got ndarray"):
        kernels.triton_attention(q, np.zeros((1, 1, 16, 16)), q)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, **env},
        check=False,
    )


def test_import_works_without_triton() -> None:
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if it were not installed\n"
        "import mha, mha.kernels, torch\n"
        "assert not mha.kernels.TRITON_AVAILABLE and mha.kernels.INTERPRETED is None\n"
        "q = torch.zeros(1, 1, 16, 16)\n"
        "try:\n"
        "    mha.kernels.triton_attention(q, q, q)\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    assert "needs the triton package" in completed.stdout
    assert "pip install triton==3.9.0" in completed.stdout


def test_interpreter_is_chosen_without_a_gpu() -> None:
    code = (
        "import os, torch, mha.kernels as k\n"
        "print(k.INTERPRETED, torch.cuda.is_available(), os.environ.get('TRITON_INTERPRET'))\n"
    )
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    interpreted, cuda, variable = completed.stdout.split()
    assert interpreted == str(cuda == "False")
    assert variable == ("1" if cuda == "False" else "None")
    # An explicit choice is respected.
    completed = _python(code, TRITON_INTERPRET="1")
    assert completed.stdout.split()[0] == "True"
