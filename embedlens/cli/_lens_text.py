"""`embedlens lens MODEL --text FILE`: the lens over a text, llama-perplexity's statistics."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from embedlens.cli._output import elapsed, emit, note, plain_progress, warn
from embedlens.errors import UsageError
from embedlens.runtime import world

TextOpt = Annotated[
    Path | None,
    typer.Option(
        "--text",
        metavar="FILE",
        help="Score every token of a text file (windows of --ctx, llama-perplexity's rule): per "
        "layer cross-entropy, bits per byte, KL to the output, entropy, top-1 accuracy; with "
        "--against, llama-perplexity's KL table at every layer. See docs/text.md.",
    ),
]
CtxOpt = Annotated[int, typer.Option("--ctx", help="With --text: tokens per window.")]
StrideOpt = Annotated[
    int | None,
    typer.Option("--stride", help="With --text: tokens between window starts (--ctx by default)."),
]
MaxTokensOpt = Annotated[
    int | None, typer.Option("--max-tokens", help="With --text: the text's first N tokens only.")
]
ScoreOpt = Annotated[
    str,
    typer.Option(
        "--score", help="With --text: 'half' (each window's second half) or 'all' its tokens."
    ),
]
SaveLogitsOpt = Annotated[
    Path | None,
    typer.Option(
        "--save-logits",
        metavar="FILE",
        help="With --text: write the output's top-k log-probabilities, for --against-logits.",
    ),
]
AgainstLogitsOpt = Annotated[
    Path | None,
    typer.Option(
        "--against-logits",
        metavar="FILE",
        help="With --text: compare the output with a --save-logits FILE (the base).",
    ),
]

_ALONE = {"prompt": "PROMPT", "prompts": "--prompts", "target": "--target", "chat": "--chat",
          "each": "--each", "skip_bad": "--skip-bad", "states": "--states",
          "save_states": "--save-states", "device_map": "--device-map",
          "template_arg": "--template-arg", "chat_template": "--chat-template",
          "compare_logit": "--compare-logit", "threshold": "--threshold"}  # fmt: skip
"""Options of `lens` that --text does not take."""


def run_text(model: str, given: dict[str, Any]) -> None:
    """`lens --text`: checks, the run under a progress bar, the report, the plot."""
    from embedlens.analysis.lens.text import lens_text
    from embedlens.cli._options import common

    for key, flag in _ALONE.items():
        if given.get(key) not in (None, False, []):
            raise UsageError(f"--text and {flag} do not combine")
    if given.get("position") not in (None, "-1"):
        raise UsageError("--text and --position do not combine: every scored token is read")
    common(quiet=given["quiet"], debug=given["debug"], device=given["device"], split=True)
    plot: Path | None = given.get("plot")
    if plot is not None:
        from embedlens.views.heatmap import check_plot_file

        check_plot_file(plot)
    from embedlens.text import model_title

    what = model_title(model)
    if given.get("against") is not None:
        what += f" against {model_title(str(given['against']))}"
    with _bar(f"Scoring {given['text']} with {what}") as advance:
        report = lens_text(
            model,
            given["text"],
            ctx=given["ctx"],
            stride=given["stride"],
            max_tokens=given["max_tokens"],
            score=given["score"],
            layers=given["layers"],
            against=given["against"],
            against_revision=given["against_revision"],
            against_logits=given["against_logits"],
            save_logits=given["save_logits"],
            tuned=given["tuned"],
            revision=given["revision"],
            dtype=given["dtype"],
            device=given["device"],
            trust_remote_code=given["trust_remote_code"],
            dist_backend=given["dist_backend"],
            progress=advance,
        )
    if world()[0] != 0:
        return
    if not report.check_ok:
        warn(
            f"the lens does not reproduce this model's logits (max |Δ| = "
            f"{report.max_abs_logit_diff:.3g}): its rows are not faithful for this architecture"
        )
    for text in report.notes:
        note("note: " + text)
    if given["save_logits"] is not None:
        note(f"wrote {given['save_logits']}")
    if plot is not None:
        from embedlens.views.lens_text import save_text_curves

        save_text_curves(report, plot)
        note(f"wrote {plot}")
    emit(report, as_json=given["as_json"])


def _rate(state: dict[str, float], done: int) -> str:
    """Tokens/s since the first window ended (the model's loading not counted)."""
    now = time.monotonic()
    if "first" not in state:
        state["first"], state["first_done"] = now, done
        return ""
    rate = (done - state["first_done"]) / max(now - state["first"], 1e-9)
    state["rate"] = rate
    return f"{rate:,.0f} tokens/s"


def _left(state: dict[str, float]) -> str:
    rate = state.get("rate", 0.0)
    if not rate:
        return ""
    return f", {rate:,.0f} tokens/s, {int((state['total'] - state['done']) / rate)} s left"


@contextmanager
def _bar(message: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr: tokens scored of all, tokens/s, time left (on a terminal; off
    one, a plain line every so often; neither with --quiet)."""
    from embedlens.cli._output import _err, _err_terminal, _state

    state: dict[str, float] = {"done": 0, "total": 0}
    if _state["quiet"] or not _err_terminal():

        def line(t: float) -> str:
            d, n = int(state["done"]), int(state["total"])
            if not n:
                return f"{message}: loading, {elapsed(t)}"
            return f"{d:,} of {n:,} tokens scored{_left(state)}: {message}"

        def plain(done: int, total: int) -> None:
            _rate(state, done)
            state["done"], state["total"] = done, total

        with plain_progress(line):
            yield plain
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
               TextColumn("tokens"), TaskProgressColumn(),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=_err(), transient=True) as bar:
        task = bar.add_task(message, total=None, rate="")

        def advance(done: int, total: int) -> None:
            rate = _rate(state, done)
            bar.update(task, completed=done, total=total, rate=rate)

        yield advance
