"""Parameter, FLOP and memory counts of a multi-head attention layer.

Conventions (the book's chapter 06 derives each formula):

* Shapes: ``B`` batch, ``T_q`` queries, ``T_k`` keys, ``D`` = d_model, ``H``
  heads, ``d_k = D / H``. The layer is the one ``torch.nn.MultiheadAttention``
  builds: query, key, value and output projections, each producing ``D``
  features; ``kdim``/``vdim`` are the feature sizes of the key and value
  *inputs* (default ``D``).
* FLOPs count the matrix products only, and count one multiply-add as 2 FLOPs
  (the convention of ``torch.utils.flop_counter``). Softmax, scaling, masking
  and bias additions are not counted: they grow like ``B * H * T_q * T_k`` or
  ``B * T * D``, one factor of ``d_k`` or ``D`` below the products.
* Memory is in bytes: parameters times bytes per parameter (4 for float32,
  2 for bfloat16).

The data at the end, real model configurations (:data:`MODEL_CONFIGS`) and
:data:`VASWANI2017_HEAD_ABLATION`, are quoted from the papers named in each
entry; ``citation`` holds the key in the book's ``references.bib``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ._validate import check_divisible, check_int

__all__ = [
    "attention_parameters",
    "attention_flops",
    "projection_flops",
    "attention_core_flops",
    "layer_flops",
    "softmax_rows",
    "parameter_bytes",
    "attention_weights_bytes",
    "kv_cache_bytes",
    "PublishedModel",
    "MODEL_CONFIGS",
    "HeadAblationRow",
    "VASWANI2017_HEAD_ABLATION",
    "attention_core_bytes",
    "attention_core_exponentials",
    "Accelerator",
    "H100_SXM",
    "H100_SXM_EXP_PER_S",
    "Roofline",
    "roofline",
    "attention_core_roofline",
    "DecoderKVConfig",
    "DECODER_KV_CONFIGS",
    "LatentAttentionFigures",
    "DEEPSEEK_V2_MLA",
    "LatentAttentionShape",
    "DEEPSEEK_V3_MLA",
    "grouped_decode_flops",
    "grouped_decode_bytes",
    "tensor_parallel_parameters",
    "tensor_parallel_saved_elements",
    "all_reduce_bytes",
    "ring_all_reduce_seconds",
    "PublishedGPU",
    "PUBLISHED_GPUS",
]


def _head_size(d_model: int, num_heads: int) -> int:
    """d_k = D / H, after checking both and that H divides D."""
    check_int("d_model", d_model)
    check_int("num_heads", num_heads)
    return check_divisible("d_model", d_model, "num_heads", num_heads)


def attention_parameters(
    d_model: int,
    num_heads: int,
    *,
    bias: bool = True,
    kdim: int | None = None,
    vdim: int | None = None,
    add_bias_kv: bool = False,
) -> int:
    """Number of parameters of one multi-head attention layer.

    The layer is the one ``torch.nn.MultiheadAttention`` builds.

    Summed head by head, to make visible that ``H`` cancels: head ``i`` owns a
    ``(D, d_k)`` slice of ``W_Q``, a ``(kdim, d_k)`` slice of ``W_K`` and a
    ``(vdim, d_k)`` slice of ``W_V``; ``W_O`` is ``(D, D)``.

    * self-attention without biases: ``4 D^2``;
    * with biases: ``4 D^2 + 4 D`` (a length-``D`` bias on each of the four
      projections);
    * ``kdim``/``vdim``: ``W_K`` is ``(kdim, D)`` and ``W_V`` is ``(vdim, D)``,
      so ``2 D^2 + D (kdim + vdim)``;
    * ``add_bias_kv``: one learned extra key and value vector, ``2 D`` more.
    """
    d_k = _head_size(d_model, num_heads)
    kdim = d_model if kdim is None else check_int("kdim", kdim)
    vdim = d_model if vdim is None else check_int("vdim", vdim)
    # the head's columns of W_Q, W_K, W_V
    per_head = d_model * d_k + kdim * d_k + vdim * d_k
    weights = num_heads * per_head + d_model * d_model  # + W_O, (D, D)
    biases = 4 * d_model if bias else 0  # b_Q, b_K, b_V, b_O, each (D,)
    # bias_k, bias_v, each (1, 1, D)
    extra_kv = 2 * d_model if add_bias_kv else 0
    return weights + biases + extra_kv


def attention_flops(
    batch: int,
    t_q: int,
    d_model: int,
    num_heads: int,
    *,
    t_k: int | None = None,
    kdim: int | None = None,
    vdim: int | None = None,
) -> dict[str, int]:
    """FLOPs of each matrix product in one multi-head attention layer.

    A multiply-add counts as 2 FLOPs.

    Args:
        batch: B.
        t_q: number of queries T_q.
        d_model: D (the width of queries, keys and values after projection).
        num_heads: H; must divide D.
        t_k: number of keys T_k (default ``t_q``: self-attention).
        kdim, vdim: feature sizes of the key and value inputs (default D).

    Returns:
        A dict with the FLOPs of ``q_proj`` (2 B T_q D D), ``k_proj``
        (2 B T_k kdim D), ``v_proj`` (2 B T_k vdim D), ``scores`` (Q K^T:
        H products of (T_q, d_k) by (d_k, T_k),
        2 B H T_q T_k d_k = 2 B T_q T_k D), ``weighted_values`` (weights V,
        the same) and ``out_proj`` (2 B T_q D D).
    """
    check_int("batch", batch)
    check_int("t_q", t_q)
    d_k = _head_size(d_model, num_heads)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    kdim = d_model if kdim is None else check_int("kdim", kdim)
    vdim = d_model if vdim is None else check_int("vdim", vdim)
    return {
        # (B, T_q, D) @ (D, D)
        "q_proj": 2 * batch * t_q * d_model * d_model,
        # (B, T_k, kdim) @ (kdim, D)
        "k_proj": 2 * batch * t_k * kdim * d_model,
        # (B, T_k, vdim) @ (vdim, D)
        "v_proj": 2 * batch * t_k * vdim * d_model,
        # (B, H, T_q, d_k) @ (B, H, d_k, T_k)
        "scores": 2 * batch * num_heads * t_q * t_k * d_k,
        # (B, H, T_q, T_k) @ (B, H, T_k, d_k)
        "weighted_values": 2 * batch * num_heads * t_q * t_k * d_k,
        # (B, T_q, D) @ (D, D)
        "out_proj": 2 * batch * t_q * d_model * d_model,
    }


def projection_flops(
    batch: int,
    t_q: int,
    d_model: int,
    *,
    t_k: int | None = None,
    kdim: int | None = None,
    vdim: int | None = None,
) -> int:
    """FLOPs of the four projections; ``8 B T D^2`` for self-attention.

    Independent of the head count.
    """
    counts = attention_flops(
        batch, t_q, d_model, 1, t_k=t_k, kdim=kdim, vdim=vdim
    )
    return (
        counts["q_proj"]
        + counts["k_proj"]
        + counts["v_proj"]
        + counts["out_proj"]
    )


def attention_core_flops(
    batch: int,
    t_q: int,
    d_model: int,
    num_heads: int,
    *,
    t_k: int | None = None,
    causal: bool = False,
) -> int:
    """FLOPs of ``Q K^T`` and ``weights V`` over all heads: ``4 B T_q T_k D``.

    The count is the same whatever ``num_heads`` is. ``causal=True`` halves the
    count: a causal mask leaves about half of the (T, T) products to compute,
    the convention of the FlashAttention papers (exactly half as T grows).
    """
    counts = attention_flops(batch, t_q, d_model, num_heads, t_k=t_k)
    core = counts["scores"] + counts["weighted_values"]
    return core // 2 if causal else core


def layer_flops(
    batch: int,
    t_q: int,
    d_model: int,
    num_heads: int,
    *,
    t_k: int | None = None,
    causal: bool = False,
) -> int:
    """FLOPs of the whole layer: attention core plus the four projections."""
    core = attention_core_flops(
        batch, t_q, d_model, num_heads, t_k=t_k, causal=causal
    )
    return core + projection_flops(batch, t_q, d_model, t_k=t_k)


def softmax_rows(batch: int, t_q: int, num_heads: int) -> int:
    """Number of softmaxes, one per query, head and sequence: ``B H T_q``."""
    for name, value in (
        ("batch", batch),
        ("t_q", t_q),
        ("num_heads", num_heads),
    ):
        check_int(name, value)
    return batch * num_heads * t_q


def parameter_bytes(num_params: int, bytes_per_param: int = 4) -> int:
    """Memory of ``num_params`` parameters, in bytes.

    4 bytes each in float32, 2 in float16/bfloat16.
    """
    check_int("num_params", num_params)
    check_int("bytes_per_param", bytes_per_param)
    return num_params * bytes_per_param


def attention_weights_bytes(
    batch: int, num_heads: int, t_q: int, t_k: int, bytes_per_element: int = 4
) -> int:
    """Memory of the attention scores or weights, ``(B, H, T_q, T_k)``.

    It grows with ``H``.
    """
    for name, value in (
        ("batch", batch),
        ("num_heads", num_heads),
        ("t_q", t_q),
        ("t_k", t_k),
        ("bytes_per_element", bytes_per_element),
    ):
        check_int(name, value)
    return batch * num_heads * t_q * t_k * bytes_per_element


def kv_cache_bytes(
    batch: int,
    seq_len: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    bytes_per_element: int = 2,
) -> int:
    """Memory of a key/value cache: ``2 B T L H_kv d_k`` elements.

    Keys and values, for every layer.
    """
    for name, value in (
        ("batch", batch),
        ("seq_len", seq_len),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("bytes_per_element", bytes_per_element),
    ):
        check_int(name, value)
    elements = 2 * batch * seq_len * num_layers * num_kv_heads * head_dim
    return elements * bytes_per_element


@dataclass(frozen=True)
class PublishedModel:
    """The attention shape of a published model, quoted from its source.

    Attributes:
        name: the model's name.
        d_model: D, the width of the residual stream.
        num_heads: H, attention heads per layer.
        num_layers: layers as the source counts them (for the encoder-decoder
            Transformer: N, the depth of the encoder and, again, of the
            decoder).
        attention_modules: multi-head attention layers in the whole model
            (encoder-decoder Transformer: N encoder self-attention + N decoder
            self-attention + N encoder-decoder attention = 3 N; the other
            models here: one per layer).
        attention_bias: whether the attention projections carry bias vectors.
        citation: key in ``references.bib`` (comma-separated when two sources
            are needed).
        source: where in the source the numbers are.
        note: anything a reader should know about the row.
    """

    name: str
    d_model: int
    num_heads: int
    num_layers: int
    attention_modules: int
    attention_bias: bool
    citation: str
    source: str
    note: str = ""

    @property
    def d_k(self) -> int:
        """d_k = d_model / num_heads (ValueError if not a whole number)."""
        return _head_size(self.d_model, self.num_heads)

    def attention_parameters_per_layer(self, bias: bool | None = None) -> int:
        """Parameters of one attention layer.

        ``bias=None`` uses the model's own choice.
        """
        return attention_parameters(
            self.d_model,
            self.num_heads,
            bias=self.attention_bias if bias is None else bias,
        )

    def attention_parameters_total(self, bias: bool | None = None) -> int:
        """Parameters of all attention layers of the model."""
        per_layer = self.attention_parameters_per_layer(bias)
        return self.attention_modules * per_layer


_GPT2_SOURCE = (
    "d_model, layers: Table 2 of radford2019language; "
    "heads: hparams.json of openai2019gpt2code"
)

#: Published configurations. Biases: BERT and GPT-2 use biased projections in
#: their released code, GPT-3 uses GPT-2's architecture, LLaMA's projections
#: have no bias, and the equations of the original Transformer (Section 3.2.2
#: of vaswani2017attention) have none.
MODEL_CONFIGS: tuple[PublishedModel, ...] = (
    PublishedModel(
        "Transformer base",
        512,
        8,
        6,
        18,
        False,
        "vaswani2017attention",
        "Table 3",
        "encoder-decoder: 6 + 6 layers, "
        "3 attention modules per encoder/decoder pair",
    ),
    PublishedModel(
        "Transformer big",
        1024,
        16,
        6,
        18,
        False,
        "vaswani2017attention",
        "Table 3",
        "encoder-decoder: 6 + 6 layers, "
        "3 attention modules per encoder/decoder pair",
    ),
    PublishedModel(
        "BERT-base",
        768,
        12,
        12,
        12,
        True,
        "devlin2019bert",
        "Section 3 (L=12, H=768, A=12)",
    ),
    PublishedModel(
        "BERT-large",
        1024,
        16,
        24,
        24,
        True,
        "devlin2019bert",
        "Section 3 (L=24, H=1024, A=16)",
    ),
    PublishedModel(
        "GPT-2 small",
        768,
        12,
        12,
        12,
        True,
        "radford2019language,openai2019gpt2code",
        _GPT2_SOURCE,
    ),
    PublishedModel(
        "GPT-2 medium",
        1024,
        16,
        24,
        24,
        True,
        "radford2019language,openai2019gpt2code",
        _GPT2_SOURCE,
    ),
    PublishedModel(
        "GPT-2 large",
        1280,
        20,
        36,
        36,
        True,
        "radford2019language,openai2019gpt2code",
        _GPT2_SOURCE,
    ),
    PublishedModel(
        "GPT-2 XL",
        1600,
        25,
        48,
        48,
        True,
        "radford2019language,openai2019gpt2code",
        _GPT2_SOURCE,
    ),
    PublishedModel(
        "GPT-3 175B", 12288, 96, 96, 96, True, "brown2020language", "Table 2.1"
    ),
    PublishedModel(
        "LLaMA-7B", 4096, 32, 32, 32, False, "touvron2023llama", "Table 2"
    ),
)


@dataclass(frozen=True)
class HeadAblationRow:
    """One row of the head-count experiments of Vaswani et al. (2017), Table 3.

    English-German translation, development set newstest2013, base model
    (d_model = 512); perplexity is per word piece. ``row`` is the table's
    label: ``"(A)"`` varies the number of heads at constant computation
    (d_k = d_v = 512 / h), ``"(B)"`` shrinks d_k alone, and ``"base"`` is the
    base model.
    """

    row: str
    num_heads: int
    d_k: int
    d_v: int
    perplexity_dev: float
    bleu_dev: float


#: Vaswani et al. (2017), Table 3: rows (A), the base model, and the first
#: line of row (B).
#: Citation key: vaswani2017attention.
VASWANI2017_HEAD_ABLATION: tuple[HeadAblationRow, ...] = (
    HeadAblationRow("(A)", 1, 512, 512, 5.29, 24.9),
    HeadAblationRow("(A)", 4, 128, 128, 5.00, 25.5),
    HeadAblationRow("base", 8, 64, 64, 4.92, 25.8),
    HeadAblationRow("(A)", 16, 32, 32, 4.91, 25.8),
    HeadAblationRow("(A)", 32, 16, 16, 5.01, 25.4),
    HeadAblationRow("(B)", 8, 16, 64, 5.16, 25.1),
)


# ---------------------------------------------------------------------------
# Bytes moved and the roofline of the attention core (chapter 13)


def attention_core_bytes(
    batch: int,
    t_q: int,
    num_heads: int,
    head_dim: int,
    *,
    t_k: int | None = None,
    bytes_per_element: int = 2,
    materialise: bool = False,
) -> int:
    """Bytes the attention core must move between main memory and the chip.

    A fused kernel reads q (T_q rows), k and v (T_k rows each) once and writes
    the output (T_q rows): ``(2 T_q + 2 T_k) B H d_k`` elements. A
    materialising core also writes the scores, reads them back for the
    softmax, writes the weights and reads them for ``weights @ v``: ``4 B H
    T_q T_k`` elements more (a causal mask does not shrink them: the
    textbook stores the whole matrix). A lower bound: it counts no re-reads.
    """
    for name, value in (
        ("batch", batch),
        ("t_q", t_q),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("bytes_per_element", bytes_per_element),
    ):
        check_int(name, value)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    elements = (2 * t_q + 2 * t_k) * batch * num_heads * head_dim
    if materialise:
        elements += 4 * batch * num_heads * t_q * t_k  # S, S, P, P
    return elements * bytes_per_element


def attention_core_exponentials(
    batch: int,
    t_q: int,
    num_heads: int,
    *,
    t_k: int | None = None,
    causal: bool = False,
) -> int:
    """``exp`` evaluations of the softmax: one per score, ``B H T_q T_k``.

    Halved when causal, as :func:`attention_core_flops` is. Against the
    ``4 B H T_q T_k d_k`` FLOPs of the two products, that is one ``exp`` per
    ``4 d_k`` FLOPs.
    """
    for name, value in (
        ("batch", batch),
        ("t_q", t_q),
        ("num_heads", num_heads),
    ):
        check_int(name, value)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    count = batch * num_heads * t_q * t_k
    return count // 2 if causal else count


@dataclass(frozen=True)
class Accelerator:
    """An accelerator's published peaks: the two ceilings of a roofline.

    Attributes:
        name: the product's name.
        dtype: the number format of ``peak_flop_per_s``.
        peak_flop_per_s: dense matrix-multiply peak, FLOP/s, in ``dtype``.
        memory_bytes_per_s: main-memory (HBM) bandwidth, bytes/s.
        citation: key in ``references.bib``. source: where the numbers are.
    """

    name: str
    dtype: str
    peak_flop_per_s: float
    memory_bytes_per_s: float
    citation: str
    source: str

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which a kernel can be compute-bound."""
        return self.peak_flop_per_s / self.memory_bytes_per_s


#: NVIDIA H100 SXM: 1,979 teraFLOPS of bfloat16 tensor-core math *with
#: sparsity* (the datasheet's footnote; dense is half) and 3.35 TB/s of HBM3.
H100_SXM = Accelerator(
    name="NVIDIA H100 SXM",
    dtype="bfloat16",
    peak_flop_per_s=1979e12 / 2,
    memory_bytes_per_s=3.35e12,
    citation="nvidia2023h100",
    source=(
        "datasheet, H100 SXM: BF16 Tensor Core 1,979 teraFLOPS with "
        "sparsity (dense: half), GPU memory bandwidth 3.35 TB/s"
    ),
)

#: exp (and other special functions) per second on the H100 SXM5, quoted in
#: shah2024flashattention3, Section 3.1: "only 3.9 TFLOPS of special
#: functions such as exponential", against 989 TFLOPS of FP16 matmul.
H100_SXM_EXP_PER_S = 3.9e12


class Roofline(NamedTuple):
    """A roofline prediction: the time if the busier ceiling were reached."""

    flop: int
    bytes_moved: int
    intensity: float  # FLOP per byte
    seconds: float  # max(flop / peak, bytes / bandwidth)
    flop_per_s: float  # flop / seconds: at most the peak
    bound: str  # "compute" or "memory"


def roofline(
    flop: int, bytes_moved: int, accelerator: Accelerator = H100_SXM
) -> Roofline:
    """The roofline model (Williams et al., 2009): a prediction, not a measure.

    A kernel needs at least ``flop / peak`` seconds of arithmetic and
    ``bytes / bandwidth`` seconds of memory traffic; if the two overlap
    perfectly, it takes the larger. Real kernels take longer.
    """
    check_int("flop", flop)
    check_int("bytes_moved", bytes_moved)
    compute = flop / accelerator.peak_flop_per_s
    memory = bytes_moved / accelerator.memory_bytes_per_s
    seconds = max(compute, memory)
    return Roofline(
        flop=flop,
        bytes_moved=bytes_moved,
        intensity=flop / bytes_moved,
        seconds=seconds,
        flop_per_s=flop / seconds,
        bound="compute" if compute >= memory else "memory",
    )


def attention_core_roofline(
    batch: int,
    seq_len: int,
    num_heads: int,
    head_dim: int,
    *,
    causal: bool = False,
    materialise: bool = False,
    accelerator: Accelerator = H100_SXM,
    bytes_per_element: int = 2,
) -> Roofline:
    """:func:`roofline` of self-attention's core, fused or materialising."""
    flop = attention_core_flops(
        batch, seq_len, num_heads * head_dim, num_heads, causal=causal
    )
    moved = attention_core_bytes(
        batch,
        seq_len,
        num_heads,
        head_dim,
        bytes_per_element=bytes_per_element,
        materialise=materialise,
    )
    return roofline(flop, moved, accelerator)


# Key/value caches of decoders with grouped key/value heads (chapter 12)


@dataclass(frozen=True)
class DecoderKVConfig:
    """What the key/value cache of a published decoder depends on, quoted.

    Attributes:
        name: the model's name.
        d_model: D. num_heads: H (query heads). num_kv_heads: H_kv.
        num_layers: L. head_dim: d_k (D / H for each model here).
        bytes_per_element: 2, the 16-bit floats the weights are released in.
        citation: keys in ``references.bib``. source: where the numbers are.
        note: anything a reader should know about the row.
    """

    name: str
    d_model: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    head_dim: int
    citation: str
    source: str
    note: str = ""
    bytes_per_element: int = 2

    def kv_cache_bytes_per_token(self) -> int:
        """Bytes per token: 2 L H_kv d_k elements (keys, values, layers)."""
        return self._bytes_per_token(self.num_kv_heads)

    def mha_kv_cache_bytes_per_token(self) -> int:
        """The same model with one key/value head per query head (H_kv = H)."""
        return self._bytes_per_token(self.num_heads)

    def _bytes_per_token(self, kv_heads: int) -> int:
        return kv_cache_bytes(
            1,
            1,
            self.num_layers,
            kv_heads,
            self.head_dim,
            self.bytes_per_element,
        )


#: Published decoder configurations, for their key/value caches.
DECODER_KV_CONFIGS: tuple[DecoderKVConfig, ...] = (
    DecoderKVConfig(
        "Llama-2-7B",
        4096,
        32,
        32,
        32,
        128,
        "meta2023llama2config7b,touvron2023llama2",
        "config.json of meta-llama/Llama-2-7b-hf; GQA only in the 34B and "
        "70B models: Table 1 of touvron2023llama2",
        "multi-head attention: H_kv = H",
    ),
    DecoderKVConfig(
        "Llama-2-70B",
        8192,
        64,
        8,
        80,
        128,
        "meta2023llama2config70b,touvron2023llama2",
        "config.json of meta-llama/Llama-2-70b-hf; GQA: Table 1 of "
        "touvron2023llama2",
    ),
    DecoderKVConfig(
        "Llama-3-8B",
        4096,
        32,
        8,
        32,
        128,
        "dubey2024llama3",
        "Table 3 of dubey2024llama3 (8B: 32 layers, model dimension 4096, "
        "32 attention heads, 8 key/value heads)",
    ),
    DecoderKVConfig(
        "Mistral-7B",
        4096,
        32,
        8,
        32,
        128,
        "jiang2023mistral",
        "Table 1 of jiang2023mistral (dim 4096, n_layers 32, head_dim 128, "
        "n_heads 32, n_kv_heads 8)",
        "sliding window of 4096 tokens: its rolling buffer cache keeps at "
        "most 4096 positions (section 2 of jiang2023mistral)",
    ),
)


@dataclass(frozen=True)
class LatentAttentionFigures:
    """Multi-head latent attention (MLA) in DeepSeek-V2, as its paper has it.

    Every field is quoted from deepseekai2024deepseekv2; nothing here was
    measured or trained for this book.

    Attributes:
        num_layers, num_heads, head_dim: l, n_h, d_h (section 3.1.2).
        kv_compression_dim: d_c, the width of the cached latent vector.
        rope_head_dim: d_h^R, the width of the cached decoupled RoPE key.
        equivalent_gqa_groups: Table 1: MLA's cache equals GQA's with this
            many groups, (d_c + d_h^R) / (2 d_h) = 2.25.
        kv_cache_reduction_vs_deepseek_67b: the abstract: "reduces the KV
            cache by 93.3%" compared with DeepSeek 67B.
    """

    num_layers: int = 60
    num_heads: int = 128
    head_dim: int = 128
    kv_compression_dim: int = 512
    rope_head_dim: int = 64
    equivalent_gqa_groups: float = 2.25
    kv_cache_reduction_vs_deepseek_67b: float = 0.933
    citation: str = "deepseekai2024deepseekv2"
    source: str = (
        "Table 1 (KV cache per token: MHA 2 n_h d_h l, GQA 2 n_g d_h l, "
        "MQA 2 d_h l, MLA (d_c + d_h^R) l = 9/2 d_h l), section 3.1.2 "
        "(dimensions), abstract (93.3%)"
    )

    def elements_per_token(self) -> int:
        """Table 1's MLA row: ``(d_c + d_h^R) l`` cached elements per token."""
        return (self.kv_compression_dim + self.rope_head_dim) * self.num_layers

    def mha_elements_per_token(self) -> int:
        """Table 1's MHA row for the same model: ``2 n_h d_h l``."""
        return 2 * self.num_heads * self.head_dim * self.num_layers


#: DeepSeek-V2's multi-head latent attention, from its paper.
DEEPSEEK_V2_MLA = LatentAttentionFigures()


@dataclass(frozen=True)
class LatentAttentionShape:
    """The widths of one multi-head latent attention layer (``mha.latent``)
    and what decoding one token with it costs.

    Attributes (a ``DeepseekV3Config``'s names): d_model D, num_heads H,
    kv_lora_rank r (the cached latent), qk_rope_head_dim d_R (the cached
    rotated key), qk_nope_head_dim d_N, v_head_dim d_v, q_lora_rank (None:
    one query projection), num_layers L; citation and source, where the
    numbers are quoted from.

    Counts follow the module's conventions (2 FLOPs a multiply-add, matrix
    products only) for ONE new token of one sequence that attends to
    ``context`` keys (the cached ones and its own), in one layer. Bytes are
    those of the keys and values the attention reads (the weights, the same
    for every path of one layer, are not counted).
    """

    d_model: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    num_layers: int = 1
    citation: str = ""
    source: str = ""

    def cache_elements_per_token(self) -> int:
        """``(r + d_R) L``: the latent and the shared rotated key, every
        layer, however many heads."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.num_layers

    def projection_flops(self) -> int:
        """The query, latent and output projections of one token: the same
        on both paths."""
        D, H, r = self.d_model, self.num_heads, self.kv_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            query = D * H * qk
        else:
            query = D * self.q_lora_rank + self.q_lora_rank * H * qk
        latent = D * (r + self.qk_rope_head_dim)
        return 2 * (query + latent + H * self.v_head_dim * D)

    def attention_flops(
        self,
        context: int,
        *,
        absorb: bool,
        queries: int = 1,
        causal: bool = False,
    ) -> int:
        """The rest: what the attention of ``queries`` new tokens to
        ``context`` keys costs (every score computed, as a dense kernel
        does, masked or not; ``causal=True``: only the scores a causal
        mask keeps, query i of the n newest seeing ``context - n + i + 1``
        keys, as a kernel that skips masked scores does).

        Naive (``absorb=False``): ``kv_b_proj`` expands every cached latent
        into H keys (d_N) and values (d_v), ``2 T_k r H (d_N + d_v)``, once
        for all the queries, then scores and the weighted sum, ``2 H T_q T_k
        (d_N + d_R + d_v)``. Absorbed, per query: ``W_UK`` (``2 H d_N r``),
        scores against the latents and rotated keys (``2 H T_k (r + d_R)``),
        the weighted sum of latents (``2 H T_k r``) and ``W_UV`` (``2 H r
        d_v``): more per key, nothing per cached token.
        """
        T = check_int("context", context)
        n = check_int("queries", queries)
        H, r, d_r = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        d_n, d_v = self.qk_nope_head_dim, self.v_head_dim
        pairs = n * T - (n * (n - 1) // 2 if causal else 0)  # scores
        if absorb:
            return 2 * H * (n * (d_n * r + r * d_v) + pairs * (2 * r + d_r))
        return 2 * T * r * H * (d_n + d_v) + 2 * H * pairs * (d_n + d_r + d_v)

    def decode_flops(self, context: int, *, absorb: bool) -> int:
        """Projections and attention of one decoded token, one layer."""
        return self.projection_flops() + self.attention_flops(
            context, absorb=absorb
        )

    def decode_bytes(
        self, context: int, *, absorb: bool, bytes_per_element: int = 2
    ) -> int:
        """Bytes of keys and values that one token's attention moves.

        Absorbed: the cache, ``T_k (r + d_R)`` elements. Naive: the cache,
        then every head's keys ``(d_N + d_R)`` and values ``d_v``, written
        by the expansion and read by the attention: ``T_k (r + d_R) + 2 T_k
        H (d_N + d_R + d_v)`` (a model of the traffic, not a measurement).
        """
        T = check_int("context", context)
        check_int("bytes_per_element", bytes_per_element)
        cache = T * (self.kv_lora_rank + self.qk_rope_head_dim)
        if absorb:
            return cache * bytes_per_element
        heads = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        expanded = 2 * T * self.num_heads * heads
        return (cache + expanded) * bytes_per_element


#: DeepSeek-V3's attention (671B parameters, 61 layers).
DEEPSEEK_V3_MLA = LatentAttentionShape(
    d_model=7168,
    num_heads=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    q_lora_rank=1536,
    num_layers=61,
    citation="deepseekai2024deepseekv3",
    source=(
        "section 4.2 of deepseekai2024deepseekv3 (61 layers, hidden "
        "dimension 7168, n_h = 128 heads of d_h = 128, d_c = 512, d_c' = "
        "1536, d_h^R = 64); the defaults of transformers' DeepseekV3Config"
    ),
)


def grouped_decode_flops(
    context: int,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> int:
    """FLOPs of one decoded token in a grouped-query layer (MHA when H_kv =
    H): projections ``2 D d_k (2 H + 2 H_kv)`` and attention ``4 H T_k
    d_k``, one layer, 2 FLOPs a multiply-add."""
    for name, value in (
        ("context", context),
        ("d_model", d_model),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        check_int(name, value)
    projections = 2 * d_model * head_dim * (2 * num_heads + 2 * num_kv_heads)
    return projections + 4 * num_heads * context * head_dim


def grouped_decode_bytes(
    context: int,
    num_kv_heads: int,
    head_dim: int,
    bytes_per_element: int = 2,
) -> int:
    """Bytes of keys and values one decoded token reads from a grouped
    cache: ``2 T_k H_kv d_k`` elements, one layer."""
    return kv_cache_bytes(
        1, context, 1, num_kv_heads, head_dim, bytes_per_element
    )


# One layer split by heads over N processes (chapter 14, mha.parallel)


def tensor_parallel_parameters(
    d_model: int,
    num_heads: int,
    world_size: int,
    *,
    num_kv_heads: int | None = None,
    bias: bool = False,
) -> int:
    """Parameters one of N processes holds when a layer is split by heads.

    Its H/N query heads' rows of W_Q and columns of W_O (``D * D / N`` each),
    the rows of W_K and W_V of the key/value heads they read (``H_kv / N``
    heads, or one head when ``H_kv < N``: replicated), their biases, and all
    of ``b_O`` (added once, after the sum). Multi-head attention:
    ``4 D^2 / N``, and ``3 D / N + D`` more with biases. ``bias`` defaults
    to False, as :class:`mha.GroupedQueryAttention`'s (Llama has none);
    :class:`mha.MultiHeadAttention`, like torch's, has biases by default.
    """
    d_k = _head_size(d_model, num_heads)
    check_int("world_size", world_size)
    check_divisible("num_heads", num_heads, "world_size", world_size)
    kv = (
        num_heads
        if num_kv_heads is None
        else check_int("num_kv_heads", num_kv_heads)
    )
    if kv % world_size and world_size % kv:
        raise ValueError(
            f"num_kv_heads ({kv}) must be divisible by world_size "
            f"({world_size}), or divide it"
        )
    q_width = d_model // world_size  # H/N heads of d_k features
    kv_width = max(1, kv // world_size) * d_k
    weights = 2 * d_model * q_width + 2 * d_model * kv_width
    return weights + (q_width + 2 * kv_width + d_model if bias else 0)


def tensor_parallel_saved_elements(
    batch: int, seq_len: int, d_model: int, num_heads: int, world_size: int
) -> int:
    """Numbers one process keeps for the backward of the split layer.

    For :class:`mha.parallel.HeadShard` (explicit attention, no mask): the
    input ``x`` (B, T, D), which every process holds whole; its heads'
    queries, keys, values and merged outputs, (B, T, D/N) each; its heads'
    attention weights, (B, H/N, T, T). ``B T D + 4 B T D / N + B H T^2 / N``.
    """
    check_int("batch", batch)
    check_int("seq_len", seq_len)
    _head_size(d_model, num_heads)
    check_int("world_size", world_size)
    heads = check_divisible("num_heads", num_heads, "world_size", world_size)
    activations = batch * seq_len * d_model
    return (
        activations
        + 4 * activations // world_size
        + batch * heads * seq_len * seq_len
    )


def all_reduce_bytes(
    batch: int, seq_len: int, d_model: int, bytes_per_element: int = 4
) -> int:
    """Bytes each process sends into the forward's all-reduce: ``B T D``."""
    for name, value in (
        ("batch", batch),
        ("seq_len", seq_len),
        ("d_model", d_model),
        ("bytes_per_element", bytes_per_element),
    ):
        check_int(name, value)
    return batch * seq_len * d_model * bytes_per_element


def ring_all_reduce_seconds(
    nbytes: int, world_size: int, bus_bytes_per_s: float
) -> float:
    """A prediction: the bandwidth term of an all-reduce of ``nbytes``.

    ``2 (N - 1) / N * nbytes / bus_bytes_per_s``: each process sends and
    receives ``2 (N - 1) / N`` times the buffer (NCCL tests' "bus bandwidth"
    convention, nvidia2018nccltests; patarasuk2009bandwidth). Latency, and
    every other real-world cost, is left out: a lower bound.
    """
    check_int("nbytes", nbytes)
    check_int("world_size", world_size)
    if not bus_bytes_per_s > 0:
        raise ValueError(
            f"bus_bytes_per_s must be positive, got {bus_bytes_per_s}"
        )
    return 2 * (world_size - 1) / world_size * nbytes / bus_bytes_per_s


@dataclass(frozen=True)
class PublishedGPU:
    """A GPU's link bandwidths and dense bfloat16 peak, from its datasheet.

    The datasheets quote link bandwidths as the total of both directions;
    one direction gets half (``*_bytes_per_s`` below), the figure that the
    all-reduce formula of :func:`ring_all_reduce_seconds` needs.
    """

    name: str
    nvlink_gb_per_s: float  # quoted, both directions together
    pcie_gb_per_s: float  # quoted, both directions together (x16 link)
    bf16_dense_tflops: float  # dense: half the datasheet's "with sparsity"
    citation: str

    @property
    def nvlink_bytes_per_s(self) -> float:
        """NVLink, one direction, bytes per second."""
        return self.nvlink_gb_per_s / 2 * 1e9

    @property
    def pcie_bytes_per_s(self) -> float:
        """PCIe, one direction, bytes per second."""
        return self.pcie_gb_per_s / 2 * 1e9


#: Datasheet figures (SXM modules). A100: NVLink 600 GB/s, PCIe Gen4 64 GB/s,
#: BF16 312 TFLOPS (624 with sparsity). H100 SXM: NVLink 900 GB/s, PCIe Gen5
#: 128 GB/s, BF16 1,979 TFLOPS with sparsity, so 989.5 dense.
PUBLISHED_GPUS: tuple[PublishedGPU, ...] = (
    PublishedGPU("A100 SXM", 600.0, 64.0, 312.0, "nvidia2021a100"),
    PublishedGPU("H100 SXM", 900.0, 128.0, 1979.0 / 2, "nvidia2023h100"),
)
