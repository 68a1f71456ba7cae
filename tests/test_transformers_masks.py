"""transformers' models on our backends honour every mask transformers hands them, or refuse
it by name: chunked attention (Llama 4's text layers), packed sequences (position ids that
restart, as DataCollatorWithFlattening sends them), left padding; flash-attention's varlen
arguments are refused, never swallowed. Each against transformers' own eager model."""

from __future__ import annotations

import copy

import pytest
import torch
from mha import kernels, register_transformers_backends
from transformers import AutoModelForCausalLM, Llama4TextConfig, LlamaConfig

from helpers import KERNEL_DEVICE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ["mha_tiled", "mha_triton", "mha_flex"]
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=97)  # fmt: skip


def _device(name: str) -> str:
    return KERNEL_DEVICE if name == "mha_triton" else "cpu"


def _pair(config, name):
    """transformers' eager model and the same weights on backend ``name``."""
    register_transformers_backends()
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
    ours.load_state_dict(eager.state_dict())
    assert (eager.config._attn_implementation, ours.config._attn_implementation) == ("eager", name)
    return eager.eval().to(_device(name)), ours.eval().to(_device(name))


def _skip_without_triton(name):
    if name == "mha_triton" and not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")


def _logits(model, ids, **inputs):
    with torch.no_grad():
        return model(ids, **inputs).logits.cpu()


@pytest.mark.parametrize("name", NAMES)
def test_chunked_attention_is_served_or_refused_by_name(name) -> None:
    # Llama 4's chunked layers: a query sees the keys of its own chunk of 4 only.
    _skip_without_triton(name)
    config = Llama4TextConfig(**SHAPE, attention_chunk_size=4, num_local_experts=2, moe_layers=[],
                              no_rope_layers=[1, 1],
                              intermediate_size_mlp=96)  # fmt: skip
    eager, ours = _pair(config, name)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    ids = ids.to(_device(name))
    if name == "mha_flex":  # a dense mask: FlexAttention takes it
        torch.testing.assert_close(_logits(ours, ids), _logits(eager, ids), rtol=0, atol=1e-4)
    else:
        with pytest.raises(ValueError, match="not causal attention with a sliding window"):
            _logits(ours, ids)


@pytest.mark.parametrize("name", NAMES)
def test_packed_sequences_attend_within_their_document(name) -> None:
    # One row, two documents of 5 and 6 tokens: position ids restart at the second.
    _skip_without_triton(name)
    eager, ours = _pair(LlamaConfig(**SHAPE), name)
    device = _device(name)
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(2)).to(device)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]], device=device)
    packed = dict(position_ids=positions, use_cache=False)  # a training step's call
    expected = _logits(eager, ids, **packed)
    alone = _logits(eager, ids[:, 5:], position_ids=positions[:, 5:], use_cache=False)
    torch.testing.assert_close(expected[:, 5:], alone, rtol=0, atol=1e-5)  # eager: packed
    if name == "mha_flex":
        torch.testing.assert_close(_logits(ours, ids, **packed), expected, rtol=0, atol=1e-4)
    else:
        with pytest.raises(ValueError, match="packed sequences"):
            _logits(ours, ids, **packed)


@pytest.mark.parametrize("name", NAMES)
def test_left_padding_is_served(name) -> None:
    _skip_without_triton(name)
    eager, ours = _pair(LlamaConfig(**SHAPE), name)
    device = _device(name)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones(2, 9, dtype=torch.int64, device=device)
    mask[0, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    keep = mask.bool().cpu()
    got = _logits(ours, ids, attention_mask=mask, position_ids=positions)[keep]
    want = _logits(eager, ids, attention_mask=mask, position_ids=positions)[keep]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_flash_attentions_varlen_arguments_are_refused_by_name() -> None:
    from mha.transformers_backends import _transformers_attention

    attention = _transformers_attention("tiled")
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 4, 16)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\['cu_seq_lens_k', 'cu_seq_lens_q'\]"):
        attention(module, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_output_attentions_warns_that_no_weights_are_computed() -> None:
    # transformers' own sdpa warns; our backends say so too, rather than return None silently.
    from mha.transformers_backends import _transformers_attention

    q = torch.zeros(1, 2, 4, 16)
    with pytest.warns(UserWarning, match="computes no attention weights"):
        _, weights = _transformers_attention("tiled")(
            torch.nn.Module(), q, q, q, None, output_attentions=True
        )
    assert weights is None
