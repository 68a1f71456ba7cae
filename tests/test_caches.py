"""The cache protocol (mha.caches): every cache honours it, and serves as a layer's cache.

The expected outputs come from the layer without a cache over the whole sequence, with the mask
written out densely (mha.reference's sliding-window mask for the rolling cache).
"""

from __future__ import annotations

import pytest
import torch
from mha import reference
from mha.caches import Cache, ConcatKVCache, KVCache, PagedKVCache, RollingKVCache
from mha.decoding import GroupedQueryAttention

from helpers import randn

B, H, H_KV, D_K, T = 2, 4, 2, 8, 11


def new_cache(kind: str, max_len: int = T):
    sizes = (H_KV, D_K)
    if kind == "preallocated":
        return KVCache(B, max_len, *sizes, dtype=torch.float64)
    if kind == "concat":
        return ConcatKVCache(B, *sizes, max_len=max_len, dtype=torch.float64)
    if kind == "paged":
        return PagedKVCache(B, max_len, *sizes, block_size=4, dtype=torch.float64)
    return RollingKVCache(B, 4, *sizes, dtype=torch.float64)


KINDS = ["preallocated", "concat", "paged", "rolling"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_honours_the_protocol(kind: str) -> None:
    cache = new_cache(kind)
    assert isinstance(cache, Cache)
    k = randn(B, H_KV, 3, D_K, seed=1)
    keys, values = cache.update(k, -k)
    assert (len(cache), cache.seen) == (3, 3)
    torch.testing.assert_close(keys, k)
    torch.testing.assert_close(values, -k)
    cache.check_update(B, H_KV, 1, D_K, torch.float64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\(B, H_kv, d_k\)"):
        cache.check_update(B, H_KV + 1, 1, D_K, torch.float64, torch.device("cpu"))
    with pytest.raises(TypeError, match="dtype torch.float64"):
        cache.check_update(B, H_KV, 1, D_K, torch.float32, torch.device("cpu"))
    cache.truncate(2)
    assert (len(cache), cache.seen) == (2, 2)
    cache.reset()
    assert (len(cache), cache.seen) == (0, 0)
    assert cache.max_len == (None if kind == "rolling" else T)


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_serves_a_layer(kind: str) -> None:
    """Prompt, then one token at a time: equal to the whole sequence at once (the rolling
    cache: under its window's mask)."""
    torch.manual_seed(0)
    layer = GroupedQueryAttention(H * D_K, H, H_KV, dtype=torch.float64).eval()
    x = randn(B, T, H * D_K, seed=2)
    cache = new_cache(kind)
    window = 4 if kind == "rolling" else T
    keep = torch.as_tensor(reference.sliding_window_mask(T, window=window))
    with torch.no_grad():
        expected = layer(x, attn_mask=keep)
        steps = [layer(x[:, :3], cache=cache)]
        steps += [layer(x[:, t : t + 1], cache=cache) for t in range(3, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-10, atol=1e-10)
    assert cache.seen == T  # positions count on past the window


def test_a_rolling_cache_refuses_what_a_layer_cannot_attend_through() -> None:
    cache = new_cache("rolling")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="first update holds at most window = 4"):
        cache.check_update(B, H_KV, 5, D_K, torch.float64, cpu)
    cache.update(*(randn(B, H_KV, 2, D_K, seed=3),) * 2)
    with pytest.raises(ValueError, match="one new token at a time after its first update"):
        cache.check_update(B, H_KV, 2, D_K, torch.float64, cpu)
    for _ in range(5):  # wrapped: positions 0 .. 6 seen, 3 .. 6 held
        cache.update(*(randn(B, H_KV, 1, D_K, seed=4),) * 2)
    with pytest.raises(ValueError, match=r"length must be 0 or at least seen - 1 = 6"):
        cache.truncate(4)
    cache.truncate(6)
    assert (cache.seen, len(cache)) == (6, 4)


@pytest.mark.parametrize("kind", ["preallocated", "paged"])
def test_a_decoding_step_never_reads_the_cache_length_from_the_device(kind, monkeypatch) -> None:
    """The layer's check, its positions and the update each ask for len(cache): the count the
    host keeps beside the length tensor serves them all, eagerly, with no read (a read from a GPU
    waits for every queued kernel); after a write the host did not make, one read."""
    torch.manual_seed(0)
    layer = GroupedQueryAttention(H * D_K, H, H_KV, dtype=torch.float64).eval()
    cache = new_cache(kind)
    x = randn(B, T, H * D_K, seed=5)
    with torch.no_grad():
        layer(x[:, :4], cache=cache)
    reads = []
    to_int = torch.Tensor.__int__

    def counted(tensor):
        reads.append(tensor is cache.length)
        return to_int(tensor)

    monkeypatch.setattr(torch.Tensor, "__int__", counted)
    with torch.no_grad():
        layer(x[:, 4:5], cache=cache)
    assert sum(reads) == 0 and len(cache) == 5
    cache.length += 1  # a write the host's count did not follow (a compiled step's)
    assert len(cache) == 6 and sum(reads) == 1
    assert len(cache) == 6 and sum(reads) == 1


def test_a_subclass_may_count_in_python() -> None:
    """Chapter 12's cache that keeps its length as a Python int still has a len()."""

    class CountedInPython(KVCache):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.length = 3

    assert len(CountedInPython(B, T, H_KV, D_K)) == 3


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
@pytest.mark.parametrize("kind", ["static", "paged"])
def test_attend_refuses_bad_input_before_the_cache_stores_it(backend: str, kind: str) -> None:
    from mha import kernels
    from mha.backends import Masking, attend

    from helpers import KERNEL_DEVICE

    if backend == "triton" and not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    device = KERNEL_DEVICE if backend == "triton" else "cpu"

    def make(head_dim: int = 32):
        if kind == "static":
            return KVCache(1, 32, 2, head_dim, device=device)
        return PagedKVCache(1, 32, 2, head_dim, block_size=4, device=device)

    def new(*shape, seed=0):
        return randn(*shape, seed=seed).float().to(device)

    q, k, v = new(1, 4, 3, 32), new(1, 2, 3, 32, seed=1), new(1, 2, 3, 32, seed=2)
    cache = make()
    bad = [
        ((new(1, 3, 3, 32), k, v, Masking()), ValueError, "H_kv dividing H"),
        ((new(1, 4, 3, 16), k, v, Masking()), ValueError, "q must have shape"),
        ((new(2, 4, 3, 32), k, v, Masking()), ValueError, "q must have shape"),
        ((q.double(), k, v, Masking()), TypeError, "one dtype"),
    ]
    if backend == "triton":  # a mask it does not take
        dense = Masking(dense=torch.ones(1, 1, 3, 3, dtype=torch.bool, device=device))
        bad.append(((q, k, v, dense), ValueError, r"takes no \['dense'\] mask"))
    for args, error, words in bad:
        with pytest.raises(error, match=words):
            attend(backend, *args, cache)
        assert len(cache) == 0, (backend, kind, words)
        if kind == "paged":
            assert cache.blocks_in_use == 0, (backend, kind, words)
    if backend == "triton":  # a head size no kernel takes: refused before the cache holds it
        wide, d = make(264), 264
        with pytest.raises(ValueError, match="d_k .* must be from 1 to 256, got 264"):
            attend(backend, new(1, 4, 3, d), new(1, 2, 3, d), new(1, 2, 3, d), Masking(), wide)
        assert len(wide) == 0
    out = attend(backend, q, k, v, Masking(), cache)  # the good call, after every refusal
    assert out.shape == q.shape and len(cache) == 3


def test_a_window_is_a_positive_int() -> None:
    from mha.backends import Masking

    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"window must be a positive int, got {bad}"):
            Masking(window=bad)
    with pytest.raises(TypeError, match="window must be an int, got float"):
        Masking(window=2.0)
