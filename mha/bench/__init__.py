"""The benchmark harness: ``python -m mha.bench``.

Times one multi-head self-attention layer (B sequences of T tokens, width D = H
* d_k) in
several implementations, on the CPU or a CUDA GPU, over a list of sequence
lengths T:

``python -m mha.bench --impl`` lists them; each is one entry in the registry
(:mod:`mha.bench.registry`), defined in :mod:`mha.bench.implementations`. The
package's rooms:

* :mod:`~mha.bench.registry` - the registry: one implementation = one decorated
  builder;
* :mod:`~mha.bench.implementations` - the entries;
* :mod:`~mha.bench.config` - a configuration, the shared weights and inputs;
* :mod:`~mha.bench.timing` - timing and peak memory of one runner;
* :mod:`~mha.bench.environment` - device, versions, threads, date and commit;
* :mod:`~mha.bench.run` - the benchmark loop;
* :mod:`~mha.bench.report` - reading reports, ratios, tables, JSON and CSV;
* :mod:`~mha.bench.decode` - ``--decode``: time per generated token;
* :mod:`~mha.bench.cli` - the command line.

FLOP counts come from :mod:`mha.counting`, the package's one home for counts.

Every layer implementation computes the same function with the same weights
(those of one ``torch.nn.MultiheadAttention``, seeded), in eval mode and
without autograd.

Timing: each implementation runs ``--warmup`` calls first (the first call also
tells whether it can run at all: a backend that does not exist for this device,
dtype or shape is reported as skipped, with the reason). Then the
implementations are timed in interleaved rounds (one call of each per round, in
a new random order each round), so that a change in the machine's load touches
all of them alike; the NumPy ones are timed in rounds of their own, apart from
the torch ones, so that neither library's idle worker threads slow the other's
calls. Each call is timed with ``time.perf_counter`` on the CPU and with CUDA
events on a GPU. The figure reported is the median over at least ``--repeats``
calls (more for fast calls, until the rounds of a sequence length have taken
``--min-time`` seconds). Ratios between implementations are medians of the
ratios within each round (see :func:`ratios`).

FLOPs count the matrix products only (one multiply-add = 2 FLOPs): the
attention core ``4 B H T^2 d_k`` (halved when causal) and the four projections
``8 B T D^2`` (:func:`mha.counting.attention_core_flops`,
:func:`mha.counting.projection_flops`). A row's ``flop_per_s`` divides the
FLOPs of what the row times (its *scope*) by its median time;
``layer_flop_per_s``, ``core_flop_per_s`` and ``projection_flop_per_s`` give
the rates of the whole layer (core + projections), of the core alone and of the
projections alone, where the row defines them (a layer row's core rate is the
core's FLOPs over the whole layer's time).

Peak memory (``--memory``): on a GPU, ``torch.cuda.max_memory_allocated`` minus
the memory allocated just before the call. On the CPU, each (implementation, T)
runs once in a fresh Python process, which resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``) just before the call and reads ``VmHWM`` after it:
the peak extra resident memory of that call.
"""

from __future__ import annotations

from .cli import main
from .config import DTYPES, BenchConfig, make_input, make_layer
from .decode import (
    DECODE_BATCHES,
    DECODE_CONTEXTS,
    decode_ratios,
    decode_targets,
    format_decode_table,
    make_decode_inputs,
    make_decode_layer,
    run_decode_benchmark,
)
from .environment import device_name, environment
from .implementations import BACKENDS, sdpa_attention, textbook_attention
from .registry import (
    DECODE_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    Implementation,
    Unsupported,
    build_decode_runner,
    build_runner,
    default_impls,
    implementation_table,
    register,
)
from .report import (
    RATIO_PAIRS,
    format_table,
    load_results,
    lookup,
    ratios,
    series,
    write_results,
)
from .run import DEFAULT_SEQ_LENS, MEMORY_SEQ_LENS, run_benchmark

__all__ = [
    "DECODE_IMPLEMENTATIONS",
    "DECODE_BATCHES",
    "DECODE_CONTEXTS",
    "build_decode_runner",
    "make_decode_layer",
    "make_decode_inputs",
    "run_decode_benchmark",
    "decode_ratios",
    "decode_targets",
    "format_decode_table",
    "BACKENDS",
    "DTYPES",
    "IMPLEMENTATIONS",
    "RATIO_PAIRS",
    "DEFAULT_SEQ_LENS",
    "MEMORY_SEQ_LENS",
    "BenchConfig",
    "Implementation",
    "Unsupported",
    "register",
    "build_runner",
    "default_impls",
    "implementation_table",
    "make_layer",
    "make_input",
    "textbook_attention",
    "sdpa_attention",
    "device_name",
    "environment",
    "run_benchmark",
    "ratios",
    "lookup",
    "series",
    "format_table",
    "write_results",
    "load_results",
    "main",
]
