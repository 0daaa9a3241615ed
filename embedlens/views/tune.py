"""How the `tune` report is shown: the held-out table, logit lens against tuned lens per layer."""

from __future__ import annotations

from rich.console import Group, RenderableType

from embedlens.reports import register_view
from embedlens.reports.tune import TuneReport
from embedlens.views.format import Sheet, shown


def render(r: TuneReport) -> RenderableType:
    """The held-out table and a line on how the lens was fitted."""
    title = (
        f"Held-out evaluation of the tuned lens of {r.display_model} "
        f"({r.eval_tokens:,} tokens, {r.dtype})"
    )
    table = Sheet(title=shown(title, "table.title"))
    table.add_column("layer", justify="right", no_wrap=True)
    names = ["logit KL", "tuned KL", "logit CE", "tuned CE", "logit bpb", "tuned bpb"]
    j = r.jacobian is not None
    if j:
        names[2:2] = ["J KL"]
        names[5:5] = ["J CE"]
        names.append("J bpb")
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for row in r.layers:
        label = f"{row.layer} emb" if row.layer == 0 else str(row.layer)
        if row.layer == r.num_layers:
            label = f"{row.layer} out"
        kl = [row.logit_kl, row.tuned_kl] + ([row.jacobian_kl] if j else [])
        ce = [row.logit_ce, row.tuned_ce] + ([row.jacobian_ce] if j else [])
        bpb = [row.logit_kl_bpb, row.tuned_kl_bpb] + ([row.jacobian_kl_bpb] if j else [])
        table.add_row(
            label,
            *(_figure(v) for v in [*kl, *ce, *bpb]),
            end_section=row.layer == r.num_layers - 1,
        )
    how = "least squares, then the KL refinement" if r.method == "kl" else "least squares"
    refined = ""
    if r.refined_layers is not None:
        kept = _ranges(r.refined_layers) or "none"
        refined = (
            f", refined on {r.refine_tokens:,} of them in {r.steps:,} steps (lr {r.lr:g}; the "
            f"refined translator kept where it did better on a fitted sequence it did not read: "
            f"layers {kept})"
        )
    line = (
        f"KL(model's output ‖ lens) and the next token's cross-entropy (CE) in nats per token; "
        f"bpb: the KL in bits per byte of the held-out text ({r.eval}). Fitted by {how} on "
        f"{r.fit_tokens:,} tokens of {r.data} in sequences of {r.seq_len:,}{refined}; "
        f"written to {r.out}.{_jacobian_line(r)}"
    )
    return Group(table, shown(line, style="dim"))


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _jacobian_line(r: TuneReport) -> str:
    """How the Jacobian lens (J) was fitted, when it was."""
    jf = r.jacobian
    if jf is None:
        return ""
    how = "exact (one-hot cotangents)" if jf.estimator == "exact" else (
        f"sketched ({jf.probes} random probes a sequence, a multiple of the identity as a "
        "control variate; "
        + ("its two halves agreed to 0.99 at every layer" if jf.agreed else
           f"stopped at --probes, the halves agreeing to {min(jf.agreement or [1.0]):.4f}")
        + ")"
    )  # fmt: skip
    return (
        f" J: the Jacobian lens, {how}, on {jf.tokens:,} tokens ({jf.prompts} sequences, the "
        f"first {jf.skip_first} positions of each left out) in {jf.backward_passes:,} backward "
        f"passes; layer 0 and the output read through the identity; written to {jf.path}."
    )


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


register_view(TuneReport, render)
