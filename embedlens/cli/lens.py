"""`embedlens lens`: what each layer would predict if it were the last (the logit lens)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from embedlens.cli._errors import handles_errors
from embedlens.cli._lens_prompts import run_prompts
from embedlens.cli._lens_states import run_states
from embedlens.cli._lens_text import (
    AgainstLogitsOpt,
    CtxOpt,
    MaxTokensOpt,
    SaveLogitsOpt,
    ScoreOpt,
    StrideOpt,
    TextOpt,
    run_text,
)
from embedlens.cli._options import (
    AgainstRevisionOpt,
    DebugOpt,
    DeviceMap,
    DeviceOpt,
    DistBackendOpt,
    Dtype,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
    TrustOpt,
    common,
)
from embedlens.cli._output import note, warn
from embedlens.cli._run import run_report, say_notes
from embedlens.errors import UsageError
from embedlens.options import LENS_FIELDS, LOAD_FIELDS, LensOptions, LoadOptions

if TYPE_CHECKING:
    from embedlens.reports.lens import LensReport

EXAMPLES = (
    "Examples:\n\n"
    '  $ embedlens lens ./SmolLM2-135M-Instruct.Q4_1.gguf "The capital of France is"\n\n'
    '  $ embedlens lens Qwen/Qwen3-0.6B "中国的首都是" --chat "中国的首都是哪里？" --no-thinking'
    " --target 北京\n\n"
    '  $ embedlens lens ./my-model "The capital of France is" --position all --plot lens.png\n\n'
    '  $ embedlens lens ./base.gguf "Paris" --chat "The capital of France?" --chat-template chat.jinja\n\n'
    '  $ embedlens lens ./big-model "Hello" --device-map auto --layers 20: --json\n\n'
    "  $ embedlens lens ./my-model --prompts prompts.jsonl --plot curves.png\n\n"
    "  $ embedlens lens ./base.gguf --text wiki.test.raw --against ./model.Q4_K_M.gguf\n\n"
    '  $ embedlens lens ./model.Q4_1.gguf "The capital of France is" --against ./model.Q8_0.gguf\n\n'
    "  $ embedlens lens ./base --prompts prompts.jsonl --against ./instruct --plot kl.png\n\n"
    "  $ embedlens lens ./my-model --prompts - --json < prompts.txt > lens.jsonl\n\n"
    '  $ embedlens lens ./big-model "Hello" --save-states hello.safetensors\n\n'
    "  $ embedlens lens ./big-model --states hello.safetensors --position all\n\n"
    '  $ embedlens lens ./my-model "The capital of France is" --site attn_out,mlp_out,resid'
)

DtypeLensOpt = Annotated[
    Dtype,
    typer.Option(
        "--dtype",
        help="Dtype the model is loaded and the lens computed in (float32 by default).",
        rich_help_panel="Loading",
    ),
]


PromptArg = Annotated[
    str | None,
    typer.Argument(
        metavar="[PROMPT]",
        help="Text to run (with --chat: the start of the assistant's answer); or --prompts.",
        show_default=False,
    ),
]

PromptsOpt = Annotated[
    str | None,
    typer.Option(
        "--prompts",
        metavar="FILE",
        help="Run every prompt of FILE (- for stdin), the model loaded once: one per line, or "
        "JSON Lines with prompt and optional target, chat, id. Prints a per-layer summary; "
        "--json writes one line per prompt, then the summary.",
        rich_help_panel="Input",
    ),
]
EachOpt = Annotated[
    bool,
    typer.Option(
        "--each", help="With --prompts: also print each prompt's table.", rich_help_panel="Output"
    ),
]
SkipBadOpt = Annotated[
    bool,
    typer.Option(
        "--skip-bad",
        help="With --prompts: skip (and count) bad lines instead of stopping.",
        rich_help_panel="Input",
    ),
]

TunedOpt = Annotated[
    Path | None,
    typer.Option(
        "--tuned",
        metavar="DIR",
        help="Read every layer but the last through the tuned lens in DIR (`embedlens tune`'s "
        "folder, or one tuned-lens saved), then the model's own decoder.",
        rich_help_panel="Decoder",
    ),
]
CompareLogitOpt = Annotated[
    bool,
    typer.Option(
        "--compare-logit",
        help="With --prompts and --tuned: the logit lens's KL and top-1 beside the tuned lens's.",
        rich_help_panel="Decoder",
    ),
]

LayersOpt = Annotated[
    str | None,
    typer.Option(
        "--layers",
        help="Layers to show: 0,4,8 or 20: or 0:10:2 (0 = embedding output, "
        "the last = the model's output). All by default.",
        rich_help_panel="Sites",
    ),
]

PositionOpt = Annotated[
    str,
    typer.Option(
        "--position",
        help="Token position read (-1 = last); 'all' adds a layer x position grid of top-1 "
        "predictions.",
        rich_help_panel="Sites",
    ),
]

TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        help="Follow this token's probability and rank at every layer.",
        rich_help_panel="Input",
    ),
]

ChatOpt = Annotated[
    str | None,
    typer.Option(
        "--chat",
        metavar="MESSAGE",
        help="Apply the chat template to this user message (with the generation prompt); "
        "PROMPT then starts the assistant's answer.",
        rich_help_panel="Input",
    ),
]

NoThinkingOpt = Annotated[
    bool,
    typer.Option(
        "--no-thinking",
        help="With --chat: pass enable_thinking=False to the template.",
        rich_help_panel="Input",
    ),
]

TemplateArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--template-arg",
        metavar="KEY=VALUE",
        help="With --chat: another template variable.",
        rich_help_panel="Input",
    ),
]

ChatTemplateOpt = Annotated[
    Path | None,
    typer.Option(
        "--chat-template",
        metavar="FILE",
        help="With --chat: a Jinja chat template to use instead of the tokenizer's (for base "
        "models and GGUF files without one).",
        rich_help_panel="Input",
    ),
]

PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="FILE",
        help="Draw the layer x position grid as a heatmap (.png, .svg or .html; needs "
        "matplotlib: pip install 'embedlens[plot]').",
        rich_help_panel="Output",
    ),
]

AgainstOpt = Annotated[
    str | None,
    typer.Option(
        "--against",
        metavar="MODEL",
        help="Read another model (B, same vocabulary and layers) on the same ids: per layer, "
        "KL(A ‖ B), whether the top-1 agree, and the residual KL (A's decoder on B's residual).",
        rich_help_panel="Comparison",
    ),
]
ThresholdOpt = Annotated[
    float | None,
    typer.Option(
        "--threshold",
        metavar="NATS",
        help="With --against: the KL above which a layer counts as divergent (1e-06 by default).",
        rich_help_panel="Comparison",
    ),
]

StatesOpt = Annotated[
    Path | None,
    typer.Option(
        "--states",
        metavar="FILE",
        help="Decode the hidden states FILE holds (vLLM's hidden-states connector's, or "
        "--save-states'), reading only the model's config, tokenizer, final norm and head: "
        "no PROMPT (the file holds the ids), no blocks run; with --site, the sites it holds; "
        "with --against B, B run on its ids. See docs/states.md.",
        rich_help_panel="Input",
    ),
]
StateLayersOpt = Annotated[
    str | None,
    typer.Option(
        "--state-layers",
        metavar="LAYERS",
        help="With --states, for a file that does not say (vLLM's): the layer of each state, "
        "e.g. 1,2,3,4 or 1:5 (layer i: block i's input; vLLM's "
        "eagle_aux_hidden_state_layer_ids).",
        rich_help_panel="Input",
    ),
]
SaveStatesOpt = Annotated[
    Path | None,
    typer.Option(
        "--save-states",
        metavar="FILE",
        help="Also write every layer's residual stream at every position (the sites asked "
        "for with --site too, and the model's logits at the last) to FILE, for --states to "
        "decode later; with --prompts FILE is a folder, a file a prompt (000001.safetensors "
        "for line 1).",
        rich_help_panel="Output",
    ),
]

SiteOpt = Annotated[
    str | None,
    typer.Option(
        "--site",
        metavar="SITES",
        help="Where in each block to read: resid (the block's output, the default), resid_mid "
        "(after attention), attn_out, mlp_out (what each adds), or several, comma-separated "
        "(rows 3.attn, 3.mid, 3.mlp, 3). See docs/lens.md.",
        rich_help_panel="Sites",
    ),
]

DeviceMapOpt = Annotated[
    DeviceMap | None,
    typer.Option(
        "--device-map",
        help="'auto' spreads the model over GPUs, CPU and disk (accelerate).",
        rich_help_panel="Loading",
    ),
]

MaxMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--max-memory",
        help="With --device-map: memory per device, e.g. cpu=8GiB,0=20GiB.",
        rich_help_panel="Loading",
    ),
]

OffloadFolderOpt = Annotated[
    Path | None,
    typer.Option(
        "--offload-folder",
        help="With --device-map: where weights that fit nowhere go (a temporary folder, "
        "removed afterwards, by default).",
        rich_help_panel="Loading",
    ),
]


@handles_errors
def lens(
    model: ModelArg,
    prompt: PromptArg = None,
    top_k: Annotated[
        int, typer.Option("--top-k", "-k", help="Predictions per layer.", rich_help_panel="Output")
    ] = 5,
    layers: LayersOpt = None,
    position: PositionOpt = "-1",
    target: TargetOpt = None,
    chat: ChatOpt = None,
    no_thinking: NoThinkingOpt = False,
    template_arg: TemplateArgOpt = None,
    chat_template: ChatTemplateOpt = None,
    plot: PlotOpt = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadFolderOpt = None,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeLensOpt = "float32",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
    prompts: PromptsOpt = None,
    each: EachOpt = False,
    skip_bad: SkipBadOpt = False,
    against: AgainstOpt = None,
    against_revision: AgainstRevisionOpt = None,
    threshold: ThresholdOpt = None,
    tuned: TunedOpt = None,
    compare_logit: CompareLogitOpt = False,
    dist_backend: DistBackendOpt = "auto",
    states: StatesOpt = None,
    state_layers: StateLayersOpt = None,
    save_states: SaveStatesOpt = None,
    site: SiteOpt = None,
    text: TextOpt = None,
    ctx: CtxOpt = 512,
    stride: StrideOpt = None,
    max_tokens: MaxTokensOpt = None,
    score: ScoreOpt = "half",
    save_logits: SaveLogitsOpt = None,
    against_logits: AgainstLogitsOpt = None,
) -> None:
    """Decode every layer's residual stream with the model's own final norm, head and post-head steps.

    Layer 0 is the embedding output, layer i the output of block i, the last row the model's own
    output. The lens runs in float32 unless --dtype says otherwise. Every run checks itself:
    decoding the last block's output must reproduce the model's logits.
    """
    _run(dict(locals()))


def _run(given: dict[str, Any]) -> None:
    """The command once its options are read (`given`: each by its parameter's name): --text,
    --states, --prompts or one prompt."""
    from embedlens.analysis.lens import lens as run_lens

    model, prompt, plot, against = given["model"], given["prompt"], given["plot"], given["against"]
    if any(given[key] is not None for key in ("text", "save_logits", "against_logits")):
        return run_text(model, given)
    load, asked = _options(given)
    if given["states"] is not None or given["state_layers"] is not None:
        return run_states(model, given, load, asked)
    b = {"against": against, "against_revision": given["against_revision"]}
    shown = (given["as_json"], given["quiet"], given["debug"], given["device"])
    if given["prompts"] is not None or prompt is None:
        common(quiet=shown[1], debug=shown[2], device=shown[3], split=True)
        return run_prompts(model, prompt, given["prompts"], each=given["each"], as_json=shown[0],
                           plot=plot, load=load, asked=asked,
                           more={**b, "dist_backend": given["dist_backend"],
                                 "save_states": given["save_states"]})  # fmt: skip
    one = replace(asked, grid=plot is not None and against is None)
    save = given["save_states"]
    work = lambda: run_lens(model, prompt, load=load, options=one,  # noqa: E731
                            save_states=save, against=against,
                            against_revision=b["against_revision"])  # fmt: skip
    _one(model, against, work, plot, save, given["compare_logit"], shown)


_CLI_NAMES = {"template_args": "template_arg"}
"""The `LensOptions` and `LoadOptions` fields whose option the command names otherwise."""


def _options(given: dict[str, Any]) -> tuple[LoadOptions, LensOptions]:
    """How to load the model and what the lens is asked, built once from the command's options:
    each field from the option of its name (`_CLI_NAMES`), so that a field is added to the
    command by adding its option; `grid` is set by --plot, and a field the command has no
    option for keeps its default."""

    def of(fields: frozenset[str]) -> dict[str, Any]:
        names = {name: _CLI_NAMES.get(name, name) for name in fields if name != "grid"}
        return {name: given[option] for name, option in names.items() if option in given}

    return LoadOptions(**of(LOAD_FIELDS)), LensOptions(**of(LENS_FIELDS))


def _one(
    model: str,
    against: str | None,
    work: Callable[[], LensReport],
    plot: Path | None,
    saved: Path | None,
    compare_logit: bool,
    shown: tuple[bool, bool, bool, str],
) -> None:
    """One prompt: the lens (`work`) under the common options, its report printed."""
    as_json, quiet, debug, device = shown
    run_report(
        model if against is None else f"{model} against {against}",
        work, as_json=as_json, quiet=quiet, debug=debug, device=device,
        doing="Running the lens on", check=lambda: _check_one(plot, compare_logit),
        say=lambda report: _say(report, plot, saved),
    )  # fmt: skip


def _check_one(plot: Path | None, compare_logit: bool) -> None:
    """Before any work: --compare-logit is for --prompts; --plot names a format the heatmap is
    drawn in, and matplotlib is there."""
    if compare_logit:
        raise UsageError("--compare-logit applies to --prompts (a summary over many prompts)")
    if plot is not None:
        from embedlens.views.heatmap import check_plot_file

        check_plot_file(plot)


def _say(report: LensReport, plot: Path | None, saved: Path | None = None) -> None:
    """On stderr: the not-faithful warnings and the notes; then the plot, when one was asked
    for (with --against: the KL curves, else the heatmap)."""
    diff = report.diff
    checks = [("this model's logits", report.check)]
    if diff is not None:
        checks.append((f"the logits of '{diff.against}'", diff.against_check))
    for whose, c in checks:
        if not c.ok:
            warn(
                f"the lens does not reproduce {whose} (max |Δ| = "
                f"{c.max_abs_logit_diff:.3g} > {c.tolerance:.3g}): its rows are not faithful "
                f"for this architecture; suspect: {c.suspect}"
            )
    say_notes(report)
    if saved is not None:
        note(f"wrote the states to {saved}")
    if plot is not None and diff is not None:
        from embedlens.views.lens_diff import save_diff_curves

        save_diff_curves(report, plot)
        note(f"wrote {plot}")
    elif plot is not None:
        from embedlens.views.heatmap import save_heatmap

        for text in save_heatmap(report, plot):
            note("note: " + text)
        note(f"wrote {plot}")
