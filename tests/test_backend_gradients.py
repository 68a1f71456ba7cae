"""Training through every attention backend: the gradients of every parameter equal the eager
backend's, under a sliding window shorter than the sequence, a left-padded row and grouped heads;
a forward-only kernel under autograd raises instead of returning a result autograd cannot see."""

from __future__ import annotations

import pytest
import torch
from mha import CausalLM, kernels
from transformers import MistralConfig

from helpers import KERNEL_DEVICE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=97, sliding_window=5, eos_token_id=None)  # fmt: skip
B, T = 2, 11


def _device(backend: str) -> str:
    if backend == "triton":
        return KERNEL_DEVICE
    return "cuda" if backend == "flex" and torch.cuda.is_available() else "cpu"


def _gradients(backend: str) -> dict[str, torch.Tensor]:
    device = _device(backend)
    torch.manual_seed(0)
    model = CausalLM.from_config(MistralConfig(**CONFIG), attn_backend=backend).to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (B, T), generator=gen).to(device)
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[0, :3] = 0  # row 0: three pads on the left
    mask = mask.to(device)
    weights = torch.randn(B, T, 97, generator=gen).to(device) * mask[..., None]
    (model(ids, attention_mask=mask) * weights).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def eager() -> dict[str, torch.Tensor]:
    return _gradients("eager")


@pytest.mark.parametrize("backend", ["sdpa", "tiled", "triton", "flex"])
def test_every_parameter_gets_the_eager_backends_gradient(backend, eager) -> None:
    if backend == "triton" and not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    if _device(backend) == "cpu" and backend == "flex":  # torch's own refusal, by name
        with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
            _gradients(backend)
        return
    got = _gradients(backend)
    for name, want in eager.items():
        assert got[name] is not None, f"{backend}: {name} has no gradient"
        torch.testing.assert_close(got[name].cpu(), want, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed")
def test_a_forward_only_kernel_under_autograd_raises() -> None:
    q = torch.randn(1, 2, 1, 16, device=KERNEL_DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 40, 16, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="forward only"):
        kernels.triton_split_kv_attention(q, k, k)
    pool = torch.randn(4, 16, 2, 16, device=KERNEL_DEVICE)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=KERNEL_DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="forward only"):
        kernels.triton_paged_attention(q, pool, pool, table, lens)
    with torch.no_grad():  # no gradient wanted: it runs
        kernels.triton_split_kv_attention(q, k, k)
        kernels.triton_paged_attention(q, pool, pool, table, lens)
