"""Attention kernels in Triton, for NVIDIA GPUs and Triton's CPU interpreter.

:func:`triton_attention` is the tiled attention of :mod:`mha.flash` as one
Triton kernel (and two more for its backward pass);
:func:`triton_split_kv_attention` splits the keys of a decoding step across
programs; :func:`triton_paged_attention` reads keys and values through a
serving engine's block table, where they are. Causal attention is aligned
bottom-right; keys and values may have fewer heads than the queries (GQA,
MQA); any head size up to 256. The kernels
are compiled ahead of time for sm_80 (A100) and sm_90 (H100) and inspected by
``python -m mha.kernels --inspect`` (:mod:`mha.kernels.aot`), and your own
kernels by :func:`compile_report` (:mod:`mha.kernels.report`); the project's
own checks run them in the interpreter, never on a GPU. Importing this
package never fails: not where Triton is missing, not where there is no GPU.

:class:`Techniques` switches the kernels' techniques (exp2 with the scale
folded, masks on the edge tiles only, TMA loads, Triton's warp
specialisation, a persistent and causally balanced schedule; a GQA group
packed in the split-KV kernel's tile; a GQA group's dk and dv split over
programs in the backward), each off until a GPU measurement shows it pays;
:data:`LADDER` climbs from the first kernel one technique per rung, and
``python -m mha.kernels --inspect --ladder`` compiles every rung.

Compiled or interpreted? Triton decides when ``@triton.jit`` decorates a
kernel, which happens when :mod:`mha.kernels.attention` is first imported:
with the environment variable ``TRITON_INTERPRET=1`` the kernels run in
Triton's interpreter, a NumPy emulation that takes CPU tensors; otherwise they
are compiled for the GPU. This package makes that choice before it imports the
kernels: if ``TRITON_INTERPRET`` is not set and ``torch.cuda.is_available()``
is False, it sets ``TRITON_INTERPRET=1`` (for this process and its children).
To run the interpreter on a machine with a GPU, set ``TRITON_INTERPRET=1``
before the first import of ``mha.kernels``; :data:`INTERPRETED` says which
mode was chosen.

Import ``mha.kernels`` before ``triton`` (and before anything that imports
it, such as torch's compiler). Triton decorates the helpers of its own
``triton.language`` (``tl.max``, ``tl.sum``, ``tl.zeros_like``, ...) when it
is first imported: imported before the interpreter was chosen, they are
compiled, and an interpreted kernel that calls one fails.
:data:`TRITON_IMPORTED_FIRST` says so, and such a kernel's launch raises
:class:`TritonImportOrderError`, which says what to do.

The interpreter runs the kernel's exact code, one program after the other,
so it checks what each program computes (its indices, masks and online
softmax), never speed, and not the code compiled for a GPU: TF32 products,
races between programs and the compiler's own bugs show only on a GPU.
Its bfloat16 ``tl.dot`` multiplies the raw bit patterns (Triton issue
#11584; an earlier one, #4972, is about bfloat16 ``tl.load`` there), so
bfloat16 is refused there and tested on a GPU only. The interpreters of
Triton 3.4 to 3.6 cannot run the kernels with NumPy 2.4 or later
(:func:`interpreter_problem` says why); the kernels refuse to start there,
by name, and the exercise checkers name it beside a learner's error.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "MAX_HEAD_DIM",
    "HEAD_DIMS",
    "TRITON_AVAILABLE",
    "INTERPRETED",
    "TRITON_IMPORTED_FIRST",
    "TritonImportOrderError",
    "interpreter_problem",
    "triton_attention",
    "triton_split_kv_attention",
    "triton_paged_attention",
    "paged_attention_torch",
    "compile_report",
    "format_report",
    "Techniques",
    "LADDER",
]

from ..environment import interpreter_problem  # noqa: E402 (no Triton)
from .tiles import LADDER, Techniques  # noqa: E402 (no Triton needed)

#: The largest head size d_k the kernels take.
MAX_HEAD_DIM = 256

#: The head sizes d_k the kernels take: any from 1 to 256.
HEAD_DIMS = range(1, MAX_HEAD_DIM + 1)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _triton_importable() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] is None
        return False


# Decided before mha.kernels.attention decorates its kernels. Were triton
# imported already (by torch's compiler, say), its own jitted helpers
# (tl.max, tl.sum, ...) stay compiled, and a kernel that calls one fails in
# the interpreter ("Cannot call @triton.jit'd outside of the scope of a
# kernel"): import mha.kernels before anything that imports triton. The
# kernels of this package call none of them; a learner's kernel may.
_IMPORTED_BEFORE = "triton" in sys.modules
_CHOSEN_HERE = (
    "TRITON_INTERPRET" not in os.environ
    and _triton_importable()
    and not _cuda_available()
)
if _CHOSEN_HERE:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
except ImportError as error:  # not installed, or not for this platform
    triton = None
    _MISSING = f"{type(error).__name__}: {error}"

#: Whether the ``triton`` package could be imported here.
TRITON_AVAILABLE = triton is not None

#: True when the kernels run in Triton's CPU interpreter, False when they
#: are compiled for the GPU, None without Triton.
INTERPRETED: bool | None = (
    bool(triton.knobs.runtime.interpret) if TRITON_AVAILABLE else None
)


class TritonImportOrderError(RuntimeError):
    """An interpreted kernel called a helper of ``triton.language`` that
    Triton had compiled: triton was imported before the interpreter was
    chosen. The message says how to start again in the right order."""


def _helpers_compiled() -> bool:
    """Whether triton.language's jitted helpers were decorated for the
    compiler while kernels decorated now are interpreted."""
    from triton.runtime.jit import JITFunction

    return bool(INTERPRETED) and isinstance(triton.language.max, JITFunction)


#: True when the kernels run in the interpreter but ``triton`` was imported
#: before it was chosen, so that the helpers of ``triton.language``
#: (``tl.max``, ``tl.sum``, ...) are compiled and an interpreted kernel
#: cannot call them (:class:`TritonImportOrderError`); False otherwise.
TRITON_IMPORTED_FIRST: bool = TRITON_AVAILABLE and _helpers_compiled()

# Triton's own words for a compiled helper called from the interpreter.
_TRITONS_ERROR = "Cannot call @triton.jit'd outside of the scope of a kernel"


def _import_order_message(kernel: str) -> str:
    who = (
        "before mha.kernels chose Triton's interpreter (it sets "
        "TRITON_INTERPRET=1 where there is no GPU)"
        if _CHOSEN_HERE and _IMPORTED_BEFORE
        else "before TRITON_INTERPRET=1 was set"
    )
    return (
        f"the kernel {kernel} runs in Triton's CPU interpreter, but triton "
        f"was imported {who}, by `import triton` or by a library that "
        "imports it (torch's compiler, for one). Triton then decorated the "
        "helpers of triton.language (tl.max, tl.sum, tl.zeros_like, "
        "tl.cdiv, ...) for its GPU compiler, and an interpreted kernel "
        "cannot call a compiled helper. To fix it, restart the kernel "
        "(Jupyter: Kernel > Restart) or the process, then import "
        "mha.kernels first, before triton and anything that imports it; "
        "or set TRITON_INTERPRET=1 before anything imports triton "
        "(TRITON_INTERPRET=1 python ...; in a notebook, os.environ["
        '"TRITON_INTERPRET"] = "1" in the first cell).'
    )


def _explain_import_order() -> None:
    """Make an interpreted launch that fails on a compiled helper raise
    :class:`TritonImportOrderError` instead of Triton's own error."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def run_or_explain(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        except Exception as error:
            if _TRITONS_ERROR not in str(error):
                raise
            name = getattr(self, "__name__", "?")
            raise TritonImportOrderError(
                _import_order_message(name)
            ) from error

    InterpretedFunction.run = run_or_explain


if TRITON_IMPORTED_FIRST:
    _explain_import_order()


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    key_start: Tensor | None = None,
    sinks: Tensor | None = None,
    window: int | None = None,
    techniques: Techniques | None = None,
) -> Tensor:
    """softmax(q k^T * scale) v for (B, H, T, d_k) tensors, by a Triton kernel.

    Differentiable (the backward pass is two more kernels). ``key_start``
    (B,) integers, or None: row b's keys before ``key_start[b]`` are
    padding (a left-padded batch), hidden and never read. See
    :func:`mha.kernels.attention.triton_attention` for the arguments.

    Raises:
        ModuleNotFoundError: Triton cannot be imported here.
    """
    _require_triton("triton_attention")
    from .attention import triton_attention as run

    return run(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        key_start=key_start,
        sinks=sinks,
        window=window,
        techniques=techniques,
    )


def triton_split_kv_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    num_splits: int | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
    techniques: Techniques | None = None,
) -> Tensor:
    """Attention for few queries and many keys, the keys split across programs.

    The split-KV ("Flash-Decoding") kernel: each program attends one query
    tile to one range of keys and writes that range's output and
    logsumexp; the ranges are merged by a logsumexp-weighted sum. Same
    arguments and result as :func:`triton_attention` (``key_start``
    included), forward only (no gradient). ``num_splits``: default, enough
    programs for every multiprocessor of the GPU (132, an H100 SXM's, in the
    interpreter). See
    :func:`mha.kernels.attention.split_kv_forward`.

    Raises:
        ModuleNotFoundError: Triton cannot be imported here.
    """
    _require_triton("triton_split_kv_attention")
    _refuse_gradients("triton_split_kv_attention", q, k, v)
    from .attention import split_kv_forward

    out, _ = split_kv_forward(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        num_splits=num_splits,
        key_start=key_start,
        window=window,
        techniques=techniques,
    )
    return out


def triton_paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """Attention over keys and values held in the blocks of a pool.

    q (B, H, T_q, d): the last T_q positions of each sequence; k_pool,
    v_pool (num_blocks, block_size, H_kv, d); block_table (B, max_blocks)
    int32; seq_lens (B,) int32, counting the T_q queries (causal, aligned
    bottom-right to each sequence's length). ``key_start`` (B,) integers,
    or None: sequence b's first key_start[b] positions are pads (a
    left-padded batch), hidden and never read. ``window``, a positive int
    or None: a query sees only its ``window`` newest keys, itself included
    (a sliding window). A query that sees no key gets zeros. The blocks
    are read where they are (no gather), GQA by packing a group's query
    heads into one tile, a decoding step split over the blocks. Forward
    only. See :mod:`mha.kernels.paged`; :func:`paged_attention_torch` is
    its twin. ``max_seq_len``: the longest of ``seq_lens`` where the caller
    knows it (flash-attention's ``max_seqlen_k``): nothing is then read
    from the device, and the table, lengths and key starts are trusted
    (the caller built them: :class:`mha.PagedKVCache`), not checked.

    Raises:
        ModuleNotFoundError: Triton cannot be imported here.
    """
    _require_triton("triton_paged_attention")
    _refuse_gradients("triton_paged_attention", q, k_pool, v_pool)
    from .paged import triton_paged_attention as run

    return run(
        q,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        scale=scale,
        key_start=key_start,
        window=window,
        max_seq_len=max_seq_len,
    )


def paged_attention_torch(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """:func:`triton_paged_attention` in plain torch (it gathers the
    blocks), the same masks included: no Triton needed. See
    :mod:`mha.kernels.paged_torch`."""
    from .paged_torch import paged_attention_torch as run

    return run(
        q,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        scale=scale,
        key_start=key_start,
        window=window,
    )


def compile_report(fn, *example_args, archs=("sm_80", "sm_90")) -> list:
    """How the Triton kernels that ``fn(*example_args)`` launches compile
    for the A100 (sm_80) and the H100 (sm_90), beside the book's kernel.

    One row per kernel and arch, as ``python -m mha.kernels --inspect``
    prints them (warps, stages, registers, spills, shared memory, HMMA and
    HGMMA), with ``warnings`` in words: a spill, what the registers figure
    of a spilling build means, shared memory beyond what one program may
    use. :func:`format_report` prints them. See
    :func:`mha.kernels.report.compile_report`.

    Raises:
        ModuleNotFoundError: Triton cannot be imported here.
    """
    _require_triton("compile_report")
    from .report import compile_report as report

    return report(fn, *example_args, archs=archs)


def format_report(rows: list) -> str:
    """The rows of :func:`compile_report` as a table, each build's
    warnings under it. See :func:`mha.kernels.report.format_report`."""
    from .report import format_report as table

    return table(rows)


def _refuse_gradients(name: str, *tensors) -> None:
    """A forward-only kernel under autograd: a ValueError, never a result
    whose gradient would silently be missing."""
    import torch

    if torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in tensors
    ):
        raise ValueError(
            f"{name} is forward only (no gradient), and an input requires "
            "grad: call it under torch.no_grad(), or use triton_attention, "
            "which has a backward pass"
        )


def _require_triton(name: str) -> None:
    if not TRITON_AVAILABLE:
        raise ModuleNotFoundError(
            f"{name} needs the triton package, which could not "
            f"be imported ({_MISSING}): pip install triton==3.9.0 (Linux)"
        )
