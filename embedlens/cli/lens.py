"""`embedlens lens`: what each layer would predict if it were the last (the logit lens)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from embedlens.cli._errors import handles_errors
from embedlens.cli._options import (
    DebugOpt,
    DeviceOpt,
    Dtype,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
    TrustOpt,
    common,
)
from embedlens.cli._output import emit, note, progress, warn
from embedlens.errors import EmbedlensError, UsageError
from embedlens.reports.lens import LensReport

if TYPE_CHECKING:
    from embedlens.analysis.lens_engine import LensResult

EXAMPLES = (
    "Examples:\n\n"
    '  $ embedlens lens ./SmolLM2-135M-Instruct.Q4_1.gguf "The capital of France is"\n\n'
    '  $ embedlens lens Qwen/Qwen3-0.6B "中国的首都是" --chat "中国的首都是哪里？" --no-thinking'
    " --target 北京\n\n"
    '  $ embedlens lens ./my-model "The capital of France is" --position all --plot lens.png\n\n'
    '  $ embedlens lens ./big-model "Hello" --device-map auto --layers 20: --json'
)

PLOT_SUFFIXES = (".png", ".svg", ".html")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")

LayerItem = int | tuple[int | None, int | None, int | None]


def parse_layer_spec(spec: str) -> list[LayerItem]:
    """Parse `0,4,8`, `20:`, `:10`, `4:12:2`, `-1` (Python indexing, stop exclusive)."""
    items: list[LayerItem] = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            raise UsageError(f"malformed --layers '{spec}': empty item", hint=_LAYERS_HINT)
        try:
            if ":" in part:
                bits = part.split(":")
                if len(bits) > 3:
                    raise ValueError
                nums = [int(b) if b.strip() else None for b in bits] + [None] * (3 - len(bits))
                if nums[2] is not None and nums[2] <= 0:
                    raise UsageError(f"malformed --layers '{spec}': a step must be positive")
                items.append((nums[0], nums[1], nums[2]))
            else:
                items.append(int(part))
        except ValueError:
            raise UsageError(
                f"malformed --layers '{spec}': '{part}' is not a layer or a range",
                hint=_LAYERS_HINT,
            ) from None
    return items


_LAYERS_HINT = (
    "use layer numbers and ranges, e.g. --layers 0,4,8 or --layers 20: or --layers 0:10:2"
)


def resolve_layers(items: list[LayerItem], num_layers: int) -> list[int]:
    """Layer numbers in 0..num_layers (the last is the model's output); out of range is an error."""
    top = num_layers
    out: list[int] = []

    def check(n: int, *, stop: bool = False) -> int:
        limit = top + 1
        if not (-limit <= n <= (limit if stop else top)):
            raise UsageError(
                f"layer {n} is out of range: the model has layers 0..{top} "
                f"(0 = embedding output, {top} = the model's output)"
            )
        return n

    for item in items:
        if isinstance(item, int):
            n = check(item)
            out.append(n % (top + 1))
        else:
            start, stop, step = item
            for n in (start, stop):
                if n is not None:
                    check(n, stop=n is stop)
            out.extend(range(top + 1)[slice(start, stop, step)])
    if not out:
        raise UsageError("--layers selects no layer")
    return sorted(set(out))


def parse_position(value: str) -> int | None:
    """An integer position (negative counts from the end), or None for `all`."""
    if value.strip().lower() == "all":
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(
            f"--position must be an integer or 'all', not '{value}'",
            hint="-1 is the last token, 0 the first",
        ) from None


def parse_max_memory(spec: str | None) -> dict[Any, int | str] | None:
    """`cpu=2GiB,0=20GiB` -> {'cpu': 2147483648, 0: 21474836480} (accelerate's max_memory)."""
    from embedlens.model.preflight import parse_size

    if spec is None:
        return None
    hint = "write DEVICE=AMOUNT pairs: cpu=8GiB,0=20GiB"
    out: dict[Any, int | str] = {}
    for part in spec.split(","):
        key, sep, amount = part.partition("=")
        if not sep or not key.strip() or not amount.strip():
            raise UsageError(f"malformed --max-memory '{spec}'", hint=hint)
        try:
            size = parse_size(amount)
        except ValueError:
            raise UsageError(
                f"--max-memory '{spec}': '{amount.strip()}' is not a size", hint=hint
            ) from None
        k = key.strip()
        out[int(k) if k.isdigit() else k] = size
    return out


def check_offload_folder(folder: Path | None) -> None:
    """--offload-folder must be a folder, or not exist yet (it is made then)."""
    if folder is not None and folder.exists() and not folder.is_dir():
        raise UsageError(
            f"--offload-folder '{folder}' is not a folder",
            hint="name a folder (it is made if missing), or leave the option out for a "
            "temporary one",
        )


def template_switches(no_thinking: bool, pairs: list[str]) -> dict[str, Any]:
    """Chat-template variables: --no-thinking and --template-arg KEY=VALUE (JSON-ish values)."""
    import json

    out: dict[str, Any] = {}
    if no_thinking:
        out["enable_thinking"] = False
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"malformed --template-arg '{pair}': write KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


DtypeLensOpt = Annotated[
    Dtype,
    typer.Option(
        "--dtype", help="Dtype the model is loaded and the lens computed in (float32 by default)."
    ),
]


@handles_errors
def lens(
    model: ModelArg,
    prompt: Annotated[
        str,
        typer.Argument(
            metavar="PROMPT",
            help="Text to run (with --chat: the start of the assistant's answer).",
            show_default=False,
        ),
    ],
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="Predictions per layer.")] = 5,
    layers: Annotated[
        str | None,
        typer.Option(
            "--layers",
            help="Layers to show: 0,4,8 or 20: or 0:10:2 (0 = embedding output, "
            "the last = the model's output). All by default.",
        ),
    ] = None,
    position: Annotated[
        str,
        typer.Option(
            "--position",
            help="Token position read (-1 = last); 'all' adds a layer x position grid of top-1 "
            "predictions.",
        ),
    ] = "-1",
    target: Annotated[
        str | None,
        typer.Option("--target", help="Follow this token's probability and rank at every layer."),
    ] = None,
    chat: Annotated[
        str | None,
        typer.Option(
            "--chat",
            metavar="MESSAGE",
            help="Apply the chat template to this user message (with the generation prompt); "
            "PROMPT then starts the assistant's answer.",
        ),
    ] = None,
    no_thinking: Annotated[
        bool,
        typer.Option(
            "--no-thinking", help="With --chat: pass enable_thinking=False to the template."
        ),
    ] = False,
    template_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--template-arg", metavar="KEY=VALUE", help="With --chat: another template variable."
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="Draw the layer x position grid as a heatmap (.png, .svg or .html; needs "
            "matplotlib: pip install 'embedlens[plot]').",
        ),
    ] = None,
    device_map: Annotated[
        str | None,
        typer.Option(
            "--device-map",
            help="'auto' spreads the model over GPUs, CPU and disk (accelerate).",
        ),
    ] = None,
    max_memory: Annotated[
        str | None,
        typer.Option(
            "--max-memory", help="With --device-map: memory per device, e.g. cpu=8GiB,0=20GiB."
        ),
    ] = None,
    offload_folder: Annotated[
        Path | None,
        typer.Option(
            "--offload-folder",
            help="With --device-map: where weights that fit nowhere go (a temporary folder, "
            "removed afterwards, by default).",
        ),
    ] = None,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeLensOpt = "float32",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Decode every layer's residual stream with the model's own final norm, head and post-head steps.

    Layer 0 is the embedding output, layer i the output of block i, the last row the model's own
    output. The lens runs in float32 unless --dtype says otherwise. Every run checks itself:
    decoding the last block's output must reproduce the model's logits.
    """
    common(quiet=quiet, debug=debug, device=device)
    if top_k < 1:
        raise UsageError(f"-k must be at least 1, not {top_k}")
    layer_items = parse_layer_spec(layers) if layers is not None else None
    pos = parse_position(position)
    switches = template_switches(no_thinking, template_arg or [])
    if switches and chat is None:
        raise UsageError("--no-thinking and --template-arg only apply with --chat")
    if not prompt.strip() and chat is None:
        raise UsageError("the prompt is empty")
    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot '{plot}': unknown format", hint="name a .png, .svg or .html file")
    if plot is not None:
        from embedlens.views.heatmap import require_matplotlib

        require_matplotlib()
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise UsageError("--max-memory and --offload-folder only apply with --device-map")
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise UsageError(
            f"unknown --device-map '{device_map}'", hint="use one of: " + ", ".join(DEVICE_MAPS)
        )
    memory = parse_max_memory(max_memory)
    check_offload_folder(offload_folder)

    from embedlens.io.source import resolve
    from embedlens.model import loading
    from embedlens.model.gguf_patches import gguf_reads_shared

    with _offload_dir(device_map, offload_folder) as folder:
        source = resolve(model, revision)
        # GGUF: the file is parsed once for tokenizer, config and weights, and let go after
        with progress(f"Loading {model}"), gguf_reads_shared(source):
            tokenizer = loading.load_tokenizer(source, trust_remote_code=trust_remote_code)
            config = loading.hf_config(source, trust_remote_code=trust_remote_code)
            text, ids = _prompt_ids(
                tokenizer, prompt, chat, switches, _template_name(source), _context(config)
            )
            target_id = _target_id(tokenizer, target) if target is not None else None
            _check_fits(config, ids, layer_items)  # fail before reading the weights
            index = _position_index(pos, len(ids))
            load_notes: list[str] = []
            model_obj = loading.load_model(
                source,
                dtype=dtype,
                device=device,
                device_map=device_map,
                max_memory=memory,
                offload_folder=folder,
                trust_remote_code=trust_remote_code,
                config=config,
                notes=load_notes,
            )
        with progress("Running the lens"):
            grid = pos is None or plot is not None
            result = _run(
                model_obj, ids, layer_items, index, grid, top_k, len(tokenizer), target_id
            )
        report = _report(
            model, tokenizer, model_obj, result, ids, text, chat, pos, index, target, target_id
        )
        report.notes[:0] = load_notes
        if not source.is_gguf:
            from embedlens.model.inventory import read_config

            config_json = read_config(source, trust_remote_code=trust_remote_code)
            built_in = config_json.builtin_code_note(trust_remote_code=trust_remote_code)
            if built_in is not None:
                report.notes.append(built_in)
    if not report.check.ok:
        warn(
            f"the lens does not reproduce this model's logits (max |Δ| = "
            f"{report.check.max_abs_logit_diff:.3g} > {report.check.tolerance:.3g}): its rows are "
            f"not faithful for this architecture; suspect: {report.check.suspect}"
        )
    for text_note in report.notes:
        note("note: " + text_note)
    if plot is not None:
        from embedlens.views.heatmap import save_heatmap

        save_heatmap(report, plot)
        note(f"wrote {plot}")
    emit(report, as_json=as_json)


def _prompt_ids(
    tokenizer: Any,
    prompt: str,
    chat: str | None,
    switches: dict[str, Any],
    template: str,
    context: int | None,
) -> tuple[str, list[int]]:
    """The text run and its ids: PROMPT as the tokenizer encodes it by default, or after a chat
    template (whose output already holds the special tokens, so none are added again).

    The template (named by `template`) renders within bounds of time and size, and its text is
    checked against what the model's context could hold before it is tokenised.
    """
    if chat is None:
        ids = list(tokenizer(prompt)["input_ids"])
        text = prompt
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(
                "this model's tokenizer has no chat template, so --chat cannot be used",
                hint="run without --chat and write the whole prompt yourself",
            )
        from embedlens.model import chat as chat_template

        messages = [{"role": "user", "content": chat}]
        limit = chat_template.max_chars(context)
        try:
            text = chat_template.render(
                lambda: tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **switches
                ),
                limit=limit,
                what=template,
            )
        except EmbedlensError:
            raise
        except Exception as e:
            raise UsageError(f"the chat template failed: {e}") from e
        text = text + prompt
        if len(text) > limit:
            raise UsageError(
                f"the prompt after the chat template is {len(text):,} characters, more than the "
                f"model's context could hold"
            )
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise UsageError("the prompt is empty: it encodes to no tokens")
    return text, ids


def _target_id(tokenizer: Any, target: str) -> int:
    from embedlens.model.words import spaced_form, spaced_note

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]

    def text_of(token_id: int) -> str:
        return _token_text(tokenizer, token_id)

    ids = encode(target)
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) == 1 and (ids[0] != unk or target == tokenizer.unk_token):
        said = spaced_note(target, ids, encode, text_of)
        if said is not None:
            note("note: --target " + said)
        return int(ids[0])
    if len(ids) == 1:
        raise UsageError(
            f"--target '{target}' is not in the vocabulary: it encodes to the unknown token "
            f"'{tokenizer.unk_token}'"
        )
    if not ids:
        raise UsageError(f"--target '{target}' encodes to no token")
    pieces = ", ".join(repr(_token_text(tokenizer, i)) for i in ids)
    spaced = spaced_form(target, ids, encode)
    raise UsageError(
        f"--target '{target}' is not a single token: it splits into {len(ids)} ({pieces})",
        hint="give one of those tokens, or a variant that is one token (a leading space often "
        "matters)"
        if spaced is None
        else f"'{text_of(spaced)}' with its leading space is one token (id {spaced}): "
        f"--target '{text_of(spaced)}'",
    )


def _position_index(pos: int | None, n_tokens: int) -> int:
    if pos is None:
        return n_tokens - 1
    if not -n_tokens <= pos < n_tokens:
        raise UsageError(
            f"position {pos} is out of range: the prompt has {n_tokens} tokens "
            f"(positions 0..{n_tokens - 1}, or -{n_tokens}..-1)"
        )
    return pos % n_tokens


@contextmanager
def _offload_dir(device_map: str | None, folder: Path | None) -> Iterator[str | None]:
    """The offload folder for --device-map: the user's, or a temporary one removed afterwards."""
    if device_map is None or folder is not None:
        yield None if folder is None else str(folder)
        return
    tmp = tempfile.mkdtemp(prefix="embedlens-offload-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _template_name(source: Any) -> str:
    """Which file the model's chat template comes from, for messages."""
    if source.is_gguf:
        return f"the chat template in '{source.path}'"
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        found = source.cached(name)
        if found is not None:
            return f"the chat template in '{found}'"
    return f"the chat template of '{source.spec}'"


def _context(config: Any) -> int | None:
    """The model's context length in tokens, if its config gives one."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def _check_fits(config: Any, ids: list[int], layer_items: list[LayerItem] | None) -> None:
    """The prompt fits the model's context, and --layers names layers it has."""
    text_config = config.get_text_config()
    context = getattr(text_config, "max_position_embeddings", None)
    if isinstance(context, int) and len(ids) > context:
        raise UsageError(
            f"the prompt is {len(ids)} tokens, longer than the model's context ({context})"
        )
    n_layers = getattr(text_config, "num_hidden_layers", None)
    if layer_items is not None and isinstance(n_layers, int):
        resolve_layers(layer_items, n_layers)


def _run(
    model: Any,
    ids: list[int],
    layer_items: list[LayerItem] | None,
    index: int,
    grid: bool,
    k: int,
    real_vocab: int,
    target_id: int | None,
) -> LensResult:
    """Run the lens on the layers asked for, at one position or (for the grid) at all of them."""
    from embedlens.analysis.lens_engine import find_blocks, run_lens

    n_blocks = len(find_blocks(model).modules)
    everything = list(range(n_blocks + 1))
    layers = everything if layer_items is None else resolve_layers(layer_items, n_blocks)
    return run_lens(
        model,
        ids,
        layers=layers,
        positions=list(range(len(ids))) if grid else [index],
        k=k,
        real_vocab=real_vocab,
        target=target_id,
    )


def _token_text(tokenizer: Any, token_id: int) -> str:
    from embedlens.model.tokens import readable

    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    return readable(tokenizer.decode([int(token_id)]), piece if isinstance(piece, str) else None)


def _report(
    model_name: str,
    tokenizer: Any,
    model: Any,
    result: LensResult,
    ids: list[int],
    text: str,
    chat: str | None,
    pos: int | None,
    index: int,
    target: str | None,
    target_id: int | None,
) -> LensReport:
    from embedlens.reports.lens import (
        GridCell,
        GridRow,
        LensCheck,
        LensLayer,
        LensTarget,
        LensToken,
        Prediction,
        TargetAt,
    )

    cache: dict[int, str] = {}

    def tok(i: int) -> str:
        if i not in cache:
            cache[i] = _token_text(tokenizer, i)
        return cache[i]

    rows = []
    for layer in result.layers:
        top = result.rows[(layer, index)]
        rows.append(
            LensLayer(
                layer=layer,
                top=[
                    Prediction(i, tok(i), p, lp)
                    for i, p, lp in zip(top.ids, top.probs, top.logprobs, strict=True)
                ],
                target=None
                if top.target_prob is None or top.target_rank is None or top.target_logprob is None
                else TargetAt(top.target_prob, top.target_rank, top.target_logprob),
            )
        )
    grid = None
    if len(result.positions) > 1 or pos is None:
        grid = [
            GridRow(
                layer=layer,
                cells=[
                    GridCell(
                        position=p,
                        id=result.rows[(layer, p)].ids[0],
                        token=tok(result.rows[(layer, p)].ids[0]),
                        prob=result.rows[(layer, p)].probs[0],
                        logprob=result.rows[(layer, p)].logprobs[0],
                    )
                    for p in sorted(result.positions)
                ],
            )
            for layer in result.layers
        ]
    c = result.check
    notes = []
    if result.full_tail:
        notes.append("the model's tail could not run on its last block alone: it ran every block")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    placement: dict[str, int] | None = None
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict) and device_map:
        placement = {}
        for where in device_map.values():
            placement[str(where)] = placement.get(str(where), 0) + 1
        if "disk" in placement:
            notes.append("some weights are offloaded to disk: the run reads them back as it goes")
    return LensReport(
        model=model_name,
        tokens=[LensToken(i, tok(i)) for i in ids],
        position=-1 if pos is None else pos,
        position_index=index,
        num_layers=result.num_layers,
        layers=rows,
        check=LensCheck(
            max_abs_logit_diff=c.max_abs_logit_diff,
            tolerance=c.tolerance,
            ok=c.ok,
            top1_agrees=c.top1_agrees,
            suspect=c.suspect,
        ),
        steps=result.steps,
        dtype=dtype,
        vocab_size=result.vocab_size,
        tokenizer_size=len(tokenizer),
        prompt=text,
        chat=chat,
        target=None
        if target is None or target_id is None
        else LensTarget(text=target, id=target_id, token=tok(target_id)),
        grid=grid,
        placement=placement,
        notes=notes,
    )
