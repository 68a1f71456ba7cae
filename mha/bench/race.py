"""The race protocol of the attention kernels: reruns compared bit for bit.

flash-attention's own test (``test_flash_attn_race_condition``) runs the
same call several times and demands bitwise equal results: a kernel with no
atomic additions has no reason to differ between runs, so any difference is
a race (a missing barrier, a read of memory nothing wrote, a miscompiled
shared-memory exchange). :func:`race_case` does that for one shape, forward
and every gradient, and measures the error of the kernels and of torch's own
``F.scaled_dot_product_attention`` against float64 on the same inputs.

:data:`GPU_GRID` covers T in {97, 113, 257, 300, 799, 1023, 1024} with every
head size in {64, 80, 96, 128, 256} once, in float16 and bfloat16, causal
and not, T_q != T_k, GQA, key starts and sinks in turn, and 3 cases of the
backward's ``Techniques.split_group``; :data:`CPU_GRID` is a small one for
Triton's interpreter. ``make gpu-check`` runs the GPU grid.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from torch.nn import functional as F

__all__ = ["RaceCase", "GPU_GRID", "CPU_GRID", "race_case", "failures"]
__all__ += ["relative_error"]

#: The gradients and outputs compared, in this order.
TENSORS = ("out", "dq", "dk", "dv", "dsinks")


@dataclass(frozen=True)
class RaceCase:
    """One shape of the race grid."""

    t_q: int
    t_k: int
    head_dim: int
    dtype: str  # "float16", "bfloat16", "float32"
    causal: bool
    heads: int = 4
    kv_heads: int = 4
    batch: int = 2
    key_start: bool = False  # left padding: row b's first keys hidden
    sinks: bool = False  # gpt-oss's learned sink logits
    split_group: bool = False  # Techniques.split_group: the backward's dk, dv

    @property
    def name(self) -> str:
        """A short label, as pytest shows it."""
        extras = [
            f"gqa{self.heads}/{self.kv_heads}"
            if self.kv_heads != self.heads
            else "",
            "keystart" if self.key_start else "",
            "sinks" if self.sinks else "",
            "split" if self.split_group else "",
            "causal" if self.causal else "",
        ]
        label = f"{self.dtype}-d{self.head_dim}-{self.t_q}x{self.t_k}"
        return "-".join([label, *filter(None, extras)])


def _gpu_grid() -> list[RaceCase]:
    lengths = (97, 113, 257, 300, 799, 1023, 1024)
    cases = []
    for i, head_dim in enumerate((64, 80, 96, 128, 256)):
        for j, t_k in enumerate(lengths):
            n = i * len(lengths) + j
            # every other case has fewer queries than keys (a chunk of a
            # prompt after a cache): T_q from the list too, below T_k
            t_q = lengths[j - 1] if n % 2 and j > 0 else t_k
            cases.append(
                RaceCase(
                    t_q=t_q,
                    t_k=t_k,
                    head_dim=head_dim,
                    dtype=("float16", "bfloat16")[n % 2],
                    causal=bool(n // 2 % 2),
                    heads=4 if n % 3 else 8,
                    kv_heads=(4, 2, 4)[n % 3] if n % 3 else 2,
                    key_start=n % 5 == 1,
                    sinks=n % 5 == 3,
                )
            )
    # the backward with a GQA group's dk and dv split over programs
    for n, (t, head_dim) in enumerate(((300, 64), (1023, 128), (799, 96))):
        cases.append(
            RaceCase(
                t_q=t,
                t_k=t,
                head_dim=head_dim,
                dtype=("float16", "bfloat16")[n % 2],
                causal=n != 2,
                heads=8,
                kv_heads=2,
                key_start=n == 1,
                split_group=True,
            )  # fmt: skip
        )
    return cases


#: 38 cases: each head size meets each length once; dtype, causal, T_q !=
#: T_k, GQA, key starts and sinks in turn; then 3 with the backward's
#: ``split_group`` switch.
GPU_GRID = _gpu_grid()

#: The interpreter's grid: small, float32 and float16 (bfloat16's tl.dot is
#: wrong there), ragged lengths, each feature once.
CPU_GRID = [
    RaceCase(33, 33, 16, "float32", False, heads=2, kv_heads=2, batch=2),
    RaceCase(17, 40, 40, "float16", True, heads=4, kv_heads=2, batch=3),
    RaceCase(21, 37, 24, "float32", True, heads=2, kv_heads=1, key_start=True),
    RaceCase(19, 19, 32, "float16", False, heads=2, kv_heads=2, sinks=True),
    RaceCase(
        23, 23, 32, "float32", True, heads=4, kv_heads=2, split_group=True
    ),
]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64 (0 when both are zero)."""
    got, want = got.double(), want.double()
    norm = want.norm().item()
    diff = (got - want).norm().item()
    return diff / norm if norm else diff


def _inputs(case: RaceCase, device: torch.device, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    b, h, h_kv, d = case.batch, case.heads, case.kv_heads, case.head_dim

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(
            device=device, dtype=dtype
        )

    q, k, v = (
        draw(b, h, case.t_q, d),
        draw(b, h_kv, case.t_k, d),
        draw(b, h_kv, case.t_k, d),
    )
    d_out = draw(b, h, case.t_q, d)
    key_start = None
    if case.key_start:  # row b's first keys are padding; every query sees
        # at least one key (a causal query i sees keys up to i + T_k - T_q)
        most = case.t_k - case.t_q if case.causal else case.t_k - 1
        starts = torch.randint(0, most + 1, (b,), generator=gen)
        key_start = starts.to(device=device, dtype=torch.int32)
    sinks = torch.randn(h, generator=gen).to(device) if case.sinks else None
    return q, k, v, d_out, key_start, sinks


def _mask(case: RaceCase, key_start, device) -> torch.Tensor | None:
    """(B, 1, T_q, T_k) boolean, True = may attend; None: every key."""
    if not case.causal and key_start is None:
        return None
    cols = torch.arange(case.t_k, device=device)
    rows = torch.arange(case.t_q, device=device)
    keep = torch.ones(case.t_q, case.t_k, dtype=torch.bool, device=device)
    if case.causal:  # bottom-right
        keep = cols[None, :] <= rows[:, None] + (case.t_k - case.t_q)
    keep = keep[None, None].expand(case.batch, 1, -1, -1)
    if key_start is not None:
        keep = keep & (cols >= key_start[:, None].long())[:, None, None, :]
    return keep


def _torch_attention(q, k, v, mask, sinks):
    """SDPA on repeated keys; a sink is one more key of zeros whose score is
    the sink logit (an additive mask column) and whose value is zero."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    b, h, t_q, _ = q.shape
    zeros = k.new_zeros(b, h, 1, k.shape[-1])
    k, v = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)
    bias = q.new_zeros(b, h, t_q, k.shape[2])
    if mask is not None:
        bias[..., :-1] = bias[..., :-1].masked_fill(~mask, -math.inf)
    bias[..., -1] = sinks.to(q.dtype)[None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _gradients(run, leaves, d_out):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = run(*leaves)
    grads = torch.autograd.grad(out, leaves, d_out)
    return [out.detach(), *grads]


def race_case(
    case: RaceCase,
    device: torch.device | str,
    *,
    reruns: int = 3,
    seed: int = 0,
) -> dict:
    """Run ``case`` ``reruns`` times through the kernels
    (:func:`mha.kernels.triton_attention`, forward and backward), and once
    through SDPA and in float64.

    Returns the case's fields and, per tensor (out, dq, dk, dv, and dsinks
    with sinks): ``differ`` (elements of any rerun not bitwise equal to the
    first), ``error`` and ``sdpa_error`` (relative to float64), and
    ``unwritten`` (non-finite elements in the kernels' result).
    """
    from .. import kernels

    device = torch.device(device)
    q, k, v, d_out, key_start, sinks = _inputs(case, device, seed)
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])

    techniques = None  # the defaults
    if case.split_group:
        from ..kernels.tiles import capability_of, default_techniques

        defaults = default_techniques(capability_of(device))
        techniques = replace(defaults, split_group=True)

    def ours(q, k, v, s=None):
        return kernels.triton_attention(
            q, k, v, causal=case.causal, key_start=key_start, sinks=s,
            techniques=techniques,
        )  # fmt: skip

    mask = _mask(case, key_start, device)
    runs = [_gradients(ours, leaves, d_out) for _ in range(reruns)]
    sdpa = _gradients(
        lambda *t: _torch_attention(
            *t[:3], mask, t[3] if sinks is not None else None
        ),
        leaves,
        d_out,
    )
    exact = _gradients(  # float64 leaves: gradients unrounded too
        lambda *t: _torch_attention(
            *t[:3], mask, t[3] if sinks is not None else None
        ),
        [t.double() for t in leaves],
        d_out.double(),
    )
    result = {"case": case.name, **asdict(case), "reruns": reruns}
    for i, name in enumerate(TENSORS[: len(runs[0])]):
        first = runs[0][i]
        result[name] = {
            "differ": sum(
                int((run[i].view(-1) != first.view(-1)).sum())
                for run in runs[1:]
            ),
            "unwritten": int((~torch.isfinite(first)).sum()),
            "error": relative_error(first, exact[i]),
            "sdpa_error": relative_error(sdpa[i], exact[i]),
        }
    return result


def failures(
    result: dict, *, factor: float = 2.0, floor: float = 1e-4
) -> list[str]:
    """What in one :func:`race_case` result breaks the protocol: a rerun
    that differs, a non-finite element, an error above ``factor`` times
    SDPA's plus ``floor``."""
    found = []
    for name in TENSORS:
        if name not in result:
            continue
        row = result[name]
        if row["differ"]:
            found.append(
                f"{name}: {row['differ']} elements differ between reruns"
            )
        if row["unwritten"]:
            found.append(f"{name}: {row['unwritten']} elements not finite")
        bound = factor * row["sdpa_error"] + floor
        if not row["error"] <= bound:
            found.append(
                f"{name}: error {row['error']:.2e} against float64, above "
                f"{factor} x SDPA's {row['sdpa_error']:.2e} + {floor:g}"
            )
    return found
