"""The flex backend compiles FlexAttention once for every decoding step of a static cache, and a
bounded number of times for a paged one (a kernel per shape: a key length that grows by one each
step would compile again at every step, then fall back to the unfused form at torch's recompile
limit). The compiles are counted with torch._dynamo's CompileCounter, whose "eager" backend runs
each captured graph as it is, here on the CPU; the tokens equal the sdpa backend's."""

from __future__ import annotations

import pytest
import torch
from mha import CausalLM, backends, variants
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention
from transformers import LlamaConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=97, eos_token_id=None)  # fmt: skip


@pytest.fixture
def counted(monkeypatch) -> CompileCounter:
    counter = CompileCounter()
    compiled = torch.compile(flex_attention, backend=counter, dynamic=False)
    monkeypatch.setattr(variants, "_compiled_flex_attention", lambda: compiled)
    monkeypatch.setattr(variants, "flex_compiles", lambda device="cpu": True)
    monkeypatch.setattr(backends, "_flex_compiled", lambda q: True)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.mark.parametrize("cache, most", [("static", 2), ("paged", 3)])
def test_decoding_compiles_a_bounded_number_of_times(counted, cache: str, most: int) -> None:
    # A prompt of 100 tokens, then 40 new: the keys grow from 100 to 139. Static: the prompt's
    # kernel and one decoding kernel over the whole cache. Paged (keys gathered, padded to a
    # power of two): the prompt's (128 keys), then 128 and 256 keys.
    torch.manual_seed(0)
    model = CausalLM.from_config(LlamaConfig(**CONFIG), attn_backend="flex").eval()
    ids = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    with torch.no_grad():
        tokens = model.generate(ids, 40, attention_mask=mask, cache=cache)
        model.set_attention_backend("sdpa")
        expected = model.generate(ids, 40, attention_mask=mask, cache=cache)
    assert counted.frame_count == most
    assert torch.equal(tokens, expected)
