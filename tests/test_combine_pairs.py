"""Two comparisons composed from runs that exist, each equal to the runs it is made of.

`--text --tuned --against`: both models read through the same tuned lens (tuned on A); A's rows
are `lens A --text --tuned`'s, B's cross-entropy is `lens B --text --tuned`'s, and the pair's
figures are `--text --against`'s taken by hand through the tuned lens (`TunedLens`, on plain
transformers' hidden states). `--tuned --against-logits` is `--tuned`'s table beside
`--against-logits`' comparison at the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embedlens
from tests.test_lens_combine import tuned_pair  # noqa: F401  (the fixture: A, B, A's lens)
from tests.test_lens_text import CTX, windows_by_hand, words_text


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return words_text(tmp_path_factory.mktemp("text") / "words.txt")


def _by_hand(a: Path, b: Path, lens: Path, text: Path) -> dict[str, list[float]]:
    """Per layer, over the scored tokens: mean KL(A ‖ B), the fraction of equal argmaxes (among
    the tokenizer's tokens), and
    the mean KL(A ‖ A's lens on B's residual), each side's layers through the tuned lens
    (`TunedLens`) on the hidden states transformers gives, the output its logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    real = len(AutoTokenizer.from_pretrained(a))
    ma, mb = (AutoModelForCausalLM.from_pretrained(m).eval() for m in (a, b))
    la, lb = (embedlens.TunedLens.from_folder(m, lens) for m in (ma, mb))
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    n = ma.config.num_hidden_layers
    sums: dict[str, np.ndarray] = {k: np.zeros(n + 1) for k in ("kl", "same", "res")}
    with torch.no_grad():
        for w in wins:
            ids = torch.tensor([w])
            oa, ob = (m(ids, output_hidden_states=True) for m in (ma, mb))
            for layer in range(n + 1):
                if layer == n:
                    xa, xb, xr = oa.logits[0, pos], ob.logits[0, pos], None
                else:
                    ha, hb = oa.hidden_states[layer][0, pos], ob.hidden_states[layer][0, pos]
                    xa, xb, xr = la(ha, layer), lb(hb, layer), la(hb, layer)
                pa = xa.double().log_softmax(-1)

                def kl(x: Any, pa: Any = pa) -> float:
                    return float((pa.exp() * (pa - x.double().log_softmax(-1))).sum())

                sums["kl"][layer] += kl(xb)
                sums["res"][layer] += kl(xb if xr is None else xr)
                sums["same"][layer] += float(
                    (xa[:, :real].argmax(-1) == xb[:, :real].argmax(-1)).sum()
                )
    scored = len(wins) * len(pos)
    return {k: (v / scored).tolist() for k, v in sums.items()}


def test_text_tuned_against_equals_each_sides_tuned_run(tuned_pair, text):  # noqa: F811
    a, b, lens = tuned_pair
    pair = embedlens.lens_text(a, text, ctx=CTX, tuned=lens, against=b)
    alone_a = embedlens.lens_text(a, text, ctx=CTX, tuned=lens)
    alone_b = embedlens.lens_text(b, text, ctx=CTX, tuned=lens)
    assert pair.lens == "tuned" and pair.pair is not None
    assert pair.layers == alone_a.layers and pair.logit_layers == alone_a.logit_layers
    theirs = [p.cross_entropy_evaluated for p in pair.pair]
    assert theirs == pytest.approx([x.cross_entropy for x in alone_b.layers], rel=1e-9)
    hand = _by_hand(a, b, lens, text)
    assert [p.kl for p in pair.pair] == pytest.approx(hand["kl"], rel=1e-4, abs=1e-7)
    assert [p.residual_kl for p in pair.pair] == pytest.approx(hand["res"], rel=1e-4, abs=1e-7)
    assert [p.same_top for p in pair.pair] == pytest.approx(hand["same"], abs=1e-12)
    # block 1 changed: the two agree through the tuned lens before it, part after it
    assert pair.pair[0].kl == 0 and pair.pair[1].kl == 0 and pair.pair[2].kl > 1e-6
    logit = embedlens.lens_text(a, text, ctx=CTX, against=b)
    assert logit.pair is not None and pair.pair[-1] == logit.pair[-1]  # the output: untranslated


def test_text_tuned_against_on_the_command_line(tuned_pair, text, cli):  # noqa: F811
    a, b, lens = tuned_pair
    args = ("lens", a, "--text", text, "--ctx", CTX, "--tuned", lens, "--against", b)
    data = cli.json(*args)
    assert data["lens"] == "tuned" and len(data["pair"]) == len(data["layers"])
    table = cli(*args)
    assert table.exit_code == 0, table.stderr
    assert "Tuned lens of" in table.stdout and "mean KLD" in table.stdout


def test_text_tuned_against_logits_is_tuned_beside_the_files_comparison(
    tuned_pair,  # noqa: F811
    text,
    tmp_path,
):
    a, b, lens = tuned_pair
    saved = tmp_path / "b.npz"
    embedlens.lens_text(b, text, ctx=CTX, save_logits=saved)
    both = embedlens.lens_text(a, text, ctx=CTX, tuned=lens, against_logits=saved)
    tuned = embedlens.lens_text(a, text, ctx=CTX, tuned=lens)
    plain = embedlens.lens_text(a, text, ctx=CTX, against_logits=saved)
    assert both.layers == tuned.layers and both.logit_layers == tuned.logit_layers
    assert both.pair == plain.pair and both.pair_output == plain.pair_output
