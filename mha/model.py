"""A whole Llama-family causal language model, its attention a switch.

:class:`CausalLM` is the decoder transformers builds for a Llama, Mistral,
Qwen2 or Qwen3 configuration: token embeddings, pre-norm blocks (RMSNorm,
grouped-query attention with RoPE, RMSNorm, a SwiGLU MLP), a last RMSNorm
and the output head (tied to the embeddings where the config says so). Its
parameters carry transformers' names (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``,
``lm_head.weight``), so ``load_state_dict`` of transformers' model is
strict, both ways. Every attention layer is chapter 12's
:class:`mha.GroupedQueryAttention`, which calls one backend of
:mod:`mha.backends` by name (``eager``, ``sdpa``, ``tiled``, ``triton``,
``flex``); :meth:`CausalLM.set_attention_backend` switches them all.

Shapes: ``B`` batch, ``T`` new tokens, ``T_k`` keys (cached + new), ``D``
hidden size, ``H`` query heads, ``H_kv`` key/value heads, ``d_k`` head
size, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._validate import check_choice, check_int, check_tensor
from .backends import Masking, get_backend
from .caches import Cache, KVCache, PagedKVCache, cached_so_far
from .configs import ModelConfig, check_context, read_config
from .functional import RMSNorm
from .layer import GroupedQueryAttention
from .sampling import Sampling, sample

__all__ = ["RMSNorm", "MLP", "DecoderLayer", "CausalLM"]
__all__ += ["sample"]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), (B, T, D) -> (B, T, D)."""

    def __init__(self, config: ModelConfig, **factory) -> None:
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(D, F_, bias=bias, **factory)
        self.up_proj = nn.Linear(D, F_, bias=bias, **factory)
        self.down_proj = nn.Linear(F_, D, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, window, backend, **factory):
        super().__init__()
        eps, D = config.rms_norm_eps, config.hidden_size
        attention = GroupedQueryAttention.from_fields
        self.self_attn = attention(config, window, backend, **factory)
        self.mlp = MLP(config, **factory)  # transformers' order of names
        self.input_layernorm = RMSNorm(D, eps, **factory)
        self.post_attention_layernorm = RMSNorm(D, eps, **factory)

    def forward(self, x: Tensor, **attention) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), **attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """A Llama-family decoder with transformers' parameter names.

    Build it with :meth:`from_config`; ``attn_backend`` names the backend
    of every attention layer (:func:`mha.attention_backends`).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        attn_backend: str = "sdpa",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config.require("vocab_size", "intermediate_size", "num_hidden_layers")
        get_backend(attn_backend)
        factory = {"device": device, "dtype": dtype}
        V, D = config.vocab_size, config.hidden_size
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, D, **factory)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, window, attn_backend, **factory)
            for window in config.windows
        )
        self.model.norm = RMSNorm(D, config.rms_norm_eps, **factory)
        self.lm_head = nn.Linear(D, V, bias=False, **factory)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.register_load_state_dict_pre_hook(_tied_head)

    @classmethod
    def from_config(
        cls,
        config: object,
        *,
        attn_backend: str = "sdpa",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> CausalLM:
        """From a transformers ``LlamaConfig``, ``MistralConfig``,
        ``Qwen2Config`` or ``Qwen3Config``, or its config.json as a dict
        (:func:`mha.configs.read_config`: a field not implemented raises a
        ValueError that names it). ``dtype``: the parameters'; default the
        config's own (``torch_dtype``), as transformers' ``from_config``."""
        fields = read_config(config)
        if dtype is None and fields.dtype is not None:
            dtype = getattr(torch, fields.dtype)
        factory = {"device": device, "dtype": dtype}
        return cls(fields, attn_backend=attn_backend, **factory)

    @property
    def attn_backend(self) -> str:
        """The name of the attention backend every layer calls."""
        return self.model.layers[0].self_attn.backend

    def set_attention_backend(self, name: str) -> None:
        """Switch every attention layer to backend ``name``."""
        name = get_backend(name).name
        for layer in self.model.layers:
            layer.self_attn.backend = name

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        caches: list[Cache] | None = None,
        logits_to_keep: int | Tensor = 0,
    ) -> Tensor:
        """Logits (B, T, V) of ``input_ids`` (B, T), after the caches'.

        ``attention_mask`` (B, T_k) of 1 (a token) and 0 (a pad), for the
        cached and new positions (or every slot of the caches), as
        transformers takes it; ``position_ids`` (1 or B, T), by default the
        next T positions of the caches; ``caches``: one per layer
        (:meth:`new_caches`), written in place. ``logits_to_keep``, as
        transformers': an int n > 0 keeps the last n positions' logits, a
        1-D tensor of indices those positions (0: all); the output head
        then runs on those only.
        """
        start = self._check_forward(input_ids, attention_mask, caches)
        T = input_ids.shape[1]
        if position_ids is None:  # the next T positions, every row alike
            position_ids = start + torch.arange(T, device=input_ids.device)
            position_ids = position_ids[None]  # (1, T)
        # what every layer hides, said once: causal, and the pads (each
        # row's first key, where the batch is left-padded)
        masking = Masking.padded(attention_mask)
        x = self.model.embed_tokens(input_ids)  # (B, T, D)
        for i, layer in enumerate(self.model.layers):
            x = layer(
                x,
                positions=position_ids,
                cache=None if caches is None else caches[i],
                masking=masking,
            )
        if isinstance(logits_to_keep, Tensor):  # positions' indices
            spec = {"kind": "integer", "ndim": 1, "shape": "(n,)"}
            check_tensor("logits_to_keep", logits_to_keep, **spec)
        else:  # the last n; 0: slice(0, None), every position
            n = check_int("logits_to_keep", logits_to_keep, minimum=0)
            logits_to_keep = slice(-n, None)
        return self.lm_head(self.model.norm(x[:, logits_to_keep]))

    def new_caches(
        self, batch: int, max_len: int, *, kind: str = "static"
    ) -> list[Cache]:
        """One empty cache per layer: ``"static"`` (:class:`mha.KVCache`)
        or ``"paged"`` (:class:`mha.PagedKVCache`, 16-position blocks, one
        block table for every layer)."""
        check_choice("cache", kind, ("static", "paged"))
        attn = self.model.layers[0].self_attn
        weight = self.lm_head.weight
        sizes = (batch, max_len, attn.num_kv_heads, attn.head_dim)
        factory = {"dtype": weight.dtype, "device": weight.device}
        if kind == "static":
            return [KVCache(*sizes, **factory) for _ in self.model.layers]
        first = PagedKVCache(*sizes, **factory)
        return [first] + [
            PagedKVCache(*sizes, share_table_with=first, **factory)
            for _ in self.model.layers[1:]
        ]

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        attention_mask: Tensor | None = None,
        cache: str = "static",
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        compile: bool | str | Callable = False,
        **settings,
    ) -> Tensor:
        """Prompt and new tokens, (B, T + new), as transformers' generate.

        The next token as :class:`mha.sampling.Sampling` chooses it: greedy,
        or sampled (``do_sample=True``) with transformers' warpers and
        defaults (``top_k`` 50 unless given; 0 switches it off, as
        ``top_p=1.0`` does), drawn with ``generator``; ``settings``: its
        ``min_p``, ``repetition_penalty``, ``min_new_tokens``,
        ``eos_token_id``, ``pad_token_id``, ``generation_config`` (a dict,
        read where an argument is not given). ``attention_mask`` (B, T): 0
        at the pads of a left-padded batch (positions count from each row's
        first token). A row that has produced a stop token continues with
        the pad token (or the first stop token); generation stops when every
        row has, so ``new`` may be less than ``max_new_tokens``.

        ``compile``: True runs every decoding step after the prompt as one
        graph of ``torch.compile`` (``fullgraph``, static shapes: the whole
        static cache, the whole attention mask, the cache's count a
        tensor), captured as a CUDA graph on a GPU (``mode="reduce-
        overhead"``; the caches' tensors are marked as static addresses),
        compiled once per model and shape and reused; a backend name or
        callable of ``torch.compile`` instead of Inductor. Static cache
        only."""
        B, T = self._check_generate(input_ids, max_new_tokens, attention_mask)
        step_graph = self._step_graph(compile, cache)
        chooser = Sampling.resolve(
            self.config,
            settings.pop("generation_config", None),
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            **settings,
        )
        device = input_ids.device
        caches = self.new_caches(B, T + max_new_tokens, kind=cache)
        mask = input_ids.new_ones(B, T + max_new_tokens, dtype=torch.bool)
        if attention_mask is not None:
            mask[:, :T] = attention_mask.to(torch.bool)
        positions = (mask[:, :T].cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
        eos = torch.tensor(chooser.eos_token_ids, device=device)
        pad = chooser.pad_token_id
        pad = eos[0] if pad is None and len(eos) else (pad or 0)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        tokens, new = input_ids, input_ids
        if step_graph is not None:  # the same tensors every step
            for c in caches:  # written in place: no copies in the graph
                for tensor in (c.keys, c.values, c.length):
                    torch._dynamo.mark_static_address(tensor)
        for step in range(max_new_tokens):
            if step_graph is not None and step > 0:  # every slot's mask
                logits = step_graph(new, mask, positions, caches, 1)
            else:
                logits = self(new, mask[:, : T + step], positions, caches, 1)
            chosen = chooser.choose(logits[:, -1], tokens, step)  # (B,)
            chosen = torch.where(done, pad, chosen)
            done = done | torch.isin(chosen, eos)
            tokens = torch.cat((tokens, chosen[:, None]), dim=1)
            if len(eos) and bool(done.all()):
                break
            new, positions = chosen[:, None], positions[:, -1:] + 1
        return tokens

    def _step_graph(self, compile: object, cache: str) -> Callable | None:
        """The compiled decoding step of ``generate(compile=...)``: None
        for False; one per backend, kept on the model."""
        if compile is False:
            return None
        if not (compile is True or isinstance(compile, str)) and not (
            callable(compile)
        ):
            raise TypeError(
                "compile must be a bool, a torch.compile backend's name or "
                f"a callable backend, got {type(compile).__name__}"
            )
        if cache != "static":
            raise ValueError(
                f"compile needs cache='static' (the whole cache every step: "
                f"one shape), got cache={cache!r}"
            )
        graphs = self.__dict__.setdefault("_step_graphs", {})
        if compile not in graphs:
            options: dict = {"fullgraph": True, "dynamic": False}
            if compile is not True:
                options["backend"] = compile
            elif self.lm_head.weight.device.type == "cuda":
                options["mode"] = "reduce-overhead"  # a CUDA graph
            graphs[compile] = torch.compile(self.forward, **options)
        return graphs[compile]

    def _check_forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        caches: list[Cache] | None,
    ) -> int | Tensor:
        """Check every input (no value read under torch.compile); the
        positions the caches have seen, read once."""
        config = self.config
        if not isinstance(input_ids, Tensor) or input_ids.dtype != torch.int64:
            got = getattr(input_ids, "dtype", type(input_ids).__name__)
            raise TypeError(f"input_ids must be an int64 tensor, got {got}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                "input_ids must have shape (B, T) with T >= 1, got shape "
                f"{tuple(input_ids.shape)}"
            )
        if self.training and config.attention_dropout > 0:
            raise ValueError(
                f"attention_dropout = {config.attention_dropout}: no "
                "backend drops attention weights; call model.eval()"
            )
        B, T = input_ids.shape
        if not torch.compiler.is_compiling():  # one read from the device
            ends = torch.stack((input_ids.min(), input_ids.max()))
            low, high = ends.tolist()
            if not 0 <= low <= high < config.vocab_size:
                raise ValueError(
                    "input_ids must lie in [0, vocab_size = "
                    f"{config.vocab_size}), got values {low} .. {high}"
                )
        start = 0
        if caches is not None:
            if len(caches) != len(self.model.layers):
                raise ValueError(
                    f"caches must hold one cache per layer "
                    f"({len(self.model.layers)}), got {len(caches)}"
                )
            start = cached_so_far(caches[0])
            attn, weight = self.model.layers[0].self_attn, self.lm_head.weight
            for cache in caches:  # none half-written
                shape = (B, attn.num_kv_heads, T, attn.head_dim)
                cache.check_update(*shape, weight.dtype, weight.device)
        if attention_mask is not None:
            _check_attention_mask(attention_mask, B, T, start, caches)
        return start

    def _check_generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        attention_mask: Tensor | None,
    ) -> tuple[int, int]:
        check_int("max_new_tokens", max_new_tokens)
        self._check_forward(input_ids, None, None)
        B, T = input_ids.shape
        check_context(T, max_new_tokens, self.config)
        if attention_mask is not None:
            _check_attention_mask(attention_mask, B, T, 0, None)
            if not bool(attention_mask[:, -1].all()):
                raise ValueError(
                    "attention_mask must be 1 at every row's last prompt "
                    "token (left padding: pads before the prompt)"
                )
        return B, T


def _tied_head(module, state_dict, prefix, *args) -> None:
    """A tied checkpoint as ``save_pretrained`` writes it has no
    ``lm_head.weight`` (it is the embeddings): load it from those."""
    head = prefix + "lm_head.weight"
    embeddings = prefix + "model.embed_tokens.weight"
    if head not in state_dict and embeddings in state_dict:
        state_dict[head] = state_dict[embeddings]


def _check_attention_mask(
    mask: Tensor, B: int, T: int, start: int | Tensor, caches
) -> None:
    if not isinstance(mask, Tensor) or mask.is_floating_point():
        got = getattr(mask, "dtype", type(mask).__name__)
        raise TypeError(
            f"attention_mask must be an int or bool tensor of 0/1, got {got}"
        )
    widths = "T_k = cached + new positions"
    if caches is not None and caches[0].max_len is not None:
        widths += f" or the caches' max_len = {caches[0].max_len}"
    ok = mask.dim() == 2 and mask.shape[0] == B
    if not torch.compiler.is_compiling():  # start is a tensor there
        ok = ok and mask.shape[1] >= start + T
    if not ok:
        raise ValueError(
            f"attention_mask must have shape (B, T_k) with B = {B} and "
            f"{widths} (>= {start} + {T}), got shape {tuple(mask.shape)}"
        )
