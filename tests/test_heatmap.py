"""The lens heatmap: tokens quoted as the tables quote them, probabilities in the cells, the
target's column, fonts that cover the tokens, and HTML that fetches nothing."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from embedlens.views.format import prob, quoted
from embedlens.views.heatmap import TICK_LABEL, fonts_for, label

pytest.importorskip("matplotlib")

CJK = {"Paris": "北京", "France": "中国", "capital": "首都", "is": "是", "of": "的"}
LONG = "princess"
LONG_TOKEN = "▁an_international_organisation"
RARE = "𓀀"
"""An Egyptian hieroglyph: printable, and in almost no installed font."""
PROMPT = "the 首都 的 中国 是"


@pytest.fixture(scope="module")
def cjk_model(tiny, tmp_path_factory) -> Path:
    """The tiny Llama with some words of its vocabulary renamed: CJK, a long token, a rare one."""
    folder = tmp_path_factory.mktemp("cjk") / "model"
    shutil.copytree(tiny("llama-tied"), folder)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    renames = {**CJK, LONG: LONG_TOKEN, "moon": RARE}
    vocab = data["model"]["vocab"]
    data["model"]["vocab"] = {renames.get(k, k): v for k, v in vocab.items()}
    path.write_text(json.dumps(data, ensure_ascii=False))
    return folder


def _texts(svg: str) -> list[str]:
    """Every line of text the SVG draws."""
    root = ET.fromstring(svg[svg.index("<svg") :])
    return ["".join(e.itertext()) for e in root.iter() if e.tag.endswith("}text")]


def _run(cli, folder: Path, out: Path, *args: str) -> tuple[dict, str]:
    result = cli("lens", folder, PROMPT, "--position", "all", "--plot", out, "--json", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_label_quotes_as_the_tables_and_ellipsises_the_middle():
    assert label(" king", 12) == quoted(" king").plain == "' king'"
    assert label("a\nb", 12) == "'a\\nb'"  # control characters escaped, as the tables show them
    cut = label(" international", 8)
    assert cut.startswith("' ") and cut.endswith("al'") and "…" in cut
    assert len(cut) <= 8 + 2
    wide = label("中国的首都是北京", 8)  # a wide character counts twice
    assert wide.startswith("'中") and wide.endswith("京'") and "…" in wide


def test_svg_cells_hold_quoted_tokens_and_probabilities(tiny, cli, cjk_model, tmp_path):
    data, _ = _run(cli, cjk_model, tmp_path / "lens.svg")
    texts = _texts((tmp_path / "lens.svg").read_text())
    for token in ("'the'", "'首都'", "'的'", "'中国'", "'是'"):  # the columns, quoted
        assert token in texts
    cells = [c for row in data["grid"] for c in row["cells"]]
    for c in cells:
        assert prob(c["prob"], c["logprob"], 2) in texts
    shown = [t.split("\n")[0] for t in texts]
    assert {label(c["token"], 99) for c in cells if len(c["token"]) < 8} <= set(shown)


def test_the_long_token_is_ellipsised_keeping_its_ends(tiny, cli, cjk_model, tmp_path):
    result = cli(
        "lens", cjk_model, f"the {LONG_TOKEN} is", "--position", "all", "--plot", tmp_path / "l.svg"
    )
    assert result.exit_code == 0, result.stderr
    texts = _texts((tmp_path / "l.svg").read_text())
    cut = [t for t in texts if t.startswith("'▁an_inter") and "…" in t]
    assert cut == [label(LONG_TOKEN, TICK_LABEL)]  # under its column: start and end kept, quoted
    assert cut[0].endswith("ation'") and len(cut[0]) <= TICK_LABEL + 2


def test_target_column(tiny, cli, cjk_model, tmp_path):
    data, _ = _run(cli, cjk_model, tmp_path / "lens.svg", "--target", "北京")
    texts = _texts((tmp_path / "lens.svg").read_text())
    assert "'北京'" in texts
    for row in data["layers"]:
        t = row["target"]
        assert f"{prob(t['prob'], t['logprob'], 2)}" in texts
        assert f"#{t['rank']}" in texts
    _run(cli, cjk_model, tmp_path / "plain.svg")
    assert not any(t.startswith("#") for t in _texts((tmp_path / "plain.svg").read_text()))


def test_html_is_self_contained(tiny, cli, cjk_model, tmp_path):
    _run(cli, cjk_model, tmp_path / "lens.html", "--target", "北京")
    page = (tmp_path / "lens.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "'首都'" in page
    loads = re.findall(
        r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//""", page
    )
    assert loads == []
    assert "@import" not in page and "<script" not in page and "<link" not in page
    # the only URLs are XML namespace names, which nothing fetches
    for url in re.findall(r"https?://[^\s\"'<>]+", page):
        assert url in {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, url


def test_png_names_characters_no_font_has(tiny, cli, cjk_model, tmp_path):
    if fonts_for([RARE]).missing != [RARE]:
        pytest.skip(f"an installed font has {RARE!r}: nothing is missing to report")
    out = tmp_path / "lens.png"
    result = cli("lens", cjk_model, f"the {RARE} is", "--position", "all", "--plot", out)
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
    notes = [line for line in result.stderr.splitlines() if "no installed font" in line]
    assert len(notes) == 1 and RARE in notes[0] and notes[0].startswith("note: ")
    svg = cli(
        "lens", cjk_model, f"the {RARE} is", "--position", "all", "--plot", tmp_path / "x.svg"
    )
    assert "no installed font" not in svg.stderr  # the viewer draws SVG text with its own fonts


def test_png_falls_back_to_a_font_with_cjk_glyphs(tiny, cli, cjk_model, tmp_path):
    fonts = fonts_for(["首都"])
    if fonts.missing:
        pytest.skip("no installed font has CJK glyphs (e.g. apt-get install fonts-noto-cjk)")
    assert len(fonts.families) >= 2 and fonts.families[0] == "DejaVu Sans"
    out = tmp_path / "lens.png"
    _, stderr = _run(cli, cjk_model, out)
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "no installed font" not in stderr


def test_a_large_grid_is_drawn_in_colours_with_every_nth_position_labelled(tmp_path):
    from embedlens.views.heatmap import plan, save_heatmap
    from tests.test_lens_bounds import grid_report

    report = grid_report(400, 31)
    notes = save_heatmap(report, tmp_path / "big.svg")
    assert notes == plan(report).notes() and "every 5th position is labelled" in notes[0]
    texts = _texts((tmp_path / "big.svg").read_text())
    ticks = [t for t in texts if t[:1].isdigit() and "'" in t]
    assert ticks[:3] == ["0 'the'", "5 'the'", "10 'the'"] and len(ticks) == 80
    assert not any(t.startswith("'") for t in texts)  # no cell holds its token
    assert len(texts) < 150
    assert any("every 5th labelled" in t and "2,000 cells" in t for t in texts)
    assert save_heatmap(report, tmp_path / "big.html") == notes
    assert save_heatmap(report, tmp_path / "big.png") == notes  # no CJK token is drawn


def test_a_grid_past_the_column_bound_merges_positions(tmp_path):
    from embedlens.views.heatmap import save_heatmap
    from tests.test_lens_bounds import grid_report

    notes = save_heatmap(grid_report(5000, 2), tmp_path / "long.svg")
    assert "merged 3 to a column" in notes[0]
    texts = _texts((tmp_path / "long.svg").read_text())
    assert "0–2" in texts and "60–62" in texts and "3–5" not in texts
    assert any("a column: 3 positions, the mean of their top-1 probabilities" in t for t in texts)
