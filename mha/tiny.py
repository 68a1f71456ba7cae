"""A tiny two-layer attention model and the synthetic induction task it learns.

The task (chapter 10): a sequence of distinct random tokens in which one
segment appears a second time, later, at a random place. Inside the second copy
the next token is predictable, but only by *induction*: find the earlier
occurrence of the current token and read the token that followed it. That takes
two steps, so it takes two layers: a head in layer 0 that copies each
position's previous token into it, and a head in layer 1 that matches on that
copied information. Because the copy's place is random, no purely positional
rule solves it.

Shapes: ``N`` or ``B`` sequences, ``T`` positions, ``V`` vocabulary size,
``D`` = d_model, ``L`` attention layers, ``H`` heads per layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._validate import check_divisible, check_int
from .module import MultiHeadAttention

__all__ = [
    "InductionData",
    "make_induction_data",
    "TinyTransformer",
    "logits_of",
    "masked_loss_and_accuracy",
    "evaluate",
    "head_mask_without",
    "train",
    "warmup_cosine",
    "head_scores",
    "head_importance",
    "head_value_norms",
]


@dataclass(frozen=True)
class InductionData:
    """A batch of the induction task.

    Attributes:
        tokens: (N, T) int64 token ids.
        targets: (N, T) int64, ``targets[:, t] = tokens[:, t + 1]`` (the last
            position repeats its own token; it is never predictable).
        predictable: (N, T) bool, True where the next token can be inferred:
            positions ``copy_start .. copy_start + segment_len - 2``.
        source_start: (N,) int64, where the segment first occurs.
        copy_start: (N,) int64, where its second copy begins
            (``copy_start >= source_start + segment_len``).
        segment_len: length of the repeated segment.
    """

    tokens: Tensor
    targets: Tensor
    predictable: Tensor
    source_start: Tensor
    copy_start: Tensor
    segment_len: int

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: slice | Tensor) -> InductionData:
        """The sequences selected by ``index``, as a new batch.

        ``index`` is a slice or an index tensor.
        """
        return InductionData(
            self.tokens[index],
            self.targets[index],
            self.predictable[index],
            self.source_start[index],
            self.copy_start[index],
            self.segment_len,
        )


def make_induction_data(
    num_sequences: int,
    *,
    seq_len: int = 16,
    vocab_size: int = 16,
    segment_len: int = 6,
    generator: torch.Generator | None = None,
) -> InductionData:
    """Draw ``num_sequences`` sequences of the induction task.

    Each sequence starts as ``seq_len - segment_len`` distinct tokens (a random
    draw without replacement from ``range(vocab_size)``). A segment
    ``base[a : a + segment_len]`` is then inserted again at position
    ``b >= a + segment_len``, with ``a`` and ``b`` uniform over their allowed
    ranges. So every token occurs once, except the segment's, which occur
    twice.
    """
    check_int("num_sequences", num_sequences)
    check_int("segment_len", segment_len, minimum=2)
    check_int("seq_len", seq_len)
    check_int("vocab_size", vocab_size)
    base_len = seq_len - segment_len
    if base_len < segment_len:
        raise ValueError(
            f"seq_len must be >= 2 * segment_len = {2 * segment_len}, "
            f"got seq_len={seq_len}"
        )
    if vocab_size < base_len:
        raise ValueError(
            f"vocab_size must be >= seq_len - segment_len = {base_len} "
            f"(tokens are distinct), got {vocab_size}"
        )
    n = num_sequences
    # Distinct tokens per row: the first base_len entries of a random
    # permutation.
    order = torch.rand(n, vocab_size, generator=generator).argsort(dim=1)
    base = order[:, :base_len]  # (N, base_len)
    # Source start a in [0, base_len - segment_len]; insertion point b in
    # [a + segment_len, base_len].
    a = (
        torch.rand(n, generator=generator) * (base_len - segment_len + 1)
    ).long()  # (N,)
    span = base_len - (a + segment_len) + 1  # number of allowed b values, >= 1
    # (N,)
    b = a + segment_len + (torch.rand(n, generator=generator) * span).long()

    pos = torch.arange(seq_len)  # (T,)
    in_copy = (pos >= b[:, None]) & (pos < b[:, None] + segment_len)  # (N, T)
    # Where each output position reads from in `base`.
    # (N, T) before / after the copy
    from_base = torch.where(pos < b[:, None], pos, pos - segment_len)
    from_seg = a[:, None] + (pos - b[:, None])  # (N, T) inside the copy
    # (N, T), values in [0, base_len)
    index = torch.where(in_copy, from_seg, from_base)
    tokens = base.gather(1, index)  # (N, T)

    targets = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # (N, T)
    # (N, T)
    predictable = (pos >= b[:, None]) & (pos < b[:, None] + segment_len - 1)
    return InductionData(tokens, targets, predictable, a, b, segment_len)


class TinyTransformer(nn.Module):
    """Embeddings, ``num_layers`` attention layers, one MLP, an output head.

    The embeddings are token + learned position embeddings. Each attention
    layer is pre-LayerNorm and residual: ``x = x + attn(ln(x))``, with
    :class:`mha.MultiHeadAttention` (no biases, so a layer whose heads are all
    switched off adds exactly zero). Then ``x = x + mlp(ln(x))`` once, and
    ``logits = head(ln(x))``. Attention is causal.
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int = 32,
        num_heads: int = 4,
        num_layers: int = 2,
        d_mlp: int = 64,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("max_len", max_len),
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("num_layers", num_layers),
            ("d_mlp", d_mlp),
        ):
            check_int(name, value)
        check_divisible("d_model", d_model, "num_heads", num_heads)
        self.vocab_size, self.max_len = vocab_size, max_len
        self.d_model, self.num_heads, self.num_layers = (
            d_model,
            num_heads,
            num_layers,
        )
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.attn_norms = nn.ModuleList(
            nn.LayerNorm(d_model) for _ in range(num_layers)
        )
        self.attns = nn.ModuleList(
            MultiHeadAttention(
                d_model, num_heads, bias=False, batch_first=True
            )
            for _ in range(num_layers)
        )
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_mlp), nn.GELU(), nn.Linear(d_mlp, d_model)
        )
        self.out_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def _check_head_mask(
        self, head_mask: Tensor | None, batch: int
    ) -> Tensor | None:
        if head_mask is None:
            return None
        shapes = [
            (self.num_layers, self.num_heads),
            (batch, self.num_layers, self.num_heads),
        ]
        if tuple(head_mask.shape) not in shapes:
            raise ValueError(
                f"head_mask must have shape (L, H) or (B, L, H) = {shapes}, "
                f"got {tuple(head_mask.shape)}"
            )
        return head_mask

    def forward(
        self,
        tokens: Tensor,
        head_mask: Tensor | None = None,
        return_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Next-token logits.

        Args:
            tokens: (B, T) int64 with T <= max_len.
            head_mask: optional (L, H) or (B, L, H); entry (l, h) multiplies
                head h of layer l (1 = keep, 0 = switch off), passed on to
                that layer's ``head_mask``.
            return_weights: also return each layer's per-head attention
                weights.

        Returns:
            logits (B, T, V) and, if ``return_weights``, a list of L tensors
            (B, H, T, T), else None.
        """
        if tokens.dim() != 2:
            raise ValueError(
                f"tokens must have shape (B, T), got {tuple(tokens.shape)}"
            )
        batch, seq_len = tokens.shape
        if seq_len > self.max_len:
            raise ValueError(
                f"tokens has T={seq_len} positions, "
                f"more than max_len={self.max_len}"
            )
        head_mask = self._check_head_mask(head_mask, batch)
        positions = torch.arange(seq_len, device=tokens.device)  # (T,)
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, T, D)
        all_weights: list[Tensor] = []
        for layer, (norm, attn) in enumerate(zip(self.attn_norms, self.attns)):
            # (H,) or (B, H)
            layer_mask = (
                None if head_mask is None else head_mask[..., layer, :]
            )
            h = norm(x)
            # is_causal=True: query t sees keys 0..t (the module builds the
            # mask, or SDPA applies it).
            out, weights = attn(
                h,
                h,
                h,
                need_weights=return_weights,
                is_causal=True,
                average_attn_weights=False,
                head_mask=layer_mask,
            )  # out (B, T, D), weights (B, H, T, T) or None
            x = x + out
            if return_weights:
                all_weights.append(weights)
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, D)
        logits = self.head(self.out_norm(x))  # (B, T, V)
        return logits, (all_weights if return_weights else None)


def logits_of(model: nn.Module, tokens: Tensor, **options: Any) -> Tensor:
    """The (N, T, V) logits of ``model`` for ``tokens`` (N, T).

    A :class:`TinyTransformer` returns ``(logits, weights)``, a
    :class:`mha.decoding.Decoder` the logits alone: :func:`train` and
    :func:`evaluate` take either.
    """
    output = model(tokens, **options)
    return output[0] if isinstance(output, tuple) else output


def masked_loss_and_accuracy(
    logits: Tensor, data: InductionData
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and accuracy of (N, T, V) logits.

    Only the predictable positions count.
    """
    # (P, V), P = number of predictable positions
    picked = logits[data.predictable]
    target = data.targets[data.predictable]  # (P,)
    loss = F.cross_entropy(picked, target)
    accuracy = (picked.argmax(dim=-1) == target).float().mean()
    return loss, accuracy


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: InductionData,
    head_mask: Tensor | None = None,
) -> tuple[float, float]:
    """(loss, accuracy) of ``model`` on ``data``; optional (L, H) head mask."""
    model.eval()
    options = {} if head_mask is None else {"head_mask": head_mask}
    logits = logits_of(model, data.tokens, **options)
    loss, accuracy = masked_loss_and_accuracy(logits, data)
    return loss.item(), accuracy.item()


def head_mask_without(
    model: TinyTransformer, removed: Iterable[tuple[int, int]]
) -> Tensor:
    """(L, H) head mask of ones with a zero at each head in ``removed``.

    ``removed`` holds ``(layer, head)`` pairs.
    """
    mask = torch.ones(model.num_layers, model.num_heads)  # (L, H)
    for layer, head in removed:
        if not (0 <= layer < model.num_layers and 0 <= head < model.num_heads):
            raise ValueError(
                "removed heads must be (layer, head) with "
                f"layer < {model.num_layers} and head < {model.num_heads}, "
                f"got {(layer, head)}"
            )
        mask[layer, head] = 0.0
    return mask


def warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over the first 5% of ``steps``, then cosine decay."""
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def train(
    model: nn.Module,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-2,
    seed: int = 0,
    seq_len: int = 16,
    segment_len: int = 6,
    log_every: int = 0,
) -> list[float]:
    """Train with AdamW on fresh batches.

    ``model`` maps tokens to logits (:func:`logits_of`) and has a
    ``vocab_size``. The batches are drawn from a generator seeded with
    ``seed``. Returns the training loss of every step. Same model
    initialisation + same seed + same thread count give the same numbers on
    the same machine.
    """
    check_int("steps", steps)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = warmup_cosine(optimizer, steps)
    losses: list[float] = []
    model.train()
    for step in range(steps):
        data = make_induction_data(
            batch_size,
            seq_len=seq_len,
            vocab_size=model.vocab_size,
            segment_len=segment_len,
            generator=generator,
        )
        logits = logits_of(model, data.tokens)
        loss, _ = masked_loss_and_accuracy(logits, data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}")
    model.eval()
    return losses


@torch.no_grad()
def head_scores(
    weights: list[Tensor] | Tensor, data: InductionData
) -> dict[str, Tensor]:
    """Measure what each head attends to.

    ``weights``: L tensors (N, H, T, T), or one (L, N, H, T, T).

    Returns a dict of (L, H) tensors, each the head's average attention
    weight on:

    * ``"previous"``: key ``t - 1``, averaged over queries ``t >= 1``;
    * ``"previous_source"``: key ``t - 1``, over the queries of the first copy
      after its first token (``a + 1 .. a + S - 1``): the keys an induction
      head must find (the answers' positions);
    * ``"self"``: key ``t``, over queries ``t >= 1`` (query 0 can only see
      itself);
    * ``"first"``: key 0, over queries ``t >= 1``;
    * ``"match"``: the earlier occurrence of the query's own token, over
      queries in the copy;
    * ``"induction"``: the token *after* that earlier occurrence, over the
      predictable queries (the answer to copy).
    """
    # (L, N, H, T, T)
    w = (
        torch.stack(list(weights))
        if isinstance(weights, (list, tuple))
        else weights
    )
    seq_len = w.shape[-1]
    t = torch.arange(seq_len)
    # (L, N, H, T - 1), queries 1 .. T - 1
    on_previous = w[..., t[1:], t[1:] - 1]
    previous = on_previous.mean(dim=(1, 3))  # (L, H)
    self_ = w[..., t[1:], t[1:]].mean(dim=(1, 3))  # (L, H)
    first = w[..., t[1:], 0].mean(dim=(1, 3))  # (L, H)

    # Inside the copy, query t = b + i holds the token of position a + i.
    in_copy = (t >= data.copy_start[:, None]) & (
        t < data.copy_start[:, None] + data.segment_len
    )  # (N, T)
    in_source = (t > data.source_start[:, None]) & (
        t < data.source_start[:, None] + data.segment_len
    )  # (N, T)
    earlier = (
        data.source_start[:, None] + t - data.copy_start[:, None]
    ).clamp(0, seq_len - 1)  # (N, T)
    after = (earlier + 1).clamp(max=seq_len - 1)  # (N, T)
    # Gather w[l, n, h, t, earlier[n, t]] for every (l, n, h, t).
    # (L, N, H, T, 1) each
    idx_match = earlier[None, :, None, :, None].expand(*w.shape[:-1], 1)
    idx_after = after[None, :, None, :, None].expand(*w.shape[:-1], 1)
    on_match = w.gather(-1, idx_match)[..., 0]  # (L, N, H, T)
    on_after = w.gather(-1, idx_after)[..., 0]  # (L, N, H, T)
    sel_copy = in_copy[None, :, None, :].float()  # (1, N, 1, T)
    sel_pred = data.predictable[None, :, None, :].float()  # (1, N, 1, T)
    # (1, N, 1, T - 1), queries 1 .. T - 1 (a + 1 >= 1)
    sel_source = in_source[None, :, None, 1:].float()
    source_total = (on_previous * sel_source).sum(dim=(1, 3))  # (L, H)
    previous_source = source_total / sel_source.sum()  # (L, H)
    match = (on_match * sel_copy).sum(dim=(1, 3)) / sel_copy.sum()  # (L, H)
    # (L, H)
    induction = (on_after * sel_pred).sum(dim=(1, 3)) / sel_pred.sum()
    return {
        "previous": previous,
        "previous_source": previous_source,
        "self": self_,
        "first": first,
        "match": match,
        "induction": induction,
    }


def head_importance(
    model: TinyTransformer,
    data: InductionData,
    head_mask: Tensor | None = None,
) -> Tensor:
    """Gradient-based head importance of Michel et al. (2019).

    ``I_h = mean_x |dL(x)/d xi_h|``, where ``xi`` is a (B, L, H) head mask,
    all ones or a copy of the (L, H) ``head_mask`` for every example (to score
    the heads that are left after some were removed); one backward pass of the
    summed per-example losses gives every example's own derivative (example
    b's loss depends only on ``xi[b]``). Returns (L, H).
    """
    model.eval()
    dtype = model.head.weight.dtype
    base = (
        torch.ones(model.num_layers, model.num_heads, dtype=dtype)
        if head_mask is None
        else head_mask.to(dtype)
    )
    # (B, L, H)
    xi = base.expand(len(data), -1, -1).clone().requires_grad_(True)
    logits, _ = model(data.tokens, head_mask=xi)
    picked = logits[data.predictable]  # (P, V)
    loss_per_position = F.cross_entropy(
        picked, data.targets[data.predictable], reduction="none"
    )  # (P,)
    # Average over each example's predictable positions, then sum over
    # examples.
    # (P,) which example each position belongs to
    rows = data.predictable.nonzero()[:, 0]
    counts = data.predictable.sum(dim=1).clamp(min=1).float()  # (B,)
    loss = (loss_per_position / counts[rows]).sum()
    (grad,) = torch.autograd.grad(loss, xi)  # (B, L, H)
    return grad.abs().mean(dim=0)  # (L, H)


@torch.no_grad()
def head_value_norms(model: TinyTransformer, tokens: Tensor) -> Tensor:
    """How much each head writes per unit of attention weight, (L, H).

    Head h of layer l adds ``w[t, j] * f_h(x_j)`` to query t's output for each
    key j, where ``f_h(x_j) = x_j W_V^(h) W_O^(h)`` is key j's value vector
    (``x_j``: the layer's normalised input at position j) mapped to the model
    width by the head's columns of the output projection. The weights say
    where a head looks; ``||f_h(x_j)||`` is the other factor of what it adds
    (Kobayashi et al., 2020). Returns the mean of ``||f_h(x_j)||`` over the
    sequences and positions of ``tokens`` (B, T). The value bias, if any, is
    part of ``f_h``; the output projection's bias belongs to no head.
    """
    inputs: list[Tensor] = []  # each layer's normalised input, (B, T, D)
    hooks = [
        attn.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
        for attn in model.attns
    ]
    try:
        model.eval()
        model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    d_model, num_heads = model.d_model, model.num_heads
    norms = []
    for attn, x in zip(model.attns, inputs):
        w_v = attn.in_proj_weight[2 * d_model :]  # (D, D)
        b_v = (
            None
            if attn.in_proj_bias is None
            else attn.in_proj_bias[2 * d_model :]
        )
        # (B, T, H, d_k)
        v = F.linear(x, w_v, b_v).unflatten(-1, (num_heads, -1))
        # (D, H, d_k): the output projection's columns, head by head
        w_o = attn.out_proj.weight.unflatten(1, (num_heads, -1))
        f = torch.einsum("bthk,dhk->bthd", v, w_o)  # (B, T, H, D)
        norms.append(f.norm(dim=-1).mean(dim=(0, 1)))  # (H,)
    return torch.stack(norms)  # (L, H)
