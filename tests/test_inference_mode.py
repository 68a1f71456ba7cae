"""Under ``torch.inference_mode()``, as serving code runs: generate with every cache, the layer
with every cache, the engine; the same tokens and outputs as without it."""

from __future__ import annotations

import pytest
import torch
from mha import CausalLM, GroupedQueryAttention, KVCache, PagedKVCache
from mha.serving import Engine
from transformers import LlamaConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=97, eos_token_id=None)  # fmt: skip


@pytest.fixture(scope="module")
def model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM.from_config(LlamaConfig(**CONFIG)).eval()


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_generate_under_inference_mode(model, cache) -> None:
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = model.generate(ids, 4, attention_mask=mask, cache=cache)
    with torch.inference_mode():
        got = model.generate(ids, 4, attention_mask=mask, cache=cache)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", [KVCache, PagedKVCache])
def test_layer_and_cache_made_under_inference_mode(kind) -> None:
    torch.manual_seed(2)
    layer = GroupedQueryAttention(64, 4, 2).eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        expected = layer(x, cache=None)
    with torch.inference_mode():
        cache = kind(2, 8, 2, 16)
        first = layer(x[:, :3], cache=cache)  # a prompt, then two steps
        steps = [layer(x[:, t : t + 1], cache=cache) for t in (3, 4)]
        assert len(cache) == 5
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), expected, rtol=1e-5, atol=1e-6)


def test_engine_under_inference_mode(model) -> None:
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8]]

    def serve():
        engine = Engine(model, num_blocks=8, block_size=4, max_num_batched_tokens=16)
        ids = [engine.add_request(p, 3) for p in prompts]
        done = engine.run()
        return [done[i] for i in ids]

    expected = serve()
    with torch.inference_mode():
        assert serve() == expected
