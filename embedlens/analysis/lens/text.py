"""`lens_text`: the lens over every scored token of a text, alone or against another model (or a
saved run's output), with llama-perplexity's statistics (`text_stats`) at every layer.

The text is read and checked before any model loads (and before torch and NumPy are imported),
tokenised once, cut into windows (llama-perplexity's rule), and each window run through the
model(s) (`text_run`); only sums and per-token KL and Δp values are kept. Under torchrun,
window w runs on rank w mod N and the windows' sums are combined in window order on every rank.

`--save-logits` keeps a run's output compactly (`LogitsFile`: per scored token its top
`text_run.TOP_K` ids and log-probabilities, the true token's log-probability and the argmax, with
the run's token ids and window rule), so that a later run on another model (a quantisation of
it) compares its output with it: O(tokens x k), not llama.cpp's O(tokens x vocabulary). A file of
--against-logits is read before any model loads too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Unpack

from embedlens.analysis.lens import options
from embedlens.analysis.lens.states_file import ManySaver, saving_many
from embedlens.analysis.lens.tuned_folder import fits_tuned
from embedlens.errors import UsageError
from embedlens.options import LoadKeywords, LoadOptions, model_and_load

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.text_run import TextRun, Window
    from embedlens.analysis.lens.text_stats import WindowSums
    from embedlens.progress import Progress
    from embedlens.reports.lens_text import LensTextReport

SCORES = ("half", "all")
FORMAT = "embedlens-logits/1"
KEYS = ("ids", "logp", "target_logp", "top1")
"""The arrays a logits file keeps per scored token (`text_run.kept_logits`)."""


def lens_text(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    text: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    ctx: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    score: str = "half",
    layers: str | Sequence[int] | None = None,
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: Any = None,
    against_revision: str | None = None,
    against_logits: str | os.PathLike[str] | None = None,
    save_logits: str | os.PathLike[str] | None = None,
    residual: bool = True,
    tuned: str | os.PathLike[str] | None = None,
    jacobian: str | os.PathLike[str] | None = None,
    site: str | Sequence[str] | None = None,
    save_states: str | os.PathLike[str] | None = None,
    load: LoadOptions | None = None,
    dist_backend: str = "auto",
    progress: Progress | None = None,
    **keywords: Unpack[LoadKeywords],
) -> LensTextReport:
    """The lens over the text file `text`: per layer, cross-entropy against the true next token
    (nats, bits per byte), KL to the model's output, entropy and top-1 accuracy; at the output
    the perplexity.

    ctx, stride: windows of `ctx` tokens every `stride` (ctx by default); score: 'half' (the
        second half of each window, llama-perplexity's rule) or 'all'; max_tokens: the text's
        first tokens only.
    against: B, compared at every layer with llama-perplexity's KL table (this model is the
        reference, llama.cpp's 'base'; B the evaluated, its 'Q'); residual: also the KL of this
        model's decoder on B's residual.
    against_logits: a file `save_logits` wrote (the reference); this model is evaluated.
    save_logits: write the output's top-k log-probabilities for a later `against_logits`.
    tuned (a lens folder) or jacobian (a Jacobian lens's artifact): that lens's statistics, the
        logit lens's beside them; with `against`, B read through the same lens (fitted on A).
    site: statistics per (layer, site) (and B's against A's); save_states: a file a window.
    load: `LoadOptions` (or its fields as keywords: `dtype=`, ...), on one device.
    dist_backend: under torchrun, the windows are split over the processes.
    progress: called as `progress("text", scored, to_score, "tokens")` after each window.
    """
    from embedlens.progress import progress_of

    model, load = model_and_load("lens_text", model, load, dict(keywords))
    sites = _check(load, against, against_logits, (tuned, jacobian), site)
    r = rule(ctx, stride, score, max_tokens)
    items = None if layers is None else options.layer_items(layers)
    body = read_text(text)
    reference = None if against_logits is None else read_logits(against_logits)
    session = _joined(dist_backend, load.device, against)
    with nullcontext() if session is None else session.guarded():
        saving = saving_many(save_states, load.revision, against, session, "--text")
        loading = options.loading(model, load)
        b = (against, against_tokenizer, against_revision)
        return _run(model, tokenizer, loading, (os.fspath(text), body, r, items), b,
                    ((tuned, jacobian), reference, save_logits, residual, sites, saving), session,
                    progress_of(progress, "lens_text"))  # fmt: skip


def _check(
    load: LoadOptions,
    against: object,
    against_logits: object,
    learned: tuple[object, object],
    site: Any,
) -> tuple[str, ...]:
    """What `lens_text` cannot combine, refused before any file is read; the sites asked."""
    if load.device_map is not None or load.max_memory is not None or load.offload_folder:
        raise UsageError("lens_text runs the model on one device: --device-map does not apply")
    if against is not None and against_logits is not None:
        raise UsageError("give --against or --against-logits, not both")
    return options.sites_asked(site, *learned)


def _run(
    model: object,
    tokenizer: Any,
    load: options.Load | dict[str, bool],
    asked: tuple[str, str, Rule, Any],
    b: tuple[Any, Any, str | None],
    more: tuple[Any, LogitsFile | None, Any, bool, tuple[str, ...], Any],
    session: Session | None,
    progress: Progress,
) -> LensTextReport:
    """`lens_text` once its options are checked: the model(s) ready, every window run."""
    from embedlens.analysis.lens.opening import context_length, open_model
    from embedlens.analysis.lens.text_run import TOP_K, TextRun, text_report
    from embedlens.analysis.lens.tuned_folder import open_learned

    name, body, r, items = asked
    learned, reference, save_logits, residual, sites, saving = more
    lens_dir = open_learned(*learned)

    def check(tok: Any, config: Any, _template: str) -> Tokens:
        fits_tuned(lens_dir, config)
        limit = context_length(config)  # a window past it is refused
        if limit is not None and r.ctx > limit:
            raise UsageError(f"--ctx {r.ctx} is longer than the model's {limit:,} positions")
        return tokenise(body, tok, r, name)

    with ExitStack() as stack:
        opened, tokens = stack.enter_context(open_model(model, tokenizer, load, check))
        other = stack.enter_context(_other(opened, *b, load, lens_dir))
        run = TextRun(opened, items, other, lens_dir, (save_logits, residual, sites))
        saver = None if saving is None else ManySaver(saving[0], opened, saving[1], sites)
        done = _all(run, (r, name), tokens, reference, (session, saver), progress)
        n, cut = len(tokens.ids), {"ctx": r.ctx, "stride": r.stride, "score": r.score}
        head = {"text": name, "n_text_tokens": n, **cut, "n_windows": len(r.starts(n))}
        ref = None if reference is None else str(reference.meta.get("model", reference.path))
        report = text_report(opened, run, done, head, other, ref)
        if save_logits is not None and (session is None or session.rank == 0):
            meta = {"model": opened.name, **cut, "vocab": run.vocab, "top_k": TOP_K}
            write_logits(save_logits, meta, tokens.ids, done)
        return report


def _joined(backend: str, device: str, against: object) -> Session | None:
    """Under torchrun: this process's part (the group joined); None alone."""
    from embedlens.runtime import world

    if world()[1] == 1:
        return None
    if against is not None:
        raise UsageError(
            "under torchrun, lens --text splits the windows over processes: --against (two "
            "models in turn) runs in one process only",
            hint="run it without torchrun, or save the reference with --save-logits and use "
            "--against-logits",
        )
    from embedlens.analysis import torchrun

    return torchrun.split_session(backend, device)


@contextmanager
def _other(
    opened: Opened,
    against: object,
    tokenizer: Any,
    revision: str | None,
    load: Any,
    lens_dir: Any = None,
) -> Iterator[Opened | None]:
    """B, checked against A (vocabulary, layers, outputs) and loaded as A was (None without);
    a tuned lens (A's) is checked against B's size before B's weights are read."""
    if against is None:
        yield None
        return
    from embedlens.analysis.lens.opening import open_model
    from embedlens.analysis.lens.pairing import Side, check_pair

    files = isinstance(load, options.Load)  # B loaded as A was
    a = Side(opened.name if files else opened.model, opened.tokenizer, load)
    like_a = {"dtype": load.dtype, "device": load.device} if files else {}
    trust = {"trust_remote_code": load.trust_remote_code} if files else {}
    b_load = options.loading(against, LoadOptions(revision=revision, **like_a, **trust))
    check_pair(a, Side(against, tokenizer, b_load))  # type: ignore[arg-type]
    b_tok = tokenizer
    if b_tok is None and not isinstance(b_load, options.Load):  # B given loaded: A's tokenizer
        b_tok = opened.tokenizer
    with open_model(against, b_tok, b_load, lambda _, c, _t: fits_tuned(lens_dir, c)) as (other, _):
        yield other


def windows(r: Rule, tokens: Tokens) -> list[Window]:
    """Every window of the text (ids with the BOS first when the tokenizer adds one)."""
    from embedlens.analysis.lens.text_run import Window

    pos = r.scored()
    out = []
    for index, start in enumerate(r.starts(len(tokens.ids))):
        ids = tokens.ids[start : start + r.ctx]
        if tokens.bos is not None:
            ids = [tokens.bos, *ids[1:]]
        targets = [ids[j + 1] for j in pos]
        n_bytes = sum(tokens.n_bytes[start + j + 1] for j in pos)
        out.append(Window(index, ids, pos, targets, n_bytes))
    return out


def _all(
    run: TextRun,
    what: tuple[Rule, str],
    tokens: Tokens,
    reference: LogitsFile | None,
    split: tuple[Session | None, ManySaver | None],
    progress: Progress,
) -> list[WindowSums]:
    """Every window run (this process's share under torchrun: window w on rank w mod N), and
    every window's sums in window order (every process's under torchrun); with a saver, each
    window's states saved (rank 0 writes them all, `ManySaver`: handed to it after each round)."""
    from embedlens.runtime import heap_kept

    (r, name), (session, saver) = what, split
    found = windows(r, tokens)
    if saver is not None:
        saver.keep = session is not None and session.rank != 0
    if reference is not None:
        reference.check_run(tokens.ids, r.ctx, r.stride, r.score, run.vocab)
    total = sum(len(w.positions) for w in found)
    done = 0
    ran: list[WindowSums] = []
    mine: Iterable[Window] = found
    if session is not None:
        from functools import partial

        from embedlens.analysis.lens.many import in_rounds

        hand_on = (lambda: None) if saver is None else partial(saver.hand_on, session)
        mine = in_rounds(found, session, hand_on)
    with heap_kept():
        for w in mine:
            ref = None if reference is None else reference.window(w.index)
            ran.append(run.run(w, ref))
            if saver is not None:
                about = {"text": name, "window": str(w.index + 1), "start": str(w.index * r.stride)}
                saver.put(w.index + 1, w.ids, about)
            n = len(w.positions)
            done = done + n if session is None else session.total("text", n)
            if session is None or session.rank == 0:
                progress("text", done, total, "tokens")
    if session is None:
        return ran
    every = sorted((w for part in session.all_gather(ran) for w in part), key=lambda w: w.index)
    # every rank gathers, a rank that ran no window (fewer windows than ranks) too
    checks = [c for c in session.all_gather(run.check) if c is not None]
    run.check = max(checks) if checks else None
    return every


@dataclass(frozen=True)
class Rule:
    """How the text is cut and scored."""

    ctx: int
    stride: int
    score: str
    max_tokens: int | None

    def scored(self) -> list[int]:
        """The positions j of a window whose prediction of token j+1 is scored: 'all' every one;
        'half' the second half (j from ctx/2, as llama-perplexity scores), or with a --stride
        below ctx/2 the last `stride` predictions (its --ppl-stride rule): each token once."""
        if self.score == "all":
            return list(range(self.ctx - 1))
        first = max(self.ctx // 2, self.ctx - 1 - self.stride)
        return list(range(first, self.ctx - 1))

    def starts(self, n_tokens: int) -> list[int]:
        """Where each window starts: every `stride` tokens while a whole window fits."""
        return list(range(0, n_tokens - self.ctx + 1, self.stride))


def rule(ctx: int, stride: int | None, score: str, max_tokens: int | None) -> Rule:
    """The options checked."""
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 4:
        raise UsageError(f"--ctx {ctx}: give a window of at least 4 tokens")
    step = ctx if stride is None else stride
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise UsageError(f"--stride {stride}: give a number of tokens above 0")
    if score not in SCORES:
        raise UsageError(f"--score {score!r}: use half or all")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < ctx):
        raise UsageError(f"--max-tokens {max_tokens}: give at least one window (--ctx {ctx})")
    return Rule(ctx, step, score, max_tokens)


def read_text(path: str | os.PathLike[str]) -> str:
    """The file's text; a file that is missing, not UTF-8 text, or empty is refused."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise UsageError(f"--text {name}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"--text {name} is a folder, not a text file") from None
    except OSError as e:
        raise UsageError(f"--text {name} cannot be read: {e.strerror or e}") from None
    if b"\0" in data:
        raise UsageError(f"--text {name} is not text (it holds NUL bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--text {name} is not UTF-8 text (byte {e.start:,})") from None
    if not text.strip():
        raise UsageError(f"--text {name} is empty")
    return text


@dataclass(frozen=True)
class Tokens:
    """The text's ids, the UTF-8 bytes each token adds, and the BOS put first in every window
    (None: the tokenizer adds none)."""

    ids: list[int]
    n_bytes: list[int]
    bos: int | None


def tokenise(text: str, tokenizer: Any, r: Rule, name: str) -> Tokens:
    """The text tokenised once (special tokens as the tokenizer adds them), cut to --max-tokens;
    shorter than one window is refused. Its first lines are checked against a GGUF model's own
    reading first (`_check_lines`)."""
    _check_lines(text, tokenizer)
    bos = _bos(tokenizer)
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True, verbose=False)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    except (NotImplementedError, ValueError, TypeError, KeyError):
        ids, offsets = list(tokenizer(text, add_special_tokens=True)["input_ids"]), None
    if r.max_tokens is not None:
        ids = ids[: r.max_tokens]
    if len(ids) < r.ctx:
        raise UsageError(
            f"--text {name} has {len(ids):,} tokens, fewer than one window (--ctx {r.ctx})",
            hint="give a longer text or a smaller --ctx",
        )
    return Tokens(ids, _bytes(text, ids, offsets, tokenizer), bos)


CHECKED_CHARS = 2000
"""A longer line is checked on its first characters, cut at a space."""


def _check_lines(text: str, tokenizer: Any) -> None:
    """The first lines' ids from `tokenizer`, each read alone, checked against the files being
    watched (a GGUF model's own reading of them, as tune checks its first texts; nothing outside
    `file_tokens.watching`)."""
    from embedlens.analysis.lens.opening import encoded
    from embedlens.model import file_tokens

    lines = [line for line in text.splitlines() if line.strip()][: file_tokens.CHECKED_TEXTS]
    for line in lines:
        if len(line) > CHECKED_CHARS:
            cut = line.rfind(" ", 0, CHECKED_CHARS)
            line = line[: cut if cut > 0 else CHECKED_CHARS]
        encoded(tokenizer, line)


def _bos(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer puts one first (llama-perplexity puts it first in every
    window then)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return int(bos) if with_special[:1] == [bos] else None


def _bytes(text: str, ids: list[int], offsets: list[Any] | None, tokenizer: Any) -> list[int]:
    """The UTF-8 bytes each token adds: from the tokenizer's character offsets (a token's end
    minus the previous token's end), else each token's decoded text."""
    if offsets is None:
        return [len(tokenizer.decode([i]).encode("utf-8")) for i in ids]
    import numpy as np

    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    width = 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)
    at = np.concatenate([[0], np.cumsum(width)])
    out, seen = [], 0
    for _, end in offsets[: len(ids)]:
        e = int(at[min(int(end), len(points))])
        out.append(max(e - seen, 0))
        seen = max(seen, e)
    return out


@dataclass(frozen=True)
class LogitsFile:
    """A saved run's output (`--save-logits`): `meta` (model, ctx, stride, score, vocab, top_k,
    windows), the text's token ids, and per scored token the arrays of `KEYS`."""

    path: str
    meta: dict[str, Any]
    tokens: np.ndarray
    rows: dict[str, np.ndarray]
    starts: np.ndarray
    """Each window's first row in `rows`."""

    def window(self, index: int) -> dict[str, np.ndarray]:
        """The rows of window `index`."""
        a, b = int(self.starts[index]), int(self.starts[index + 1])
        return {k: v[a:b] for k, v in self.rows.items()}

    def check_run(self, tokens: list[int], ctx: int, stride: int, score: str, vocab: int) -> None:
        """Refuse a file made from another text, window rule or vocabulary."""
        m = self.meta
        mine = {"ctx": ctx, "stride": stride, "score": score, "vocab": vocab}
        for key, value in mine.items():
            if m.get(key) != value:
                raise UsageError(
                    f"--against-logits {self.path} was saved with {key} {m.get(key)}, this run "
                    f"has {value}",
                    hint="run with the options the file was saved with",
                )
        if self.tokens.tolist() != tokens:
            raise UsageError(
                f"--against-logits {self.path} holds another text's tokens "
                f"({len(self.tokens):,} tokens; this run {len(tokens):,})",
                hint="give the same --text and --max-tokens, and models of the same tokenizer",
            )


def read_logits(path: str | os.PathLike[str]) -> LogitsFile:
    """Read a file `--save-logits` wrote (`write_logits`); anything else is refused with one
    line."""
    import zipfile

    import numpy as np

    name = os.fspath(path)
    try:
        with np.load(name, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise ValueError(meta.get("format"))
            tokens = z["tokens"]
            rows = {k: z[k] for k in KEYS}
    except FileNotFoundError:
        raise UsageError(f"--against-logits {name}: no such file") from None
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise UsageError(
            f"--against-logits {name} is not a logits file of lens --text --save-logits ({e})"
        ) from None
    starts = np.concatenate([[0], np.cumsum(meta["windows"])])
    return LogitsFile(name, meta, tokens, rows, starts)


def write_logits(
    path: str | os.PathLike[str], meta: dict[str, Any], ids: list[int], done: list[WindowSums]
) -> None:
    """The output's rows each window kept (`text_run.kept_logits`) written as a logits file,
    with the run's `meta` and the text's token ids."""
    import numpy as np

    head = {**meta, "format": FORMAT, "windows": [len(w.extra["top1"]) for w in done]}
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)}
    arrays["tokens"] = np.asarray(ids, dtype=np.int32)
    arrays.update({k: np.concatenate([w.extra[k] for w in done]) for k in KEYS})
    with open(path, "wb") as f:
        np.savez(f, **arrays)
