"""What users ask the lens for, checked before any file is read: layers, positions, -k, sites,
chat template variables, and how to load the model."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedlens.errors import UsageError
from embedlens.options import LensOptions, LoadOptions

DEVICE_MAPS: tuple[str, ...] = ("auto", "balanced", "balanced_low_0", "sequential")
LayerItem = int | tuple[int | None, int | None, int | None]
MemoryMap = dict[int | str, int | str]

SUFFIX = {"attn_out": ".attn", "resid_mid": ".mid", "mlp_out": ".mlp", "resid": ""}
"""A site's row label after the layer number (`3.attn`, `3.mid`, `3.mlp`, `3`), in block order."""
SITES: tuple[str, ...] = tuple(SUFFIX)
"""The sites, in the order their rows come within a block."""

DEFAULT_THRESHOLD = 1e-6
"""KL (nats) above which a layer counts as divergent. A model against itself, or against an
exact copy, gives exactly 0 (the same bits through the same code). Two runs of the same weights
whose logits differ by rounding alone stay far below it: logits moved by at most δ move KL by at
most δ²/2 (half the variance of the change), and the self-check allows δ = 1e-3 in float32,
i.e. 5e-7 nats."""

_LAYERS_HINT = (
    "use layer numbers and ranges, e.g. --layers 0,4,8 or --layers 20: or --layers 0:10:2"
)


@dataclass(frozen=True)
class Ask:
    """What the lens is asked for on one prompt, checked."""

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
    sites: tuple[str, ...] = ("resid",)
    """The sites read, in block order (`sites_asked`)."""


@dataclass(frozen=True)
class ManyAsk:
    """What is asked for every prompt of many (each line adds its prompt, target and chat)."""

    layers: list[LayerItem] | None
    position: int | list[int] | None
    top_k: int
    switches: dict[str, Any]
    skip_bad: bool
    template: tuple[str, str] | None = None
    """A chat template the caller gave, for the lines with a chat message."""
    sites: tuple[str, ...] = ("resid",)
    """The sites read, in block order (`sites_asked`)."""

    def line(self, prompt: str, chat: str | None, target: str | None) -> Ask:
        """One line's ask, as a single run would take it (a list of positions: its last)."""
        pos = self.position
        single = pos[-1] if isinstance(pos, list) else pos
        return Ask(prompt, chat, self.switches, self.layers, single, self.top_k, target,
                   pos is None, self.template, self.sites)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Load(LoadOptions):
    """How to load a model from its files, checked (`loading`)."""

    max_memory: MemoryMap | None = None
    offload_folder: Path | None = None


def ask(prompt: str, asked: LensOptions) -> Ask:
    """Check what was asked of one prompt, before any file is read."""
    if not isinstance(asked.position, (int, str)):
        raise UsageError("a list of positions applies only with prompts=")
    check_top_k(asked.top_k)
    items = None if asked.layers is None else layer_items(asked.layers)
    pos = parse_position(asked.position)
    switches = template_switches(asked.no_thinking, asked.template_args)
    chat = asked.chat
    if switches and chat is None:
        raise UsageError("--no-thinking and --template-arg only apply with --chat")
    if not prompt.strip() and chat is None:
        raise UsageError("the prompt is empty")
    template = user_template(asked.chat_template, chat)
    if asked.compare_logit:
        raise UsageError("--compare-logit applies to --prompts (a summary over many prompts)")
    grid = asked.grid or pos is None
    sites = sites_asked(asked.site, asked.tuned, asked.jacobian)
    return Ask(prompt, chat, switches, items, pos, asked.top_k, asked.target, grid, template, sites)


def many(asked: LensOptions, against: object) -> ManyAsk:
    """Check the options that apply to every prompt of many, before any file is read (--target,
    --chat and --grid are each line's own; --compare-logit needs --tuned, and compares the tuned
    lens with the logit lens on one model, not with --against)."""
    one_prompt_only(asked.target, asked.chat, asked.grid)
    check_top_k(asked.top_k)
    items = None if asked.layers is None else layer_items(asked.layers)
    switches = template_switches(asked.no_thinking, asked.template_args)
    template = user_template(asked.chat_template, None, per_line=True)
    positions = parse_positions(asked.position)
    if asked.compare_logit and asked.tuned is None and asked.jacobian is None:
        raise UsageError(
            "--compare-logit compares a learned lens with the logit lens: give --tuned or "
            "--jacobian"
        )
    if asked.compare_logit and against is not None:
        raise UsageError(
            "--compare-logit compares two lenses on one model: run it without --against"
        )
    sites = sites_asked(asked.site, asked.tuned, asked.jacobian)
    return ManyAsk(items, positions, asked.top_k, switches, asked.skip_bad, template, sites)


Loading = Load | dict[str, bool]
"""How to load a model named by its files (checked), or for a model given loaded, which loading
options were given (it refuses them)."""


def loading(model: object, load: LoadOptions) -> Loading:
    """How to load a model named by its files, checked before any file is read; for a model
    already loaded, which loading options were given (it refuses them)."""
    if not isinstance(model, (str, os.PathLike)):
        return load.given()
    from embedlens.model.loading import check_choices

    check_choices(load.dtype, load.device)
    device_map, max_memory, offload_folder = load.device_map, load.max_memory, load.offload_folder
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise UsageError("--max-memory and --offload-folder only apply with --device-map")
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise UsageError(
            f"unknown --device-map '{device_map}'", hint="use one of: " + ", ".join(DEVICE_MAPS)
        )
    memory = parse_max_memory(max_memory) if isinstance(max_memory, str) else max_memory
    folder = None if offload_folder is None else Path(offload_folder)
    if folder is not None and folder.exists() and not folder.is_dir():
        raise UsageError(
            f"--offload-folder '{folder}' is not a folder",
            hint="name a folder (it is made if missing), or leave the option out for a "
            "temporary one",
        )
    checked = {"max_memory": None if memory is None else dict(memory), "offload_folder": folder}
    return Load(**{**vars(load), **checked})


def one_prompt_only(target: str | None, chat: str | None, grid: bool) -> None:
    """--target, --chat and --grid are each line's own with many prompts."""
    if target is not None or chat is not None or grid:
        raise UsageError(
            "--target, --chat and --grid apply to one prompt; with --prompts give target and "
            "chat on each line (JSON Lines)"
        )


def sites_asked(
    value: str | Sequence[str] | None, tuned: object, jacobian: object = None
) -> tuple[str, ...]:
    """`--site` (one site or several: comma-separated, or a list) as the sites asked for, in
    block order, checked before any model loads: a tuned or Jacobian lens is fitted to the
    residual stream only (and one learned lens is read at a time)."""
    if tuned is not None and jacobian is not None:
        raise UsageError("--tuned and --jacobian do not combine: read through one learned lens")
    if value is None:
        sites: tuple[str, ...] = ("resid",)
    else:
        items = value.split(",") if isinstance(value, str) else list(value)
        names = [str(s).strip() for s in items if str(s).strip()]
        bad = [s for s in names if s not in SITES]
        if bad or not names:
            raise UsageError(
                f"unknown --site {bad[0] if bad else repr(value)}: use one or more of "
                f"{', '.join(SITES)}, comma-separated",
                hint="e.g. --site resid_mid,resid",
            )
        sites = tuple(s for s in SITES if s in names)
    for flag, lens, kind in (("--tuned", tuned, "tuned"), ("--jacobian", jacobian, "Jacobian")):
        if lens is not None and sites != ("resid",):
            raise UsageError(
                f"{flag} reads the residual stream only (--site resid): a {kind} lens is fitted "
                "to the blocks' outputs, not to the stream inside a block or to what one adds",
                hint=f"drop {flag} to read the other sites through the model's own decoder",
            )
    return sites


def check_top_k(top_k: int) -> None:
    """-k is at least 1 (a -k past the vocabulary shows it all, with a note)."""
    if top_k < 1:
        raise UsageError(f"-k must be at least 1, not {top_k}")


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


def resolve_layers(items: list[LayerItem] | None, num_layers: int) -> list[int]:
    """Layer numbers in 0..num_layers (the last is the model's output; None: all of them); out of
    range is an error."""
    top = num_layers
    if items is None:
        return list(range(top + 1))
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
            for bound, is_stop in ((start, False), (stop, True)):
                if bound is not None:
                    check(bound, stop=is_stop)
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


def parse_positions(value: int | str | Sequence[int]) -> int | list[int] | None:
    """-1 (an int), 'all' (None), or a list of positions ('3,5,-1' or [3, 5, -1])."""
    if isinstance(value, str) and "," in value:
        try:
            return [int(part) for part in value.split(",")]
        except ValueError:
            raise UsageError(
                f"--position must be an integer, 'all' or a list such as 3,5,-1, not '{value}'"
            ) from None
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise UsageError(f"position must be an integer, 'all' or a list of them: {value!r}")
        return list(value)
    assert isinstance(value, (int, str))
    return parse_position(value)


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


_OPTION = "an option of transformers' apply_chat_template, not a template variable"
RESERVED_TEMPLATE_ARGS: dict[str, str] = {
    "conversation": "the conversation is the --chat message (the template reads it as messages)",
    "messages": "the template's messages are the --chat message",
    "conversations": "the template's messages are the --chat message",
    "tokenize": "embedlens renders the template to text and tokenises that itself",
    "add_generation_prompt": "embedlens always asks for the generation prompt (the lens reads "
    "what the model would write next)",
    "chat_template": "give another template with --chat-template FILE",
    **dict.fromkeys(
        (
            "continue_final_message",
            "sanitize_control_tokens",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        ),
        _OPTION,
    ),
}
"""Names a template argument cannot take, and why: what the chat call (`prompt._render_chat`)
passes itself, and the other parameters of `apply_chat_template` and of the template's render
that would never reach the template as variables."""


def template_switches(
    no_thinking: bool, args: Mapping[str, Any] | Sequence[str] | None
) -> dict[str, Any]:
    """Chat-template variables: --no-thinking, and a dict or KEY=VALUE strings (JSON values
    where they parse as JSON, else the text); none may take a name the chat call uses itself."""
    import json

    if isinstance(args, Mapping):
        given = dict(args)
    else:
        given = {}
        for pair in [args] if isinstance(args, str) else args or []:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"malformed --template-arg '{pair}': write KEY=VALUE")
            try:
                given[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                given[key.strip()] = value
    for key in given:
        if not isinstance(key, str):
            raise UsageError(f"template_args names variables by text, not {key!r}")
        why = RESERVED_TEMPLATE_ARGS.get(key)
        if why is not None:
            raise UsageError(
                f"--template-arg '{key}' cannot be given: {why}",
                hint="template arguments are the chat template's own variables "
                "(such as enable_thinking)",
            )
    return ({"enable_thinking": False} if no_thinking else {}) | given


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
