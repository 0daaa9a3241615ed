"""What a caller chooses, as objects: how to load a model (`LoadOptions`) and what the lens is
asked (`LensOptions`).

`lens`, `lens_prompts`, `lens_states`, `lens_text` and `tune` take them as `load=` and `options=`;
their keyword arguments of the same names build them (`options_from`), a model may be given as a
`LoadOptions` with its source, and what is left over is refused (`lens_given`, `model_and_load`).
`params` and `tied` take a `LoadOptions` as `load=` too: the weights are loaded with it
(`weights_load`). A field is added here alone: the functions route keywords by these fields, and
the command line builds the objects from its options of the same names. Nothing is checked on
construction: each function checks what it is given in its own order, before any file is read, so
that a mistake is named as the command line names it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

from embedlens.errors import UsageError

PathLike = str | os.PathLike[str]


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How to load a model from its files (a model given loaded takes none of them)."""

    source: PathLike | None = None
    """The model's files: a hub id (REPO:FILE.gguf for a GGUF in it), a folder or a .gguf file;
    None: the function's `model` argument."""
    revision: str | None = None
    """Hub revision: branch, tag or commit."""
    dtype: str = "float32"
    """'float32', 'bfloat16', 'float16' or 'auto' (the checkpoint's)."""
    device: str = "cpu"
    """'cpu', 'cuda', 'mps' or 'auto'."""
    device_map: str | None = None
    """'auto', 'balanced', 'balanced_low_0' or 'sequential': the model over several devices."""
    max_memory: Mapping[int | str, int | str] | str | None = None
    """With `device_map`: memory per device, as a dict or as 'cpu=8GiB,0=20GiB'."""
    offload_folder: PathLike | None = None
    """With `device_map`: where weights that fit nowhere go (a temporary folder by default)."""
    trust_remote_code: bool = False
    """Allow a model's own code to run."""

    def given(self) -> dict[str, bool]:
        """Which options differ from their defaults (`source` aside): a model given loaded
        refuses them."""
        return {
            f.name: getattr(self, f.name) != f.default
            for f in dataclasses.fields(self)
            if f.name != "source"
        }


@dataclass(frozen=True, kw_only=True)
class LensOptions:
    """What the lens is asked, on one prompt (`lens`) or many (`lens_prompts`)."""

    layers: str | Sequence[int] | None = None
    """'0,4,8', '20:', '0:10:2' or a list of layers (0 = the embedding output); all by default."""
    top_k: int = 5
    """Predictions per layer."""
    position: int | str | Sequence[int] = -1
    """The token position read (-1 = the last), 'all' for the layer x position grid, or (many
    prompts) a list of positions."""
    target: str | None = None
    """A token whose probability and rank are followed at every layer (one prompt)."""
    chat: str | None = None
    """A user message to apply the chat template to; the prompt then starts the answer (one
    prompt; many prompts give it on each line)."""
    no_thinking: bool = False
    """With a chat message: enable_thinking=False for the template."""
    template_args: Mapping[str, Any] | Sequence[str] | None = None
    """More template variables, as a dict or as 'KEY=VALUE' strings."""
    chat_template: PathLike | None = None
    """The chat template used instead of the tokenizer's: a str is its Jinja text, a Path (any
    os.PathLike) a file holding it."""
    grid: bool = False
    """The layer x position grid even when one position is read (for a heatmap; one prompt)."""
    skip_bad: bool = False
    """Many prompts: skip (and count) bad prompts instead of stopping at the first."""
    threshold: float | None = None
    """With `against`: the KL (nats) above which a layer counts as divergent."""
    tuned: PathLike | None = None
    """A lens folder (`tune`'s or tuned-lens's): each layer but the last read through it."""
    jacobian: PathLike | None = None
    """A Jacobian lens's artifact (a .pt file, a folder holding one, or 'HUB_ID:FILE'): each layer
    with a matrix read through it."""
    compare_logit: bool = False
    """Many prompts, with `tuned` or `jacobian`: the logit lens's statistics over the same prompts
    too."""
    site: str | Sequence[str] | None = None
    """Where in the blocks the stream is read: 'resid' (the default: each block's output),
    'resid_mid', 'attn_out', 'mlp_out', or several (a comma list or a sequence): docs/lens.md."""


Options = TypeVar("Options", LoadOptions, LensOptions)


class LoadKeywords(TypedDict, total=False):
    """`LoadOptions`' fields as keyword arguments (but `source`: the model itself), so that type
    checkers and editors see each one the functions take (`**keywords: Unpack[...]`)."""

    revision: str | None
    dtype: str
    device: str
    device_map: str | None
    max_memory: Mapping[int | str, int | str] | str | None
    offload_folder: PathLike | None
    trust_remote_code: bool


class LensKeywords(LoadKeywords, total=False):
    """`LoadOptions`' and `LensOptions`' fields as keyword arguments (`lens`, `lens_prompts`,
    `lens_states`); tests/test_api_lens.py checks they are the fields, no more, no fewer."""

    layers: str | Sequence[int] | None
    top_k: int
    position: int | str | Sequence[int]
    target: str | None
    chat: str | None
    no_thinking: bool
    template_args: Mapping[str, Any] | Sequence[str] | None
    chat_template: PathLike | None
    grid: bool
    skip_bad: bool
    threshold: float | None
    tuned: PathLike | None
    jacobian: PathLike | None
    compare_logit: bool
    site: str | Sequence[str] | None


LOAD_FIELDS = frozenset(f.name for f in dataclasses.fields(LoadOptions)) - {"source"}
LENS_FIELDS = frozenset(f.name for f in dataclasses.fields(LensOptions))


def options_from(kind: type[Options], given: Options | None, keywords: dict[str, Any]) -> Options:
    """`given` (or the defaults) with the keyword arguments of `kind`'s fields taken out of
    `keywords` set on it; a field given both ways is refused."""
    mine = {name: keywords.pop(name) for name in list(keywords) if name in _fields(kind)}
    if given is None:
        return kind(**mine)
    if not isinstance(given, kind):
        raise UsageError(f"expected {kind.__name__}, not {type(given).__name__}")
    both = sorted(name for name in mine if getattr(given, name) != getattr(kind(), name))
    if both:
        what = "load=" if kind is LoadOptions else "options="
        raise UsageError(f"{', '.join(both)} given both in {what} and as a keyword: give it once")
    return dataclasses.replace(given, **mine) if mine else given


def no_other_keywords(function: str, keywords: dict[str, Any]) -> None:
    """What is left of the keyword arguments once the options took theirs: refused as Python
    refuses an unknown keyword argument."""
    if keywords:
        name = next(iter(keywords))
        raise TypeError(f"{function}() got an unexpected keyword argument '{name}'")


def renamed(
    function: str, keywords: dict[str, Any], old: str, new: str, value: Any, what: str
) -> Any:
    """`value` (the argument `new`), or what `keywords` gives under its former name `old`, taken
    out of them with a DeprecationWarning (`what`: the warning's words before `new=`)."""
    if old not in keywords:
        return value
    given = keywords.pop(old)
    if value is not None:
        raise UsageError(f"give {new}= alone ({old}= is its former name)")
    warnings.warn(
        f"{function}({old}=...) is deprecated: {what} {new}=", DeprecationWarning, stacklevel=3
    )
    return given


COUNT_KEYWORDS: dict[str, Any] = dict(
    revision=None, dtype="auto", device="cpu", trust_remote_code=False
)
"""The loading keywords of `params`, `tied` and `vocab`, with their defaults."""


def weights_load(
    function: str, model: object, load: LoadOptions | bool | None, keywords: dict[str, Any]
) -> tuple[LoadOptions, bool]:
    """How `params` and `tied` read `model`: the options (`load=` with the keywords given set on
    it, or the keywords alone) and whether the weights are loaded (a `LoadOptions` given). The
    former `load=True`/`load=False` warn; a model's loading over devices is refused."""
    if isinstance(load, bool):
        warnings.warn(
            f"{function}(load={load}) is deprecated: give load=LoadOptions(...) to count from "
            "the loaded weights (loaded with those options), or leave load= out",
            DeprecationWarning,
            stacklevel=3,
        )
        return LoadOptions(**keywords), load
    if load is None:
        return LoadOptions(**keywords), False
    return one_device(function, model, load, keywords), True


def one_device(
    function: str, model: object, load: LoadOptions, keywords: dict[str, Any]
) -> LoadOptions:
    """`load=` with the loading keywords (`COUNT_KEYWORDS`) that are not at their defaults set on
    it, for a function that loads the model on one device (`params`, `tied`, `vocab`): a field
    given both ways, another model's source, and a loading over devices are refused."""
    given = {name: value for name, value in keywords.items() if value != COUNT_KEYWORDS[name]}
    options = named(model, options_from(LoadOptions, load, given))
    over = [
        name for name in ("device_map", "max_memory", "offload_folder") if options.given()[name]
    ]
    if over:
        raise UsageError(
            f"{function} loads the model on one device: {', '.join(over)} do not apply"
        )
    return options


def named(model: object, load: LoadOptions) -> LoadOptions:
    """`load`, once a source it names is the model given (UsageError where it is another)."""
    if load.source is not None:
        name = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        if name != os.fspath(load.source):
            raise UsageError(
                "load= names another model than the one given: leave its source out, or give "
                "it as the model"
            )
    return load


def _fields(kind: type[LoadOptions] | type[LensOptions]) -> frozenset[str]:
    return LOAD_FIELDS if kind is LoadOptions else LENS_FIELDS


def model_and_load(
    function: str, model: object, load: LoadOptions | None, keywords: dict[str, Any]
) -> tuple[Any, LoadOptions]:
    """The model (its files, or loaded) and how to load it: `model` may be a `LoadOptions` with
    its `source`; `load=` and the loading keywords build the rest. Any keyword left over is
    refused as Python refuses an unknown one (`function` names the call)."""
    model, load, _ = lens_given(function, model, load, None, keywords, lens=False)
    return model, load


def lens_given(
    function: str,
    model: object,
    load: LoadOptions | None,
    options: LensOptions | None,
    keywords: dict[str, Any],
    *,
    lens: bool = True,
) -> tuple[Any, LoadOptions, LensOptions]:
    """`model_and_load`, and the lens's options: `options=` with the keywords of its fields set
    on it (`lens`; else left as given); any keyword left over is refused."""
    if isinstance(model, LoadOptions):
        if load is not None:
            raise UsageError("the model's LoadOptions are given twice: as the model and as load=")
        if model.source is None:
            raise UsageError("LoadOptions given as the model need its source")
        load, model = model, model.source
    load = named(model, options_from(LoadOptions, load, keywords))
    asked = options_from(LensOptions, options, keywords) if lens else LensOptions()
    no_other_keywords(function, keywords)
    return model, load, asked
