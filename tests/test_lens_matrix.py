"""The lens's parts, every combination: sources x reductions x sites x decoders x comparisons.

Each combination either runs, and then equals the runs it is composed from, or is refused with
one `error:` line (exit 2) whose reason docs/lens.md lists under "Combinations refused":

- `--site resid` is the residual stream every lens reads: a run with it is byte for byte the run
  without it;
- `--against B` adds B to a run: every figure of the run without it is in it, equal (the two
  models run side by side, so floats are compared to float32 rounding); with a site inside the
  blocks on prompts, the pair is the pair on the residual stream with where the two part inside
  the blocks added (docs/json.md: `lens --against --site`; over a text it is the `--text --site`
  object with B's figures per row, as the rule says);
- `--states FILE` (saved by the model's own run, with every site) decodes what that run decoded:
  its rows equal the model run's.

The specific figures of each combination (B's side, a site's rows, the tuned pair) are checked
against independent computations in the tests of each part; this file holds the whole grid to
its rules, so that a pair nobody wrote is a failure here rather than a refusal users meet.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.test_lens_combine import PROMPT, tuned_pair  # noqa: F401 (a fixture used here)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("model", "states")
REDUCTIONS = ("prompt", "prompts", "text")
SITES = (None, "resid", "attn_out")
DECODERS = ("logit", "tuned", "jacobian")
COMPARISONS = (None, "against", "compare_logit", "against_logits")
ALL_SITES = "resid_mid,attn_out,mlp_out,resid"

REASONS = {
    "tuned_site": "--tuned reads the residual stream only",
    "jacobian_site": "--jacobian reads the residual stream only",
    "compare_needs_tuned": "--compare-logit compares a learned lens with the logit lens",
    "compare_one_model": "--compare-logit compares two lenses on one model",
    "compare_many": "--compare-logit applies to --prompts",
    "compare_text": "--text and --compare-logit do not combine",
    "compare_states": "--compare-logit does not apply to --states",
    "logits_text": "--against-logits apply with --text",
    "states_prompts": "--prompts does not apply to --states",
    "states_text": "--text and --states do not combine",
}
"""Each refusal the grid meets, by the words its `error:` line says."""


def refusals(
    source: str, reduction: str, site: str | None, decoder: str, comparison: str | None
) -> set[str]:
    """The reasons a combination is refused for (empty: it runs). Where several apply, the
    error names one of them."""
    out: set[str] = set()
    if decoder != "logit" and site not in (None, "resid"):
        out.add(f"{decoder}_site")
    if source == "states" and reduction == "prompts":
        out.add("states_prompts")
    if source == "states" and reduction == "text":
        out.add("states_text")
    if comparison == "compare_logit":
        out |= {"compare_text"} if reduction == "text" else set()
        out |= {"compare_states"} if source == "states" else set()
        out |= {"compare_many"} if reduction == "prompt" else set()
        out |= {"compare_needs_tuned"} if decoder == "logit" else set()
    if comparison == "against_logits" and reduction != "text":
        out.add("logits_text")
    return out


COMBOS = list(itertools.product(SOURCES, REDUCTIONS, SITES, DECODERS, COMPARISONS))


@pytest.fixture(scope="module")
def parts(tuned_pair, tmp_path_factory, cli_module):  # noqa: F811 (the fixture imported above)
    """A, B, the lens tuned on A, a Jacobian lens fitted on A, a prompts file, a text, A's saved
    logits over the text, and A's states of PROMPT saved with every site."""
    a, b, lens = tuned_pair
    root = tmp_path_factory.mktemp("matrix")
    jacobian = _jacobian_lens(a, root / "jacobian.pt")
    prompts = root / "p.txt"
    prompts.write_text(PROMPT + "\nthe capital city of Italy is Rome and the capital of\n")
    text = root / "t.txt"
    from tests.test_tune import words_file

    text.write_text(words_file(root / "w.txt", docs=20).read_text()[:1500])
    logits = root / "a.logits"
    states = root / "a.safetensors"
    for extra in (["--text", text, "--ctx", "32", "--save-logits", logits],
                  [PROMPT, "--site", ALL_SITES, "--save-states", states]):  # fmt: skip
        done = cli_module("lens", a, *extra, "-q")
        assert done.exit_code == 0, done.stderr
    return {"a": a, "b": b, "lens": lens, "jacobian": jacobian, "prompts": prompts, "text": text,
            "logits": logits, "states": states}  # fmt: skip


def _jacobian_lens(model: Path, path: Path) -> Path:
    """A Jacobian lens for `model`: matrices near the identity at every block but the last."""
    import torch

    import embedlens
    from embedlens.analysis.lens.jacobian import write_artifact

    sized = embedlens.params(model, meta_only=True)
    d, n = sized.hidden_size, sized.num_layers
    g = torch.Generator().manual_seed(1)
    matrices = {i: torch.eye(d) + 0.05 * torch.randn(d, d, generator=g) for i in range(n - 1)}
    return write_artifact(path, matrices, n_prompts=1, metadata={"target_layer": n - 1})


@pytest.fixture(scope="module")
def cli_module():
    from tests.conftest import Runner

    return Runner()


def command(parts: dict[str, Path], combo: tuple[Any, ...]) -> list[Any]:
    """The `lens` command line of one combination."""
    source, reduction, site, decoder, comparison = combo
    # -k chooses a row's top-k: --text's table has no such rows and refuses it
    args: list[Any] = ["lens", parts["a"], "--layers", "0:"] + (
        [] if reduction == "text" else ["-k", "3"]
    )
    if source == "states":
        args += ["--states", parts["states"]]
    args += {"prompt": [PROMPT] if source == "model" else [],
             "prompts": ["--prompts", parts["prompts"]],
             "text": ["--text", parts["text"], "--ctx", "32"]}[reduction]  # fmt: skip
    args += [] if site is None else ["--site", site]
    learned = {"tuned": ["--tuned", parts["lens"]], "jacobian": ["--jacobian", parts["jacobian"]]}
    args += learned.get(decoder, [])
    args += {None: [], "against": ["--against", parts["b"]], "compare_logit": ["--compare-logit"],
             "against_logits": ["--against-logits", parts["logits"]]}[comparison]  # fmt: skip
    return args


_RUNS: dict[tuple[str, ...], Any] = {}


def run_json(cli: Any, args: list[Any]) -> Any:
    """The run's JSON (the last line: --prompts writes each prompt's line before its summary),
    run once for all the combinations that compare with it."""
    key = tuple(str(a) for a in args)
    if key not in _RUNS:
        done = cli(*args, "--json")
        assert done.exit_code == 0, (args, done.stderr)
        _RUNS[key] = json.loads(done.stdout.strip().splitlines()[-1])
    return _RUNS[key]


def contains(whole: Any, part: Any, where: str = "") -> None:
    """Every figure of `part` is in `whole`, equal (floats to float32 rounding); a part `part`
    leaves empty (None) may be filled in `whole` (B's name where a comparison has a B)."""
    if isinstance(part, dict):
        assert isinstance(whole, dict), where
        for key, value in part.items():
            if value is not None and key not in ("check", "max_abs_logit_diff", "notes"):
                assert key in whole, f"{where}.{key} missing"
                contains(whole[key], value, f"{where}.{key}")
    elif isinstance(part, list):
        assert isinstance(whole, list) and len(whole) == len(part), where
        for i, (w, p) in enumerate(zip(whole, part, strict=True)):
            contains(w, p, f"{where}[{i}]")
    elif isinstance(part, float) and isinstance(whole, float):
        assert whole == pytest.approx(part, rel=1e-4, abs=1e-6), where
    else:
        assert whole == part, where


@pytest.mark.parametrize("combo", COMBOS, ids=["-".join(str(p) for p in combo) for combo in COMBOS])
def test_every_combination_runs_or_is_refused_for_its_listed_reason(parts, cli_module, combo):
    reasons = refusals(*combo)
    args = command(parts, combo)
    if reasons:
        said = cli_module.fails(*args, code=2)
        assert any(REASONS[r] in said for r in reasons), (said, reasons)
        return
    got = run_json(cli_module, args)
    source, reduction, site, decoder, comparison = combo
    if site == "resid":
        assert got == run_json(
            cli_module, command(parts, (source, reduction, None, decoder, comparison))
        )
    if comparison == "against":  # inside the blocks, the pair adds where A and B part there
        inside = site not in (None, "resid") and reduction != "text"
        alone = (source, reduction, None, decoder, "against") if inside else (*combo[:-1], None)
        alone = run_json(cli_module, command(parts, alone))
        contains(got, {k: v for k, v in alone.items() if k not in ("model",)}, "")
    if source == "states":
        from_model = run_json(
            cli_module, command(parts, ("model", reduction, site, decoder, comparison))
        )
        for key in ("layers", "sites", "diff"):
            if key in from_model:
                contains(got[key], from_model[key], key)


def test_every_refusal_of_the_grid_is_listed_in_the_docs():
    """docs/lens.md's "Combinations refused" names each reason the grid meets, by its flags."""
    docs = (ROOT / "docs" / "lens.md").read_text(encoding="utf-8")
    listed = docs.split("## Combinations refused", 1)[1].split("\n## ", 1)[0]
    flags = {
        "tuned_site": ["--tuned", "--site"],
        "jacobian_site": ["--jacobian", "--site"],
        "compare_needs_tuned": ["--compare-logit", "--tuned"],
        "compare_one_model": ["--compare-logit", "--against"],
        "compare_many": ["--compare-logit", "--prompts"],
        "compare_text": ["--compare-logit", "--text"],
        "compare_states": ["--compare-logit", "--states"],
        "logits_text": ["--against-logits", "--text"],
        "states_prompts": ["--states", "--prompts"],
        "states_text": ["--states", "--text"],
    }
    met = set().union(*(refusals(*combo) for combo in COMBOS))
    assert met <= set(flags)
    for reason in sorted(met):
        line = next(
            (ln for ln in listed.split("\n- ") if all(f in ln for f in flags[reason])), None
        )
        assert line is not None, f"docs/lens.md lists no refusal of {flags[reason]}"
    assert not re.search(r"not yet|for now", listed), "a refusal listed only because unwritten"
