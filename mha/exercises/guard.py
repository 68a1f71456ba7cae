"""Guard bands: a learner's Triton kernel cannot write where the checker
does not look, and cannot end the Python process.

While a checker runs a learner's function, :func:`guarded` intercepts every
Triton launch (``kernel[grid](...)``): each tensor argument's memory is
copied into the middle of a larger buffer whose two ends, the *guard bands*,
hold a sentinel (a NaN for floats); the kernel runs on the copies, and its
results are copied back. A guard value changed is a store outside the
tensor; a guard value read is a NaN in whatever it reaches. In Triton's
interpreter (the CPU) every load and store is also checked, before it
happens, against the launch's buffers: a read outside a tensor is named, and
an access far outside every buffer, which would end the process with a
segmentation fault, is refused and named. Where the interpreter cannot be
watched (a Triton without the hooks used here), :func:`in_child` runs the
checklist in a forked child first, so that a crash ends the child only.

Nothing here imports Triton: the launches are intercepted only where Triton
is already imported (no kernel can run otherwise).
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["guarded", "Launches", "in_child", "needs_child", "crash_message"]

#: Bytes in each guard band, at least: a tile of 128 rows stored one tile
#: too far lands in it. A band is also never smaller than the tensor itself,
#: so that a batch or head index one too large lands in it too.
GUARD_BYTES = 1 << 16
#: Whether the interpreter's loads and stores are checked (tests switch it
#: off to exercise the forked child that stands in where they cannot be).
WATCH = True
#: A sentinel per floating dtype: a quiet NaN with a payload no arithmetic
#: produces, as the bits of the integer type of the same width.
_NAN_BITS = {
    "float64": ("int64", 0x7FFA5A5A5A5A5A5A),
    "float32": ("int32", 0x7FC5A5A5),
    "float16": ("int16", 0x7E5A),
    "bfloat16": ("int16", 0x7FE5),
}
_OTHER_BYTE = 0xA5  # the sentinel's byte in bands of other dtypes
#: (ndim, axis counted from the end, size) -> (what it is, its mask).
Bounds = dict[tuple[int, int, int], tuple[str, str]]


@dataclass
class Band:
    """One storage of a launch's tensors, copied between two guard bands.

    ``buffer`` (uint8, on the storage's device) is ``guard`` bytes of
    sentinel, the storage's bytes, ``guard`` bytes of sentinel.
    """

    storage: Any  # the caller's torch.UntypedStorage
    tensor: Any  # the first argument on it: its shape names the places
    names: list[str]
    buffer: Any
    guard: int
    fresh: Any  # the two bands' bytes as filled, concatenated

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes()

    @property
    def start(self) -> int:
        """The address of the storage's first byte inside ``buffer``."""
        return self.buffer.data_ptr() + self.guard

    @property
    def itemsize(self) -> int:
        return self.tensor.element_size()

    @property
    def first(self) -> int:
        """The address of the first argument's first element."""
        return self.start + self.tensor.storage_offset() * self.itemsize

    @property
    def extent(self) -> int:
        """Elements from the first argument's first to one past its last."""
        shape, strides = self.tensor.shape, self.tensor.stride()
        return 1 + sum((n - 1) * abs(s) for n, s in zip(shape, strides))

    @property
    def name(self) -> str:
        return " and ".join(f"`{n}`" for n in dict.fromkeys(self.names))


def _make_band(tensor: Any, name: str) -> Band:
    import torch

    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    guard = max(GUARD_BYTES, -(-nbytes // 256) * 256)  # keeps alignment
    total = 2 * guard + -(-nbytes // 8) * 8
    buffer = torch.empty(total, dtype=torch.uint8, device=tensor.device)
    bits = _NAN_BITS.get(str(tensor.dtype).removeprefix("torch."))
    if bits is None:
        buffer.fill_(_OTHER_BYTE)
    else:
        buffer.view(getattr(torch, bits[0])).fill_(bits[1])
    inner = buffer[guard : guard + nbytes]
    inner.copy_(_bytes_of(storage))
    fresh = torch.cat([buffer[:guard], buffer[guard + nbytes :]])
    return Band(storage, tensor, [name], buffer, guard, fresh)


def _bytes_of(storage: Any) -> Any:
    """The bytes of ``storage`` as a uint8 tensor that shares them."""
    import torch

    empty = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return empty.set_(storage, 0, (storage.nbytes(),), (1,))


def _view_in(band: Band, tensor: Any) -> Any:
    """``tensor`` with its shape and strides, in ``band``'s buffer."""
    import torch

    itemsize = tensor.element_size()
    offset = band.guard // itemsize + tensor.storage_offset()
    empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return empty.set_(
        band.buffer.untyped_storage(), offset, tensor.shape, tensor.stride()
    )


@dataclass
class Access:
    """Accesses of one kind outside one tensor (or far outside all)."""

    kernel: str
    action: str  # "store" or "load"
    band: Band | None  # None: far outside every buffer
    offsets: list[np.ndarray] = field(default_factory=list)  # elements
    far: int = 0  # accesses far outside every buffer
    distance: int = 0  # bytes from the nearest buffer, for ``far``

    def positions(self) -> np.ndarray:
        return np.unique(np.concatenate(self.offsets or [np.zeros(0, int)]))


class Launches:
    """What the learner's launches did outside their tensors.

    ``bounds`` says what a dimension is and the mask that keeps an index
    below its size: ``{(4, -2, 77): ("T_q", "the row bound (rows <
    T_Q)")}`` for the second-last dimension, of size 77, of a 4-dimensional
    tensor.
    """

    def __init__(self, bounds: Bounds | None = None):
        self.bounds = dict(bounds or {})
        self.accesses: dict[tuple, Access] = {}
        self.depth = 0  # launches in progress (an autotuner's inner ones)

    def __bool__(self) -> bool:
        return bool(self.accesses)

    def record(
        self,
        kernel: str,
        action: str,
        band: Band | None,
        offsets: Any = None,
        far: int = 0,
        distance: int = 0,
    ) -> None:
        """Note accesses outside ``band``'s tensor (``offsets``, elements
        from its first), or ``far`` ones outside every buffer (no band)."""
        key = (kernel, action, id(band.storage) if band else None)
        access = self.accesses.setdefault(key, Access(kernel, action, band))
        if offsets is not None and len(offsets):
            access.offsets.append(np.asarray(offsets, dtype=np.int64))
        access.far += far
        if far:
            access.distance = min(access.distance or distance, distance)

    def message(self) -> str | None:
        """The first of: a far access, a store, a load, as a sentence."""
        if not self.accesses:
            return None

        def rank(access: Access) -> int:
            return 0 if access.far else 1 if access.action == "store" else 2

        ordered = sorted(self.accesses.values(), key=rank)
        words = describe(ordered[0], self.bounds)
        others = [a.band.name for a in ordered[1:] if a.band]
        if others:
            names = " and ".join(dict.fromkeys(others))
            words += f"; it went outside {names} too"
        return words

    # the launch, intercepted

    def launch(self, kernel: Any, run: Callable, args: tuple, kwargs: dict):
        """``run(*args, **kwargs)`` with every tensor in guard bands."""
        if self.depth:  # inside a guarded launch already
            return run(*args, **kwargs)
        names = _argument_names(kernel)
        bands: dict[int, Band] = {}

        def wrap(value: Any, name: str) -> Any:
            if not _guardable(value):
                return value
            key = value.untyped_storage().data_ptr()
            if key in bands:
                bands[key].names.append(name)
            else:
                bands[key] = _make_band(value, name)
            return _view_in(bands[key], value)

        args = tuple(
            wrap(a, names[i] if i < len(names) else f"argument {i}")
            for i, a in enumerate(args)
        )
        kwargs = {key: wrap(value, key) for key, value in kwargs.items()}
        kernel_name = _kernel_name(kernel)
        watching = _watch(self, kernel_name, list(bands.values()))
        self.depth += 1
        try:
            with watching:
                return run(*args, **kwargs)
        finally:
            self.depth -= 1
            for band in bands.values():
                self._close(kernel_name, band)

    def _close(self, kernel: str, band: Band) -> None:
        """Copy ``band``'s storage back; record the stores in its guards."""
        import torch

        guard, nbytes = band.guard, band.nbytes
        _bytes_of(band.storage).copy_(band.buffer[guard : guard + nbytes])
        now = torch.cat([band.buffer[:guard], band.buffer[guard + nbytes :]])
        changed = torch.nonzero(now != band.fresh).flatten().cpu().numpy()
        if not changed.size:
            return
        # byte positions in the buffer, then elements from the first one
        at = np.where(changed < guard, changed, changed + nbytes)
        first = band.first - band.buffer.data_ptr()
        offsets = np.unique((at - first) // band.itemsize)
        self.record(kernel, "store", band, offsets)


def _guardable(value: Any) -> bool:
    if not (hasattr(value, "untyped_storage") and hasattr(value, "shape")):
        return False
    if value.device.type not in ("cpu", "cuda"):
        return False
    if any(stride < 0 for stride in value.stride()):
        return False
    return value.untyped_storage().nbytes() > 0


def _argument_names(kernel: Any) -> Sequence[str]:
    for owner in (kernel, getattr(kernel, "fn", None)):
        names = getattr(owner, "arg_names", None)
        if names:
            return list(names)
    return []


def _kernel_name(kernel: Any) -> str:
    for owner in (kernel, getattr(kernel, "fn", None)):
        name = getattr(owner, "__name__", None)
        if isinstance(name, str):
            return name
    return type(kernel).__name__


_ACTIVE: list[Launches] = []


@contextmanager
def guarded(
    bounds: Bounds | None = None,
) -> Iterator[Launches]:
    """While inside, every Triton launch runs on guarded copies of its
    tensors; the :class:`Launches` yielded holds what went outside.

    Nested uses share the outer one's record.
    """
    if _ACTIVE:
        _ACTIVE[-1].bounds.update(bounds or {})
        yield _ACTIVE[-1]
        return
    launches = Launches(bounds)
    if "triton" not in sys.modules:  # no Triton kernel can run
        yield launches
        return
    from triton.runtime.jit import KernelInterface

    original = KernelInterface.__getitem__

    def getitem(kernel: Any, grid: Any) -> Callable:
        run = original(kernel, grid)

        def launch(*args: Any, **kwargs: Any) -> Any:
            return launches.launch(kernel, run, args, kwargs)

        return launch

    KernelInterface.__getitem__ = getitem  # type: ignore[method-assign]
    _ACTIVE.append(launches)
    try:
        yield launches
    finally:
        _ACTIVE.pop()
        KernelInterface.__getitem__ = original  # type: ignore[method-assign]


# ---------------------------------------------------------------------------
# Triton's interpreter: every load and store checked before it happens


#: The interpreter's memory operations that :func:`_watch` wraps.
_WRAPPED = ("create_masked_load", "create_masked_store", "create_atomic_rmw")


def _builder() -> Any:
    """The interpreter's builder, if its memory operations can be wrapped."""
    if not WATCH:
        return None
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is None or not all(hasattr(builder, n) for n in _WRAPPED):
        return None
    if not hasattr(interpreter, "TensorHandle"):
        return None
    return builder


@contextmanager
def _watch(launches: Launches, kernel: str, bands: list[Band]) -> Iterator:
    """Check the interpreter's loads and stores against ``bands``."""
    builder = _builder() if bands else None
    if builder is None or all(b.buffer.device.type != "cpu" for b in bands):
        yield
        return
    from triton import language as tl
    from triton.runtime.interpreter import TensorHandle

    bands = sorted(bands, key=lambda band: band.start)
    starts = np.array([band.start for band in bands], dtype=np.int64)
    ends = starts + np.array([band.nbytes for band in bands], dtype=np.int64)
    outer = [
        (band.buffer.data_ptr(), band.buffer.data_ptr() + band.buffer.numel())
        for band in bands
    ]

    def check(action: str, ptrs: Any, mask: Any) -> np.ndarray | None:
        """Record the accesses outside every tensor; True where far."""
        addresses = np.asarray(ptrs.data).astype(np.int64)
        active = np.ones(addresses.shape, bool)
        if mask is not None:
            active = np.broadcast_to(np.asarray(mask.data, bool), active.shape)
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        at = np.searchsorted(starts, addresses, side="right") - 1
        inside = (at >= 0) & (addresses + size <= ends[np.maximum(at, 0)])
        outside = active & ~inside
        if not outside.any():
            return None
        stray = addresses[outside]
        near = np.zeros(stray.shape, bool)
        for band, (low, high) in zip(bands, outer):
            here = (stray >= low) & (stray + size <= high)
            if here.any():
                near |= here
                offsets = (stray[here] - band.first) // band.itemsize
                launches.record(kernel, action, band, offsets)
        if near.all():
            return None
        far_addresses = stray[~near]
        distance = min(
            min(
                abs(far_addresses - low).min(), abs(far_addresses - high).min()
            )
            for low, high in outer
        )
        count = int(far_addresses.size)
        launches.record(
            kernel, action, None, far=count, distance=int(distance)
        )
        far = np.zeros(addresses.shape, bool)
        far[outside] = ~near
        return far

    def refused(mask: Any, far: np.ndarray, shape: tuple) -> Any:
        keep = np.ones(shape, bool) if mask is None else mask.data
        keep = np.broadcast_to(np.asarray(keep, bool), shape) & ~far
        return TensorHandle(keep, tl.int1 if mask is None else mask.dtype)

    original = {name: builder.__dict__.get(name) for name in _WRAPPED}
    load = builder.create_masked_load
    store = builder.create_masked_store
    atomic = builder.create_atomic_rmw

    # the cache and eviction settings that follow (their number differs
    # between Triton's versions: 3.9 has one, 3.6 to 3.8 two) pass through
    def masked_load(ptrs, mask, other, *settings):
        far = check("load", ptrs, mask)
        if far is not None:
            mask = refused(mask, far, ptrs.data.shape)
        return load(ptrs, mask, other, *settings)

    def masked_store(ptrs, value, mask, *settings):
        far = check("store", ptrs, mask)
        if far is not None:
            mask = refused(mask, far, ptrs.data.shape)
        return store(ptrs, value, mask, *settings)

    def atomic_rmw(op, ptrs, value, mask, *settings):
        far = check("store", ptrs, mask)
        if far is not None:
            mask = refused(mask, far, ptrs.data.shape)
        return atomic(op, ptrs, value, mask, *settings)

    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    try:
        yield
    finally:
        for name, method in original.items():
            if method is None:
                builder.__dict__.pop(name, None)
            else:
                setattr(builder, name, method)


# ---------------------------------------------------------------------------
# The messages


def _known(bounds: Bounds, tensor: Any, axis: int) -> tuple[str, str] | None:
    """What axis ``axis`` of ``tensor`` is, and its mask, if ``bounds``
    knows."""
    ndim = tensor.dim()
    return bounds.get((ndim, axis - ndim, int(tensor.shape[axis])))


def _dimension(bounds: Bounds, tensor: Any, axis: int) -> str:
    size = int(tensor.shape[axis])
    known = _known(bounds, tensor, axis)
    return f"of size {size}, {known[0]}" if known else f"of size {size}"


def _bound(bounds: Bounds, tensor: Any, axis: int) -> str:
    known = _known(bounds, tensor, axis)
    if known:
        return known[1]
    return (
        f"a bound on that dimension (an index below {int(tensor.shape[axis])})"
    )


def describe(access: Access, bounds: Bounds) -> str:
    """One sentence: which kernel, what it did, to which tensor, where, and
    the mask that is missing."""
    band, kernel = access.band, f"`{access.kernel}`"
    verb = "wrote" if access.action == "store" else "read"
    masked = "the store" if access.action == "store" else "the load"
    if band is None:
        return (
            f"your kernel {kernel} {'wrote to' if verb == 'wrote' else verb} "
            f"{access.far} address{'es' * (access.far > 1)} far outside "
            f"every tensor it was given ({access.distance:.2g} bytes or more "
            "from each): an offset computed with a wrong stride, size or "
            f"program id, or an unmasked {access.action}. In Triton's "
            "interpreter such an access ends the Python process (a "
            "segmentation fault), on a GPU it is an illegal memory access; "
            "the checker refused it"
        )
    tensor = band.tensor
    shape = "(" + ", ".join(str(n) for n in tensor.shape) + ")"
    offsets = access.positions()
    before = offsets[offsets < 0]
    if before.size:
        return (
            f"your kernel {kernel} {verb} {before.size} "
            f"value{'s' * (before.size > 1)} before the start of "
            f"{band.name}, a {shape} tensor (up to {-int(before.min())} "
            "elements before its first): an index below 0 (a row, head or "
            "batch offset that went negative; causal's offset T_k - T_q is "
            f"negative when T_q > T_k). Mask {masked} with index >= 0, or "
            "start the loop at 0"
        )
    past = offsets - band.extent
    count = int(past.size)
    where, bound = _where(tensor, int(past.max()) + 1, bounds)
    return (
        f"your kernel {kernel} {verb} {count} value{'s' * (count > 1)} past "
        f"the end of {band.name}, a {shape} tensor: {where}. Mask {masked} "
        f"with {bound}"
    )


def _where(tensor: Any, reach: int, bounds: Bounds) -> tuple[str, str]:
    """Where values up to ``reach`` elements past the end of ``tensor``
    lie, and the bound that keeps them out.

    They continue its innermost dimension when they are fewer than its
    size, or when the next dimension is not one a kernel masks (the heads
    of a (B, H, T) logsumexp); otherwise they are rows past its last row.
    """
    axes = sorted(
        (a for a in range(tensor.dim()) if tensor.shape[a] > 1),
        key=lambda a: tensor.stride(a),
    )
    if not axes:
        return f"up to {reach} elements after it", "a bound on its size"
    inner = axes[0]
    size = int(tensor.shape[inner])
    along_inner = (
        len(axes) == 1
        or reach < size
        or (
            _known(bounds, tensor, inner) is not None
            and _known(bounds, tensor, axes[1]) is None
        )
    )
    if along_inner:
        place = "of its last row" if len(axes) > 1 else "along it"
        return (
            f"indices {size} to {size + reach - 1} {place} (a dimension "
            f"{_dimension(bounds, tensor, inner)})",
            _bound(bounds, tensor, inner),
        )
    outer = axes[1]
    rows = int(tensor.shape[outer])
    extra = reach // size  # rows of size, or of a padded width below 2 size
    last = "its last (batch, head)" if len(axes) > 2 else "it"
    where = (
        f"rows {rows} to {rows + extra - 1} of {last} (a dimension "
        f"{_dimension(bounds, tensor, outer)})"
    )
    if reach % size == 0:
        return where, _bound(bounds, tensor, outer)
    return (
        where + f", each wider than its {size} values",
        _bound(bounds, tensor, outer)
        + " and "
        + _bound(bounds, tensor, inner),
    )


# ---------------------------------------------------------------------------
# A forked child, where the interpreter cannot be watched


def needs_child(device: str) -> bool:
    """Whether a checklist on ``device`` should run in a child first: in
    Triton's interpreter when its loads and stores cannot be checked, where
    ``fork`` exists and CUDA is not initialised (a forked child cannot use
    it)."""
    if "triton" not in sys.modules or str(device) != "cpu":
        return False
    if not hasattr(os, "fork") or _builder() is not None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and torch.cuda.is_initialized())


@dataclass
class Outcome:
    """How a checklist run in a child ended: ``item`` is the number of the
    last item started; ``signal`` the signal's name if the child died of
    one."""

    item: int
    signal: str | None


def in_child(
    items: Sequence[Callable[[], None]], timeout: float = 600.0
) -> Outcome:
    """Run ``items`` in order in a forked child, its output discarded, until
    one raises; say how it ended. A child still running after ``timeout``
    seconds is killed, with no verdict (``signal`` None)."""
    read, write = os.pipe()
    with warnings.catch_warnings():  # fork in a process with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            faulthandler.disable()  # its report of the crash: the parent's
            torch = sys.modules.get("torch")
            if torch is not None:  # the parent's OpenMP threads are gone:
                torch.set_num_threads(1)  # a parallel region would hang
            for number, item in enumerate(items, 1):
                os.write(write, f"{number}\n".encode())
                item()
        finally:
            os._exit(0)
    os.close(write)
    chunks, deadline = [], time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([read], [], [], left)[0]:
            continue
        chunk = os.read(read, 4096)
        if not chunk:  # the child is done, or dead
            break
        chunks.append(chunk)
    else:  # it hangs: no verdict from it, the caller runs the items itself
        os.kill(pid, signal.SIGKILL)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    numbers = [int(line) for line in b"".join(chunks).split()]
    died = os.WIFSIGNALED(status) and left > 0
    return Outcome(
        numbers[-1] if numbers else 0,
        signal.Signals(os.WTERMSIG(status)).name if died else None,
    )


def crash_message(name: str) -> str:
    """The verdict on a kernel that ended its process with signal ``name``."""
    return (
        f"your kernel crashed the process ({name}): the checker ran the "
        "checklist in a separate process first, so nothing of yours is "
        "lost. A crash in Triton's interpreter is a load or store far "
        "outside a tensor: an unmasked tl.store or tl.load, or an offset "
        "computed with a wrong stride, size or program id"
    )
