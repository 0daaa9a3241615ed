"""`embedlens params`: who owns the parameters."""

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
from embedlens.reports.params import ParamsReport

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens params ./SmolLM2-135M-Instruct.Q4_1.gguf\n\n"
    "  $ embedlens params meta-llama/Meta-Llama-3-70B --meta-only\n\n"
    "  $ embedlens params Qwen/Qwen3-0.6B --per-block --json"
)

_LABELS = {
    "embedding": "embedding",
    "lm_head": "LM head",
    "position_embedding": "position embeddings",
    "blocks": "decoder blocks",
    "final_norm": "final norm",
    "other": "other",
}


@handles_errors
def params(
    model: ModelArg,
    meta_only: Annotated[
        bool, typer.Option("--meta-only", help="Build from the config alone; no weights needed.")
    ] = False,
    load: Annotated[
        bool, typer.Option("--load", help="Count from the loaded model (reads all weights).")
    ] = False,
    per_block: Annotated[
        bool, typer.Option("--per-block", help="Also list every block by part.")
    ] = False,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show who owns the parameters: embedding, LM head, blocks, norms (tied weights once).

    Figures come from the checkpoint's headers when it has safetensors or GGUF weights (no
    weights read, no torch), from the config on the meta device with --meta-only, or from the
    loaded model with --load.
    """
    from embedlens.analysis.params import params_report
    from embedlens.errors import UsageError
    from embedlens.io.source import resolve
    from embedlens.model.inventory import take_inventory

    common(quiet=quiet, debug=debug, dtype=dtype, device=device)
    if meta_only and load:
        raise UsageError("--meta-only and --load exclude each other")
    mode = "meta" if meta_only else "weights" if load else None
    with progress(f"Reading {model}"):
        source = resolve(model, revision)
        inv, used, _ = take_inventory(
            source, mode, trust_remote_code=trust_remote_code, dtype=dtype, device=device
        )
        report = params_report(model, inv, used, per_block=per_block)
    if used == "meta" and not meta_only:
        note("no safetensors or GGUF headers to read: counted from the config on the meta device")
    for text in report.notes:
        note("note: " + text)
    emit(report, as_json=as_json, render=render_params)


def render_params(r: ParamsReport) -> RenderableType:
    """The share table, the block parts, and the head's cost."""
    table = Table(title=shown(f"Parameters of {r.model} (source: {r.source})", "table.title"))
    table.add_column("part")
    table.add_column("params", justify="right")
    table.add_column("share", justify="right")
    table.add_column("bytes", justify="right")
    for g in r.groups:
        label = _LABELS.get(g.name, g.name)
        if g.name == "embedding" and r.tied:
            label += " (tied with the head)"
        table.add_row(shown(label), count(g.params), share(g.fraction), size(g.bytes))
        if g.name == "blocks":
            for part in r.block_parts:
                table.add_row(
                    shown("  " + part.name, style="dim"),
                    Text(count(part.params), style="dim"),
                    Text(share(part.fraction), style="dim"),
                    Text(size(part.bytes), style="dim"),
                )
    table.add_section()
    table.add_row("total", count(r.total), "100.00%", size(r.total_bytes), style="bold")
    lines: list[RenderableType] = [
        table,
        shown(
            f"V = {count(r.vocab_size)}, d = {count(r.hidden_size)}, {r.num_layers} blocks, "
            f"{'tied' if r.tied else 'untied'} head, dtype {r.dtype or '?'}."
        ),
    ]
    head = "embedding + head" if not r.tied else "embedding (= head)"
    lines.append(
        Text(
            f"{head}: {share(r.embedding_lm_head_fraction)} of all parameters. "
            f"LM head per token: 2·V·d = {count(r.head_flops_per_token)} operations, "
            f"{share(r.head_flops_fraction)} of a token's forward pass "
            "(about 2 per weight used; attention over the context aside)."
        )
    )
    if r.moe is not None:
        m = r.moe
        lines.append(
            Text(
                f"Mixture of experts: {m.experts_per_token} of {m.num_experts} experts per token; "
                f"active per token {count(m.active_params)} ({share(m.active_fraction)} of all)."
            )
        )
    if r.blocks:
        per = Table(title="Per block")
        for col in ("layer", "params", "attention", "mlp", "experts", "router", "norms", "other"):
            per.add_column(col, justify="right")
        for b in r.blocks:
            per.add_row(
                str(b.layer),
                *(count(x) for x in (b.params, b.attention, b.mlp, b.experts, b.router, b.norms)),
                count(b.other),
            )
        lines.append(per)
    return Group(*lines)
