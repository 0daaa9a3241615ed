"""The logit-lens picture: a layer x position heatmap of top-1 probabilities, tokens in the cells.

matplotlib is an optional extra (`pip install 'embedlens[plot]'`) and is imported only here,
inside the functions. PNG is drawn with whatever fonts are installed (CJK fonts are used when
present); SVG and HTML keep the tokens as text, so a browser renders every script.
"""

from __future__ import annotations

import html
import importlib.util
import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from embedlens.errors import EmbedlensError, MissingDependencyError, UsageError
from embedlens.reports.lens import LensReport

_CJK_FONTS = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Source Han Sans SC",
    "Source Han Sans",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Microsoft YaHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "SimHei",
    "Arial Unicode MS",
)
MAX_LABEL = 12
"""Tokens longer than this are cut in the cells (the JSON keeps them whole)."""
PLOT_SUFFIXES = (".png", ".svg", ".html")


def require_matplotlib() -> None:
    """Fail early, with the install hint, when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError(
            "--plot needs matplotlib", hint="pip install 'embedlens[plot]'"
        )


def check_plot_file(path: Path) -> None:
    """Before any work: the file names a format the heatmap is drawn in, and matplotlib is there."""
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot '{path}': unknown format", hint="name a .png, .svg or .html file")
    require_matplotlib()


def _label(token: str) -> str:
    text = token.replace("\n", "\\n").replace("\t", "\\t")
    text = "'" + text + "'" if text.strip() != text or not text else text
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "…"


def _fonts() -> list[str]:
    from matplotlib import font_manager

    have = {f.name for f in font_manager.fontManager.ttflist}
    return ["DejaVu Sans", *(f for f in _CJK_FONTS if f in have)]


def figure(report: LensReport) -> Any:
    """The heatmap as a matplotlib Figure (the grid's last layer at the top)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    if report.grid is None:
        raise EmbedlensError("there is no layer x position grid to draw")
    rows = list(reversed(report.grid))
    probs = np.array([[c.prob for c in row.cells] for row in rows])
    positions = [c.position for c in rows[0].cells]
    width = min(40.0, 1.5 + 0.95 * len(positions))
    height = min(60.0, 1.6 + 0.32 * len(rows))
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(probs, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    for y, row in enumerate(rows):
        for x, cell in enumerate(row.cells):
            ax.text(
                x,
                y,
                _label(cell.token),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if cell.prob > 0.55 else "black",
                parse_math=False,
            )
    ax.set_xticks(range(len(positions)))
    ax.set_xticklabels(
        [_label(report.tokens[p].token) for p in positions], rotation=60, ha="right", fontsize=8
    )
    for label in ax.get_xticklabels():
        label.set_parse_math(False)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_layer_label(report, row.layer) for row in rows], fontsize=7)
    ax.set_xlabel("input token (the cell shows the prediction for the next one)")
    ax.set_ylabel("layer")
    title = ax.set_title(f"Logit lens: {report.display_model}", fontsize=10)
    title.set_parse_math(False)
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02, label="top-1 probability")
    fig.tight_layout()
    return fig


def _layer_label(report: LensReport, layer: int) -> str:
    if layer == 0:
        return "0 emb"
    if layer == report.num_layers:
        return f"{layer} out"
    return str(layer)


@contextmanager
def _drawn(report: LensReport) -> Iterator[Any]:
    """The heatmap's figure, drawn with fonts that cover the tokens; closed afterwards."""
    import matplotlib
    import matplotlib.pyplot as plt

    with (
        warnings.catch_warnings(),
        matplotlib.rc_context({"font.family": _fonts(), "svg.fonttype": "none"}),
    ):
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig = figure(report)
        try:
            yield fig
        finally:
            plt.close(fig)


def heatmap_svg(report: LensReport) -> str:
    """The heatmap as an inline <svg> element (for HTML pages and notebooks)."""
    buffer = io.StringIO()
    with _drawn(report) as fig:
        fig.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]


def save_heatmap(report: LensReport, path: Path) -> None:
    """Write the heatmap to `path`: .png, .svg, or .html (the SVG inside a page)."""
    suffix = path.suffix.lower()
    if suffix == ".html":
        _write(path, _page(report, heatmap_svg(report)).encode("utf-8"))
        return
    binary = io.BytesIO()
    with _drawn(report) as fig:
        fig.savefig(binary, format=suffix.lstrip("."), dpi=150)
    _write(path, binary.getvalue())


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as e:
        raise EmbedlensError(f"cannot write the plot to '{path}': {e.strerror or e}") from e


def _page(report: LensReport, svg: str) -> str:
    prompt = html.escape(report.prompt)
    title = html.escape(f"Logit lens: {report.display_model}")
    check = report.check
    verdict = "reproduces" if check.ok else "does NOT reproduce"
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{title}</title></head>\n<body style='font-family: sans-serif'>\n"
        f"<h1 style='font-size: 1.2em'>{title}</h1>\n<p>Prompt: <code>{prompt}</code></p>\n"
        f"{svg}\n<p>Self-check: decoding the last block's output {verdict} the model's logits "
        f"(max |Δ| = {check.max_abs_logit_diff:.2g}). Decode: "
        f"{html.escape(' → '.join(report.steps))}.</p>\n</body></html>\n"
    )
