"""`embedlens vocab`: is this vocabulary healthy, trained, and the one these weights were trained with?"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from embedlens.cli._errors import handles_errors
from embedlens.cli._options import (
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
    TrustOpt,
    common,
)
from embedlens.cli._output import count, emit, err_console, note, progress, quoted
from embedlens.reports.vocab import Undertrained, VocabDiff, VocabReport

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens vocab ./SmolLM2-135M-Instruct.Q4_1.gguf\n\n"
    "  $ embedlens vocab ./my-model --against ./old-tokenizer/tokenizer.json\n\n"
    "  $ embedlens vocab ./my-model --check-fit --tokenizer ./new-tokenizer\n\n"
    "  $ embedlens vocab Qwen/Qwen3-0.6B --verify --max-verify 50 --json"
)


@handles_errors
def vocab(
    model: ModelArg,
    against: Annotated[
        str | None,
        typer.Option(
            "--against",
            metavar="OTHER",
            help="Compare with another vocabulary: a model, a tokenizer folder or tokenizer.json, "
            "or a GGUF.",
        ),
    ] = None,
    check_fit: Annotated[
        bool,
        typer.Option(
            "--check-fit",
            help="Load the model and measure whether its weights fit the tokenizer (built-in "
            "English and Chinese texts, against ids shifted by one).",
        ),
    ] = False,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            metavar="OTHER",
            help="Check this tokenizer against the weights instead of the model's own.",
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify", help="Load the model and ask it to repeat each under-trained candidate."
        ),
    ] = False,
    max_verify: Annotated[
        int, typer.Option("--max-verify", metavar="N", help="Candidates --verify asks about.")
    ] = 20,
    all_tokens: Annotated[
        bool, typer.Option("--all", help="Show every candidate (JSON: every row's indicator).")
    ] = False,
    top: Annotated[int, typer.Option("--top", help="Candidates shown in the table.")] = 15,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check the vocabulary against the weights: rows, unreachable and under-trained tokens.

    Without --verify and --check-fit it reads the headers, the tokenizer and one matrix (the
    head, or the embedding when tied), never torch. The fingerprint is a SHA-256 of the
    vocabulary (ids, token bytes, special tokens) to store beside the weights and compare at
    start-up.
    """
    from embedlens.analysis.vocab import vocab as run
    from embedlens.errors import UsageError

    common(quiet=quiet, debug=debug, dtype=dtype, device=device)
    # [V, d] x [d] products and one [d, d] eigenproblem: BLAS threads cost more than they give on
    # busy cores (read when numpy is first imported; a value the user set wins).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if top < 0:
        raise UsageError(f"--top must be at least 0 (got {top})")
    spinner = nullcontext() if verify else progress(f"Reading {model}")
    with _Bar(quiet) as bar, spinner:
        report = run(
            model,
            against=against,
            check_fit=check_fit,
            tokenizer=tokenizer,
            verify=verify,
            max_verify=max_verify,
            all_tokens=all_tokens or as_json,
            revision=revision,
            dtype=dtype,
            device=device,
            trust_remote_code=trust_remote_code,
            on_progress=bar.update,
        )
    for text in report.notes:
        note("note: " + text)
    emit(report, as_json=as_json, render=lambda r: render_vocab(r, top=None if all_tokens else top))


class _Bar:
    """A progress bar on stderr for --verify's batches (terminal only, not with --quiet)."""

    def __init__(self, quiet: bool) -> None:
        self._quiet = quiet
        self._progress: object | None = None
        self._task: object | None = None

    def __enter__(self) -> _Bar:
        return self

    def update(self, done: int, total: int) -> None:
        if self._quiet or not err_console.is_terminal:
            return
        from rich.progress import Progress

        if self._progress is None:
            self._progress = Progress(console=err_console, transient=True)
            self._progress.start()  # type: ignore[attr-defined]
            self._task = self._progress.add_task("Verifying", total=total)  # type: ignore[attr-defined]
        self._progress.update(self._task, completed=done)  # type: ignore[attr-defined]

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()  # type: ignore[attr-defined]


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _layout(r: VocabReport) -> Table:
    lay = r.layout
    t = Table(title=Text(f"Vocabulary ({r.tokenizer})", style="bold"), show_header=False)
    t.add_column("what")
    t.add_column("value")
    t.add_row("tokenizer tokens", count(lay.tokenizer_size))
    t.add_row(
        "embedding rows", f"{count(lay.embedding_rows)} ({lay.embedding_tensor}, d = {lay.width})"
    )
    t.add_row(
        "head rows",
        "tied to the embedding" if lay.tied else f"{count(lay.head_rows)} ({lay.head_tensor})",
    )
    t.add_row("padding rows", count(lay.padding_rows))
    t.add_row("tokens without a row", count(lay.missing_rows))
    specials = Text(f"{len(lay.special_tokens)}")
    for s in lay.special_tokens[:3]:
        specials.append(" ")
        specials.append_text(quoted(s.token))
    if len(lay.special_tokens) > 3:
        specials.append(" ...")
    t.add_row("special tokens", specials)
    t.add_row("added tokens", f"{lay.added_tokens}, placed: {lay.added_placement}")
    t.add_row("unreachable tokens", _kinds(r.unreachable.count, r.unreachable.by_kind))
    t.add_row("fingerprint", "sha256:" + r.fingerprint.sha256)
    if r.fingerprint.metadata_key is not None:
        verdict = "matches" if r.fingerprint.matches else "DIFFERS"
        t.add_row("metadata hash", f"{r.fingerprint.metadata_key}: {verdict}")
    return t


def _kinds(n: int, by_kind: dict[str, int]) -> str:
    if not by_kind:
        return count(n)
    return count(n) + " (" + ", ".join(f"{k} {count(v)}" for k, v in by_kind.items()) + ")"


def _scan(u: Undertrained, top: int | None) -> list[RenderableType]:
    parts: list[RenderableType] = []
    head = "the embedding, tied head" if u.matrix == "input" else "the head"
    if u.threshold is None:
        parts.append(
            Text(
                f"Under-trained scan of {u.tensor} ({head}): no reference rows (no padding, unreachable or "
                "unused-named tokens), so no indicator; norms only.",
                style="yellow",
            )
        )
        return parts
    counts = ", ".join(f"{k} {count(v)}" for k, v in u.counts.items())
    parts.append(
        Text(
            f"Under-trained scan of {u.tensor} ({head}): {counts}",
            style="bold",
        )
    )
    parts.append(
        Text(
            f"indicator: cosine to the mean of {count(u.reference_count)} reference rows "
            f"({', '.join(f'{k} {count(v)}' for k, v in u.reference_by_kind.items())}), first principal component "
            f"removed; candidates {u.threshold_rule} ({u.threshold:.3f})",
            style="dim",
        )
    )
    shown = u.candidates if top is None else u.candidates[:top]
    if shown:
        t = Table()
        t.add_column("#", justify="right")
        t.add_column("id", justify="right")
        t.add_column("token")
        t.add_column("indicator", justify="right")
        t.add_column("norm", justify="right")
        if u.verified:
            t.add_column("repeat p", justify="right")
        t.add_column("verdict")
        for rank, c in enumerate(shown, 1):
            token = quoted(c.token)
            if c.special:
                token.append(" (special)", style="dim")
            cells: list[str | Text] = [
                str(rank),
                str(c.id),
                token,
                _num(c.indicator),
                _num(c.norm, 2),
            ]
            if u.verified:
                cells.append("-" if c.repeat_prob is None else f"{c.repeat_prob:.2e}")
            cells.append(c.verdict)
            t.add_row(*cells)
        parts.append(t)
        if len(shown) < len(u.candidates):
            parts.append(Text(f"... {len(u.candidates) - len(shown)} more (--all)", style="dim"))
    ref = _num(u.reference_norm_median, 2)
    parts.append(Text(f"median row norm {u.norm_median:.2f}; reference rows' {ref}", style="dim"))
    for group in u.identical_rows[:3]:
        ids = ", ".join(str(i) for i in group[:12]) + (", ..." if len(group) > 12 else "")
        parts.append(Text(f"{len(group)} rows are exactly equal (never moved apart): ids {ids}"))
    return parts


def _diff(d: VocabDiff) -> list[RenderableType]:
    title = f"Against '{d.other}' ({count(d.other_size)} tokens): "
    if d.identical:
        return [Text(title + "identical vocabulary", style="bold green")]
    state = "compatible (only appended tokens)" if d.compatible else "DIFFERENT"
    parts: list[RenderableType] = [
        Text(
            title + f"{state}; same id {count(d.same_ids)}, shifted {count(d.shifted)}, added "
            f"{count(d.added)}, removed {count(d.removed)}, renamed {count(d.renamed)}",
            style="bold",
        )
    ]
    parts.extend(Text("  " + line) for line in d.summary)
    for label, refs in (("added", d.added_examples), ("removed", d.removed_examples)):
        if refs:
            line = Text(f"  {label}:")
            for ref in refs:
                line.append(f" {ref.id} ")
                line.append_text(quoted(ref.token))
            parts.append(line)
    for rn in d.renamed_examples:
        line = Text(f"  renamed: {rn.id} ")
        line.append_text(quoted(rn.token))
        line.append(" -> ")
        line.append_text(quoted(rn.other_token))
        parts.append(line)
    return parts


def render_vocab(r: VocabReport, *, top: int | None = 15) -> RenderableType:
    """The layout table, the scan, the comparison and the fit check, then the verdict."""
    parts: list[RenderableType] = [_layout(r)]
    parts.extend(_scan(r.undertrained, top))
    if r.against is not None:
        parts.extend(_diff(r.against))
    if r.fit is not None:
        t = Table(title=Text(f"Fit with the tokenizer ({r.fit.tokenizer})", style="bold"))
        for col in ("text", "tokens", "loss", "ids shifted by one", "uniform", "fits"):
            t.add_column(col, justify="left" if col in ("text", "fits") else "right")
        for x in r.fit.languages:
            t.add_row(
                x.language,
                str(x.tokens),
                _num(x.loss, 2),
                _num(x.shifted_loss, 2),
                _num(x.uniform_loss, 2),
                "yes" if x.fits else "NO",
            )
        parts.append(t)
        parts.append(
            Text(
                f"a text fits when shifting its ids costs at least {r.fit.margin:.1f} nats",
                style="dim",
            )
        )
    if r.problems:
        for p in r.problems:
            parts.append(Text("problem: " + p, style="bold red"))
    else:
        parts.append(
            Text("No problem found between this vocabulary and the weights.", style="green")
        )
    return Group(*parts)
