"""Tests of mha.decoding: grouped-query attention, the caches, conversion, generation.

Expected values come from elsewhere: torch.nn.MultiheadAttention / mha.MultiHeadAttention, a
head-by-head loop written here, masks written out by hand, the full causal forward (for the
caches), and transformers' LlamaAttention (tests/test_llama_parity.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from mha import MultiHeadAttention, reference
from mha.decoding import (
    ConcatKVCache,
    Decoder,
    GroupedQueryAttention,
    KVCache,
    PagedKVCache,
    generate,
    generate_batch,
    grouped_attention,
    grouped_from_multi_head,
    left_pad,
)
from mha.functional import causal_mask, grouped_query_state_dict
from mha.positions import apply_rope

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, H = 32, 8
D_K = D // H
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def make_layer(num_kv_heads: int, *, dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = GroupedQueryAttention(D, H, num_kv_heads, dtype=dtype, **kwargs).eval()
    with torch.no_grad():  # weights of unit scale: differences show up clearly
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=dtype) / math.sqrt(p.shape[-1]))
    return layer


def assert_close(actual, expected, dtype=torch.float64):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# The layer against multi-head attention and a head-by-head loop


@pytest.mark.parametrize("bias", [False, True])
def test_equal_heads_is_multi_head_attention(bias: bool) -> None:
    torch.manual_seed(1)
    mha_layer = MultiHeadAttention(D, H, bias=bias, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():  # torch zero-initialises biases, which would hide a bias mistake
        for p in mha_layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * 0.3)
    layer = GroupedQueryAttention(D, H, H, bias=bias, rope_base=None, dtype=torch.float64)
    layer.load_state_dict(grouped_query_state_dict(mha_layer))
    x = randn(3, 9, D, seed=2)
    expected, _ = mha_layer(x, x, x, is_causal=True, need_weights=False)
    assert_close(layer(x), expected)
    # The same weights in torch's own layer, with its causal mask spelled out.
    torch_layer = torch.nn.MultiheadAttention(
        D, H, bias=bias, batch_first=True, dtype=torch.float64
    )
    torch_layer.load_state_dict(mha_layer.state_dict())
    blocked = torch.ones(9, 9, dtype=torch.bool).triu(1)
    expected_torch, _ = torch_layer(x, x, x, attn_mask=blocked, need_weights=False)
    assert_close(layer(x), expected_torch)


def test_grouped_query_state_dict_names_and_shapes() -> None:
    layer = torch.nn.MultiheadAttention(D, H, batch_first=True)
    state = grouped_query_state_dict(layer)
    assert list(state) == [
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
        "o_proj.bias",
    ]
    assert all(t.shape[0] == D for t in state.values())
    torch.testing.assert_close(state["k_proj.weight"], layer.in_proj_weight[D : 2 * D])
    state["q_proj.weight"][0, 0] += 1.0  # copies: the layer is untouched
    assert state["q_proj.weight"][0, 0] != layer.in_proj_weight[0, 0]
    with pytest.raises(ValueError, match="kdim"):
        grouped_query_state_dict(torch.nn.MultiheadAttention(D, H, kdim=5, vdim=5))


def loop_attention(q, k, v, keep=None):
    """Head by head: query head h uses key/value head h // G (written without grouping tricks).

    ``keep``: (T_q, T_k) for every head, or (B, H, T_q, T_k) per head."""
    H_q, H_kv = q.shape[1], k.shape[1]
    out = []
    for h in range(H_q):
        kv = h // (H_q // H_kv)
        scores = q[:, h] @ k[:, kv].transpose(-2, -1) / math.sqrt(q.shape[-1])
        if keep is not None:
            scores = scores.masked_fill(~(keep[:, h] if keep.dim() == 4 else keep), -math.inf)
        out.append(torch.softmax(scores, dim=-1) @ v[:, kv])
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_grouped_attention_equals_a_loop_over_heads(num_kv_heads: int) -> None:
    q = randn(2, H, 5, D_K, seed=1)
    k, v = randn(2, num_kv_heads, 7, D_K, seed=2), randn(2, num_kv_heads, 7, D_K, seed=3)
    keep = torch.rand(5, 7, generator=torch.Generator().manual_seed(4)) < 0.7
    keep[:, 0] = True
    assert_close(grouped_attention(q, k, v), loop_attention(q, k, v))
    assert_close(grouped_attention(q, k, v, keep), loop_attention(q, k, v, keep))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
def test_layer_equals_multi_head_attention_with_repeated_key_value_weights(
    num_kv_heads: int,
) -> None:
    # GQA is MHA in which the G query heads of a group see copies of one key/value head:
    # repeat each key/value head's rows G times and an MHA layer must give the same output.
    layer = make_layer(num_kv_heads, rope_base=None)
    G = H // num_kv_heads
    state = {name: t.clone() for name, t in layer.state_dict().items()}
    for name in ("k_proj.weight", "v_proj.weight"):
        state[name] = state[name].unflatten(0, (num_kv_heads, D_K)).repeat_interleave(G, dim=0)
        state[name] = state[name].flatten(0, 1)  # (H d_k, D)
    mha_layer = GroupedQueryAttention(D, H, H, rope_base=None, dtype=torch.float64)
    mha_layer.load_state_dict(state)
    x = randn(2, 6, D, seed=5)
    assert_close(layer(x), mha_layer(x))


def test_fully_masked_query_gives_zeros_not_nan() -> None:
    layer = make_layer(2, rope_base=None)
    x = randn(2, 4, D, seed=6)
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    keep[1, 0, 2] = False  # query 2 of sequence 1 may attend to nothing
    heads_of = {}
    layer.o_proj.register_forward_hook(lambda m, args, out: heads_of.update(x=args[0]))
    out = layer(x, attn_mask=keep, is_causal=False)
    assert torch.isfinite(out).all()
    assert torch.equal(heads_of["x"][1, 2], torch.zeros(D, dtype=torch.float64))
    q, k, v = randn(1, 4, 3, 4, seed=7), randn(1, 2, 3, 4), randn(1, 2, 3, 4, seed=8)
    none = torch.zeros(3, 3, dtype=torch.bool)
    assert torch.equal(grouped_attention(q, k, v, none), torch.zeros(1, 4, 3, 4, dtype=q.dtype))


def test_attn_mask_combines_with_the_causal_mask() -> None:
    layer = make_layer(2, rope_base=None)
    x = randn(2, 5, D, seed=9)
    padding = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    padding[0, ..., :2] = False  # sequence 0: keys 0 and 1 are padding
    both = padding & torch.ones(5, 5, dtype=torch.bool).tril()
    assert_close(layer(x, attn_mask=padding), layer(x, attn_mask=both, is_causal=False))
    per_head = torch.ones(2, H, 5, 5, dtype=torch.bool).tril()
    per_head[:, 3, :, 0] = False
    per_head[:, 3, 0, 0] = True
    q = layer.q_proj(x).unflatten(-1, (H, D_K)).transpose(1, 2)
    k = layer.k_proj(x).unflatten(-1, (2, D_K)).transpose(1, 2)
    v = layer.v_proj(x).unflatten(-1, (2, D_K)).transpose(1, 2)
    heads = loop_attention(q, k, v, per_head)
    expected = layer.o_proj(heads.transpose(1, 2).flatten(-2))
    assert_close(layer(x, attn_mask=per_head, is_causal=False), expected)


# ---------------------------------------------------------------------------------------------
# Causal masks: top-left and bottom-right, by hand


def test_causal_masks_by_hand() -> None:
    top_left = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    bottom_right = [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert reference.causal_mask(2, 5).astype(int).tolist() == top_left
    assert reference.causal_mask(2, 5, align="top-left").astype(int).tolist() == top_left
    assert reference.causal_mask(2, 5, align="bottom-right").astype(int).tolist() == bottom_right
    assert causal_mask(2, 5, align="bottom-right").int().tolist() == bottom_right
    assert causal_mask(2, 5).int().tolist() == top_left
    square = [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    for align in ("top-left", "bottom-right"):  # the same when T_q = T_k
        assert causal_mask(3, 3, align=align).int().tolist() == square


def test_chunk_after_a_cache_uses_the_bottom_right_mask() -> None:
    # Two new queries after three cached tokens: query 0 sees keys 0..3, query 1 keys 0..4.
    layer = make_layer(2, rope_base=None)
    x = randn(1, 5, D, seed=10)
    cache = KVCache(1, 5, 2, D_K, dtype=torch.float64)
    layer(x[:, :3], cache=cache)
    out = layer(x[:, 3:], cache=cache)
    keep = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    expected = layer(x, attn_mask=torch.cat([torch.zeros(3, 5, dtype=torch.bool), keep]))
    assert_close(out, expected[:, 3:])
    top_left = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    wrong = layer(
        x, attn_mask=torch.cat([torch.ones(3, 5, dtype=torch.bool), top_left]), is_causal=False
    )
    assert (out - wrong[:, 3:]).abs().max() > 1e-3  # the top-left mask would be another function


# ---------------------------------------------------------------------------------------------
# Incremental decoding with a cache equals the full causal forward


@pytest.mark.parametrize("cache_kind", [KVCache, ConcatKVCache])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("prompt_len", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cached_decoding_equals_full_forward_at_every_step(
    cache_kind, num_kv_heads: int, prompt_len: int, dtype
) -> None:
    new_tokens = 4
    total = prompt_len + new_tokens
    layer = make_layer(num_kv_heads, dtype=dtype)
    x = randn(2, total, D, seed=11, dtype=dtype)
    with torch.no_grad():
        full = layer(x)  # (B, T, D), causal, positions 0..T-1
        if cache_kind is KVCache:
            cache = KVCache(2, total, num_kv_heads, D_K, dtype=dtype)
        else:
            cache = ConcatKVCache(2, num_kv_heads, D_K, dtype=dtype)
        steps = [layer(x[:, :prompt_len], cache=cache)]
        for t in range(prompt_len, total):
            steps.append(layer(x[:, t : t + 1], cache=cache))
            assert len(cache) == t + 1
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(steps[0], full[:, :prompt_len], rtol=tol, atol=tol)
    for i, step in enumerate(steps[1:]):
        t = prompt_len + i
        torch.testing.assert_close(step, full[:, t : t + 1], rtol=tol, atol=tol)


def test_explicit_positions_equal_the_default_and_shift_per_row() -> None:
    layer = make_layer(2)
    x = randn(2, 6, D, seed=12)
    assert_close(layer(x, positions=torch.arange(6)), layer(x))
    assert_close(layer(x, positions=torch.arange(6).expand(2, 6)), layer(x))
    # RoPE scores depend on offsets only: shifting every position by 5 changes nothing.
    assert_close(layer(x, positions=torch.arange(5, 11)), layer(x))
    # Per-row positions: row 1 shifted by 3 still equals the default, row by row.
    rows = torch.stack([torch.arange(6), torch.arange(3, 9)])
    assert_close(layer(x, positions=rows), layer(x))
    # Positions that are not consecutive change the result (they are really used).
    scrambled = torch.tensor([0, 2, 1, 3, 4, 5])
    assert (layer(x, positions=scrambled) - layer(x)).abs().max() > 1e-3


def test_cache_update_returns_views_of_the_preallocated_tensors() -> None:
    cache = KVCache(2, 10, 2, 4)
    k, v = torch.ones(2, 2, 3, 4), 2 * torch.ones(2, 2, 3, 4)
    storage = cache.keys.data_ptr()
    k_all, v_all = cache.update(k, v)
    assert k_all.shape == (2, 2, 3, 4) and len(cache) == 3
    assert k_all.data_ptr() == storage  # written in place, no new tensor
    k_all, v_all = cache.update(3 * k, 4 * k)
    assert k_all.shape == (2, 2, 6, 4)
    assert torch.equal(k_all[:, :, 3:], 3 * k) and torch.equal(v_all[:, :, :3], v)
    cache.truncate(2)
    assert len(cache) == 2
    cache.reset()
    assert len(cache) == 0 and cache.keys.shape == (2, 2, 10, 4)
    growing = ConcatKVCache(2, 2, 4)
    growing.update(k, v)
    k_all, _ = growing.update(3 * k, 4 * k)
    assert k_all.shape == (2, 2, 6, 4) and len(growing) == 6
    growing.truncate(3)
    assert torch.equal(growing.keys, k)
    growing.reset()
    assert len(growing) == 0


# ---------------------------------------------------------------------------------------------
# Greedy generation


def small_decoder(num_kv_heads: int = 2, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(vocab_size=13, d_model=32, num_heads=4, num_kv_heads=num_kv_heads)
    return model.double().eval()


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_greedy_generation_is_the_same_with_and_without_a_cache(num_kv_heads: int) -> None:
    model = small_decoder(num_kv_heads)
    prompt = torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(1))
    plain = generate(model, prompt, 12, cache=None)
    assert plain.shape == (3, 17) and torch.equal(plain[:, :5], prompt)
    assert torch.equal(generate(model, prompt, 12, cache="preallocated"), plain)
    assert torch.equal(generate(model, prompt, 12, cache="concat"), plain)
    assert torch.equal(generate(model, prompt, 12, cache="paged"), plain)
    # Greedy: every new token is the argmax of the model's logits on everything before it.
    logits = model(plain[:, :-1])
    assert torch.equal(logits[:, 4:].argmax(-1), plain[:, 5:])


def test_decoder_with_caches_equals_full_forward() -> None:
    model = small_decoder(2)
    tokens = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(2))
    full = model(tokens)
    caches = model.new_caches(2, 9)
    steps = [model(tokens[:, :4], caches=caches)]
    steps += [model(tokens[:, t : t + 1], caches=caches) for t in range(4, 9)]
    assert_close(torch.cat(steps, dim=1), full)


# ---------------------------------------------------------------------------------------------
# MHA -> GQA by mean-pooling


def test_grouped_from_multi_head_mean_pools_key_and_value_heads() -> None:
    layer = make_layer(8)
    pooled = grouped_from_multi_head(layer, 2)
    assert pooled.num_kv_heads == 2 and pooled.rope_base == layer.rope_base
    k_heads = layer.k_proj.weight.detach().reshape(8, D_K, D)  # (H, d_k, D)
    # By hand: new head 0 = mean of old heads 0..3, new head 1 = mean of old heads 4..7.
    expected = torch.cat([k_heads[0:4].mean(0), k_heads[4:8].mean(0)])
    torch.testing.assert_close(pooled.k_proj.weight, expected, rtol=0, atol=1e-15)
    v_heads = layer.v_proj.weight.detach().reshape(8, D_K, D)
    torch.testing.assert_close(pooled.v_proj.weight[D_K:], v_heads[4:].mean(0))
    assert torch.equal(pooled.q_proj.weight, layer.q_proj.weight)
    assert torch.equal(pooled.o_proj.weight, layer.o_proj.weight)
    mqa = grouped_from_multi_head(pooled, 1)  # pooling twice = pooling all at once
    torch.testing.assert_close(mqa.k_proj.weight, k_heads.mean(0), rtol=0, atol=1e-15)


def test_grouped_from_multi_head_of_identical_heads_changes_nothing() -> None:
    # If the heads of each group are equal, their mean is that head: the output cannot change.
    layer = make_layer(8)
    with torch.no_grad():
        for proj in (layer.k_proj, layer.v_proj):
            heads = proj.weight.reshape(2, 4, D_K, D)
            proj.weight.copy_(heads[:, :1].expand(2, 4, D_K, D).reshape(H * D_K, D))
    x = randn(2, 6, D, seed=13)
    assert_close(grouped_from_multi_head(layer, 2)(x), layer(x))


def test_grouped_from_torch_multi_head_attention() -> None:
    torch.manual_seed(3)
    torch_layer = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    same = grouped_from_multi_head(torch_layer, H)  # no pooling: the same layer
    x = randn(2, 5, D, seed=14)
    blocked = torch.ones(5, 5, dtype=torch.bool).triu(1)
    expected, _ = torch_layer(x, x, x, attn_mask=blocked, need_weights=False)
    assert same.rope_base is None
    assert_close(same(x), expected)
    assert grouped_from_multi_head(torch_layer, 4).num_kv_heads == 4


def test_decoder_grouped_copies_everything_but_attention() -> None:
    model = small_decoder(4)
    mqa = model.grouped(1)
    assert mqa.num_kv_heads == 1 and model.num_kv_heads == 4
    assert torch.equal(mqa.embed.weight, model.embed.weight)
    assert mqa.attns[0].k_proj.weight.shape == (8, 32)
    tokens = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(3))
    assert mqa(tokens).shape == (2, 6, 13)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing written to the cache


def test_num_kv_heads_must_divide_num_heads() -> None:
    with pytest.raises(
        ValueError, match=r"num_heads \(8\) must be divisible by num_kv_heads \(3\)"
    ):
        GroupedQueryAttention(D, H, 3)
    with pytest.raises(TypeError, match="num_kv_heads must be an int"):
        GroupedQueryAttention(D, H, 2.0)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        GroupedQueryAttention(D, H, 0)
    with pytest.raises(
        ValueError, match=r"must divide the layer's number of key/value heads \(4\)"
    ):
        grouped_from_multi_head(make_layer(4), 3)
    with pytest.raises(TypeError, match="layer must be"):
        grouped_from_multi_head(torch.nn.Linear(4, 4), 1)


def test_rope_with_odd_head_width_is_refused() -> None:
    with pytest.raises(ValueError, match=r"even head width d_k.*d_k = 12 / 4 = 3"):
        GroupedQueryAttention(12, 4, 2)
    GroupedQueryAttention(12, 4, 2, rope_base=None)  # without RoPE an odd d_k is fine


def cache_tensors(cache) -> list[torch.Tensor]:
    if isinstance(cache, PagedKVCache):
        return [cache.key_blocks, cache.value_blocks, cache.block_table]
    return [cache.keys, cache.values]


def snapshot(cache):
    return len(cache), [t.clone() for t in cache_tensors(cache)]


def assert_unchanged(cache, before) -> None:
    length, tensors = before
    assert len(cache) == length
    assert all(torch.equal(a, b) for a, b in zip(cache_tensors(cache), tensors))


@pytest.mark.parametrize("kind", ["preallocated", "concat", "paged"])
def test_errors_leave_the_cache_untouched(kind: str) -> None:
    layer = make_layer(2, dtype=torch.float32)
    x = randn(2, 6, D, seed=15, dtype=torch.float32)

    def new_cache(batch=2, heads=2, dtype=torch.float32, device=None):
        if kind == "preallocated":
            return KVCache(batch, 8, heads, D_K, dtype=dtype, device=device)
        if kind == "paged":
            return PagedKVCache(batch, 8, heads, D_K, block_size=4, dtype=dtype, device=device)
        return ConcatKVCache(batch, heads, D_K, max_len=8, dtype=dtype, device=device)

    cache = new_cache()
    layer(x[:, :5], cache=cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"max_len = 8 tokens and holds 5: 6 new tokens"):
        layer(x, cache=cache)  # too many tokens for the room left
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match=r"positions must be >= 0.*got values -1 \.\. -1"):
        layer(x[:, :1], cache=cache, positions=torch.tensor([-1]))
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match=r"positions must have shape \(T,\) = \(1,\)"):
        layer(x[:, :1], cache=cache, positions=torch.tensor([5, 6]))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        layer(x[:, :1], cache=cache, positions=torch.tensor([5.0]))
    with pytest.raises(ValueError, match=r"attn_mask must be broadcastable to \(B, H, T, T_k\)"):
        layer(x[:, :1], cache=cache, attn_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor"):
        layer(x[:, :1], cache=cache, attn_mask=torch.zeros(1, 6))
    assert_unchanged(cache, before)
    layer(x[:, :1], cache=cache, positions=torch.tensor([5]))  # the right one is accepted
    assert len(cache) == 6

    wrong = {
        "dtype": (new_cache(dtype=torch.float64), TypeError, "cache's dtype torch.float64"),
        "batch": (new_cache(batch=3), ValueError, r"\(B, H_kv, d_k\) = \(3, 2, 4\)"),
        "heads": (new_cache(heads=4), ValueError, r"\(B, H_kv, d_k\) = \(2, 4, 4\)"),
        "device": (new_cache(device="meta"), ValueError, "cache's device meta"),
    }
    for name, (other, error, message) in wrong.items():
        before = snapshot(other) if name != "device" else None
        with pytest.raises(error, match=message):
            layer(x[:, :2], cache=other)
        if before is not None:  # (a cache on the meta device has no values to read)
            assert_unchanged(other, before)
            assert len(other) == 0, name


def test_cache_update_errors() -> None:
    cache = KVCache(1, 4, 2, 4)
    k = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        cache.update(k, torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match=r"k must have shape \(B, H_kv, T, d_k\)"):
        cache.update(k[0], k[0])
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        cache.update(k, None)
    with pytest.raises(
        TypeError, match=r"dtype torch.float32, got \(torch.float32, torch.float64\)"
    ):
        cache.update(k, k.double())
    cache.update(k, k)
    with pytest.raises(ValueError, match="max_len = 4 tokens and holds 3: 2 new tokens"):
        cache.update(k[:, :, :2], k[:, :, :2])
    assert len(cache) == 3
    with pytest.raises(ValueError, match=r"length must be at most len\(cache\) = 3, got 4"):
        cache.truncate(4)
    with pytest.raises(TypeError, match="max_len must be an int"):
        KVCache(1, 4.0, 2, 4)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        KVCache(1, 4, 2, 4, dtype=torch.int64)


def test_layer_input_errors() -> None:
    layer = make_layer(2)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, D\) with D = 32, got shape"):
        layer(randn(2, 3, 16))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        layer(torch.zeros(2, 3, D, dtype=torch.int64))
    float32 = layer.to(torch.float32)  # x in float64: ours, not torch's "mat1 and mat2" error
    with pytest.raises(TypeError, match="x must have the layer.s dtype torch.float32, got torch"):
        float32(randn(2, 3, D))
    no_rope = make_layer(2, rope_base=None)
    with pytest.raises(ValueError, match=r"rope_base=None"):
        no_rope(randn(2, 3, D), positions=torch.arange(3))
    with pytest.raises(ValueError, match="rope_base must be a float > 1|base must be a float > 1"):
        GroupedQueryAttention(D, H, 2, rope_base=0.5)


def test_generation_errors() -> None:
    model = small_decoder(2)
    prompt = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="cache must be one of"):
        generate(model, prompt, 2, cache="ring")
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, vocab_size\) = \[0, 13\)"):
        generate(model, prompt + 13, 2)
    with pytest.raises(TypeError, match="tokens must be an int64 tensor"):
        generate(model, prompt.float(), 2)
    with pytest.raises(ValueError, match="caches must hold one cache per layer"):
        model(prompt, caches=model.new_caches(1, 4)[:1])


# ---------------------------------------------------------------------------------------------
# A batch of prompts of different lengths: left padding, per-row positions, a key-padding mask


PROMPT_LENGTHS = (3, 7, 1, 5)


def prompts_of(lengths=PROMPT_LENGTHS, seed: int = 20) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 13, (n,), generator=gen) for n in lengths]


def test_left_pad_by_hand() -> None:
    tokens, real, positions = left_pad(
        [torch.tensor([5, 6]), torch.tensor([7, 8, 9])], pad_token=0
    )
    assert tokens.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert real.tolist() == [[False, True, True], [True, True, True]]
    assert positions.tolist() == [[0, 0, 1], [0, 1, 2]]


@pytest.mark.parametrize("kind", ["preallocated", "paged"])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_layer_on_a_left_padded_batch_equals_each_prompt_alone(
    kind: str, num_kv_heads: int
) -> None:
    layer = make_layer(num_kv_heads)
    gen = torch.Generator().manual_seed(21)
    xs = [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in PROMPT_LENGTHS]
    steps = 4
    new = torch.randn(len(xs), steps, D, generator=gen, dtype=torch.float64)  # (B, steps, D)
    T = max(PROMPT_LENGTHS)
    x = torch.zeros(len(xs), T, D, dtype=torch.float64)
    for b, rows in enumerate(xs):
        x[b, T - len(rows) :] = rows  # left padding (the pads' inputs are zeros)
    _, real, positions = left_pad([torch.zeros(n, dtype=torch.int64) for n in PROMPT_LENGTHS])
    if kind == "paged":
        cache = PagedKVCache(
            len(xs), T + steps, num_kv_heads, D_K, block_size=4, dtype=torch.float64
        )
    else:
        cache = KVCache(len(xs), T + steps, num_kv_heads, D_K, dtype=torch.float64)
    keys = torch.ones(len(xs), T + steps, dtype=torch.bool)
    keys[:, :T] = real
    mask = keys[:, None, None, :]  # (B, 1, 1, T_max): False at the pads
    with torch.no_grad():
        outs = [layer(x, cache=cache, positions=positions, attn_mask=mask)]
        at = positions[:, -1:]
        for t in range(steps):
            at = at + 1
            outs.append(layer(new[:, t : t + 1], cache=cache, positions=at, attn_mask=mask))
        batched = torch.cat(outs, dim=1)  # (B, T + steps, D)
        for b, rows in enumerate(xs):
            alone = layer(torch.cat((rows, new[b]))[None])  # positions 0.. by default
            assert_close(batched[b, T - len(rows) :], alone[0])
    assert not batched.isnan().any()  # pad queries see no key: zeros, not NaN


@pytest.mark.parametrize("cache", ["preallocated", "paged"])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_generate_batch_gives_each_prompt_what_it_gets_alone(
    cache: str, num_kv_heads: int
) -> None:
    model = small_decoder(num_kv_heads, seed=3)
    prompts = prompts_of()
    batched = generate_batch(model, prompts, 9, cache=cache)
    for prompt, row in zip(prompts, batched):
        alone = generate(model, prompt[None], 9)[0]
        assert torch.equal(row, alone)


def test_per_row_positions_with_a_cache_are_accepted() -> None:
    # Each row continues its own positions: row 1 started 3 tokens later than row 0.
    layer = make_layer(2)
    x = randn(2, 6, D, seed=22)
    cache = KVCache(2, 6, 2, D_K, dtype=torch.float64)
    rows = torch.stack([torch.arange(0, 5), torch.arange(3, 8)])
    with torch.no_grad():
        first = layer(x[:, :5], cache=cache, positions=rows)
        step = layer(x[:, 5:], cache=cache, positions=rows[:, -1:] + 1)
    assert_close(torch.cat((first, step), dim=1), layer(x))  # RoPE: offsets only


def test_batch_errors() -> None:
    model = small_decoder(2)
    with pytest.raises(TypeError, match=r"prompts must be a list of 1-D int64 tensors"):
        generate_batch(model, torch.zeros(2, 3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="prompts must hold at least one prompt"):
        generate_batch(model, [], 2)
    with pytest.raises(ValueError, match=r"prompts\[1\] must have shape \(T,\) with T >= 1"):
        generate_batch(model, [torch.tensor([1]), torch.tensor([], dtype=torch.int64)], 2)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be an int64 tensor"):
        generate_batch(model, [torch.tensor([1.0])], 2)
    with pytest.raises(ValueError, match="cache must be one of 'preallocated', 'paged'"):
        generate_batch(model, [torch.tensor([1])], 2, cache="concat")
    layer = make_layer(2)
    cache = KVCache(2, 8, 2, D_K, dtype=torch.float64)
    layer(randn(2, 3, D), cache=cache)
    with pytest.raises(
        ValueError, match=r"T_k = len\(cache\) \+ T = 4 or 8, or the cache's max_len"
    ):
        layer(randn(2, 1, D), cache=cache, attn_mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# Training and evaluation on the induction task


def test_train_decoder_lowers_the_loss_and_evaluate_matches_a_direct_count() -> None:
    from mha.decoding import evaluate_decoder, train_decoder
    from mha.tiny import make_induction_data

    torch.manual_seed(0)
    model = Decoder(vocab_size=16, d_model=16, num_heads=4, num_layers=1, d_mlp=32)
    losses = train_decoder(model, steps=30, batch_size=16, lr=1e-2, seed=0)
    assert len(losses) == 30 and not model.training
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns something
    data = make_induction_data(
        40, seq_len=16, vocab_size=16, segment_len=6, generator=torch.Generator().manual_seed(1)
    )
    loss, accuracy = evaluate_decoder(model, data)
    with torch.no_grad():
        logits = model(data.tokens)  # (N, T, V)
    picked = logits[data.predictable].argmax(-1)  # the scored positions only
    expected = (picked == data.targets[data.predictable]).double().mean().item()
    assert accuracy == pytest.approx(expected)
    assert loss == pytest.approx(
        torch.nn.functional.cross_entropy(
            logits[data.predictable], data.targets[data.predictable]
        ).item()
    )
    with pytest.raises(TypeError, match="steps must be an int"):
        train_decoder(model, steps=2.5)


# ---------------------------------------------------------------------------------------------
# Inputs that could be read two ways, and a model's caches checked before any is written


def test_a_two_dimensional_mask_that_could_be_a_padding_mask_is_refused() -> None:
    # transformers' attention_mask is (B, T_k); with B = T it has the shape of a (T, T_k) mask.
    layer = make_layer(2)
    x = randn(3, 3, D, seed=4)
    real = torch.tensor([[True, True, True], [False, True, True], [False, False, True]])
    with pytest.raises(ValueError, match=r"\(3, 3\) cannot be read.*\(B, 1, 1, T_k\)"):
        layer(x, attn_mask=real)
    by_row = layer(x, attn_mask=real[:, None, None, :])  # (B, 1, 1, T_k): padding per row
    as_rows = layer(x, attn_mask=real[None, None])  # (1, 1, T, T_k): one mask for every row
    assert (by_row - as_rows).abs().max() > 1e-3  # the two readings differ
    layer(x[:1], attn_mask=real)  # B = 1: a 2-D mask is (T, T_k), nothing else


def test_decoder_checks_every_cache_before_writing_any() -> None:
    model = small_decoder(2)
    tokens = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(3))
    caches = model.new_caches(2, 9)
    dtype = model.head.weight.dtype
    caches[1] = KVCache(2, 5, model.num_kv_heads, model.attns[0].head_dim, dtype=dtype)
    with pytest.raises(ValueError, match="max_len"):
        model(tokens, caches=caches)
    assert [len(cache) for cache in caches] == [0, 0]  # nothing half-written


def test_positions_of_shape_one_by_t_serve_every_row() -> None:
    # transformers' position_ids are often (1, T), the same for every row of the batch.
    layer = make_layer(2, rope_base=10000.0)
    x = randn(3, 5, D, seed=8)
    shared = torch.arange(7, 12)
    expected = layer(x, positions=shared)
    assert_close(layer(x, positions=shared[None]), expected)
    assert_close(layer(x, positions=shared.expand(3, 5)), expected)
    q = randn(3, 2, 5, 6, seed=9)
    assert_close(apply_rope(q, shared[None]), apply_rope(q, shared))
