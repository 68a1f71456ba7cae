"""Decoding under torch.compile(fullgraph=True): one graph for the prefill, one for every step.

The caches keep the number of written positions in a tensor, so the compiler has no Python int
to guard (one that changes every step would compile the step again, each time, until
torch._dynamo's recompile limit sends it back to eager). The graphs are counted with
torch._dynamo.testing.CompileCounter, whose "eager" backend runs the captured graph as it is
(the count is the compiler's, whatever the backend); the benchmark's compiled entries run
inductor itself. Expected outputs: the same layer and cache, run eagerly.
"""

from __future__ import annotations

import math

import pytest
import torch
from mha import bench
from mha.decoding import GroupedQueryAttention, KVCache, PagedKVCache
from torch._dynamo.testing import CompileCounter

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, H, H_KV = 32, 8, 2
D_K = D // H
PROMPT, STEPS = 5, 32
GLOBAL_CACHE = None  # the cache of the test that reads it as a global


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_layer() -> GroupedQueryAttention:
    torch.manual_seed(0)
    layer = GroupedQueryAttention(D, H, H_KV, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) / math.sqrt(p.shape[-1]))
    return layer


def new_cache(kind: str):
    total = PROMPT + STEPS
    if kind == "paged":
        return PagedKVCache(2, total, H_KV, D_K, block_size=4, dtype=torch.float64)
    return KVCache(2, total, H_KV, D_K, dtype=torch.float64)


def eager_steps(layer, x, kind: str) -> torch.Tensor:
    cache = new_cache(kind)
    outs = [layer(x[:, :PROMPT], cache=cache)]
    outs += [layer(x[:, t : t + 1], cache=cache) for t in range(PROMPT, PROMPT + STEPS)]
    return torch.cat(outs, dim=1)


def run_steps(step, x, cache) -> torch.Tensor:
    """The prefill, then STEPS single tokens; blocks reserved outside the compiled step."""
    outs = []
    for start, end in [(0, PROMPT), *((t, t + 1) for t in range(PROMPT, PROMPT + STEPS))]:
        if isinstance(cache, PagedKVCache):
            cache.reserve(end - start)  # the scheduler's part, eager
        outs.append(step(x[:, start:end]))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kind", ["preallocated", "paged"])
@pytest.mark.parametrize("held", ["argument", "closure", "global", "module"])
def test_one_graph_for_the_prefill_and_one_for_every_step(kind: str, held: str) -> None:
    global GLOBAL_CACHE
    layer = make_layer()
    x = randn(2, PROMPT + STEPS, D, seed=1)
    cache = GLOBAL_CACHE = new_cache(kind)
    counter = CompileCounter()
    with torch.no_grad():
        expected = eager_steps(layer, x, kind)
        if held == "argument":
            compiled = torch.compile(
                lambda chunk, c: layer(chunk, cache=c), backend=counter, fullgraph=True
            )
            out = run_steps(lambda chunk: compiled(chunk, cache), x, cache)
        elif held == "global":  # a Python int read from a global is guarded by its value
            compiled = torch.compile(
                lambda chunk: layer(chunk, cache=GLOBAL_CACHE), backend=counter, fullgraph=True
            )
            out = run_steps(compiled, x, cache)
        elif held == "closure":
            compiled = torch.compile(
                lambda chunk: layer(chunk, cache=cache), backend=counter, fullgraph=True
            )
            out = run_steps(compiled, x, cache)
        else:

            class WithCache(torch.nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.layer, self.cache = layer, cache

                def forward(self, chunk: torch.Tensor) -> torch.Tensor:
                    return self.layer(chunk, cache=self.cache)

            out = run_steps(torch.compile(WithCache(), backend=counter, fullgraph=True), x, cache)
    assert counter.frame_count == 2  # the prefill's graph and the step's, nothing more
    assert len(cache) == PROMPT + STEPS
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["preallocated_compiled", "hf_static_compiled"])
def test_the_compiled_benchmark_steps_equal_the_full_forward(impl: str) -> None:
    # Inductor itself: the benchmark's compiled entries, ours and transformers'.
    layer = bench.make_decode_layer(32, 4, 2)
    context, x_new = bench.make_decode_inputs(2, 9, 32)
    with torch.no_grad():
        expected = layer(torch.cat((context, x_new), dim=1))[:, -1:]  # positions 0..9
        runner = bench.build_runner(bench.DECODE_IMPLEMENTATIONS, impl, layer, context, x_new)
        first, second = runner(), runner()  # the same step every call
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, second)
    assert impl not in bench.select(bench.DECODE_IMPLEMENTATIONS, None, "cpu")  # asked for only


def test_compiled_ratios_by_hand() -> None:
    times = {  # per-round times of (impl) at B = 1, H_kv = 4, T = 128
        "preallocated_cache": [2.0, 4.0, 2.0],
        "preallocated_compiled": [1.0, 1.0, 1.0],  # 0.5, 0.25, 0.5 -> median 0.5
        "hf_static_cache": [3.0, 3.0, 3.0],
        "hf_static_compiled": [2.0, 2.0, 4.0],  # 2/3, 2/3, 4/3 -> median 2/3
    }
    report = {
        "config": {"batches": [1], "contexts": [128], "kv_heads": [4], "heads": 4},
        "results": [
            {
                "impl": impl,
                "num_kv_heads": 4,
                "batch": 1,
                "context": 128,
                "status": "ok",
                "median_s": sorted(samples)[1],
                "times_s": samples,
            }
            for impl, samples in times.items()
        ],
    }
    (ratio,) = bench.decode_ratios(report)
    assert ratio["compiled/eager"] == pytest.approx(0.5)
    assert ratio["hf_compiled/hf_eager"] == pytest.approx(2 / 3)
    assert ratio["ours/hf_static, compiled"] == pytest.approx(0.5)  # 1/2, 1/2, 1/4
    assert ratio["no_cache/ours"] is None  # not measured


def test_a_compiled_step_with_a_full_cache_fails_loudly() -> None:
    layer = make_layer()
    cache = KVCache(2, 3, H_KV, D_K, dtype=torch.float64)
    step = torch.compile(lambda chunk: layer(chunk, cache=cache), backend="eager", fullgraph=True)
    x = randn(2, 4, D, seed=2)
    with torch.no_grad():
        for t in range(3):
            step(x[:, t : t + 1])
        with pytest.raises(RuntimeError, match="max_len = 3"):
            step(x[:, 3:4])


def _small_model():
    from mha.model import CausalLM
    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=61,
        eos_token_id=None,
    )  # fmt: skip  (no stop token: every step runs)
    return CausalLM.from_config(config, dtype=torch.float64).eval()


def test_generate_compiles_one_graph_for_every_decoding_step() -> None:
    # generate(compile=...): the prompt eagerly, then every step through one graph (the whole
    # static cache and the whole mask each step, the count a tensor); kept on the model and
    # reused by the next call of the same shapes
    model = _small_model()
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    counter = CompileCounter()
    tokens = model.generate(ids, 8, compile=counter)
    assert tokens.shape == (2, 5 + 8)
    assert torch.equal(tokens, model.generate(ids, 8))  # greedy: the eager steps' tokens
    assert counter.frame_count == 1
    assert torch.equal(model.generate(ids, 8, compile=counter), tokens)
    assert counter.frame_count == 1  # reused, not compiled again
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[0, :2] = 0  # a left-padded row: the mask of every slot goes to the graph
    padded = model.generate(ids, 8, attention_mask=mask, compile=counter)
    assert torch.equal(padded, model.generate(ids, 8, attention_mask=mask))


def test_generate_compile_refuses_what_it_cannot_do() -> None:
    model = _small_model()
    ids = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="compile needs cache='static'"):
        model.generate(ids, 2, cache="paged", compile=True)
    with pytest.raises(TypeError, match="compile must be a bool, a torch.compile backend's name"):
        model.generate(ids, 2, compile=3)
