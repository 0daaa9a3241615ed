"""`lens`: what each layer would predict if it were the last (the logit lens), from Python.

This module turns what a user asks (a model, a prompt, options named as the CLI's) into one run of
the engine (`lens_engine`) and a `LensReport`. A model given already loaded is used as it is: never
reloaded, moved, re-typed or left changed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from embedlens.errors import ConfigError, EmbedlensError, UsageError
from embedlens.reports.lens import (
    GridCell,
    GridRow,
    LensCheck,
    LensLayer,
    LensReport,
    LensSummaryReport,
    LensTarget,
    LensToken,
    Prediction,
    TargetAt,
)
from embedlens.text import error_line

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from embedlens.analysis.lens_engine import LensResult
    from embedlens.analysis.lens_many import EachFn
    from embedlens.io.source import ModelSource
    from embedlens.model.prompts import PromptSource

DEVICE_MAPS: tuple[str, ...] = ("auto", "balanced", "balanced_low_0", "sequential")
LayerItem = int | tuple[int | None, int | None, int | None]
MemoryMap = dict[int | str, int | str]

_LAYERS_HINT = (
    "use layer numbers and ranges, e.g. --layers 0,4,8 or --layers 20: or --layers 0:10:2"
)


@dataclass(frozen=True)
class _Ask:
    """What the lens is asked for, checked."""

    prompt: str
    chat: str | None
    switches: dict[str, Any]
    layers: list[LayerItem] | None
    position: int | None
    """None: every position (`all`)."""
    top_k: int
    target: str | None
    grid: bool
    template: tuple[str, str] | None = None
    """A chat template the caller gave (its text, and how messages name it)."""


@dataclass(frozen=True)
class _Load:
    """How to load a model from its files."""

    revision: str | None
    dtype: str
    device: str
    device_map: str | None
    max_memory: MemoryMap | None
    offload_folder: Path | None
    trust_remote_code: bool


@dataclass(frozen=True)
class _Prompt:
    """The prompt as run: its text and ids, the position read, the target's id, notes."""

    text: str
    ids: list[int]
    index: int
    target_id: int | None
    notes: list[str]


@overload
def lens(model: str | os.PathLike[str] | nn.Module, prompt: str, **options: Any) -> LensReport: ...


@overload
def lens(
    model: str | os.PathLike[str] | nn.Module,
    prompt: None = None,
    *,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource,
    **options: Any,
) -> LensSummaryReport: ...


def lens(  # type: ignore[misc]  # the overloads take options as **options
    model: str | os.PathLike[str] | nn.Module,
    prompt: str | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    layers: str | Sequence[int] | None = None,
    top_k: int = 5,
    position: int | str | Sequence[int] = -1,
    target: str | None = None,
    chat: str | None = None,
    no_thinking: bool = False,
    template_args: Mapping[str, Any] | Sequence[str] | None = None,
    chat_template: str | os.PathLike[str] | None = None,
    grid: bool = False,
    device_map: str | None = None,
    max_memory: Mapping[int | str, int | str] | str | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None = None,
    each: EachFn | None = None,
    skip_bad: bool = False,
) -> LensReport | LensSummaryReport:
    """Decode every layer's residual stream with the model's own final norm, head and post-head
    steps; the report's `check` says whether that reproduces the model's logits.

    model: a hub id, a folder, a .gguf file, or a loaded transformers model (then `tokenizer` is
        required, and the loading options must stay at their defaults: it runs as it is).
    layers: '0,4,8', '20:', '0:10:2' or a list of layers (0 = the embedding output); all by default.
    position: the token position read (-1 = the last), or 'all' for the layer x position grid.
    chat: a user message to apply the chat template to; `prompt` then starts the answer.
    template_args: more template variables, as a dict or as 'KEY=VALUE' strings.
    chat_template: the chat template to use instead of the tokenizer's (for a model without
        one): a str is the template's Jinja text, a Path (any os.PathLike) a file holding it.
    grid: compute the layer x position grid even when one position is read (for a heatmap).
    max_memory: with `device_map`, memory per device, as a dict or as 'cpu=8GiB,0=20GiB'.
    prompts: many prompts instead of `prompt` (strings, or dicts with `prompt` and optional
        `target`, `chat`, `id`; or `PromptSource.open(path)`): returns a `LensSummaryReport` of
        per-layer statistics, and calls `each(report, line)` with each prompt's `LensReport` as
        it comes. `position` may then be a list.
    skip_bad: with `prompts`, skip (and count) bad prompts instead of stopping at the first.
    """
    loading = (revision, dtype, device, device_map, max_memory, offload_folder, trust_remote_code)
    if prompts is not None or prompt is None:
        return _lens_prompts(
            model, prompt, prompts, tokenizer, dict(
                top_k=top_k, layers=layers, position=position, no_thinking=no_thinking,
                template_args=template_args, skip_bad=skip_bad, each=each,
                template=user_template(chat_template, None, per_line=True),
            ), (target, chat, grid), loading,
        )  # fmt: skip
    ask = _ask(prompt, layers, top_k, position, target, chat, no_thinking, template_args, grid)
    ask = dataclasses.replace(ask, template=user_template(chat_template, chat))
    if not isinstance(model, (str, os.PathLike)):
        _refuse_load_options(*loading)
        return _lens_loaded(model, ask, tokenizer)
    load = _load_options(*loading)
    return _lens_files(os.fspath(model), ask, load, tokenizer)


def _lens_prompts(
    model: str | os.PathLike[str] | nn.Module,
    prompt: str | None,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None,
    tokenizer: Any,
    options: dict[str, Any],
    single_only: tuple[str | None, str | None, bool],
    loading: tuple[Any, ...],
) -> LensSummaryReport:
    """`lens(model, prompts=[...])`: see `lens_many`."""
    from embedlens.analysis import lens_many

    if prompts is None:
        raise UsageError("give a prompt, or prompts=[...]")
    if prompt is not None:
        raise UsageError("give either a prompt or prompts=, not both")
    if single_only[0] is not None or single_only[1] is not None or single_only[2]:
        raise UsageError(
            "--target, --chat and --grid apply to one prompt; with --prompts give target and "
            "chat on each line (JSON Lines)"
        )
    ask = lens_many.many(**options)
    source = lens_many.source_of(prompts)
    if not isinstance(model, (str, os.PathLike)):
        _refuse_load_options(*loading)
        _check_loaded(model, tokenizer)
        return lens_many.lens_loaded(model, source, ask, tokenizer)
    load = _load_options(*loading)
    return lens_many.lens_files(os.fspath(model), source, ask, load, tokenizer)


def _ask(
    prompt: str,
    layers: str | Sequence[int] | None,
    top_k: int,
    position: int | str | Sequence[int],
    target: str | None,
    chat: str | None,
    no_thinking: bool,
    template_args: Mapping[str, Any] | Sequence[str] | None,
    grid: bool,
) -> _Ask:
    """Check what was asked, before any file is read."""
    if not isinstance(position, (int, str)):
        raise UsageError("a list of positions applies only with prompts=")
    if top_k < 1:
        raise UsageError(f"-k must be at least 1, not {top_k}")
    items = None if layers is None else layer_items(layers)
    pos = parse_position(position)
    switches = template_switches(no_thinking, template_args)
    if switches and chat is None:
        raise UsageError("--no-thinking and --template-arg only apply with --chat")
    if not prompt.strip() and chat is None:
        raise UsageError("the prompt is empty")
    return _Ask(prompt, chat, switches, items, pos, top_k, target, grid or pos is None)


def user_template(
    chat_template: str | os.PathLike[str] | None, chat: str | None, *, per_line: bool = False
) -> tuple[str, str] | None:
    """The caller's chat template, read and checked before any model file is: (text, name).
    `per_line`: many prompts, whose lines carry their own chat messages."""
    if chat_template is None:
        return None
    if chat is None and not per_line:
        raise UsageError("--chat-template only applies with --chat")
    if isinstance(chat_template, str):
        if not chat_template.strip():
            raise UsageError("the chat template given is empty")
        return chat_template, "the chat template given"
    from embedlens.model.chat import read_template

    path = os.fspath(chat_template)
    return read_template(path), f"the chat template in '{path}'"


def _load_options(
    revision: str | None,
    dtype: str,
    device: str,
    device_map: str | None,
    max_memory: Mapping[int | str, int | str] | str | None,
    offload_folder: str | os.PathLike[str] | None,
    trust_remote_code: bool,
) -> _Load:
    """Check the loading options, before any file is read."""
    from embedlens.model.loading import check_device, check_dtype

    check_dtype(dtype)
    check_device(device)
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise UsageError("--max-memory and --offload-folder only apply with --device-map")
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise UsageError(
            f"unknown --device-map '{device_map}'", hint="use one of: " + ", ".join(DEVICE_MAPS)
        )
    memory = parse_max_memory(max_memory) if isinstance(max_memory, str) else max_memory
    folder = None if offload_folder is None else Path(offload_folder)
    check_offload_folder(folder)
    return _Load(
        revision,
        dtype,
        device,
        device_map,
        None if memory is None else dict(memory),
        folder,
        trust_remote_code,
    )


def _refuse_load_options(
    revision: str | None,
    dtype: str,
    device: str,
    device_map: str | None,
    max_memory: object,
    offload_folder: object,
    trust_remote_code: bool,
) -> None:
    """A loaded model runs as it is: options that say how to load one are errors."""
    given = {
        "revision": revision is not None,
        "dtype": dtype != "float32",
        "device": device != "cpu",
        "device_map": device_map is not None,
        "max_memory": max_memory is not None,
        "offload_folder": offload_folder is not None,
        "trust_remote_code": trust_remote_code,
    }
    named = [name for name, set_ in given.items() if set_]
    if named:
        verb = "applies" if len(named) == 1 else "apply"
        raise UsageError(
            f"{', '.join(named)} {verb} only when embedlens loads the model: a loaded model runs "
            "as it is, in its own dtype and on its own devices",
            hint="leave them out, or pass the model's name or path instead",
        )


def _lens_files(name: str, ask: _Ask, load: _Load, tokenizer: Any) -> LensReport:
    """The lens on a model that embedlens loads from its files (hub, folder or GGUF)."""
    from embedlens.io.source import resolve
    from embedlens.model import loading
    from embedlens.model.gguf_patches import gguf_reads_shared

    trust = load.trust_remote_code
    with _offload_dir(load.device_map, load.offload_folder) as folder:
        source = resolve(name, load.revision)
        # GGUF: the file is parsed once for tokenizer, config and weights, and let go after
        with gguf_reads_shared(source):
            loading.check_source(source, trust_remote_code=trust)
            if tokenizer is None:
                tokenizer = loading.load_tokenizer(source, trust_remote_code=trust)
            config = loading.hf_config(source, trust_remote_code=trust)
            prompt = _prepare(ask, tokenizer, config, _template_name(source))
            load_notes: list[str] = []
            model = loading.load_model(
                source,
                dtype=load.dtype,
                device=load.device,
                device_map=load.device_map,
                max_memory=load.max_memory,
                offload_folder=folder,
                trust_remote_code=trust,
                config=config,
                notes=load_notes,
            )
        report = _run_report(name, model, tokenizer, ask, prompt)
    built_in = _builtin_code_note(config, trust_remote_code=trust)
    after = [] if built_in is None else [built_in]
    return dataclasses.replace(report, notes=[*prompt.notes, *load_notes, *report.notes, *after])


def _lens_loaded(model: object, ask: _Ask, tokenizer: Any) -> LensReport:
    """The lens on a model the caller loaded: run as it is, its training flags restored after."""
    _check_loaded(model, tokenizer)
    assert tokenizer is not None
    name = getattr(model, "name_or_path", None) or type(model).__name__
    config = getattr(model, "config", None)
    prompt = _prepare(ask, tokenizer, config, f"the chat template of '{name}'")
    with _eval_mode(model):  # type: ignore[arg-type]
        report = _run_report(str(name), model, tokenizer, ask, prompt)  # type: ignore[arg-type]
    return dataclasses.replace(report, notes=[*prompt.notes, *report.notes])


def _check_loaded(model: object, tokenizer: Any) -> None:
    """A loaded model must be a torch module, and come with its tokenizer."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model must be a hub id, a path or a loaded transformers model, not "
            f"{type(model).__name__}"
        )
    if tokenizer is None:
        raise UsageError(
            "a loaded model needs its tokenizer to read the prompt",
            hint="pass tokenizer=, e.g. AutoTokenizer.from_pretrained(...) of the same model",
        )


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the run; every module's training flag as it was after."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def _builtin_code_note(config: PretrainedConfig, *, trust_remote_code: bool) -> str | None:
    """The note for a config that maps to repository code transformers did not run (auto_map
    over a built-in model type), from the config already read."""
    from embedlens.model.config import ModelConfig

    raw = {
        "model_type": getattr(config, "model_type", None),
        "auto_map": getattr(config, "auto_map", None),
    }
    return ModelConfig(raw=raw).builtin_code_note(trust_remote_code=trust_remote_code)


# --- what the user typed ---------------------------------------------------------------------


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


def layer_items(layers: str | Sequence[int]) -> list[LayerItem]:
    """The layers asked for: a spec string, or layer numbers (negative ones count from the end)."""
    if isinstance(layers, str):
        return parse_layer_spec(layers)
    items: list[LayerItem] = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise UsageError(f"layers must be layer numbers, not {layer!r}", hint=_LAYERS_HINT)
        items.append(layer)
    if not items:
        raise UsageError("--layers selects no layer")
    return items


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
            for bound in (start, stop):
                if bound is not None:
                    check(bound, stop=bound is stop)
            out.extend(range(top + 1)[slice(start, stop, step)])
    if not out:
        raise UsageError("--layers selects no layer")
    return sorted(set(out))


def parse_position(value: int | str) -> int | None:
    """An integer position (negative counts from the end), or None for `all`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value)
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(
            f"--position must be an integer or 'all', not '{text}'",
            hint="-1 is the last token, 0 the first",
        ) from None


def parse_max_memory(spec: str) -> MemoryMap:
    """`cpu=2GiB,0=20GiB` -> {'cpu': 2147483648, 0: 21474836480} (accelerate's max_memory)."""
    from embedlens.model.preflight import parse_size

    hint = "write DEVICE=AMOUNT pairs: cpu=8GiB,0=20GiB"
    out: MemoryMap = {}
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


def template_switches(
    no_thinking: bool, args: Mapping[str, Any] | Sequence[str] | None
) -> dict[str, Any]:
    """Chat-template variables: --no-thinking, and a dict or KEY=VALUE strings (JSON values
    where they parse as JSON, else the text)."""
    import json

    out: dict[str, Any] = {}
    if no_thinking:
        out["enable_thinking"] = False
    if isinstance(args, Mapping):
        out.update(args)
        return out
    for pair in [args] if isinstance(args, str) else args or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"malformed --template-arg '{pair}': write KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


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


# --- the prompt ------------------------------------------------------------------------------


def _prepare(ask: _Ask, tokenizer: Any, config: PretrainedConfig | None, template: str) -> _Prompt:
    """Tokenise the prompt, find the target, and check both fit the model (before any weight
    is read)."""
    own = None if ask.template is None else ask.template[0]
    name = template if ask.template is None else ask.template[1]
    text, ids = prompt_ids(tokenizer, ask.prompt, ask.chat, ask.switches, name, config, own)
    notes: list[str] = []
    target_id = None if ask.target is None else target_token(tokenizer, ask.target, notes)
    _check_fits(config, ids, ask.layers)
    return _Prompt(text, ids, _position_index(ask.position, len(ids)), target_id, notes)


def prompt_ids(
    tokenizer: Any,
    prompt: str,
    chat: str | None,
    switches: dict[str, Any],
    template: str,
    config: PretrainedConfig | None,
    chat_template: str | None = None,
) -> tuple[str, list[int]]:
    """The text run and its ids: PROMPT as the tokenizer encodes it by default, or after a chat
    template (whose output already holds the special tokens, so none are added again).

    The template (named by `template`) renders within bounds of time and size, and its text is
    checked against what the model's context could hold before it is tokenised. A
    `chat_template` (Jinja text) is used instead of the tokenizer's own.
    """
    if chat is None:
        ids = list(tokenizer(prompt)["input_ids"])
        text = prompt
    else:
        context = _context(config)
        text = _render_chat(tokenizer, chat, switches, template, context, chat_template) + prompt
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise UsageError("the prompt is empty: it encodes to no tokens")
    return text, [int(i) for i in ids]


def _render_chat(
    tokenizer: Any,
    chat: str,
    switches: dict[str, Any],
    template: str,
    context: int | None,
    own: str | None = None,
) -> str:
    """The chat template (the tokenizer's, or `own`) applied to one user message, with the
    generation prompt."""
    if own is None and not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            "this model's tokenizer has no chat template, so --chat cannot be used",
            hint="give one with --chat-template FILE (a Jinja file), or run without --chat "
            "and write the whole prompt yourself",
        )
    from embedlens.model import chat as bounded

    messages = [{"role": "user", "content": chat}]
    limit = bounded.max_chars(context)
    extra = {} if own is None else {"chat_template": own}
    try:
        text = bounded.render(
            lambda: tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **extra, **switches
            ),
            limit=limit,
            what=template,
        )
    except EmbedlensError as e:
        if own is None or isinstance(e, UsageError):
            raise
        raise UsageError(e.message, hint="fix the template given with --chat-template") from e
    except Exception as e:
        if own is not None:
            raise UsageError(f"the chat template failed: {e}") from e
        # the model's own template (raise_exception, a Jinja error): its files are at fault
        raise ConfigError(
            f"{template} fails: {error_line(e, limit=None)}",
            hint="give a working template with --chat-template FILE, or run without --chat",
        ) from e
    if len(text) > limit:
        raise UsageError(
            f"the prompt after the chat template is {len(text):,} characters, more than the "
            f"model's context could hold"
        )
    return text


def target_token(tokenizer: Any, target: str, notes: list[str]) -> int:
    """The id of the --target token; a note when a spaced form was probably meant."""
    from embedlens.model.words import spaced_form, spaced_note

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]

    def text_of(token_id: int) -> str:
        return token_text(tokenizer, token_id)

    ids = encode(target)
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) == 1 and (ids[0] != unk or target == tokenizer.unk_token):
        said = spaced_note(target, ids, encode, text_of)
        if said is not None:
            notes.append("--target " + said)
        return int(ids[0])
    if len(ids) == 1:
        raise UsageError(
            f"--target '{target}' is not in the vocabulary: it encodes to the unknown token "
            f"'{tokenizer.unk_token}'"
        )
    if not ids:
        raise UsageError(f"--target '{target}' encodes to no token")
    pieces = ", ".join(repr(text_of(i)) for i in ids)
    spaced = spaced_form(target, ids, encode)
    raise UsageError(
        f"--target '{target}' is not a single token: it splits into {len(ids)} ({pieces})",
        hint="give one of those tokens, or a variant that is one token (a leading space often "
        "matters)"
        if spaced is None
        else f"'{text_of(spaced)}' with its leading space is one token (id {spaced}): "
        f"--target '{text_of(spaced)}'",
    )


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text (its bytes when decoding loses them)."""
    from embedlens.model.tokens import readable

    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    return readable(tokenizer.decode([int(token_id)]), piece if isinstance(piece, str) else None)


def _position_index(pos: int | None, n_tokens: int) -> int:
    if pos is None:
        return n_tokens - 1
    if not -n_tokens <= pos < n_tokens:
        raise UsageError(
            f"position {pos} is out of range: the prompt has {n_tokens} tokens "
            f"(positions 0..{n_tokens - 1}, or -{n_tokens}..-1)"
        )
    return pos % n_tokens


def _template_name(source: ModelSource) -> str:
    """Which file the model's chat template comes from, for messages."""
    if source.is_gguf:
        return f"the chat template in '{source.path}'"
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        found = source.cached(name)
        if found is not None:
            return f"the chat template in '{found}'"
    return f"the chat template of '{source.spec}'"


def _text_config(config: PretrainedConfig | None) -> object:
    """The language model's part of a config (the config itself when it has no parts)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _context(config: PretrainedConfig | None) -> int | None:
    """The model's context length in tokens, if its config gives one."""
    context = getattr(_text_config(config), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def _check_fits(
    config: PretrainedConfig | None, ids: list[int], items: list[LayerItem] | None
) -> None:
    """The prompt fits the model's context, and the layers asked for exist."""
    context = _context(config)
    if context is not None and len(ids) > context:
        raise UsageError(
            f"the prompt is {len(ids)} tokens, longer than the model's context ({context})"
        )
    n_layers = getattr(_text_config(config), "num_hidden_layers", None)
    if items is not None and isinstance(n_layers, int):
        resolve_layers(items, n_layers)


# --- the run and its report ------------------------------------------------------------------


def _run_report(
    name: str, model: nn.Module, tokenizer: Any, ask: _Ask, prompt: _Prompt
) -> LensReport:
    """Run the lens on the layers asked for, at one position or (for the grid) all of them."""
    from embedlens.analysis.lens_engine import find_blocks, run_lens

    n_blocks = len(find_blocks(model).modules)
    every = list(range(n_blocks + 1))
    layers = every if ask.layers is None else resolve_layers(ask.layers, n_blocks)
    result = run_lens(
        model,
        prompt.ids,
        layers=layers,
        positions=list(range(len(prompt.ids))) if ask.grid else [prompt.index],
        k=ask.top_k,
        real_vocab=len(tokenizer),
        target=prompt.target_id,
        full_at=[prompt.index],
    )
    return _report(name, tokenizer, model, result, ask, prompt)


def _report(
    name: str,
    tokenizer: Any,
    model: nn.Module,
    result: LensResult,
    ask: _Ask,
    prompt: _Prompt,
) -> LensReport:
    cache: dict[int, str] = {}

    def tok(i: int) -> str:
        if i not in cache:
            cache[i] = token_text(tokenizer, i)
        return cache[i]

    notes: list[str] = []
    shown = len(result.rows[(result.layers[0], prompt.index)].ids)
    if ask.top_k > shown:
        notes.append(
            f"-k {ask.top_k} is more than the vocabulary's {shown:,} tokens: showing all {shown:,}"
        )
    if result.full_tail:
        notes.append("the model's tail could not run on its last block alone: it ran every block")
    placement = _placement(model)
    if placement is not None and "disk" in placement:
        notes.append("some weights are offloaded to disk: the run reads them back as it goes")
    c = result.check
    target_id = prompt.target_id
    return LensReport(
        model=name,
        tokens=[LensToken(i, tok(i)) for i in prompt.ids],
        position=-1 if ask.position is None else ask.position,
        position_index=prompt.index,
        num_layers=result.num_layers,
        layers=_layer_rows(result, prompt.index, tok),
        check=LensCheck(c.max_abs_logit_diff, c.tolerance, c.ok, c.top1_agrees, c.suspect),
        steps=result.steps,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        vocab_size=result.vocab_size,
        tokenizer_size=len(tokenizer),
        prompt=prompt.text,
        chat=ask.chat,
        target=None
        if ask.target is None or target_id is None
        else LensTarget(text=ask.target, id=target_id, token=tok(target_id)),
        grid=_grid_rows(result, tok) if len(result.positions) > 1 or ask.position is None else None,
        placement=placement,
        notes=notes,
    )


def _layer_rows(result: LensResult, index: int, tok: Callable[[int], str]) -> list[LensLayer]:
    """One row per layer asked for, at the position read."""
    rows = []
    for layer in result.layers:
        top = result.rows[(layer, index)]
        at = None
        if (
            top.target_prob is not None
            and top.target_rank is not None
            and top.target_logprob is not None
        ):
            at = TargetAt(top.target_prob, top.target_rank, top.target_logprob)
        predictions = [
            Prediction(i, tok(i), p, lp)
            for i, p, lp in zip(top.ids, top.probs, top.logprobs, strict=True)
        ]
        rows.append(LensLayer(layer=layer, top=predictions, target=at))
    return rows


def _grid_rows(result: LensResult, tok: Callable[[int], str]) -> list[GridRow]:
    """The top-1 prediction at every layer and position."""

    def cell(layer: int, p: int) -> GridCell:
        top = result.rows[(layer, p)]
        return GridCell(p, top.ids[0], tok(top.ids[0]), top.probs[0], top.logprobs[0])

    return [
        GridRow(layer=layer, cells=[cell(layer, p) for p in sorted(result.positions)])
        for layer in result.layers
    ]


def _placement(model: nn.Module) -> dict[str, int] | None:
    """With a device map: how many placed modules went to each device."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict) or not device_map:
        return None
    placement: dict[str, int] = {}
    for where in device_map.values():
        placement[str(where)] = placement.get(str(where), 0) + 1
    return placement
