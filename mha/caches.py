"""Key/value caches, and the protocol every one of them honours.

A cache holds the keys and values of the positions seen so far, per layer.
The attention layer (:class:`mha.GroupedQueryAttention`, the model's
layers in :mod:`mha.model`) needs only the protocol :class:`Cache`:

* ``update(k, v) -> (k_all, v_all)``: write the new keys and values
  (B, H_kv, T, d_k) and return every key and value the new queries attend
  to, (B, H_kv, T_k, d_k), the new ones last;
* ``len(cache)``: positions held; ``seen``: positions written so far, the
  position of the next token (equal to ``len`` except in a cache that
  forgets, :class:`RollingKVCache`);
* ``reset()``: forget everything; ``truncate(length)``: keep the first
  ``length`` positions;
* ``check_update(batch, num_kv_heads, new_tokens, head_dim, dtype,
  device)``: raise, naming what is wrong, if such an update cannot be
  served, before anything is written (a layer checks every input before it
  computes);
* ``max_len``: positions it can hold, or None for no limit.

Four caches honour it: :class:`KVCache` (preallocated, written in place,
gpt-fast's), :class:`ConcatKVCache` (grown by concatenation),
:class:`PagedKVCache` (blocks from one pool, vLLM's) and
:class:`RollingKVCache` (the ``window`` newest positions in a ring,
Mistral 7B's rolling buffer). ``tests/test_caches.py`` runs every one of
them through the same protocol and through a layer.

Shapes: ``B`` batch, ``H_kv`` key/value heads, ``T`` new positions, ``T_k``
positions returned, ``d_k`` head size.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from ._validate import check_int
from .blocks import BlockAllocator
from .kernels.paged_torch import page_index

__all__ = [
    "Cache",
    "cached_so_far",
    "KVCache",
    "ConcatKVCache",
    "PagedKVCache",
    "RollingKVCache",
]


@runtime_checkable
class Cache(Protocol):
    """What an attention layer asks of a key/value cache (see the module)."""

    max_len: int | None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def __len__(self) -> int: ...

    @property
    def seen(self) -> int: ...

    def reset(self) -> None: ...

    def truncate(self, length: int) -> None: ...

    def check_update(
        self,
        batch: int,
        num_kv_heads: int,
        new_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        v: Tensor | None = None,
    ) -> None: ...


def cached_so_far(cache: Cache) -> int | Tensor:
    """Positions the cache has seen, read once before a step: an int, or
    under ``torch.compile`` a 0-dim tensor (a count the compiler would guard
    as a constant, and compile again for every step, must stay a tensor)."""
    length = getattr(cache, "length", None)
    if torch.compiler.is_compiling() and isinstance(length, Tensor):
        return length.clone()  # update() counts on in place
    return cache.seen  # len(cache), or more where the cache forgets


class KVCache:
    """Keys and values of the tokens so far, preallocated and written in place.

    ``keys`` and ``values`` are (B, H_kv, max_len, d_k) tensors, allocated
    once; :meth:`update` writes the new tokens' keys and values into the next
    free positions and returns views of everything written so far. The cost
    of a step does not depend on how much was cached before (gpt-fast's
    ``KVCache``). The count of written positions is a tensor, ``length``,
    so that ``torch.compile`` compiles one step for every length.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        _check_cache_args(batch, num_kv_heads, head_dim, dtype)
        self.max_len = check_int("max_len", max_len)
        self.batch, self.num_kv_heads, self.head_dim = (
            batch,
            num_kv_heads,
            head_dim,
        )
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = dtype, self.keys.device
        self.length = _length_counter(self.device)
        self._count: tuple[int, int] | None = None  # see _host_count

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, H_kv, T, d_k) after the cached ones; return all.

        Compiled, the whole (B, H_kv, max_len, d_k) tensors come back (a
        shape that does not change from step to step); the layer masks the
        positions not yet written.
        """
        self.check_update(*_update_shape(k, v), k.dtype, k.device, v=v)
        slots = self.length + torch.arange(k.shape[2], device=self.device)
        self.keys.index_copy_(2, slots, k)  # in place: nothing copied again
        self.values.index_copy_(2, slots, v)
        _advance(self, k.shape[2])
        if torch.compiler.is_compiling():
            return self.keys, self.values
        end = len(self)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def __len__(self) -> int:
        return _host_count(self)

    @property
    def seen(self) -> int:
        """Positions written so far: ``len(cache)``."""
        return len(self)

    def reset(self) -> None:
        """Forget every cached token (the memory stays allocated)."""
        _set_length(self, 0)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens and forget the rest."""
        _set_length(self, _check_truncate(length, len(self)))

    def check_update(
        self,
        batch: int,
        num_kv_heads: int,
        new_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        v: Tensor | None = None,
    ) -> None:
        """Raise ValueError/TypeError if such an update cannot be written."""
        _check_dtype_device(self, dtype, device, v)
        _check_update(self, batch, num_kv_heads, new_tokens, head_dim)


class ConcatKVCache:
    """Keys and values of the tokens so far, grown by concatenation.

    Every :meth:`update` builds new (B, H_kv, T_k, d_k) tensors from the old
    ones and the new tokens' (``torch.cat``): step t copies all t cached
    positions again. Same interface as :class:`KVCache`; ``max_len`` is
    optional.
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        _check_cache_args(batch, num_kv_heads, head_dim, dtype)
        self.max_len = (
            None if max_len is None else check_int("max_len", max_len)
        )
        self.batch, self.num_kv_heads, self.head_dim = (
            batch,
            num_kv_heads,
            head_dim,
        )
        empty = (batch, num_kv_heads, 0, head_dim)
        self.keys = torch.zeros(empty, dtype=dtype, device=device)
        self.values = torch.zeros(empty, dtype=dtype, device=device)
        self.dtype, self.device = dtype, self.keys.device

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v (B, H_kv, T, d_k) to the cached ones; return all."""
        self.check_update(*_update_shape(k, v), k.dtype, k.device, v=v)
        self.keys = torch.cat((self.keys, k), dim=2)  # a new tensor, each step
        self.values = torch.cat((self.values, v), dim=2)
        return self.keys, self.values

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def __len__(self) -> int:
        return self.keys.shape[2]

    @property
    def seen(self) -> int:
        """Positions written so far: ``len(cache)``."""
        return self.keys.shape[2]

    def reset(self) -> None:
        """Forget every cached token."""
        self.truncate(0)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens and forget the rest."""
        length = _check_truncate(length, len(self))
        self.keys = self.keys[:, :, :length]
        self.values = self.values[:, :, :length]

    check_update = KVCache.check_update


class PagedKVCache:
    """Keys and values in fixed-size blocks from one pool (vLLM's layout).

    The pool holds ``num_blocks`` blocks of ``block_size`` positions,
    ``key_blocks`` and ``value_blocks`` (num_blocks + 1, block_size, H_kv,
    d_k), the layout :func:`mha.kernels.triton_paged_attention` reads; the
    last block is a null block that is never handed out. Row ``b``'s
    position ``p`` lives in block ``block_table[b, p // block_size]`` at
    offset ``p % block_size``. The blocks come from a
    :class:`mha.blocks.BlockAllocator`, the serving engine's: one is made
    here, or ``allocator`` is taken (its ``num_blocks`` and ``block_size``,
    every block free). A block is taken when a row's first position in it
    is written (:meth:`reserve`), and :meth:`free` gives a finished row's
    blocks back: memory follows the tokens, not ``max_len`` (Kwon et al.
    2023). Same ``update`` / ``len`` / ``reset`` / ``truncate`` as
    :class:`KVCache`; ``update`` gathers each row's blocks into (B, H_kv,
    T_k, d_k) for attention that takes keys in a row, while :meth:`write`
    stores the new keys only, for a kernel that reads the blocks where they
    lie (:meth:`pages`).

    ``share_table_with``: another layer's paged cache, whose block table,
    allocator and rows this one shares (a model's layers, made by
    :meth:`mha.CausalLM.new_caches`): each layer has its own pools, one
    table says where every layer's position ``p`` lies, the first layer to
    write a step takes its blocks, and :meth:`reset`, :meth:`truncate` and
    :meth:`free` act on every layer that shares it.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
        allocator: BlockAllocator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        share_table_with: PagedKVCache | None = None,
    ) -> None:
        dtype = dtype or torch.get_default_dtype()
        _check_cache_args(batch, num_kv_heads, head_dim, dtype)
        self.max_len = check_int("max_len", max_len)
        shared = share_table_with
        if shared is not None:
            _check_shared(
                shared, batch, max_len, block_size, num_blocks, allocator
            )
            allocator = shared.allocator
        elif allocator is None:
            block_size = check_int("block_size", block_size or 16)
            if num_blocks is None:  # enough for every row at max_len
                num_blocks = batch * -(-max_len // block_size)
            allocator = BlockAllocator(
                check_int("num_blocks", num_blocks),
                block_size,
                prefix_caching=False,
            )
        else:
            _check_allocator(allocator, block_size, num_blocks)
        self.allocator = allocator
        self.num_blocks, self.block_size = (
            allocator.num_blocks,
            allocator.block_size,
        )
        self.blocks_per_row = -(-max_len // self.block_size)  # ceil
        self.batch, self.num_kv_heads, self.head_dim = (
            batch,
            num_kv_heads,
            head_dim,
        )
        shape = (self.num_blocks + 1, self.block_size, num_kv_heads, head_dim)
        self.key_blocks = torch.zeros(shape, dtype=dtype, device=device)
        self.value_blocks = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = dtype, self.key_blocks.device
        self.null_block = self.num_blocks  # where a row without a block points
        self.length = _length_counter(self.device)
        self._count: tuple[int, int] | None = None  # see _host_count
        if shared is not None:  # one table: the same tensors, the same rows
            self.block_table, self.active = shared.block_table, shared.active
            self._rows, self._live = shared._rows, shared._live
            self._sharing = shared._sharing
            self._sharing.append(self)
            _set_length(self, len(shared))
            return
        self.block_table = torch.full(
            (batch, self.blocks_per_row),
            self.null_block,
            dtype=torch.int32,
            device=self.device,
        )  # (B, blocks per row)
        self.active = torch.ones(batch, dtype=torch.bool, device=self.device)
        self._rows: list[list[int]] = [[] for _ in range(batch)]  # on host
        self._live = list(range(batch))  # the rows not freed
        self._sharing = [self]  # the caches of this table

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, H_kv, T, d_k) into the rows' blocks; return all,
        gathered: (B, H_kv, T_k, d_k).

        Eagerly the blocks are reserved here; a compiled step needs
        :meth:`reserve` called before it (vLLM's scheduler, too, hands out
        blocks before the model runs). Compiled, every row's ``max_len``
        positions come back; the layer masks those not yet written.
        """
        self.write(k, v)
        end = self.max_len if torch.compiler.is_compiling() else len(self)
        index = page_index(self.block_table, self.block_size, end)[:2]
        # (B, T_k, H_kv, d_k) -> (B, H_kv, T_k, d_k)
        return tuple(
            pool[index].transpose(1, 2)
            for pool in (self.key_blocks, self.value_blocks)
        )

    def write(self, k: Tensor, v: Tensor) -> None:
        """Store k, v (B, H_kv, T, d_k) in the rows' blocks and nothing
        else: the only bytes a step moves when a kernel reads the blocks
        where they lie (:meth:`pages`)."""
        self.check_update(*_update_shape(k, v), k.dtype, k.device, v=v)
        T = k.shape[2]
        if not torch.compiler.is_compiling():
            self.reserve(T)
        slots = self.length + torch.arange(T, device=self.device)  # (T,)
        blocks = self.block_table[:, slots // self.block_size]  # (B, T)
        offsets = slots % self.block_size  # (T,)
        if torch.compiler.is_compiling():  # no write into the null block
            torch._assert_async(  # (a finished row's may go there)
                ((blocks != self.null_block) | ~self.active[:, None]).all(),
                "PagedKVCache: reserve() the blocks before a compiled step",
            )
        # blocks[b, t], offsets[t] <- k[b, :, t]: (B, T, H_kv, d_k)
        self.key_blocks[blocks, offsets] = k.transpose(1, 2)
        self.value_blocks[blocks, offsets] = v.transpose(1, 2)
        _advance(self, T)

    def pages(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(key_blocks, value_blocks, block_table, seq_lens)`` as
        :func:`mha.kernels.triton_paged_attention` takes them: the pools
        themselves, not copies, and (B,) int32 lengths, ``len(self)``."""
        lens = torch.full(
            (self.batch,), len(self), dtype=torch.int32, device=self.device
        )
        return self.key_blocks, self.value_blocks, self.block_table, lens

    def reserve(self, new_tokens: int) -> None:
        """Take from the pool the blocks that the next ``new_tokens``
        positions of every active row need; nothing if the pool is short,
        nothing either where a layer sharing the table took them already.
        The table's rows are kept on the host too: nothing is read back."""
        last = -(-(len(self) + new_tokens) // self.block_size)
        short = {b: last - len(self._rows[b]) for b in self._live}
        needed = sum(n for n in short.values() if n > 0)
        if not needed:
            return
        if needed > self.allocator.num_free:
            raise ValueError(
                f"the pool has {self.allocator.num_free} free blocks of "
                f"{self.block_size} positions; {new_tokens} new tokens for "
                f"{len(self._live)} rows need {needed}"
            )
        for b, n in short.items():
            if n > 0:
                first = len(self._rows[b])
                self._rows[b] += [self.allocator.allocate() for _ in range(n)]
                self.block_table[b, first:last] = torch.tensor(
                    self._rows[b][first:], dtype=torch.int32
                )

    def free(self, row: int) -> None:
        """Give row ``row``'s blocks back to the pool: its sequence is done.
        Later writes of that row go to the null block, and its keys and
        values read from there are meaningless."""
        check_int("row", row, minimum=0)
        if row >= self.batch:
            raise ValueError(f"row must be < batch = {self.batch}, got {row}")
        self._release(row, 0)
        self.active[row] = False
        if row in self._live:
            self._live.remove(row)

    @property
    def blocks_in_use(self) -> int:
        """Blocks taken from the pool and not given back."""
        return self.num_blocks - self.allocator.num_free

    def __len__(self) -> int:
        return _host_count(self)

    @property
    def seen(self) -> int:
        """Positions written so far: ``len(cache)``."""
        return len(self)

    def reset(self) -> None:
        """Forget every cached token, in every layer sharing the table;
        every block goes back to the pool."""
        for b in range(self.batch):
            self._release(b, 0)
        self.active.fill_(True)
        self._live[:] = range(self.batch)
        for cache in self._sharing:
            _set_length(cache, 0)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens and forget the rest, in
        every layer sharing the table; the blocks past them go back to the
        pool."""
        length = _check_truncate(length, len(self))
        keep = -(-length // self.block_size)
        for b in range(self.batch):
            self._release(b, keep)
        for cache in self._sharing:
            _set_length(cache, min(length, len(cache)))

    def _release(self, row: int, keep: int) -> None:
        """Row ``row``'s blocks from index ``keep`` on, back to the pool."""
        held = self._rows[row][keep:]
        if held:
            self.allocator.free(held)
            del self._rows[row][keep:]
            self.block_table[row, keep:] = self.null_block

    check_update = KVCache.check_update


def _check_allocator(
    allocator: BlockAllocator, block_size: int | None, num_blocks: int | None
) -> None:
    """``allocator`` is a fresh :class:`BlockAllocator` of these sizes."""
    if not isinstance(allocator, BlockAllocator):
        raise TypeError(
            "allocator must be an mha.blocks.BlockAllocator, got "
            f"{type(allocator).__name__}"
        )
    for name, asked in (
        ("block_size", block_size),
        ("num_blocks", num_blocks),
    ):
        if asked is not None and asked != getattr(allocator, name):
            raise ValueError(
                f"{name} must be the allocator's ({getattr(allocator, name)})"
                f" or None, got {asked}"
            )
    if allocator.num_free != allocator.num_blocks:
        raise ValueError(
            "allocator must have every block free (the cache's pool is its "
            f"own), got {allocator.num_blocks - allocator.num_free} in use"
        )


def _check_shared(
    shared: object,
    batch: int,
    max_len: int,
    block_size: int | None,
    num_blocks: int | None,
    allocator: BlockAllocator | None,
) -> None:
    """A cache whose table another shares: a PagedKVCache of these rows."""
    if not isinstance(shared, PagedKVCache):
        raise TypeError(
            "share_table_with must be an mha.PagedKVCache, got "
            f"{type(shared).__name__}"
        )
    if (batch, max_len) != (shared.batch, shared.max_len):
        raise ValueError(
            f"share_table_with must have the same (batch, max_len), got "
            f"{(shared.batch, shared.max_len)} for {(batch, max_len)}"
        )
    for name, asked in (
        ("block_size", block_size),
        ("num_blocks", num_blocks),
    ):
        if asked is not None and asked != getattr(shared, name):
            raise ValueError(
                f"{name} must be the shared table's ({getattr(shared, name)})"
                f" or None, got {asked}"
            )
    if allocator is not None and allocator is not shared.allocator:
        raise ValueError(
            "allocator must be None with share_table_with (the table's own "
            "allocator serves every layer)"
        )


def _advance(cache: KVCache | PagedKVCache, new: int) -> None:
    """``length += new``; eagerly the host's count follows it, unread."""
    if torch.compiler.is_compiling():
        cache.length += new
        return
    known = len(cache)  # no read: the count is current
    cache.length += new
    cache._count = (known + new, cache.length._version)


def _set_length(cache: KVCache | PagedKVCache, length: int) -> None:
    """``length`` positions held, on the device and on the host alike."""
    cache.length.fill_(length)
    cache._count = (length, cache.length._version)


def _length_counter(device: torch.device) -> Tensor:
    """A cache's count of written positions: a 0-d int64 tensor on the
    device, made outside inference mode even when the cache is made inside
    it (``torch.inference_mode()``, as serving code runs), so that its
    ``_version`` still counts in-place writes for :func:`_host_count`."""
    with torch.inference_mode(False):
        return torch.zeros((), dtype=torch.int64, device=device)


def _host_count(cache: KVCache | PagedKVCache) -> int:
    """``int(cache.length)``, read from the device only when the tensor was
    written since the last read: its ``_version`` counts in-place writes
    (``+=``, ``fill_``, ``zero_``). A decoding step asks for the length
    several times (the model's check, the layer's, the position, the
    update's); one read from the host is enough."""
    length = cache.length
    if not isinstance(length, Tensor) or torch.compiler.is_compiling():
        return int(length)  # a count kept in Python; or traced
    count = getattr(cache, "_count", None)
    if count is None or count[1] != length._version:
        count = cache._count = (int(length), length._version)
    return count[0]


def _check_cache_args(
    batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    check_int("batch", batch)
    check_int("num_kv_heads", num_kv_heads)
    check_int("head_dim", head_dim)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")


def _update_shape(k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
    """(B, H_kv, T, d_k) of the new keys, after checking k and v."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(t).__name__}"
            )
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (B, H_kv, T, d_k), got shape "
                f"{tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(
            "k and v must have the same shape (B, H_kv, T, d_k), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    return tuple(k.shape)


def _check_update(
    cache: KVCache | ConcatKVCache | PagedKVCache,
    batch: int,
    num_kv_heads: int,
    new_tokens: int,
    head_dim: int,
) -> None:
    expected = (cache.batch, cache.num_kv_heads, cache.head_dim)
    if (batch, num_kv_heads, head_dim) != expected:
        raise ValueError(
            "the new keys and values must have (B, H_kv, d_k) = "
            f"{expected}, the cache's, got {(batch, num_kv_heads, head_dim)}"
        )
    if torch.compiler.is_compiling():  # len() would read a tensor's value
        if cache.max_len is not None and isinstance(cache.length, Tensor):
            torch._assert_async(
                cache.length + new_tokens <= cache.max_len,
                f"the cache has room for max_len = {cache.max_len} tokens",
            )
        return
    if cache.max_len is not None and len(cache) + new_tokens > cache.max_len:
        raise ValueError(
            f"the cache has room for max_len = {cache.max_len} tokens and "
            f"holds {len(cache)}: {new_tokens} new tokens do not fit"
        )


def _check_dtype_device(
    cache: KVCache | ConcatKVCache | PagedKVCache,
    dtype: torch.dtype,
    device: torch.device,
    v: Tensor | None,
) -> None:
    if dtype != cache.dtype or (v is not None and v.dtype != cache.dtype):
        got = dtype if v is None or v.dtype == dtype else (dtype, v.dtype)
        raise TypeError(
            f"the new keys and values must have the cache's dtype "
            f"{cache.dtype}, got {got}"
        )
    if torch.device(device) != cache.device or (
        v is not None and v.device != cache.device
    ):
        raise ValueError(
            f"the new keys and values must be on the cache's device "
            f"{cache.device}, got {device}"
        )


def _check_truncate(length: int, current: int) -> int:
    length = check_int("length", length, minimum=0)
    if length > current:
        raise ValueError(
            f"length must be at most len(cache) = {current}, got {length}"
        )
    return length


class RollingKVCache:
    """Keys and values of the ``window`` newest positions, in a ring.

    Position p lives in slot p % window of (B, H_kv, window, d_k) tensors
    allocated once (Mistral 7B's rolling buffer cache, Jiang et al. 2023):
    the memory stays ``window`` positions however long the sequence grows.
    :meth:`update` writes the new keys and values and returns views of the
    slots written so far, which are the keys and values the newest query
    attends to under :func:`sliding_window` (``window``): in slot order, not
    in time order, which attention does not need, since the positions are in
    the keys already (RoPE) and one query has nothing to mask. The earlier
    queries of a chunk of several new tokens see keys that the chunk
    overwrote: attend a prompt with the sliding-window mask, then decode one
    token at a time.
    """

    def __init__(
        self,
        batch: int,
        window: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        window = check_int("window", window)
        # The slots and every other check are a KVCache's, max_len = window.
        self._slots = KVCache(
            batch, window, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.window = window
        self.seen = 0  # positions written so far, the newest is seen - 1

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, H_kv, T, d_k); return (B, H_kv, <= window, d_k)."""
        slots = self._slots  # written by index: its own count stays 0
        shape = _tokens_shape(k, v, self.window)
        slots.check_update(*shape, k.dtype, k.device, v=v)
        new = k.shape[2]
        keep = min(new, self.window)  # older new tokens are out of reach
        where = torch.arange(self.seen + new - keep, self.seen + new)
        where = (where % self.window).to(slots.keys.device)  # (keep,) slots
        slots.keys.index_copy_(2, where, k[:, :, new - keep :])
        slots.values.index_copy_(2, where, v[:, :, new - keep :])
        self.seen += new
        filled = len(self)
        return slots.keys[:, :, :filled], slots.values[:, :, :filled]

    def __len__(self) -> int:
        """Positions held: min(positions seen, window)."""
        return min(self.seen, self.window)

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.seen = 0

    max_len = None  # positions: no limit; memory: ``window`` of them

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on. The ring keeps only the
        newest ``window``: going back further than one position, once it has
        wrapped, would need keys it no longer holds."""
        length = _check_truncate(length, self.seen)
        wrapped = self.seen > self.window
        if wrapped and 0 < length < self.seen - 1:
            raise ValueError(
                f"length must be 0 or at least seen - 1 = {self.seen - 1}: "
                f"the ring holds the newest {self.window} positions of "
                f"{self.seen}, got {length}"
            )
        self.seen = length

    def check_update(
        self,
        batch: int,
        num_kv_heads: int,
        new_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        v: Tensor | None = None,
    ) -> None:
        """Raise ValueError/TypeError if an attention layer cannot attend
        through this cache with ``new_tokens`` new queries.

        :meth:`update` returns the slots, not the positions in order: one
        new query attends to them all, a first chunk of at most ``window``
        positions attends causally; a later chunk would need keys that it
        overwrites (attend a longer prompt with the window's mask, then
        decode one token at a time)."""
        tokens = min(new_tokens, self.window)
        self._slots.check_update(
            batch, num_kv_heads, tokens, head_dim, dtype, device, v=v
        )
        if new_tokens > 1 and self.seen > 0:
            raise ValueError(
                "a RollingKVCache takes one new token at a time after its "
                f"first update, got new_tokens = {new_tokens} after "
                f"{self.seen} positions"
            )
        if new_tokens > self.window:
            raise ValueError(
                f"a RollingKVCache's first update holds at most window = "
                f"{self.window} positions for a layer, got new_tokens = "
                f"{new_tokens}"
            )


def _tokens_shape(
    k: Tensor, v: Tensor, window: int
) -> tuple[int, int, int, int]:
    """(B, H_kv, T, d_k) of k and v, T counted as at most ``window``."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a (B, H_kv, T, d_k) tensor, got {got}"
            )
    if k.shape != v.shape:
        raise ValueError(
            "k and v must have the same shape (B, H_kv, T, d_k), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    batch, heads, new, head_dim = k.shape
    return batch, heads, min(new, window), head_dim
