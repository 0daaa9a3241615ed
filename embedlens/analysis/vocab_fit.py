"""The checks that load the model: does it repeat a candidate token, and does it fit a tokenizer?

`--verify` asks the model to repeat each candidate under a few fixed prompts and keeps the highest
probability it gives the token; below 1% confirms the token as under-trained (as in "Fishing for
Magikarp"). `--check-fit` measures the mean next-token loss on short built-in texts with the ids
the tokenizer gives and with every id shifted by one: weights trained with this tokenizer score
far better on the first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from importlib import resources
from typing import Any

from embedlens.io.source import ModelSource
from embedlens.model.tokenizer import Vocab
from embedlens.reports.vocab import Fit, FitLanguage, Undertrained

CONFIRM_BELOW = 0.01
FIT_MARGIN = 2.0
LANGUAGES = {"en": "fit_en.txt", "zh": "fit_zh.txt"}
_BATCH = 16
_PLACE = "\x00TOKEN\x00"
# Each prompt shows the token a few times and ends where the model should write it once more.
PROMPTS = (
    "A copying machine prints back exactly what it is given.\n"
    f"Given: «{_PLACE}»\nPrinted: «{_PLACE}»\nGiven: «{_PLACE}»\nPrinted: «",
    f"Repeat after me, exactly.\nMe: {_PLACE}\nYou: {_PLACE}\nMe: {_PLACE}\nYou:",
    f"{_PLACE}{_PLACE}{_PLACE}{_PLACE}{_PLACE}{_PLACE}{_PLACE}{_PLACE}",
)


def builtin_text(language: str) -> str:
    """One of the built-in texts shipped with the package."""
    return (
        resources.files("embedlens")
        .joinpath("data")
        .joinpath(LANGUAGES[language])
        .read_text("utf-8")
    )


def _template(vocab: Vocab, prompt: str) -> list[int | None]:
    """The prompt's ids with None where the token goes."""
    out: list[int | None] = []
    parts = prompt.split(_PLACE)
    for k, part in enumerate(parts):
        if part:
            out.extend(vocab.encode(part))
        if k < len(parts) - 1:
            out.append(None)
    return out


def _bos(model: object) -> list[int]:
    config = getattr(model, "config", None)
    bos = getattr(config, "bos_token_id", None)
    return [bos] if isinstance(bos, int) else []


def load(source: ModelSource, *, dtype: str, device: str, trust_remote_code: bool) -> Any:
    """The model, loaded once for --verify and --check-fit."""
    from embedlens.model.loading import load_model

    return load_model(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def verify_candidates(
    model: Any,
    vocab: Vocab,
    scanned: Undertrained,
    *,
    max_verify: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> Undertrained:
    """The scan with the first `max_verify` candidates verified by asking the model."""
    import torch

    chosen = scanned.candidates[:max_verify]
    if not chosen:
        return scanned
    dev = next(model.parameters()).device
    bos = _bos(model)
    best = dict.fromkeys((c.id for c in chosen), 0.0)
    templates: list[list[int | None]] = [[*bos, *_template(vocab, p)] for p in PROMPTS]
    total = len(templates) * math.ceil(len(chosen) / _BATCH)
    done = 0
    for template in templates:
        for start in range(0, len(chosen), _BATCH):
            batch = [c.id for c in chosen[start : start + _BATCH]]
            ids = torch.tensor([[t if t is not None else tok for t in template] for tok in batch])
            with torch.inference_mode():
                logits = model(input_ids=ids.to(dev)).logits[:, -1, :].float()
            logp = torch.log_softmax(logits, dim=-1)
            for row, tok in enumerate(batch):
                best[tok] = max(best[tok], float(logp[row, tok].exp()))
            done += 1
            if on_progress is not None:
                on_progress(done, total)
    verified = [
        dataclasses.replace(
            c,
            repeat_prob=best[c.id],
            verdict="confirmed" if best[c.id] < CONFIRM_BELOW else "rejected",
        )
        if c.id in best
        else c
        for c in scanned.candidates
    ]
    confirmed = sum(1 for c in verified if c.verdict == "confirmed")
    rejected = sum(1 for c in verified if c.verdict == "rejected")
    counts = {
        "reference": scanned.counts["reference"],
        "confirmed": confirmed,
        "rejected": rejected,
        "candidate": len(verified) - confirmed - rejected,
        "ok": scanned.counts["ok"],
    }
    return dataclasses.replace(scanned, candidates=verified, counts=counts, verified=len(chosen))


def check_fit(model: Any, vocab: Vocab, name: str, *, rows: int) -> Fit:
    """Mean next-token loss per built-in text, as tokenized and with ids shifted by one."""
    import torch

    dev = next(model.parameters()).device
    bos = _bos(model)
    real = min(vocab.size, rows)
    out: list[FitLanguage] = []
    for language in LANGUAGES:
        ids = vocab.encode(builtin_text(language))
        if any(i >= rows for i in ids):  # the model cannot even look these ids up
            out.append(FitLanguage(language, len(ids), math.nan, math.nan, math.log(rows), False))
            continue
        shifted = [(i + 1) % real for i in ids]
        losses = [_loss(model, torch, bos + seq, dev) for seq in (ids, shifted)]
        out.append(
            FitLanguage(
                language=language,
                tokens=len(ids),
                loss=losses[0],
                shifted_loss=losses[1],
                uniform_loss=math.log(rows),
                fits=losses[1] - losses[0] >= FIT_MARGIN,
            )
        )
    return Fit(name, FIT_MARGIN, out, all(x.fits for x in out))


def _loss(model: Any, torch: Any, ids: list[int], dev: Any) -> float:
    """Mean next-token cross-entropy (nats) over the sequence."""
    t = torch.tensor([ids], device=dev)
    with torch.inference_mode():
        logits = model(input_ids=t).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, t[0, 1:]))
