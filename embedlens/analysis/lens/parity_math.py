"""Parity's per-row figures, in float64: each row's figure computed on one thread from that row
alone, the rows split among a pool of threads (the machine's cores), so that its bits depend on
the row, never on the thread count or the machine's load."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from embedlens.analysis.lens.blocks import Decoder

CHUNK = 64
"""Rows a task takes (each [CHUNK, V] in float64 while its figures are taken)."""
DECODE_ROWS = 256
"""Rows decoded at a time ([DECODE_ROWS, V] float32)."""


def rowwise(fn: Callable[..., tuple[Any, ...]], *tensors: torch.Tensor) -> list[Any]:
    """`fn` on CHUNK rows of `tensors` at a time, each task on one thread, the tasks spread over
    torch's threads; each of `fn`'s outputs (a tensor per row) concatenated in row order."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from embedlens.analysis.lens.blocks import one_thread

    n = len(tensors[0])
    spans = [(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)]
    workers = min(torch.get_num_threads(), len(spans))

    def task(span: tuple[int, int]) -> tuple[Any, ...]:
        torch.set_num_threads(1)  # this thread's reductions whole, wherever the setting lives
        return fn(*(t[span[0] : span[1]] for t in tensors))

    with one_thread():
        if workers <= 1:
            parts = [task(s) for s in spans]
        else:
            with ThreadPoolExecutor(workers) as pool:
                parts = list(pool.map(task, spans))
    if not parts:
        return []
    return [torch.cat([p[k] for p in parts]) for k in range(len(parts[0]))]


def distances(a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row, in float64: ‖a − b‖ / ‖b‖ (0 where both are 0, inf where only b is) and
    cos(a, b) = (‖a‖² + ‖b‖² − ‖a − b‖²) / (2 ‖a‖ ‖b‖), which is exactly 1 for equal rows."""
    import numpy as np

    if not len(a):
        return np.zeros(0), np.zeros(0)
    sa, sb, sd = (x.numpy() for x in rowwise(_squares, a, b))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(sd == 0, 0.0, np.sqrt(sd) / np.sqrt(sb))
        cos = np.where(sd == 0, 1.0, (sa + sb - sd) / (2 * np.sqrt(sa * sb)))
    return rel, np.nan_to_num(cos, nan=0.0)


def _squares(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, y = a.double(), b.double()
    return (x * x).sum(-1), (y * y).sum(-1), ((x - y) ** 2).sum(-1)


def kl_lse(za: torch.Tensor, zb: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Per row of logits, in float64: KL(softmax za ‖ softmax zb) in nats, as Σ p (za − zb) −
    lse(za) + lse(zb) (exactly 0 for equal rows), and the two log-sum-exps."""
    import numpy as np

    if not len(za):
        import torch

        empty = torch.zeros(0, dtype=torch.float64)
        return np.zeros(0), empty, empty
    kl, la, lb = rowwise(_kl, za, zb)
    return kl.numpy(), la, lb


def _kl(za: torch.Tensor, zb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    import torch

    a, b = za.double(), zb.double()
    la, lb = torch.logsumexp(a, -1), torch.logsumexp(b, -1)
    d = torch.sub(a, b, out=b)  # za − zb, exact in float64
    p = a.sub_(la[:, None]).exp_()
    if bool(torch.isinf(za).any()):
        d = torch.where(p > 0, d, 0.0)  # 0 log 0 = 0, where A gives a token none
    return (p.mul_(d).sum(-1) - la + lb).clamp_min(0.0), la, lb


def decode(decoder: Decoder, rows: torch.Tensor) -> torch.Tensor:
    """Float32 logits [P, V] of residual rows [P, H], DECODE_ROWS rows at a time."""
    import torch

    step = DECODE_ROWS
    parts = [decoder.logits(rows[i : i + step], ()).float() for i in range(0, len(rows), step)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else rows.new_zeros((0, 0), dtype=torch.float32)


def top1(logits: torch.Tensor, vocab: int) -> np.ndarray:
    """Each row's argmax among the real tokens (the lower id of equal maxima)."""
    return logits[:, :vocab].argmax(-1).numpy()


def next_deltas(
    za: torch.Tensor, zb: torch.Tensor, lse: tuple[torch.Tensor, torch.Tensor], nxt: list[int]
) -> np.ndarray:
    """log π_A(t) − log π_B(t) of each row's next token t, in float64 from the logits and each
    row's log-sum-exp (`kl_lse`'s)."""
    import numpy as np
    import torch

    if not nxt:
        return np.zeros(0)
    index = torch.tensor(nxt).unsqueeze(-1)
    la = za.gather(-1, index)[:, 0].double() - lse[0]
    lb = zb.gather(-1, index)[:, 0].double() - lse[1]
    return (la - lb).numpy()
