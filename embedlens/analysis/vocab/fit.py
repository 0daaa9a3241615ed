"""The checks that load the model: does it repeat a candidate token, and does it fit a tokenizer?

`--verify` asks the model to repeat each candidate under a few fixed prompts and keeps the highest
probability it gives the token; below 1% confirms the token as under-trained (as in "Fishing for
Magikarp"). `--check-fit` measures the mean next-token loss on short built-in texts with the ids
the tokenizer gives, with every id shifted by one (weights trained with this tokenizer score far
better on the first), and against a reference: the model's own tokenizer on the same text when
another tokenizer is checked, else the loss expected of a trained model (`EXPECTED`). A
vocabulary shifted past some id moves only the rarer tokens: the shift contrast barely notices,
the rise over the reference does.
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from typing import Any

from embedlens.errors import CheckpointError, SourceError, UnsupportedError
from embedlens.io.gguf import GGUFHeader
from embedlens.io.source import ModelSource
from embedlens.model.tokenizer import Vocab, load_vocab
from embedlens.progress import Progress, no_progress
from embedlens.reports.vocab import Fit, FitLanguage, Undertrained

CONFIRM_BELOW = 0.01
FIT_MARGIN = 2.0
OWN_RISE = 0.25
"""The most a text may cost over the model's own tokenizer, in nats per own token."""
EXPECTED = {"en": 3.4, "zh": 4.2}
"""A trained model's loss on each built-in text with its own tokenizer, at most: the higher of
SmolLM2-135M-Instruct's (Q4_1 GGUF: 3.35 and 2.78) and Gemma 3 270M's (Q4_K_M GGUF: 3.06 and
4.11), rounded up to 0.1."""
EXPECTED_RISE = 1.5
"""The most a text's loss may exceed EXPECTED (the two models differ by up to 1.33)."""
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
    progress: Progress = no_progress,
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
            progress("verifying", done, total, "batches")
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


def own_reference(
    source: ModelSource, gguf: GGUFHeader | None, rows: int
) -> tuple[Vocab | None, str | None]:
    """The model's own tokenizer to judge another against, or None and why it cannot be."""
    try:
        own = load_vocab(source, gguf)
        ids = [i for language in LANGUAGES for i in own.encode(builtin_text(language))]
    except (UnsupportedError, CheckpointError, SourceError) as e:
        return None, f"its own tokenizer cannot be read ({e.message})"
    if any(i >= rows for i in ids):
        return None, "its own tokenizer gives ids past the model's rows"
    return own, None


def _fits_positions(model: Any, n: int) -> None:
    """A built-in text longer than the model's positions is refused, once the model failed on
    it (rotary models run past `max_position_embeddings`; a learned position table cannot)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and n > limit:
        raise UnsupportedError(
            f"--check-fit scores built-in texts, one of {n} tokens, and this model "
            f"takes {limit} positions"
        )


def check_fit(
    model: Any, vocab: Vocab, name: str, *, rows: int, own: Vocab | None, is_own: bool
) -> Fit:
    """Mean next-token loss per built-in text, as tokenized, with ids shifted by one, and against
    the reference: `own` (the model's own tokenizer) when given and not the one checked
    (`is_own`), else EXPECTED."""
    import torch

    dev = next(model.parameters()).device
    bos = _bos(model)
    real = min(vocab.size, rows)
    compared = own is not None and not is_own

    def measured(ids: list[int]) -> float:
        try:
            return _loss(model, torch, bos + ids, dev)
        except IndexError:  # a learned position table shorter than the text (GPT-2's wpe)
            _fits_positions(model, len(bos + ids))
            raise

    out: list[FitLanguage] = []
    for language in LANGUAGES:
        text = builtin_text(language)
        ids = vocab.encode(text)
        mine = ids if is_own else (None if own is None else own.encode(text))
        own_loss = None if mine is None or mine == ids else measured(mine)
        if any(i >= rows for i in ids):  # the model cannot even look these ids up
            loss, shifted = math.nan, math.nan
        else:
            loss = measured(ids)
            shifted = measured([(i + 1) % real for i in ids])
        if mine == ids:
            own_loss = loss
        if compared and mine is not None and own_loss is not None:
            reference, threshold = own_loss, OWN_RISE
            rise = _rise(loss, len(bos + ids) - 1, own_loss, len(bos + mine) - 1)
        else:
            reference, threshold = EXPECTED[language], EXPECTED_RISE
            rise = loss - reference
        out.append(
            FitLanguage(
                language=language,
                tokens=len(ids),
                loss=loss,
                shifted_loss=shifted,
                uniform_loss=math.log(rows),
                fits=shifted - loss >= FIT_MARGIN and rise <= threshold,
                own_tokens=None if mine is None else len(mine),
                own_loss=own_loss,
                reference_loss=reference,
                rise=rise,
                threshold=threshold,
            )
        )
    reference_name = "own_tokenizer" if compared else "expectation"
    return Fit(name, FIT_MARGIN, out, all(x.fits for x in out), reference_name)


def _rise(loss: float, predicted: int, own_loss: float, own_predicted: int) -> float:
    """The whole text's extra nats over the own tokenizer's, per own prediction: loss - own_loss
    when both read the text in as many tokens, and fair when they do not (a finer reading has
    more, easier tokens)."""
    if loss == own_loss and predicted == own_predicted:
        return 0.0
    return (loss * predicted - own_loss * own_predicted) / own_predicted


def unfit(fit: Fit) -> str:
    """The problem a fit that fails is reported as: per language that fails, what moved."""
    whose = (
        "with the model's own tokenizer"
        if fit.reference == "own_tokenizer"
        else "expected of a trained model"
    )
    parts = []
    for x in fit.languages:
        if x.fits:
            continue
        if not math.isfinite(x.loss):
            parts.append(f"{x.language}: some of its ids have no row in the model")
            continue
        why = []
        if not x.rise <= x.threshold:
            why.append(
                f"{x.loss:.2f} nats per token against {x.reference_loss:.2f} {whose} "
                f"(+{x.rise:.2f}, more than the {x.threshold:.2f} allowed)"
            )
        if not x.shifted_loss - x.loss >= fit.margin:
            why.append(
                f"its ids score no better than ids shifted by one ({x.loss:.2f} against "
                f"{x.shifted_loss:.2f} shifted, less than {fit.margin:.1f} apart)"
            )
        parts.append(f"{x.language}: " + " and ".join(why))
    return "the weights do not fit this tokenizer: " + "; ".join(parts)


def _loss(model: Any, torch: Any, ids: list[int], dev: Any) -> float:
    """Mean next-token cross-entropy (nats) over the sequence."""
    t = torch.tensor([ids], device=dev)
    with torch.inference_mode():
        logits = model(input_ids=t).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, t[0, 1:]))
