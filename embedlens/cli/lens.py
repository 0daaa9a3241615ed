"""`embedlens lens`: what each layer would predict if it were the last (the logit lens).

The command declares its options once, in its signature: each takes its help and its `--help`
panel from `_HELP` and `_PANELS` (`_option`). It then runs one function of
`embedlens.analysis.lens` for the mode asked (--text, --states, --prompts or one prompt) and
prints the report, with the warnings, notes and plot that go to stderr and files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from embedlens.cli._errors import handles_errors
from embedlens.cli._lens_parity import (
    AgainstDtypeOpt,
    AgainstStatesOpt,
    CapOpt,
    HeadDtypeOpt,
    run_parity,
    wanted,
)
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
from embedlens.cli._output import counter, emit, note, rendered, warn, write_stdout
from embedlens.cli._run import run_report, say_notes
from embedlens.errors import UsageError
from embedlens.options import LENS_FIELDS, LOAD_FIELDS, LensOptions, LoadOptions
from embedlens.runtime import world
from embedlens.text import model_title

if TYPE_CHECKING:
    from embedlens.model.prompts import PromptLine
    from embedlens.reports.lens import LensReport, LensSummaryReport

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
    "  $ embedlens lens ./my-model --text wiki.test.raw --dtype bfloat16 --against-dtype float32\n\n"
    '  $ embedlens lens ./my-model "The capital of France is" --site attn_out,mlp_out,resid'
)

_PANELS = {
    "Input": "prompts skip_bad target chat no_thinking template_arg chat_template states "
    "state_layers",
    "Sites": "layers position site",
    "Decoder": "tuned jacobian compare_logit",
    "Comparison": "against threshold",
    "Output": "top_k plot each save_states",
    "Loading": "dtype device_map max_memory offload_folder",
}
"""The `--help` panel of each option `lens` declares here (the shared ones carry their own)."""

_HELP = {
    "top_k": "Predictions per layer.",
    "layers": "Layers to show: 0,4,8 or 20: or 0:10:2 (0 = embedding output, "
    "the last = the model's output). All by default.",
    "position": "Token position read (-1 = last); 'all' adds a layer x position grid of top-1 "
    "predictions.",
    "target": "Follow this token's probability and rank at every layer.",
    "chat": "Apply the chat template to this user message (with the generation prompt); "
    "PROMPT then starts the assistant's answer.",
    "no_thinking": "With --chat: pass enable_thinking=False to the template.",
    "template_arg": "With --chat: another template variable.",
    "chat_template": "With --chat: a Jinja chat template to use instead of the tokenizer's (for "
    "base models and GGUF files without one).",
    "plot": "Draw the layer x position grid as a heatmap (.png, .svg or .html; needs "
    "matplotlib: pip install 'embedlens[plot]').",
    "device_map": "'auto' spreads the model over GPUs, CPU and disk (accelerate).",
    "max_memory": "With --device-map: memory per device, e.g. cpu=8GiB,0=20GiB.",
    "offload_folder": "With --device-map: where weights that fit nowhere go (a temporary folder, "
    "removed afterwards, by default).",
    "dtype": "Dtype the model is loaded and the lens computed in (float32 by default).",
    "prompts": "Run every prompt of FILE (- for stdin), the model loaded once: one per line, or "
    "JSON Lines with prompt and optional target, chat, id. Prints a per-layer summary; "
    "--json writes one line per prompt, then the summary.",
    "each": "With --prompts: also print each prompt's table.",
    "skip_bad": "With --prompts: skip (and count) bad lines instead of stopping.",
    "against": "Read another model (B, same vocabulary and layers) on the same ids: per layer, "
    "KL(A ‖ B), whether the top-1 agree, and the residual KL (A's decoder on B's residual).",
    "threshold": "With --against: the KL above which a layer counts as divergent (1e-06 by "
    "default); in a parity run, the mean RMS relative difference (1e-03 by default).",
    "tuned": "Read every layer but the last through the tuned lens in DIR (`embedlens tune`'s "
    "folder, or one tuned-lens saved), then the model's own decoder.",
    "jacobian": "Read every layer through the Jacobian lens in FILE (a .pt artifact `embedlens "
    "tune --jacobian`, TransformerLens or the reference wrote; a folder holding one; or "
    "HUB_ID:FILE): J_l h, then the model's own decoder. Layers without a matrix (the embedding "
    "output, the last) are read as the logit lens reads them.",
    "compare_logit": "With --prompts and --tuned or --jacobian: the logit lens's KL and top-1 "
    "beside the learned lens's.",
    "states": "Decode the hidden states FILE holds (vLLM's hidden-states connector's, or "
    "--save-states'), reading only the model's config, tokenizer, final norm and head: "
    "no PROMPT (the file holds the ids), no blocks run; with --site, the sites it holds; "
    "with --against B, B run on its ids. See docs/states.md.",
    "state_layers": "With --states, for a file that does not say (vLLM's): the layer of each "
    "state, e.g. 1,2,3,4 or 1:5 (layer i: block i's input; vLLM's "
    "eagle_aux_hidden_state_layer_ids).",
    "save_states": "Also write every layer's residual stream at every position (the sites asked "
    "for with --site too, and the model's logits at the last) to FILE, for --states to "
    "decode later; with --prompts FILE is a folder, a file a prompt (000001.safetensors "
    "for line 1).",
    "site": "Where in each block to read: resid (the block's output, the default), resid_mid "
    "(after attention), attn_out, mlp_out (what each adds), or several, comma-separated "
    "(rows 3.attn, 3.mid, 3.mlp, 3). See docs/lens.md.",
}
"""The help of each option `lens` declares here, by its parameter."""


def _option(name: str, *short: str, metavar: str | None = None) -> Any:
    """The option of parameter `name` (`--name`, its `_` as `-`), with its help and panel."""
    panel = next(panel for panel, names in _PANELS.items() if name in names.split())
    flag = "--" + name.replace("_", "-")
    return typer.Option(flag, *short, help=_HELP[name], rich_help_panel=panel, metavar=metavar)


PromptArg = Annotated[
    str | None,
    typer.Argument(
        metavar="[PROMPT]",
        help="Text to run (with --chat: the start of the assistant's answer); or --prompts.",
        show_default=False,
    ),
]


@handles_errors
def lens(
    model: ModelArg,
    prompt: PromptArg = None,
    top_k: Annotated[int, _option("top_k", "-k")] = 5,
    layers: Annotated[str | None, _option("layers")] = None,
    position: Annotated[str, _option("position")] = "-1",
    target: Annotated[str | None, _option("target")] = None,
    chat: Annotated[str | None, _option("chat", metavar="MESSAGE")] = None,
    no_thinking: Annotated[bool, _option("no_thinking")] = False,
    template_arg: Annotated[list[str] | None, _option("template_arg", metavar="KEY=VALUE")] = None,
    chat_template: Annotated[Path | None, _option("chat_template", metavar="FILE")] = None,
    plot: Annotated[Path | None, _option("plot", metavar="FILE")] = None,
    device_map: Annotated[DeviceMap | None, _option("device_map")] = None,
    max_memory: Annotated[str | None, _option("max_memory")] = None,
    offload_folder: Annotated[Path | None, _option("offload_folder")] = None,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: Annotated[Dtype, _option("dtype")] = "float32",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
    prompts: Annotated[str | None, _option("prompts", metavar="FILE")] = None,
    each: Annotated[bool, _option("each")] = False,
    skip_bad: Annotated[bool, _option("skip_bad")] = False,
    against: Annotated[str | None, _option("against", metavar="MODEL")] = None,
    against_revision: AgainstRevisionOpt = None,
    threshold: Annotated[float | None, _option("threshold", metavar="NATS")] = None,
    tuned: Annotated[Path | None, _option("tuned", metavar="DIR")] = None,
    jacobian: Annotated[str | None, _option("jacobian", metavar="FILE")] = None,
    compare_logit: Annotated[bool, _option("compare_logit")] = False,
    dist_backend: DistBackendOpt = "auto",
    states: Annotated[Path | None, _option("states", metavar="FILE")] = None,
    state_layers: Annotated[str | None, _option("state_layers", metavar="LAYERS")] = None,
    save_states: Annotated[Path | None, _option("save_states", metavar="FILE")] = None,
    site: Annotated[str | None, _option("site", metavar="SITES")] = None,
    text: TextOpt = None,
    ctx: CtxOpt = 512,
    stride: StrideOpt = None,
    max_tokens: MaxTokensOpt = None,
    score: ScoreOpt = "half",
    save_logits: SaveLogitsOpt = None,
    against_logits: AgainstLogitsOpt = None,
    against_states: AgainstStatesOpt = None,
    against_dtype: AgainstDtypeOpt = None,
    head_dtype: HeadDtypeOpt = None,
    cap: CapOpt = None,
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
    if wanted(given):
        return run_parity(model, given)
    if any(given[key] is not None for key in ("text", "save_logits", "against_logits")):
        return run_text(model, given)
    load, asked = _options(given)
    if given["states"] is not None or given["state_layers"] is not None:
        return run_states(model, given, load, asked)
    if given["prompts"] is not None or prompt is None:
        return _prompts(model, given, load, asked)
    one = replace(asked, grid=plot is not None and against is None)
    save = given["save_states"]
    pair = {"against": against, "against_revision": given["against_revision"]}
    run_report(
        model if against is None else f"{model} against {against}",
        lambda: run_lens(model, prompt, load=load, options=one, save_states=save, **pair),
        doing="Running the lens on",
        check=lambda: _check_one(plot, given["compare_logit"]),
        say=lambda report: _say(report, plot, save),
        **{key: given[key] for key in ("as_json", "quiet", "debug", "device")},
    )


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


def _check_one(plot: Path | None, compare_logit: bool) -> None:
    """Before any work: --compare-logit is for --prompts; the plot file is one drawn."""
    if compare_logit:
        raise UsageError("--compare-logit applies to --prompts (a summary over many prompts)")
    _check_plot(plot)


def _check_plot(plot: Path | None) -> None:
    """--plot names a format the plot is drawn in, and matplotlib is there."""
    if plot is not None:
        from embedlens.views.heatmap import check_plot_file

        check_plot_file(plot)


def _say(report: LensReport, plot: Path | None, saved: Path | None = None) -> None:
    """On stderr: the not-faithful warnings and the notes; then the plot, when one was asked
    for."""
    diff = report.diff
    checks = [("this model's logits", report.check)]
    if diff is not None:
        checks.append((f"the logits of '{diff.against}'", diff.against_check))
    for whose, c in checks:
        if not c.ok:
            how = f"(max |Δ| = {c.max_abs_logit_diff:.3g} > {c.tolerance:.3g})"
            _unfaithful(whose, how, f"; suspect: {c.suspect}")
    say_notes(report)
    if saved is not None:
        note(f"wrote the states to {saved}")
    _plot(report, plot)


def _plot(report: LensReport | LensSummaryReport, plot: Path | None) -> None:
    """The plot asked for: one prompt's heatmap without --against, else the curves (the
    summary's, or the KL curves of A against B)."""
    from embedlens.reports.lens import LensReport

    if plot is None:
        return
    if isinstance(report, LensReport) and report.diff is None:
        from embedlens.views.heatmap import save_heatmap

        for text in save_heatmap(report, plot):
            note("note: " + text)
    else:
        from embedlens.views.curves import save_curves

        save_curves(report, plot)
    note(f"wrote {plot}")


def _prompts(model: str, given: dict[str, Any], load: LoadOptions, asked: LensOptions) -> None:
    """--prompts: each prompt's output as it comes (its JSON line, or its table with --each), the
    summary last."""
    from embedlens.analysis.lens import lens_prompts
    from embedlens.analysis.lens.options import one_prompt_only
    from embedlens.model.prompts import PromptSource

    common(quiet=given["quiet"], debug=given["debug"], device=given["device"], split=True)
    prompts, as_json, each, plot = given["prompts"], given["as_json"], given["each"], given["plot"]
    if prompts is None:
        raise UsageError("give a PROMPT, or --prompts FILE (- for stdin)")
    if given["prompt"] is not None:
        raise UsageError("give either PROMPT or --prompts, not both")
    rank, size = world()
    if prompts == "-" and size > 1:
        raise UsageError(
            "--prompts - reads stdin, which the processes torchrun starts do not share",
            hint="give a file every process can read",
        )
    one_prompt_only(asked.target, asked.chat, False)
    _check_plot(plot)
    if not (as_json or each):  # only the summary is printed, and it reads each prompt's top-1
        asked = replace(asked, top_k=min(asked.top_k, 1))
    show = _Shown(as_json=as_json, each=each)
    source = PromptSource.open(prompts)
    what, against, save = model_title(model), given["against"], given["save_states"]
    if against is not None:
        what = f"{what} against {model_title(str(against))}"
    with counter(f"Running the lens on {what}", "prompts") as advance:

        def on_report(report: LensReport, line: PromptLine) -> None:
            show.report(report, line)
            advance()

        pair = {"against": against, "against_revision": given["against_revision"]}
        more = {"dist_backend": given["dist_backend"], "save_states": save, **pair}
        summary = lens_prompts(model, source, load=load, options=asked, on_report=on_report, **more)
    if rank != 0:  # under torchrun, rank 0 prints every prompt's output and the summary
        return
    show.finish(summary, plot)
    emit(summary, as_json=as_json)
    if save is not None:
        note(f"wrote each prompt's states to {save} (a file a line)")


def _unfaithful(whose: str, how: str, then: str = "") -> None:
    """The warning that the lens does not reproduce `whose` logits (`how`: by how much, or on
    how many prompts)."""
    warn(
        f"the lens does not reproduce {whose} {how}: its rows are not faithful for this "
        f"architecture{then}"
    )


@dataclass
class _Shown:
    """What each prompt prints: its JSON line, or its table with --each; notes once each."""

    as_json: bool
    each: bool
    noted: set[str] = field(default_factory=set)
    unfaithful: int = 0

    def report(self, report: LensReport, line: PromptLine) -> None:
        if not report.check.ok:
            self.unfaithful += 1
        self.notes(report.notes)
        if self.as_json:
            write_stdout(json_line(report, line.id))
        elif self.each:
            write_stdout(rendered(report.__rich__()))

    def notes(self, notes: list[str]) -> None:
        for text in notes:
            if text not in self.noted:
                self.noted.add(text)
                note("note: " + text)

    def finish(self, summary: LensSummaryReport, plot: Path | None) -> None:
        """The warning when some prompts were not faithful, the notes, then the plot."""
        of = f"of {summary.n_prompts} prompts"
        if self.unfaithful:
            alone = " (run one of them alone to see the suspect step)"
            _unfaithful("this model's logits", f"on {self.unfaithful} {of}", alone)
        diff = summary.diff
        if diff is not None and diff.n_against_unfaithful:
            _unfaithful(f"the logits of '{diff.against}'", f"on {diff.n_against_unfaithful} {of}")
        self.notes(summary.notes)
        _plot(summary, plot)


def json_line(report: LensReport, ident: str | int | None) -> str:
    """The single run's JSON object on one line, with the line's `id` when it has one."""
    if ident is None:
        return report.to_json() + "\n"
    data = {**report.to_dict(), "id": ident}
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(data, ensure_ascii=True, allow_nan=False)
    return text + "\n"
