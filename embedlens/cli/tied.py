"""`embedlens tied`: does the head share the embedding's memory."""

from __future__ import annotations

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
from embedlens.cli._output import count, emit, note, progress, share, shown, size
from embedlens.reports.tied import TiedReport

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens tied ./my-model\n\n"
    "  $ embedlens tied Qwen/Qwen3-0.6B --meta-only\n\n"
    "  $ embedlens tied ./my-model --load --json"
)


@handles_errors
def tied(
    model: ModelArg,
    meta_only: Annotated[
        bool,
        typer.Option("--meta-only", help="Build from the config on the meta device (no weights)."),
    ] = False,
    load: Annotated[
        bool, typer.Option("--load", help="Load the weights and compare data_ptr().")
    ] = False,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Say whether the LM head shares the embedding's storage, and what that saves.

    Evidence is shown piece by piece: the config's flag, whether the checkpoint stores a head
    matrix, and (with --meta-only or --load) whether the built model's head is the embedding.
    """
    from embedlens.analysis.tied import storage_shared, tied_report
    from embedlens.errors import UsageError
    from embedlens.io.source import resolve
    from embedlens.model.inventory import take_inventory

    common(quiet=quiet, debug=debug, dtype=dtype, device=device)
    if meta_only and load:
        raise UsageError("--meta-only and --load exclude each other")
    with progress(f"Reading {model}"):
        source = resolve(model, revision)
        header_inv, _, _ = (
            take_inventory(source, "header", trust_remote_code=trust_remote_code)
            if not meta_only
            else (None, None, None)
        )
        inv, model_obj, check = header_inv, None, None
        if meta_only or load:
            mode = "meta" if meta_only else "weights"
            inv, _, model_obj = take_inventory(
                source, mode, trust_remote_code=trust_remote_code, dtype=dtype, device=device
            )
            check = (
                "parameter identity on meta" if meta_only else "data_ptr() of the loaded weights"
            )
        assert inv is not None
        flag = (header_inv or inv).config.tie_word_embeddings
        if flag is None and model_obj is not None:
            flag = bool(getattr(model_obj.config.get_text_config(), "tie_word_embeddings", False))
        has_head = None
        if header_inv is not None:
            has_head = header_inv.head is not None or header_inv.stored_head is not None
        report = tied_report(
            model,
            inv,
            checkpoint_has_head=has_head,
            config_flag=flag,
            same_storage=None if model_obj is None else storage_shared(model_obj, loaded=load),
            storage_check=check,
        )
    for text in report.notes:
        note("note: " + text)
    emit(report, as_json=as_json, render=render_tied)


def _yes_no(value: bool | None) -> Text:
    if value is None:
        return Text("not checked", style="dim")
    return Text("yes" if value else "no", style="green" if value else "yellow")


def render_tied(r: TiedReport) -> RenderableType:
    """Evidence, verdict and savings."""
    table = Table(title=shown(f"Is the LM head of {r.model} the embedding?", "table.title"))
    table.add_column("evidence")
    table.add_column("says tied?")
    table.add_row("config: tie_word_embeddings", _yes_no(r.evidence.config))
    table.add_row(
        "checkpoint stores no separate head",
        _yes_no(
            None
            if r.evidence.checkpoint_has_lm_head is None
            else not r.evidence.checkpoint_has_lm_head
        ),
    )
    table.add_row("built model: head is the embedding", _yes_no(r.evidence.same_storage))
    v, d = r.shape
    verdict = shown(("TIED" if r.tied else "UNTIED") + f": {r.verdict}.", style="bold")
    lines: list[RenderableType] = [table, verdict]
    if r.tied:
        lines.append(
            shown(
                f"Sharing the [{count(v)}, {count(d)}] matrix saves {count(r.saved_params)} "
                f"parameters ({size(r.saved_bytes)} at {r.dtype or '?'}), "
                f"{share(r.saved_fraction)} of the model."
            )
        )
    else:
        lines.append(
            Text(f"The head is a second [{count(v)}, {count(d)}] matrix: nothing is shared.")
        )
    return Group(*lines)
