"""The sites of one prompt decoded: `resid_mid` through the lens; `attn_out` and `mlp_out` two
ways, directly (the piece alone through the final norm and head: direct logit attribution) and
as the change they make to the lens (the lens after the piece against the lens before it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from embedlens.analysis.lens.blocks import Decoder
from embedlens.analysis.lens.engine import CHUNK_BYTES
from embedlens.analysis.lens.ranking import Top, best, exact_top1, exact_tops
from embedlens.analysis.lens.sites import Pieces
from embedlens.analysis.lens.stats import next_ids
from embedlens.errors import NumericError

Key = tuple[str, int]
"""(stream, layer): 'mid', 'attn', 'mlp' (the pieces), 'pre', 'post', 'pre+attn', 'pre+mlp'."""
PIECE = {"attn_out": "attn", "resid_mid": "mid", "mlp_out": "mlp"}


@dataclass(frozen=True)
class Change:
    """What a piece does to the lens at the position read: KL(after ‖ before) in nats, and the
    tokens whose log-probability rose the most (id, Δ log-probability, probability after)."""

    kl: float
    gained: list[tuple[int, float, float]]


@dataclass(frozen=True)
class SiteRows:
    """A prompt's sites decoded: (site, layer, position) -> the top-k at the position read (the
    top-1 elsewhere); (site, layer) -> a piece's change at the position read."""

    rows: dict[tuple[str, int, int], Top]
    changes: dict[tuple[str, int], Change]


@dataclass(frozen=True)
class SiteJob:
    """What to decode: the sites other than resid at `layers`, at `positions` (indices into the
    pieces' rows are their order), the one at `index` in full."""

    sites: Sequence[str]
    layers: Sequence[int]
    positions: Sequence[int]
    index: int
    k: int
    real_vocab: int
    target: int | None
    ids: Sequence[int] = ()
    """The prompt's ids (each row's next token)."""


def before_after(piece: str, layer: int, pieces: Pieces) -> tuple[Key, Key]:
    """The streams a piece's change is read between: attention from the block's input to
    resid_mid, the MLP from resid_mid to the output (in a parallel block, each from the input to
    the input plus the piece)."""
    if layer not in pieces.mid:
        return ("pre", layer), ("pre+" + piece, layer)
    if piece == "attn":
        return ("pre", layer), ("mid", layer)
    return ("mid", layer), ("post", layer)


def stream(key: Key, pieces: Pieces) -> torch.Tensor:
    """The rows [P, d] of one stream."""
    name, layer = key
    piece: dict[int, torch.Tensor] = getattr(pieces, name.removeprefix("pre+"))
    return pieces.pre[layer] + piece[layer] if name.startswith("pre+") else piece[layer]


def decode_sites(
    job: SiteJob, pieces: Pieces, decoder: Decoder, device: torch.device, vocab: int
) -> SiteRows:
    """Every site row of `job` through the decoder, in bounded chunks."""
    full = job.positions.index(job.index)
    wanted: list[tuple[Key, int]] = []
    for layer in job.layers:
        for site in job.sites:
            piece = PIECE[site]
            wanted += [((piece, layer), j) for j in range(len(job.positions))]
            if piece != "mid":
                for key in before_after(piece, layer, pieces):
                    if (key, full) not in wanted:
                        wanted.append((key, full))
    logits = dict(decoded_rows(decoder, pieces, wanted, device, vocab))
    rows: dict[tuple[str, int, int], Top] = {}
    changes: dict[tuple[str, int], Change] = {}
    for layer in job.layers:
        for site in job.sites:
            piece = PIECE[site]
            at = [logits[(piece, layer), j] for j in range(len(job.positions))]
            rows.update(_tops(job, site, layer, at))
            if piece != "mid":
                before, after = before_after(piece, layer, pieces)
                changes[(site, layer)] = change(
                    logits[before, full], logits[after, full], job.k, job.real_vocab
                )
    return SiteRows(rows, changes)


def _tops(
    job: SiteJob, site: str, layer: int, logits: list[torch.Tensor]
) -> dict[tuple[str, int, int], Top]:
    """One site's rows at one layer reduced: the position read to its top-k, the others to
    their top-1."""
    out: dict[tuple[str, int, int], Top] = {}
    x = torch.stack(logits)
    ones = exact_top1(x, job.real_vocab)
    for j, p in enumerate(job.positions):
        if p == job.index:
            nexts = next_ids(job.ids, [p])
            out[(site, layer, p)] = exact_tops(
                x[j : j + 1], job.k, job.real_vocab, job.target, nexts
            )[0]
        else:
            out[(site, layer, p)] = ones[j]
    return out


def change(before: torch.Tensor, after: torch.Tensor, k: int, real_vocab: int) -> Change:
    """KL(after ‖ before) over the whole output, and the k real tokens gained the most."""
    lb = torch.log_softmax(before.double(), -1)
    la = torch.log_softmax(after.double(), -1)
    kl = float((la.exp() * (la - lb)).sum())
    delta = (la - lb)[:real_vocab]
    ids = best(delta[None].float(), k)[0].tolist()
    return Change(max(kl, 0.0), [(i, float(delta[i]), float(la[i].exp())) for i in ids])


def decoded_rows(
    decoder: Decoder,
    pieces: Pieces,
    wanted: list[tuple[Key, int]],
    device: torch.device,
    vocab: int,
) -> Iterator[tuple[tuple[Key, int], torch.Tensor]]:
    """Each wanted (stream, row) decoded: float32 logits [V], in chunks of bounded size."""
    streams = {key: stream(key, pieces) for key in dict.fromkeys(k for k, _ in wanted)}
    chunk = max(1, CHUNK_BYTES // (4 * vocab))
    for start in range(0, len(wanted), chunk):
        part = wanted[start : start + chunk]
        h = torch.stack([streams[key][j] for key, j in part]).to(device)
        out = decoder.logits(h, [key[1] for key, _ in part]).float()
        _finite(out, part)
        yield from zip(part, out, strict=True)


def _finite(out: torch.Tensor, part: list[tuple[Key, int]]) -> None:
    """Refuse a decoded row that is not finite."""
    bad = ~torch.isfinite(out).all(-1)
    if bool(bad.any()):
        (name, layer), _ = part[int(bad.nonzero()[0, 0])]
        raise NumericError(
            f"decoding {name} of block {layer} through the model's final steps gives logits "
            "that are not finite: that site cannot be read",
            hint="in a 16-bit dtype the lens can overflow: try --dtype float32",
        )
