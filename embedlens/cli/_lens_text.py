"""`embedlens lens MODEL --text FILE`: the lens over a text, llama-perplexity's statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from embedlens.cli._output import emit, note, tokens_bar, warn
from embedlens.errors import UsageError
from embedlens.options import LensOptions, LoadOptions
from embedlens.runtime import world


def _option(name: str, help: str, panel: str = "Input", metavar: str | None = None) -> Any:
    """The option `--name` (its `_` as `-`) with its help, in its panel of `lens --help`."""
    flag = "--" + name.replace("_", "-")
    return typer.Option(flag, help=help, rich_help_panel=panel, metavar=metavar)


TextOpt = Annotated[
    Path | None,
    _option(
        "text",
        "Score every token of a text file (windows of --ctx, llama-perplexity's rule): per layer "
        "cross-entropy, bits per byte, KL to the output, entropy, top-1 accuracy; with "
        "--against, llama-perplexity's KL table at every layer. See docs/text.md.",
        metavar="FILE",
    ),
]
CtxOpt = Annotated[int, _option("ctx", "With --text: tokens per window.")]
StrideOpt = Annotated[
    int | None, _option("stride", "With --text: tokens between window starts (--ctx by default).")
]
MaxTokensOpt = Annotated[
    int | None, _option("max_tokens", "With --text: the text's first N tokens only.")
]
ScoreOpt = Annotated[
    str, _option("score", "With --text: 'half' (each window's second half) or 'all' its tokens.")
]
SaveLogitsOpt = Annotated[
    Path | None,
    _option(
        "save_logits",
        "With --text: write the output's top-k log-probabilities, for --against-logits.",
        "Output",
        "FILE",
    ),
]
AgainstLogitsOpt = Annotated[
    Path | None,
    _option(
        "against_logits",
        "With --text: compare the output with a --save-logits FILE (the base).",
        "Comparison",
        "FILE",
    ),
]

_ALONE = {"prompt": "PROMPT", "prompts": "--prompts", "target": "--target", "chat": "--chat",
          "each": "--each", "skip_bad": "--skip-bad", "states": "--states",
          "device_map": "--device-map", "template_arg": "--template-arg",
          "chat_template": "--chat-template", "compare_logit": "--compare-logit",
          "threshold": "--threshold", "state_layers": "--state-layers"}  # fmt: skip
"""Options of `lens` that --text does not take."""
_TOP_K = LensOptions().top_k
"""-k's default: any other -k is refused with --text."""


def run_text(model: str, given: dict[str, Any]) -> None:
    """`lens --text`: checks, the run under a progress bar, the report, the plot."""
    from embedlens.cli._options import common

    _refused(given)
    common(quiet=given["quiet"], debug=given["debug"], device=given["device"], split=True)
    plot: Path | None = given.get("plot")
    if plot is not None:
        from embedlens.views.heatmap import check_plot_file

        check_plot_file(plot)
    from embedlens.text import model_title

    what = model_title(model)
    if given.get("against") is not None:
        what += f" against {model_title(str(given['against']))}"
    from embedlens.analysis.lens.text import lens_text

    keys = ("ctx", "stride", "max_tokens", "score", "layers", "against", "against_revision",
            "against_logits", "save_logits", "tuned", "jacobian", "site", "save_states",
            "dist_backend")  # fmt: skip
    load = LoadOptions(revision=given["revision"], dtype=given["dtype"], device=given["device"],
                       trust_remote_code=given["trust_remote_code"])  # fmt: skip
    with tokens_bar(f"Scoring {given['text']} with {what}", "tokens scored") as advance:
        report = lens_text(
            model,
            given["text"],
            load=load,
            progress=lambda _stage, done, total, _unit, _detail="": advance(done, total),
            **{key: given[key] for key in keys},
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
    wrote = {"save_logits": "", "save_states": " (each window's states, a file a window)"}
    for key, what in wrote.items():
        if given.get(key) is not None:
            note(f"wrote {given[key]}{what}")
    if plot is not None:
        from embedlens.views.lens_text import save_text_curves

        save_text_curves(report, plot)
        note(f"wrote {plot}")
    emit(report, as_json=given["as_json"])


def _refused(given: dict[str, Any]) -> None:
    """What --text does not take, refused."""
    if given["text"] is None:
        raise UsageError("--save-logits and --against-logits apply with --text FILE")
    for key, flag in _ALONE.items():
        if given.get(key) not in (None, False, []):
            raise UsageError(f"--text and {flag} do not combine")
    if given.get("position") not in (None, "-1"):
        raise UsageError("--text and --position do not combine: every scored token is read")
    if given.get("top_k", _TOP_K) != _TOP_K:
        raise UsageError("--text and -k do not combine: its table is per layer, over every token")
