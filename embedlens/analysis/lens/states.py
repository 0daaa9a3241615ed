"""`lens_states`: the lens on hidden states an inference engine (or `lens --save-states`) wrote,
decoded with the model's final norm, head and post-head steps alone (`decoders.open_tail`): its
blocks are never read. The rows go through the engine's decoding and ranking
(`BatchLens.decode`), and the report is the one `lens` builds, so the same states give the same
figures."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any, Unpack

from embedlens.analysis.lens import options as checks
from embedlens.analysis.lens.report import Check, LensResult
from embedlens.analysis.lens.tuned_folder import config_size, fits_tuned, head_weight, open_learned
from embedlens.errors import UsageError
from embedlens.options import LensKeywords, LensOptions, LoadOptions, lens_given

if TYPE_CHECKING:
    import torch

    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.decoders import Tail, Through
    from embedlens.analysis.lens.opening import Prompt
    from embedlens.analysis.lens.pairing import Pair
    from embedlens.analysis.lens.states_file import StatesFile
    from embedlens.analysis.lens.tuned_folder import Learned
    from embedlens.model.files import ModelFiles
    from embedlens.reports.lens import LensReport


Parts = tuple["Learned | None", "Pair | None"]
"""What decodes and compares the states: a tuned lens's folder (or None), and B."""


def lens_states(
    model: str | os.PathLike[str] | LoadOptions,
    states: str | os.PathLike[str],
    *,
    state_layers: str | None = None,
    load: LoadOptions | None = None,
    options: LensOptions | None = None,
    against: str | os.PathLike[str] | None = None,
    against_revision: str | None = None,
    **keywords: Unpack[LensKeywords],
) -> LensReport:
    """The lens on the hidden states in `states` (a safetensors file: vLLM's hidden-states
    connector's, or `lens --save-states`'s), decoded with `model`'s own final norm, head and
    post-head steps, of which alone the tensors are read (a folder's safetensors or a GGUF file).

    state_layers: which layers a file that does not say holds ('1,2,3,4' or '1:5'; layer i is
        the input of block i, vLLM's `eagle_aux_hidden_state_layer_ids`).
    load, options: as `lens` takes them (or their fields as keywords); of `LoadOptions`,
        `revision`, `dtype` and `trust_remote_code` apply (it decodes on the CPU); of
        `LensOptions`, `layers`, `top_k`, `position`, `target`, `grid`, `tuned`, `site` (the
        sites the file holds: `lens --site S --save-states` saves them) and `threshold`. Layers
        the file lacks are not shown. The report's `states` says where the states came from and
        whether the self-check was made: only a file with the model's own logits (embedlens')
        and its last layer can be checked.
    against: B, run on the file's ids and compared with the states as `lens(..., against=B)`
        compares two models (`against_revision`: B's revision).
    """
    from embedlens.analysis.lens import api
    from embedlens.analysis.lens.states_file import open_states
    from embedlens.model.loading import check_dtype

    name, load, asked = lens_given("lens_states", model, load, options, dict(keywords))
    _applies(load, asked)
    ask = checks.ask("the file's", asked)  # the prompt and its chat message: the file's
    b = (against, None, against_revision, asked.threshold)
    pair = api.models(name, None, load, *b)[1]
    check_dtype(load.dtype)
    lens_dir = open_learned(asked.tuned, asked.jacobian)
    file = open_states(states, state_layers)
    file.check_sites(ask.sites)
    if pair is not None:
        from embedlens.analysis.lens.pairing import check_pair

        check_pair(pair.a, pair.b)
    ask = dataclasses.replace(ask, prompt="", chat=file.metadata.get("chat"))
    return _run(os.fspath(name), load, file, ask, (lens_dir, pair))


_NOT_APPLIED = {
    "it decodes on the CPU": ("device", "device_map", "max_memory", "offload_folder"),
    "the file holds the ids": ("chat", "no_thinking", "template_args", "chat_template"),
    "one file, one run": ("skip_bad", "compare_logit"),
}
"""Why `lens_states` does not take an option: the options (`LoadOptions`' or `LensOptions`')."""


def _applies(load: LoadOptions, asked: LensOptions) -> None:
    """Refuse an option `lens_states` does not take (given other than its default)."""
    loading, default = load.given(), LensOptions()
    for why, names in _NOT_APPLIED.items():
        for name in names:
            if loading.get(name) or getattr(asked, name, None) != getattr(default, name, None):
                raise UsageError(f"{name} does not apply to lens_states ({why})")


def _run(
    name: str, load: LoadOptions, file: StatesFile, ask: checks.Ask, parts: Parts
) -> LensReport:
    """The model's config and tokenizer, the file checked against them, the tail read, the run."""
    from embedlens.compat.transformers.gguf_patches import gguf_reads_shared
    from embedlens.io.ranges import tally
    from embedlens.io.source import resolve
    from embedlens.model.files import check_source
    from embedlens.model.loading import check_tokenizer_files

    source = resolve(name, load.revision)
    # a GGUF file parsed once for tokenizer, config and tail; a hub repo's tail read by range
    with tally() as hub:
        # the headers, config and a GGUF file's tokenizer, read before transformers is imported
        files = check_source(source, trust_remote_code=load.trust_remote_code)
        if source.is_gguf:
            check_tokenizer_files(files)
        with gguf_reads_shared(source):
            report = _run_on(name, files, load, file, ask, parts)
    if not hub.used:
        return report
    return dataclasses.replace(report, notes=[*report.notes, *hub.notes()])


def _run_on(
    name: str, files: ModelFiles, load: LoadOptions, file: StatesFile, ask: checks.Ask, parts: Parts
) -> LensReport:
    """`_run` once the model's files are found: with a pair, B runs first on the file's ids (and
    is freed), and A's states are decoded beside B's residual, as `against.lens_pair` runs A."""
    import torch

    from embedlens.analysis.lens.decoders import open_tail, tuned_through
    from embedlens.model import file_tokens, loading

    lens_dir, pair = parts
    source, trust = files.source, load.trust_remote_code
    tokenizer = loading.load_tokenizer(files, trust_remote_code=trust)
    config = loading.hf_config(source, trust_remote_code=trust)
    ids = file.token_ids()
    n_layers = _check_fits(file, ids, config, len(tokenizer))
    fits_tuned(lens_dir, config)
    with file_tokens.watching(source, loaded=True, others=(), model=name):
        run = _prompt(tokenizer, ids, ask, file)
    shown = _shown(ask, n_layers, file)
    b = None
    if pair is not None:  # B first, on the file's ids, then freed (as `lens --against` runs it)
        from embedlens.analysis.lens.against import run_b

        b = (*run_b(pair.b, tokenizer, run, ask, lens_dir), pair.threshold)
    dtype = torch.float32 if load.dtype == "auto" else loading.torch_dtype(load.dtype)
    tail = open_tail(source, dtype, trust_remote_code=trust)
    through = tuned_through(lens_dir, tail.model, tokenizer)
    decoding = shown if b is None else sorted(file.layers)  # the pair: every layer, then cut
    other = None if b is None else b[0].kept.residual  # type: ignore[union-attr]
    result, decoder = _decode(tail, through, file, decoding, run, ask, len(tokenizer), other)
    made = (name, tokenizer, tail, decoder, run, ask)
    report = _composed(made, result, file, shown, b)
    learned = {} if through is None else through.fields
    return _states_report(report, file, tail, result.check, learned)


def _composed(
    made: tuple[str, Any, Tail, Decoder, Prompt, checks.Ask],
    result: LensResult,
    file: StatesFile,
    shown: list[int],
    b: Any,
) -> LensReport:
    """The report of the decoded states (`made`: the model's name, tokenizer, tail, decoder,
    the prompt and what was asked): with B (`against.run_b`'s, and the threshold), A against B
    as `lens_pair` compares them, A's sites read from the file; else with the sites the file
    holds."""
    import torch

    from embedlens.analysis.lens.many import shown_rows
    from embedlens.analysis.lens.report import lens_report
    from embedlens.analysis.lens.sites import Reader

    name, tokenizer, tail, decoder, run, ask = made
    inner, cpu = [x for x in shown if x >= 1], torch.device("cpu")
    report = lens_report(name, tokenizer, tail.model, shown_rows(result, shown), ask, run)
    if b is None:
        if ask.sites == ("resid",):
            return report
        from embedlens.analysis.lens.site_report import read_sites

        reader = Reader(file.pieces(inner, result.positions), decoder, cpu, result.vocab_size)
        return read_sites(report, reader, tokenizer, ask, run, result, tail.model)
    from embedlens.analysis.lens.pairing import compare, pair_report
    from embedlens.analysis.lens.site_report import logits_at

    rb, named, b_sites, threshold = b
    inside = None
    if b_sites is not None:  # A's rows inside the blocks read from the file, at the position read
        reader = Reader(file.pieces(inner, [run.index]), decoder, cpu, result.vocab_size)
        inside = (logits_at(reader, ask.sites, inner, [run.index]), b_sites)
    diffs = compare(result, rb, run.index)
    return pair_report(report, diffs, rb, named, threshold, tokenizer, shown, inside)


def _check_fits(file: StatesFile, ids: list[int], config: Any, tokenizer_size: int) -> int:
    """The file's width, layers and token ids fit the model's config and tokenizer: its number
    of blocks."""
    hidden, n_layers = config_size(config)
    where = f"'{file.path.name}'"
    if hidden is not None and file.hidden_size != hidden:
        raise UsageError(
            f"{where} holds states of width {file.hidden_size}, but the model's hidden size is "
            f"{hidden}: they are not this model's"
        )
    if n_layers is None:
        raise UsageError("the model's config gives no num_hidden_layers")
    past = [layer for layer in file.layers if layer > n_layers]
    if past:
        raise UsageError(
            f"{where} holds layer {past[0]}, but the model has layers 0..{n_layers} "
            f"({n_layers} blocks): the states are not this model's, or --state-layers is wrong"
        )
    if file.layout == "embedlens" and len(file.layers) != n_layers + 1:
        raise UsageError(
            f"{where} holds {len(file.layers)} layers, but the model has {n_layers + 1} "
            f"(0..{n_layers}): the states are not this model's"
        )
    vocab = max(tokenizer_size, getattr(config, "vocab_size", 0))
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(
            f"{where} holds token id {bad[0]}, which is not in the model's vocabulary "
            f"({tokenizer_size} tokens): the states are not this model's"
        )
    return n_layers


def _prompt(tokenizer: Any, ids: list[int], ask: checks.Ask, file: StatesFile) -> Prompt:
    """The prompt as the file's ids give it (its text from embedlens' metadata, else decoded)."""
    from embedlens.analysis.lens.opening import Prompt, position_index, target_token

    text = file.metadata.get("prompt")
    if text is None:
        text = tokenizer.decode(ids)
    target_id = alternative = None
    if ask.target is not None:
        target_id, alternative = target_token(tokenizer, ask.target)
    return Prompt(text, ids, position_index(ask.position, len(ids)), target_id, [], alternative)


def _shown(ask: checks.Ask, n_layers: int, file: StatesFile) -> list[int]:
    """The layers asked for that the file holds."""
    asked = checks.resolve_layers(ask.layers, n_layers)
    shown = [layer for layer in asked if layer in file.layers]
    if not shown:
        held = ", ".join(str(layer) for layer in sorted(file.layers))
        raise UsageError(f"the file holds none of the layers asked for (it holds {held})")
    return shown


def _decode(
    tail: Tail,
    through: Through | None,
    file: StatesFile,
    shown: list[int],
    run: Prompt,
    ask: checks.Ask,
    real_vocab: int,
    other: dict[int, torch.Tensor] | None = None,
) -> tuple[LensResult, Decoder]:
    """Every (layer, position) shown decoded by the model's own decoder on the tail (or the tuned
    lens's `through` builds on it) and reduced by the engine (`BatchLens.decode`), at every
    position with a grid, else at the one read; the last layer's rows stand for the model's
    output, but at the last position where the file holds the model's own logits (as `lens` shows
    them). `other`: B's residual, decoded beside (`Kept`). The result, and the decoder."""
    import torch

    from embedlens.analysis.lens.blocks import threads_for
    from embedlens.analysis.lens.engine import BatchItem, BatchLens

    n_layers, last, own = len(tail.blocks.modules), file.n_tokens - 1, file.logits()
    positions = list(range(len(run.ids))) if ask.grid else [run.index]
    wanted = sorted(set(shown) | ({n_layers} & set(file.layers)))
    residual = {layer: file.finite_rows(layer, positions) for layer in wanted}
    held = {}
    if own is not None and n_layers in shown and last in positions:
        held = {positions.index(last): own}
    keep = other is not None
    wrap = None if through is None else through.wrap
    lens = BatchLens(tail.model, shown, ask.top_k, real_vocab, keep, wrap, exact=True)
    item = BatchItem(run.ids, positions, run.target_id, run.index, other)
    with torch.inference_mode(), threads_for(tail.model, len(positions)):
        result = lens.decode(item, residual, _vocab(tail, own), held)
        decoder = lens.decoder
        assert decoder is not None
        check = _check(file, tail, decoder, own)
        first = residual[n_layers if n_layers in residual else wanted[0]][0]
        steps = decoder.steps(first, check.tolerance)
    return dataclasses.replace(result, layers=shown, check=check, steps=steps), decoder


def _vocab(tail: Tail, own: torch.Tensor | None) -> int:
    """Rows of the model's output: the head's, else the logits the file holds."""
    weight = head_weight(tail.model)[1]
    if weight is not None:
        return int(weight.shape[0])
    if own is not None:
        return int(own.shape[-1])
    config: Any = getattr(tail.model, "config", None)
    return int(config.vocab_size)


def _check(file: StatesFile, tail: Tail, decoder: Decoder, own: torch.Tensor | None) -> Check:
    """The decoding of the last layer at the last position against the model's own logits when
    the file holds both; else a check not made (NaN). Its tolerance: the coarser of the
    decoding's dtype and the states' own (the logits a bfloat16 run saved beside its states hold
    bfloat16's rounding)."""
    import torch

    from embedlens.analysis.lens.engine import tolerance

    held = (next(tail.model.parameters()).dtype, getattr(torch, file.dtype))
    dtype = max(held, key=lambda d: torch.finfo(d).eps)
    tol = tolerance(dtype, torch.zeros(1) if own is None else own)
    n_layers = len(tail.blocks.modules)
    if own is None or n_layers not in file.layers:
        return Check(math.nan, tol, False, None)
    mine = decoder.logits(file.rows(n_layers, [file.n_tokens - 1]), [n_layers]).float()[0]
    diff = float((mine - own).abs().max())
    agrees = bool(mine.argmax() == own.argmax())
    suspect = None
    if not diff <= tol:
        suspect = "the decoding of the last block's output (the file's states and logits differ)"
    return Check(diff, tol, agrees, suspect)


def _states_report(
    report: LensReport, file: StatesFile, tail: Tail, check: Check, learned: dict[str, Any]
) -> LensReport:
    """The lens report (with sites, or B's diff) with where its states came from, what the
    check did, and the learned lens it was read through (`learned`: the report's field)."""
    from embedlens.reports.lens import StatesSource

    n_layers = len(tail.blocks.modules)
    why = file.why_not_checked(n_layers)
    said = why or (
        f"made: block {n_layers}'s output decoded at the last position against the model's "
        f"own logits the file holds (max |Δ| = {check.max_abs_logit_diff:.2g})"
    )
    source = StatesSource(
        file=str(file.path),
        layout=file.layout,
        layers=list(file.layers),
        dtype=file.dtype,
        checked=why is None,
        check=said,
        tensors_read=list(tail.read),
        metadata=dict(file.metadata),
    )
    return dataclasses.replace(report, **learned, states=source)
