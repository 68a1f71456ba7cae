"""Launch settings of the attention kernels, importable without Triton.

Which tiles, warps and pipeline stages each kernel of
:mod:`mha.kernels.attention` is launched with, per GPU, dtype and head size
(:func:`default_tiles`); how many key splits a decoding pass makes
(:func:`default_num_splits`); and the GPUs' published limits that the
choices respect (:data:`SHARED_LIMIT`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validate import check_int

__all__ = [
    "Tiles",
    "Techniques",
    "LADDER",
    "default_techniques",
    "persistent_programs",
    "persistent_items",
    "capability_of",
    "check_techniques",
    "KERNELS",
    "default_tiles",
    "padded_head_dim",
    "default_num_splits",
    "split_sizes",
    "H100_MULTIPROCESSORS",
    "SHARED_LIMIT",
    "INSPECTED_HEAD_DIMS",
]

#: The most shared memory one program may use (bytes): 163 KB on compute
#: capability 8.0 and 227 KB on 9.0 (CUDA C++ Programming Guide, technical
#: specifications per compute capability).
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}

#: The head sizes ``python -m mha.kernels --inspect`` compiles by default:
#: 64, 128 and 256, and 80, 96 and 192, which the kernels pad to 128 and 256
#: (``PADDED_DIM``) and so launch with those sizes' tiles.
INSPECTED_HEAD_DIMS = (64, 80, 96, 128, 192, 256)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Tiles:
    """How a kernel is launched: tile sizes, warps and pipeline stages."""

    block_q: int  # queries per tile
    block_k: int  # keys per tile
    num_warps: int  # warps of 32 threads per program
    num_stages: int  # loads kept in flight by Triton's software pipelining


@dataclass(frozen=True)
class Techniques:
    """Switches of the kernels (``forward``, its backward, ``split_kv``),
    each a change of the same algorithm that is kept only where it is
    measured to pay; every one off is the book's first kernel.

    * ``exp2``: the scores in base 2, ``exp2(s * scale * log2 e - m)``: the
      scale folded into one multiply-add before the exponential (the GPU's
      ``exp`` is ``exp2`` after a multiply anyway), the running maximum in
      base 2, the logsumexp turned back to base e once at the end.
    * ``edge_masks``: the loop over key tiles cut in three, so that only
      the tiles at the edges are masked (padding, the start of a window,
      the causal diagonal, the ragged tail) and every tile that all the
      query tile's rows see whole runs with no mask and unmasked loads.
    * ``tma`` (with ``edge_masks``): the unmasked tiles loaded through
      tensor descriptors, by the Tensor Memory Accelerator (TMA) of Hopper
      and later GPUs, not by the threads' address arithmetic; the last
      stride of k and v must be 1, the others and the base address
      multiples of 16 bytes.
    * ``pack_group`` (``split_kv`` only): a tile's rows are the query heads
      of one GQA group times the queries, as the paged kernel's always are,
      so that each key tile is read once per group, not once per head.
    * ``costliest_first`` (``forward`` only): the grid's programs in order
      of cost, the last query tiles (a causal pass's longest) first, so
      that the GPU, which is commonly observed to start programs in about
      the grid's order (CUDA does not promise it), has only short ones
      left to fit in at the end.
    * ``persistent`` (``forward``, with ``costliest_first``):
      :func:`persistent_programs` programs, not one per query tile, each
      looping over its share of the (query tile, batch, head) items, dealt
      costliest first in snake order (:func:`persistent_items`): a causal
      pass's work spread evenly without a launch per tile.
    * ``warp_specialize`` (``forward``, with ``tma``, not with
      ``persistent``): the loop over key tiles handed to Triton's warp
      specialisation, which gives the TMA's loads to a producer warpgroup
      (the 4 warps launched) and the products and the softmax to two
      consumer warpgroups that Triton adds, half the query rows each, with
      the producer's registers (Hopper's ``setmaxnreg``). Triton specialises a
      loop whose loads are all tensor descriptors and that no other loop
      of the kernel feeds, so the edges' loops are folded back into one:
      every key tile through the TMA, every tile masked.
    * ``split_group`` (the backward of ``forward``): dk and dv computed by
      one program per key tile of each *query* head, not of each key/value
      head, into float32 shares summed over each GQA group afterwards: G
      times the programs for groups of G (a short sequence with few
      key/value heads fills the GPU), G times the memory for dk and dv.
    """

    exp2: bool = False
    edge_masks: bool = False
    tma: bool = False
    pack_group: bool = False
    costliest_first: bool = False
    persistent: bool = False
    warp_specialize: bool = False
    split_group: bool = False

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, bool):
                raise TypeError(
                    f"Techniques.{name} must be a bool, got "
                    f"{type(value).__name__} {value!r}"
                )
        if self.tma and not self.edge_masks:
            raise ValueError(
                "Techniques(tma=True) loads the tiles that edge masks leave "
                "unmasked: it needs edge_masks=True"
            )
        if self.persistent and not self.costliest_first:
            raise ValueError(
                "Techniques(persistent=True) deals the items costliest "
                "first: it needs costliest_first=True"
            )
        if self.warp_specialize and not self.tma:
            raise ValueError(
                "Techniques(warp_specialize=True) specialises a loop whose "
                "loads are tensor descriptors: it needs tma=True"
            )
        if self.warp_specialize and self.persistent:
            raise ValueError(
                "Techniques(warp_specialize=True) specialises the only loop "
                "of the kernel: it cannot be inside persistent=True's loop"
            )

    def not_in(self, kernel: str) -> list[str]:
        """The switches that are on and that ``kernel`` (``"forward"``,
        whose call runs the backward too, or ``"split_kv"``) lacks."""
        return [
            name
            for name, on in vars(self).items()
            if on and kernel not in _SWITCHES_OF[name]
        ]

    def runs_in(self, kernel: str) -> bool:
        """Whether ``kernel`` has every switch that is on."""
        return not self.not_in(kernel)

    def constants(self) -> dict:
        """The kernels' constexprs: only those switched on, so that a
        launch with every switch off compiles to the first kernel."""
        return {
            name: True
            for name, on in (
                ("PACK_GROUP", self.pack_group),
                ("EXP2", self.exp2),
                ("EDGE_MASKS", self.edge_masks),
                ("TMA", self.tma),
                ("COSTLIEST_FIRST", self.costliest_first),
                ("PERSISTENT", self.persistent),
                ("WARP_SPECIALIZE", self.warp_specialize),
            )
            if on
        }


#: The kernels each switch belongs to ("forward": its call, backward too).
_SWITCHES_OF = {
    "exp2": ("forward", "split_kv"),
    "edge_masks": ("forward", "split_kv"),
    "tma": ("forward", "split_kv"),
    "pack_group": ("split_kv",),
    "costliest_first": ("forward",),
    "persistent": ("forward",),
    "warp_specialize": ("forward",),
    "split_group": ("forward",),
}

#: The ladder: from the book's first kernel, one technique more per rung
#: (``python -m mha.bench.gpu`` times each rung; the compiler report shows
#: what each changes). The last rung trades warp specialisation for the
#: persistent loop: Triton leaves a loop inside another unspecialised.
LADDER = (
    ("first kernel", Techniques()),
    ("exp2, scale folded", Techniques(exp2=True)),
    ("masks at the edges only", Techniques(exp2=True, edge_masks=True)),
    ("TMA loads", Techniques(exp2=True, edge_masks=True, tma=True)),
    (
        "warp-specialised",
        Techniques(exp2=True, edge_masks=True, tma=True, warp_specialize=True),
    ),
    (
        "costliest tiles first",
        Techniques(
            exp2=True,
            edge_masks=True,
            tma=True,
            warp_specialize=True,
            costliest_first=True,
        ),
    ),
    (
        "persistent, balanced",
        Techniques(
            exp2=True,
            edge_masks=True,
            tma=True,
            costliest_first=True,
            persistent=True,
        ),
    ),
)

#: 32-bit registers in one multiprocessor (compute capability 8.0 to 9.0),
#: and the most one thread may use, 255, rounded up to the unit registers
#: are allocated in, 8:
#: CUDA C++ Programming Guide, technical specifications.
REGISTERS_PER_MULTIPROCESSOR = 64 * 1024
MAX_REGISTERS_PER_THREAD = 256


def persistent_programs(multiprocessors: int, num_warps: int) -> int:
    """How many programs a persistent launch makes: as many as surely fit
    the GPU at once, each thread with the most registers it may have (2
    programs of 4 warps, or 1 of 8, per multiprocessor)."""
    per_thread = MAX_REGISTERS_PER_THREAD * 32 * num_warps
    return multiprocessors * max(1, REGISTERS_PER_MULTIPROCESSOR // per_thread)


def persistent_items(
    program: int, programs: int, q_blocks: int, batch_heads: int
) -> list[tuple[int, int]]:
    """The (query tile, b * H + h) items that ``program`` of ``programs``
    computes, in order, in a persistent forward pass: the items sorted by
    query tile, last first (a causal pass's costliest), and dealt in rounds
    of ``programs``, forwards in even rounds and backwards in odd ones."""
    items = q_blocks * batch_heads
    taken = []
    for deal in range(_cdiv(items, programs)):
        seat = program if deal % 2 == 0 else programs - 1 - program
        item = deal * programs + seat
        if item < items:
            taken.append((q_blocks - 1 - item // batch_heads,
                          item % batch_heads))  # fmt: skip
    return taken


def default_techniques(capability: tuple[int, int] = (9, 0)) -> Techniques:
    """The switches the kernels run with on a GPU of ``capability``: every
    one off until a GPU measurement (``make gpu-check``) shows it pays
    there."""
    del capability  # no switch measured yet on any GPU
    return Techniques()


def check_techniques(techniques: object) -> Techniques | None:
    """``techniques``: a :class:`Techniques` or None (the defaults)."""
    if techniques is not None and not isinstance(techniques, Techniques):
        raise TypeError(
            "techniques must be a mha.kernels.Techniques or None, got "
            f"{type(techniques).__name__} {techniques!r}"
        )
    return techniques


#: The kernels, by the names the inspection reports (``paged``:
#: :mod:`mha.kernels.paged`, whose rows are a group's query heads).
KERNELS = ("forward", "backward_dk_dv", "backward_dq", "split_kv", "paged")

# Default tiles, chosen by compiling every kernel ahead of time (python -m
# mha.kernels --inspect) so that no build spills registers to local memory
# (at d_k 64, 80, 96, 128, 192 and 256, causal or not, with per-row key
# starts or not) and every program's shared memory fits the GPU:
# (kernel, arch, bytes per element, padded head size) -> Tiles. Float32
# products are computed in full float32 by the CUDA cores (no tensor cores),
# which needs far more registers: smaller tiles, more warps. "sm_80" also
# serves the GPUs other than sm_90; every sm_80 build fits the 99 KB of
# shared memory that sm_86 and sm_89 allow a program. The paged kernel, a
# split-KV kernel that gathers its keys through a block table, takes the
# split-KV kernel's tiles.
_TILES = {
    # 16-bit inputs (float16, bfloat16)
    ("forward", "sm_80", 2, 64): Tiles(128, 64, 4, 3),
    ("forward", "sm_80", 2, 128): Tiles(128, 64, 8, 3),
    ("forward", "sm_80", 2, 256): Tiles(64, 32, 4, 2),
    ("forward", "sm_90", 2, 64): Tiles(128, 64, 4, 3),
    ("forward", "sm_90", 2, 128): Tiles(128, 64, 8, 3),
    ("forward", "sm_90", 2, 256): Tiles(64, 64, 8, 2),
    ("split_kv", "sm_80", 2, 64): Tiles(16, 64, 4, 3),
    ("paged", "sm_80", 2, 64): Tiles(16, 64, 4, 3),
    ("split_kv", "sm_80", 2, 128): Tiles(16, 64, 4, 3),
    ("paged", "sm_80", 2, 128): Tiles(16, 64, 4, 3),
    ("split_kv", "sm_80", 2, 256): Tiles(16, 32, 4, 2),
    ("paged", "sm_80", 2, 256): Tiles(16, 32, 4, 2),
    ("split_kv", "sm_90", 2, 64): Tiles(16, 64, 4, 3),
    ("paged", "sm_90", 2, 64): Tiles(16, 64, 4, 3),
    ("split_kv", "sm_90", 2, 128): Tiles(16, 64, 4, 3),
    ("paged", "sm_90", 2, 128): Tiles(16, 64, 4, 3),
    ("split_kv", "sm_90", 2, 256): Tiles(16, 32, 4, 2),
    ("paged", "sm_90", 2, 256): Tiles(16, 32, 4, 2),
    ("backward_dk_dv", "sm_80", 2, 64): Tiles(32, 64, 8, 1),
    ("backward_dk_dv", "sm_80", 2, 128): Tiles(32, 64, 8, 2),
    ("backward_dk_dv", "sm_80", 2, 256): Tiles(16, 32, 8, 2),
    ("backward_dk_dv", "sm_90", 2, 64): Tiles(32, 64, 4, 2),
    ("backward_dk_dv", "sm_90", 2, 128): Tiles(32, 64, 8, 2),
    ("backward_dk_dv", "sm_90", 2, 256): Tiles(16, 32, 8, 2),
    ("backward_dq", "sm_80", 2, 64): Tiles(64, 32, 4, 2),
    ("backward_dq", "sm_80", 2, 128): Tiles(64, 32, 8, 2),
    ("backward_dq", "sm_80", 2, 256): Tiles(32, 16, 8, 2),
    ("backward_dq", "sm_90", 2, 64): Tiles(64, 32, 4, 2),
    ("backward_dq", "sm_90", 2, 128): Tiles(64, 32, 8, 2),
    ("backward_dq", "sm_90", 2, 256): Tiles(32, 16, 8, 2),
    # float32 inputs: twice the bytes per element, smaller tiles
    ("forward", "sm_80", 4, 64): Tiles(64, 32, 8, 2),
    ("forward", "sm_80", 4, 128): Tiles(32, 32, 8, 2),
    ("forward", "sm_80", 4, 256): Tiles(32, 16, 8, 2),
    ("forward", "sm_90", 4, 64): Tiles(64, 32, 8, 2),
    ("forward", "sm_90", 4, 128): Tiles(64, 16, 8, 2),
    ("forward", "sm_90", 4, 256): Tiles(32, 16, 8, 2),
    ("split_kv", "sm_80", 4, 64): Tiles(16, 32, 4, 2),
    ("paged", "sm_80", 4, 64): Tiles(16, 32, 4, 2),
    ("split_kv", "sm_80", 4, 128): Tiles(16, 16, 4, 2),
    ("paged", "sm_80", 4, 128): Tiles(16, 16, 4, 2),
    ("split_kv", "sm_80", 4, 256): Tiles(16, 16, 8, 2),
    ("paged", "sm_80", 4, 256): Tiles(16, 16, 8, 2),
    ("split_kv", "sm_90", 4, 64): Tiles(16, 32, 4, 2),
    ("paged", "sm_90", 4, 64): Tiles(16, 32, 4, 2),
    ("split_kv", "sm_90", 4, 128): Tiles(16, 16, 4, 2),
    ("paged", "sm_90", 4, 128): Tiles(16, 16, 4, 2),
    ("split_kv", "sm_90", 4, 256): Tiles(16, 16, 4, 2),
    ("paged", "sm_90", 4, 256): Tiles(16, 16, 4, 2),
    ("backward_dk_dv", "sm_80", 4, 64): Tiles(32, 16, 8, 1),
    ("backward_dk_dv", "sm_80", 4, 128): Tiles(16, 16, 8, 2),
    ("backward_dk_dv", "sm_80", 4, 256): Tiles(16, 16, 8, 1),
    ("backward_dk_dv", "sm_90", 4, 64): Tiles(32, 16, 8, 2),
    ("backward_dk_dv", "sm_90", 4, 128): Tiles(16, 16, 8, 2),
    ("backward_dk_dv", "sm_90", 4, 256): Tiles(16, 16, 8, 1),
    ("backward_dq", "sm_80", 4, 64): Tiles(32, 32, 8, 2),
    ("backward_dq", "sm_80", 4, 128): Tiles(32, 32, 8, 2),
    ("backward_dq", "sm_80", 4, 256): Tiles(16, 16, 8, 2),
    ("backward_dq", "sm_90", 4, 64): Tiles(32, 32, 8, 2),
    ("backward_dq", "sm_90", 4, 128): Tiles(32, 32, 8, 2),
    ("backward_dq", "sm_90", 4, 256): Tiles(16, 16, 8, 2),
}


def default_tiles(
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    capability: tuple[int, int] = (9, 0),
) -> Tiles:
    """The default :class:`Tiles` of ``kernel`` for a head size, a dtype and
    a GPU's compute capability ((8, 0) is the A100, (9, 0) the H100)."""
    arch = "sm_90" if capability[0] in (9, 10) else "sm_80"
    size = torch.empty((), dtype=dtype).element_size()
    dim = max(64, padded_head_dim(head_dim))  # d_k 16, 32: d_k 64's tiles
    return _TILES[kernel, arch, min(size, 4), dim]


def capability_of(device: torch.device) -> tuple[int, int]:
    """The compute capability the kernels are launched for on ``device``:
    a CUDA device's own, else (9, 0) (the interpreter: any tiles are
    right)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return (9, 0)


def padded_head_dim(head_dim: int) -> int:
    """d_k rounded up to a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def default_num_splits(
    programs: int, t_k: int, block_k: int, multiprocessors: int
) -> int:
    """Key splits for a decoding pass of ``programs`` (query tile, head)
    pairs: as many as keep every program of a split in one wave (one
    program per multiprocessor), each split at least one key tile long."""
    if programs == 0:  # an empty batch: one split of nothing
        return 1
    wanted = multiprocessors // programs
    return max(1, min(wanted, _cdiv(t_k, block_k)))


def split_sizes(t_k: int, num_splits: int, block_k: int) -> tuple[int, int]:
    """Keys per split, a whole number of key tiles, and the splits that
    makes (at most ``num_splits``)."""
    check_int("num_splits", num_splits)
    tiles = _cdiv(_cdiv(t_k, num_splits), block_k)
    return tiles * block_k, _cdiv(t_k, tiles * block_k)


#: Streaming multiprocessors assumed where no GPU says: the H100 SXM's 132.
H100_MULTIPROCESSORS = 132
