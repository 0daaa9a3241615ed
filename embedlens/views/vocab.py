"""How the `vocab` report is shown: the layout, the under-trained scan, the comparison, the fit."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.vocab import (
    Candidate,
    Fit,
    MatrixScan,
    Undertrained,
    VocabDiff,
    VocabReport,
)
from embedlens.views.format import Sheet, Words, count, quoted, shown

TOP = 15  # candidates shown without --all


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _layout(r: VocabReport) -> Sheet:
    lay = r.layout
    t = Sheet(title=shown(f"Vocabulary ({r.tokenizer})", "bold"), show_header=False)
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
    specials = Words(f"{len(lay.special_tokens)}")
    for s in lay.special_tokens[:3]:
        specials.add(" ").token(s.token)
    if len(lay.special_tokens) > 3:
        specials.append(" ...")
    t.add_row("special tokens", specials)
    t.add_row("added tokens", f"{lay.added_tokens}, placed: {lay.added_placement}")
    t.add_row("unreachable tokens", _kinds(r.unreachable.count, r.unreachable.by_kind))
    if r.fingerprint.metadata_key is not None:
        verdict = "matches" if r.fingerprint.matches else "DIFFERS"
        t.add_row("metadata hash", f"{r.fingerprint.metadata_key}: {verdict}")
    return t


def _fingerprint(r: VocabReport) -> Words:
    """The fingerprint on a line of its own (71 characters: no table cell at 80 columns holds
    it whole), moved under its label when the line is too narrow for both."""
    return Words("fingerprint: ", style="bold").add("sha256:" + r.fingerprint.sha256)


def _kinds(n: int, by_kind: dict[str, int]) -> str:
    if not by_kind:
        return count(n)
    return count(n) + " (" + ", ".join(f"{k} {count(v)}" for k, v in by_kind.items()) + ")"


_NAMES = {"input": "embedding", "output": "head"}
_SHORT = {"input": "emb.", "output": "head"}


def _scan(u: Undertrained, top: int | None) -> list[RenderableType]:
    """The scan's headline, each matrix's rules, the candidates, equal rows and the groups."""
    scans: list[Undertrained | MatrixScan] = [u] if u.input is None else [u, u.input]
    head = "the embedding, tied head" if u.matrix == "input" else "the head"
    of = f"{u.tensor} ({head})"
    if u.input is not None:
        of += f" and {u.input.tensor} (the embedding)"
    counts = ", ".join(f"{k} {count(v)}" for k, v in u.counts.items())
    parts: list[RenderableType] = [shown(f"Under-trained scan of {of}: {counts}", style="bold")]
    for m in scans:
        which = "" if u.input is None else f"{_NAMES[m.matrix]}: "
        parts.append(Text(which + _indicator_rule(u, m), style="dim"))
        rules = f"{which}norm: {_rule(m.norm_rule)}; mean: {_rule(m.mean_rule)}"
        parts.append(Text(rules, style="dim"))
    listed = u.candidates if top is None else u.candidates[:top]
    if listed:
        parts.append(_candidates(u, listed))
        if len(listed) < len(u.candidates):
            parts.append(Text(f"... {len(u.candidates) - len(listed)} more (--all)", style="dim"))
    if u.one_matrix is not None and any(u.one_matrix.values()):
        parts.append(
            Text(
                f"rows that disagree: {count(u.one_matrix['output'])} tokens flagged in the head "
                f"only, {count(u.one_matrix['input'])} in the embedding only"
            )
        )
    for m in scans:
        which = "" if u.input is None else f" ({_NAMES[m.matrix]})"
        norms = f"median row norm{which} {m.norm_median:.2f}"
        if m.reference_norm_median is not None:
            norms += f"; reference rows' {m.reference_norm_median:.2f}"
        parts.append(Text(norms, style="dim"))
        for group in m.identical_rows[:3]:
            ids = ", ".join(str(i) for i in group[:12]) + (", ..." if len(group) > 12 else "")
            parts.append(
                Text(f"{len(group)} rows are exactly equal{which} (never moved apart): ids {ids}")
            )
    for g in u.groups:
        style = "yellow" if g.verdict != "ordinary" else ""
        parts.append(shown(g.summary[0].upper() + g.summary[1:], style=style))
    return parts


def _rule(text: str) -> str:
    """'candidates at or below ...', or 'no ... signal' as it is."""
    return text if text.startswith("no ") else "candidates " + text


def _indicator_rule(u: Undertrained, m: Undertrained | MatrixScan) -> str:
    if m.threshold is None:
        return "indicator: none (no reference rows: no padding, unreachable or unused-named tokens)"
    kinds = ", ".join(f"{k} {count(v)}" for k, v in u.reference_by_kind.items())
    return (
        f"indicator: cosine to the mean of {count(u.reference_count)} reference rows ({kinds}), "
        f"first principal component removed ({m.component}); candidates {m.threshold_rule} "
        f"({m.threshold:.3f})"
    )


def _signal(u: Undertrained, c: Candidate) -> str:
    """'indicator, norm', or with two matrices 'indicator (head), norm (both)'."""
    if u.input is None:
        return ", ".join(c.signals)
    out = []
    for k in c.signals:
        where = [m for m, signals in c.by_matrix.items() if k in signals]
        out.append(f"{k} ({'both' if len(where) > 1 else _SHORT[where[0]]})")
    return ", ".join(out)


def _candidates(u: Undertrained, listed: list[Candidate]) -> Sheet:
    """The candidates' table: id, token, indicator, norm (each matrix's when untied), the
    signals that flagged it, (with --verify) repeat probability."""
    t = Sheet()
    names = ["#", "id", "token", "indicator", "norm"]
    if u.input is not None:
        names = ["#", "id", "token", "head\nind.", "head\nnorm", "emb.\nind.", "emb.\nnorm"]
    # A narrow terminal wraps the text columns at spaces; numbers and tokens are never cut.
    for name in names:
        if name == "token":
            t.add_column(name)
        else:
            t.add_column(name, justify="right", no_wrap=True)
    t.add_column("signal", overflow="fold")
    if u.verified:
        t.add_column("repeat p", justify="right", no_wrap=True)
    t.add_column("verdict", overflow="fold")
    for rank, c in enumerate(listed, 1):
        token = quoted(c.token)
        if c.special:
            token.add(" (special)", style="dim")
        cells: list[str | Text] = [str(rank), str(c.id), token, _num(c.indicator), _num(c.norm, 2)]
        if c.input is not None:
            cells += [_num(c.input.indicator), _num(c.input.norm, 2)]
        cells.append(_signal(u, c))
        if u.verified:
            cells.append("-" if c.repeat_prob is None else f"{c.repeat_prob:.2e}")
        cells.append(c.verdict)
        t.add_row(*cells)
    return t


def _diff(d: VocabDiff) -> list[RenderableType]:
    title = f"Against '{d.other}' ({count(d.other_size)} tokens): "  # shown: a path
    if d.identical:
        return [shown(title + "identical vocabulary", style="bold green")]
    state = (
        "UNRELATED"
        if d.unrelated
        else "compatible (only appended tokens)"
        if d.compatible
        else "DIFFERENT"
    )
    parts: list[RenderableType] = [
        shown(
            title + f"{state}; same id {count(d.same_ids)}, shifted {count(d.shifted)}, added "
            f"{count(d.added)}, removed {count(d.removed)}, renamed {count(d.renamed)}",
            style="bold",
        )
    ]
    parts.extend(shown("  " + line) for line in d.summary)
    for label, refs in (("added", d.added_examples), ("removed", d.removed_examples)):
        if refs:
            line = Words(f"  {label}:")
            for ref in refs:
                line.add(f" {ref.id} ").token(ref.token)
            parts.append(line)
    for rn in d.renamed_examples:
        line = Words(f"  renamed: {rn.id} ").token(rn.token).add(" -> ").token(rn.other_token)
        parts.append(line)
    return parts


def _fit(fit: Fit) -> list[RenderableType]:
    """The losses per text against the reference, and what a text must score to fit."""
    own = fit.reference == "own_tokenizer"
    t = Sheet(title=shown(f"Fit with the tokenizer ({fit.tokenizer})", style="bold"))
    reference = "own tokenizer" if own else "expected"
    for col in ("text", "tokens", "loss", reference, "rise", "allowed", "ids shifted by one"):
        t.add_column(col, justify="left" if col == "text" else "right")
    t.add_column("uniform", justify="right")
    t.add_column("fits")
    for x in fit.languages:
        t.add_row(
            x.language,
            str(x.tokens),
            _num(x.loss, 2),
            _num(x.reference_loss, 2),
            _num(x.rise, 2),
            _num(x.threshold, 2),
            _num(x.shifted_loss, 2),
            _num(x.uniform_loss, 2),
            "yes" if x.fits else "NO",
        )
    against = (
        "the model's own tokenizer on the same text"
        if own
        else "the loss expected of a trained model with its own tokenizer"
    )
    rule = (
        f"a text fits when its loss rises at most the allowed nats per token over {against}, "
        f"and shifting its ids costs at least {fit.margin:.1f} nats"
    )
    return [t, Text(rule, style="dim")]


def render(r: VocabReport) -> RenderableType:
    """The layout table, the scan, the comparison and the fit check, then the verdict."""
    top = None if r.shows_all else TOP
    parts: list[RenderableType] = [_layout(r), _fingerprint(r)]
    parts.extend(_scan(r.undertrained, top))
    if r.against is not None:
        parts.extend(_diff(r.against))
    if r.fit is not None:
        parts.extend(_fit(r.fit))
    if r.problems:
        for p in r.problems:
            parts.append(shown("problem: " + p, "bold red"))
    else:
        parts.append(
            Text("No problem found between this vocabulary and the weights.", style="green")
        )
    return Group(*parts)


register_view(VocabReport, render)
