"""mha.Engine: every request's tokens equal that prompt generated alone.

The reference is ``model.generate`` on one prompt (greedy, a static cache, the sdpa backend):
the engine's batches, chunks, shared prefix blocks and preemptions must change nothing. The
model is tiny and in float64, so that a different batch composition (other matrix shapes, other
summation orders) moves logits by rounding only and cannot flip a greedy choice. The counts
(prefill and decode tokens, reused prefix positions, preemptions, peak blocks) are derived by hand
in each test from the block arithmetic, not read from the engine.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mha import CausalLM, Engine
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, MistralConfig

from helpers import KERNEL_DEVICE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 61


@functools.cache
def tiny_model(
    eos: int | None = None, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> CausalLM:
    """The same weights on every ``device`` (drawn on the CPU); KERNEL_DEVICE for the Triton
    kernels."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = CausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # attention that matters: most greedy choices depend on the context
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj, scale in (
                (attn.q_proj, 3),
                (attn.k_proj, 3),
                (attn.v_proj, 4),
                (attn.o_proj, 4),
            ):
                proj.weight.mul_(scale)
    return model.to(device)


@functools.cache
def alone(prompt: tuple[int, ...], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """The reference: the prompt generated alone, greedily."""
    out = tiny_model(eos).generate(torch.tensor([prompt]), max_new_tokens)
    return out[0, len(prompt) :].tolist()


tokens = st.integers(3, VOCAB - 1)


@st.composite
def workloads(draw):
    """Prompts (some sharing a prefix), their arrival steps, the engine's settings."""
    shared = draw(st.lists(tokens, min_size=4, max_size=12))
    n = draw(st.integers(2, 5))
    prompts = []
    for _ in range(n):
        keep = draw(st.integers(0, len(shared)))
        tail = draw(st.lists(tokens, min_size=0 if keep else 1, max_size=10))
        prompts.append(tuple(shared[:keep] + tail))
    new = [draw(st.integers(1, 8)) for _ in prompts]
    arrivals = [draw(st.integers(0, 6)) for _ in prompts]
    block_size = draw(st.sampled_from([2, 4]))
    need = max(-(-(len(p) + m - 1) // block_size) for p, m in zip(prompts, new))
    num_blocks = draw(st.integers(need, need + 4))  # one request alone fits: pressure
    budget = draw(st.integers(1, 40))
    caching = draw(st.booleans())
    return prompts, new, arrivals, block_size, num_blocks, budget, caching


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_equals_its_prompt_generated_alone(workload) -> None:
    prompts, new, arrivals, block_size, num_blocks, budget, caching = workload
    engine = Engine(tiny_model(), num_blocks=num_blocks, block_size=block_size,
                    max_num_batched_tokens=budget, prefix_caching=caching)  # fmt: skip
    ids, step, got, streamed = {}, 0, {}, {}
    while len(ids) < len(prompts) or engine.scheduler.has_work():
        for i, (prompt, m, at) in enumerate(zip(prompts, new, arrivals)):
            if at == step:  # requests arrive while others run
                ids[i] = engine.add_request(list(prompt), m)
        for output in engine.step():
            streamed.setdefault(output.id, []).extend(output.new_tokens)
            if output.finished:
                got[output.id] = output.generated
        step += 1
    assert streamed == got  # the stream adds up to each request's tokens
    assert not engine.requests  # every finished request forgotten
    for i, prompt in enumerate(prompts):
        assert got[ids[i]] == alone(prompt, new[i]), (i, prompt)
    assert engine.stats.peak_blocks_in_use <= num_blocks
    event(f"preempted: {engine.stats.preemptions > 0}")
    event(f"prefix reused: {engine.stats.prefix_tokens_reused > 0}")
    assert engine.scheduler.blocks_in_use == 0  # every block given back


def test_a_shared_prefix_is_computed_once() -> None:
    # block_size 4: the shared 9 tokens fill blocks 0 and 1 (8 positions) and one more.
    shared = [5, 9, 11, 13, 17, 19, 23, 29, 31]
    first, second = shared + [37, 41], shared + [43]
    for caching, reused in ((True, 8), (False, 0)):
        engine = Engine(tiny_model(), num_blocks=16, block_size=4, prefix_caching=caching)
        a = engine.add_request(first, 3)
        got = engine.run()  # first done: its blocks are free, their hashes kept
        b = engine.add_request(second, 3)
        got |= engine.run()
        assert engine.stats.prefix_tokens_reused == reused
        # prefill: 11 + 10 prompt tokens, less what was reused; decode: 2 + 2 tokens
        assert engine.stats.prefill_tokens == 21 - reused
        assert engine.stats.decode_tokens == 4
        assert got[a] == alone(tuple(first), 3) and got[b] == alone(tuple(second), 3)


def test_the_block_of_the_newest_token_is_always_computed() -> None:
    # A prompt of exactly two blocks, seen before: block 0 reused, block 1 holds the token
    # whose logits are needed, so it is computed again (4 positions reused, not 8).
    prompt = list(range(10, 18))
    engine = Engine(tiny_model(), num_blocks=8, block_size=4)
    engine.add_request(prompt, 2)
    engine.run()
    c = engine.add_request(prompt, 2)
    assert engine.run()[c] == alone(tuple(prompt), 2)
    assert engine.stats.prefix_tokens_reused == 4


def test_the_newest_request_is_preempted_and_recomputed() -> None:
    # block_size 4, 6 blocks; two prompts of 8 tokens, 8 new tokens each, no eos. Both are
    # admitted (2 + 2 blocks), take a third block each at position 8 (6 in use), and at
    # position 12 the first needs a fourth: the pool is empty, the second (newest) is
    # preempted. The first finishes with 4 blocks; the second then comes back for its 8 + 4
    # tokens (3 blocks) and finishes: one preemption, at most 6 blocks in use.
    first, second = list(range(3, 11)), list(range(20, 28))
    engine = Engine(tiny_model(eos=None), num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b = engine.add_request(first, 8), engine.add_request(second, 8)
    finished = []
    got = {}
    while engine.scheduler.has_work():
        for output in engine.step():
            if output.finished:
                finished.append(output.id)
                got[output.id] = output.generated
    assert finished == [a, b]  # the newest was preempted, the oldest went on
    assert engine.stats.preemptions == 1
    assert engine.stats.peak_blocks_in_use == 6
    assert got[a] == alone(tuple(first), 8)
    assert got[b] == alone(tuple(second), 8)


def test_a_step_mixes_decode_tokens_with_prefill_chunks_in_one_forward() -> None:
    model = tiny_model(eos=None)
    engine = Engine(model, num_blocks=32, block_size=4, max_num_batched_tokens=6)
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(engine.layers[0].plan))
    try:
        engine.add_request([3, 4, 5], 6)
        engine.step()  # the first prompt whole (3 tokens); its first new token
        engine.add_request(list(range(30, 50)), 2)  # 20 tokens: chunks of 5 beside 1 decode
        engine.step()
        plan = forwards[-1]
        assert plan.decodes == 1 and plan.ids.shape == (1, 6)
        assert [(first, end) for first, end, _, _ in plan.groups] == [(0, 1), (1, 6)]
        engine.run()
    finally:
        hook.remove()
    assert len(forwards) == engine.stats.steps  # one forward per step
    # prefill: 3 + 20 prompt tokens; decode: 5 + 1 (every new token but the first)
    assert (engine.stats.prefill_tokens, engine.stats.decode_tokens) == (23, 6)


def test_sampled_requests_equal_generate_with_the_same_generator() -> None:
    model, prompt = tiny_model(eos=None), [7, 8, 9, 10, 11]
    settings = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    want = model.generate(torch.tensor([prompt]), 6, **settings,
                          generator=torch.Generator().manual_seed(3))[0, 5:].tolist()  # fmt: skip
    engine = Engine(model, num_blocks=8, block_size=4)
    engine.add_request([3] * 9, 4)  # another request in the same batches
    i = engine.add_request(prompt, 6, **settings, generator=torch.Generator().manual_seed(3))
    assert engine.run()[i] == want


def test_peak_blocks_follow_the_tokens_held() -> None:
    # One request: 8 prompt tokens + 5 new; keys and values of 8 + 4 positions = 3 blocks of 4.
    engine = Engine(tiny_model(eos=None), num_blocks=20, block_size=4)
    engine.add_request(list(range(3, 11)), 5)
    engine.run()
    assert engine.stats.peak_blocks_in_use == 3


@pytest.mark.parametrize(
    ("prompt", "new", "sampling", "error", "words"),
    [
        ([3] * 30, 11, {}, ValueError, "could never fit"),  # 40 positions > 8 blocks of 4
        ([], 4, {}, ValueError, "prompt_ids"),
        ([3, VOCAB], 4, {}, ValueError, "vocab_size"),
        ([3, -1], 4, {}, ValueError, "prompt_ids"),
        (torch.ones(2, 3, dtype=torch.long), 4, {}, ValueError, "1-D"),
        (torch.ones(3), 4, {}, ValueError, "integer"),
        ([3.0, 4.0], 4, {}, TypeError, "prompt_ids"),
        ([3, 4], 0, {}, ValueError, "max_new_tokens"),
        ([3, 4], 4, {"beam_width": 2}, ValueError, "beam_width"),
        ([3, 4], 4, {"temperature": 0.0}, ValueError, "temperature"),
        ([3, 4], 4, {"top_p": 1.5}, ValueError, "top_p"),
        ([3, 4], 4, {"do_sample": 1}, TypeError, "do_sample"),
    ],
)
def test_bad_requests_are_refused_by_name(prompt, new, sampling, error, words) -> None:
    engine = Engine(tiny_model(), num_blocks=8, block_size=4)
    with pytest.raises(error, match=words):
        engine.add_request(prompt, new, **sampling)
    assert not engine.scheduler.has_work()  # nothing half-queued


def test_bad_engines_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="mha.CausalLM"):
        Engine(torch.nn.Linear(2, 2), num_blocks=8)
    with pytest.raises(ValueError, match="num_blocks"):
        Engine(tiny_model(), num_blocks=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(tiny_model(), num_blocks=8, max_num_batched_tokens=0)


class CopiesOutOf(TorchDispatchMode):
    """Bytes of every new tensor that a torch operation makes from the pools' memory (a
    gather, an index, a copy); a view of the pools or a write into them is no copy."""

    def __init__(self, pools: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {pool.untyped_storage().data_ptr() for pool in pools}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    if t.untyped_storage().data_ptr() not in self.storages:
                        self.bytes += t.nbytes
        return out


def test_a_decode_step_copies_nothing_out_of_the_pool() -> None:
    # Two requests (20 and 7 prompt tokens) after a prefill step and a decode step: the third
    # step decodes their 22nd and 9th tokens. float32, 2 layers, H_kv = 2, d_k = 8.
    model = tiny_model(eos=None, dtype=torch.float32, device=KERNEL_DEVICE)
    copied = {}
    for backend in ("triton", "sdpa"):
        model.set_attention_backend(backend)
        engine = Engine(model, num_blocks=16, block_size=4)
        engine.add_request(list(range(3, 23)), 4)
        engine.add_request(list(range(30, 37)), 5)
        engine.step(), engine.step()
        pools = [t for layer in engine.layers for t in (layer.k_pool, layer.v_pool)]
        with CopiesOutOf(pools) as counter:
            engine.step()
        assert engine.layers[0].plan.decodes == 2
        copied[backend] = counter.bytes
    model.set_attention_backend("sdpa")
    assert copied["triton"] == 0  # the kernel reads the blocks where they lie
    # the torch twin gathers both rows to the longest length, 22 positions: k and v of 2 layers
    assert copied["sdpa"] == 2 * 2 * (2 * 22 * 2 * 8 * 4)


def test_the_models_paged_cache_copies_nothing_on_the_triton_backend() -> None:
    # model.generate's PagedKVCache (chapter 12): a left-padded batch of two rows (3 pads in row
    # 0), 20 positions, then one decode step. On sdpa the cache gathers the 21 positions every row
    # holds (not its whole blocks of 16), k and v, 2 layers, H_kv = 2, d_k = 8, float32. On
    # triton the paged kernel reads them in place (and hides row 0's pads through key_start):
    # nothing is copied,
    # and the step's logits are the gathered path's.
    model = tiny_model(eos=None, dtype=torch.float32, device=KERNEL_DEVICE)
    ids = torch.tensor([list(range(3, 23)), list(range(30, 50))], device=KERNEL_DEVICE)
    mask = torch.ones(2, 21, dtype=torch.int64, device=KERNEL_DEVICE)
    mask[0, :3] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    copied, logits = {}, {}
    for backend in ("sdpa", "triton"):
        model.set_attention_backend(backend)
        caches = model.new_caches(2, 32, kind="paged")
        with torch.no_grad():
            model(ids, mask[:, :20], positions[:, :20], caches)
            pools = [t for cache in caches for t in (cache.key_blocks, cache.value_blocks)]
            with CopiesOutOf(pools) as counter:
                new = torch.tensor([[5], [6]], device=KERNEL_DEVICE)
                logits[backend] = model(new, mask, positions[:, 20:], caches)
        copied[backend] = counter.bytes
    model.set_attention_backend("sdpa")
    assert copied["sdpa"] == 2 * 2 * (2 * 2 * 21 * 8 * 4)
    assert copied["triton"] == 0
    torch.testing.assert_close(logits["triton"], logits["sdpa"], rtol=1e-5, atol=1e-5)


def test_a_sliding_window_model_is_served() -> None:
    # Mistral with a window of 4 (shorter than every prompt): the engine's paged attention hides
    # what the window hides, on the torch twin (float64) and on the Triton kernel (float32).
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=4,
                           max_position_embeddings=128)  # fmt: skip
    prompts = [list(range(3, 14)), list(range(20, 27)), list(range(40, 49))]
    for backend, dtype, device in (
        ("sdpa", torch.float64, "cpu"),
        ("triton", torch.float32, KERNEL_DEVICE),
    ):
        torch.manual_seed(0)
        model = CausalLM.from_config(config, dtype=dtype, attn_backend=backend).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(3), layer.self_attn.k_proj.weight.mul_(3)
        model.to(device)  # the engine's pools and plans follow the model's device
        want = [
            model.generate(torch.tensor([p], device=device), 5)[0, len(p) :].tolist()
            for p in prompts
        ]
        engine = Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=8)
        ids = [engine.add_request(p, 5) for p in prompts]
        got = engine.run()
        assert [got[i] for i in ids] == want, backend


def test_the_triton_paged_kernel_serves_the_engine() -> None:
    model = tiny_model(eos=None, dtype=torch.float32, device=KERNEL_DEVICE)
    prompts = [list(range(3, 23)), list(range(30, 37))]
    want = [
        model.generate(torch.tensor([p], device=KERNEL_DEVICE), 4)[0, len(p) :].tolist()
        for p in prompts
    ]
    model.set_attention_backend("triton")
    try:
        engine = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=6)
        ids = [engine.add_request(p, 4) for p in prompts]
        got = engine.run()
    finally:
        model.set_attention_backend("sdpa")
    assert [got[i] for i in ids] == want


def test_the_serve_benchmark_reports_every_entry() -> None:
    from mha.bench import serve

    report = serve.run_serve_benchmark(
        requests=(2,), repeats=1, min_time=0.0, max_repeats=1, quiet=True
    )
    rows = {row["impl"]: row for row in report["results"]}
    assert set(rows) == {"engine", "one_by_one", "static_batch"}
    assert all(row["status"] == "ok" and row["tokens_per_s"] > 0 for row in rows.values())
    work = serve.workload(2)
    memory = report["memory"][0]
    assert memory["tokens_equal_one_by_one"]
    longest = max(len(p) for p, _ in work) + max(n for _, n in work)
    assert memory["static_batch_positions"] == 2 * longest
    assert memory["engine_peak_blocks"] <= serve.pool_blocks(work)
    assert "engine/one_by_one" in report["ratios"][0]


# ---------------------------------------------------------------------------------------------
# The engine as a server: what run() returns, abort, the model's state, the backend chosen


def test_run_returns_what_finished_in_that_call_and_forgets_it() -> None:
    engine = Engine(tiny_model(eos=None), num_blocks=16, block_size=4)
    a = engine.add_request([3, 4, 5], 2)
    assert engine.run() == {a: alone((3, 4, 5), 2)}
    b = engine.add_request([6, 7], 3)
    assert engine.run() == {b: alone((6, 7), 3)}  # a was returned before: not again
    assert engine.requests == {} and engine.run() == {}
    assert engine.scheduler.blocks_in_use == 0


def test_abort_drops_a_request_and_gives_its_blocks_back() -> None:
    engine = Engine(tiny_model(eos=None), num_blocks=16, block_size=4)
    a, b = engine.add_request([3, 4, 5, 6, 7], 6), engine.add_request([8, 9], 4)
    engine.step()
    engine.abort(a)  # running: its blocks go back
    c = engine.add_request([10, 11, 12], 2)
    engine.abort(c)  # still waiting
    assert engine.run() == {b: alone((8, 9), 4)}
    assert engine.scheduler.blocks_in_use == 0
    with pytest.raises(ValueError, match="request_id must be a request in flight, got 0"):
        engine.abort(a) if a == 0 else engine.abort(0)


def test_the_models_train_or_eval_state_is_left_as_it_was() -> None:
    model = tiny_model(eos=None)
    model.train()
    try:
        engine = Engine(model, num_blocks=16, block_size=4)
        assert model.training
        i = engine.add_request([3, 4, 5], 2)
        got = engine.run()
        assert model.training
    finally:
        model.eval()
    assert got[i] == alone((3, 4, 5), 2)


@pytest.mark.parametrize("backend", ["eager", "tiled", "flex"])
def test_a_backend_without_a_paged_kernel_serves_through_its_own_attention(
    backend, monkeypatch
) -> None:
    # No paged kernel: the keys are gathered, and the backend chosen computes attention (counted
    # here), never SDPA in its place; the tokens equal generating alone, in a sliding window too.
    from mha import backends

    calls = []
    original = backends.BACKENDS[backend]
    counted = dataclasses.replace(
        original, function=lambda *a: calls.append(1) or original.function(*a)
    )
    monkeypatch.setitem(backends.BACKENDS, backend, counted)
    model = tiny_model(eos=None)
    model.set_attention_backend(backend)
    try:
        engine = Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=8)
        prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
        ids = [engine.add_request(p, 5) for p in prompts]
        got = engine.run()
    finally:
        model.set_attention_backend("sdpa")
    assert calls  # the backend's own function ran
    for i, prompt in zip(ids, prompts):
        assert got[i] == alone(tuple(prompt), 5), backend


def test_a_token_past_the_vocabulary_is_named() -> None:
    engine = Engine(tiny_model(eos=None), num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=rf"prompt_ids must lie in \[0, vocab_size = {VOCAB}\)"):
        engine.add_request([3, VOCAB + 2], 2)
    with pytest.raises(ValueError, match="at least one token id"):
        engine.add_request([], 2)
