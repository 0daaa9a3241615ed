"""`embedlens tied`: does the head share the embedding's memory."""

from __future__ import annotations

from typing import Annotated

import typer

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
from embedlens.cli._output import emit, note, progress

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

    common(quiet=quiet, debug=debug, device=device)
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
    emit(report, as_json=as_json)
