"""What a call of `lens`, `lens_prompts` or `tune` was given, made into its option objects: the
model (its files, or loaded), `LoadOptions` and `LensOptions`, and, with `against`, the pair.

Keyword arguments build the objects (`embedlens.options.options_from`); a field given both as a
keyword and in `load=`/`options=` is refused, as is a keyword neither object has.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens import options as checks
from embedlens.errors import UsageError
from embedlens.options import LensOptions, LoadOptions, named, no_other_keywords, options_from

if TYPE_CHECKING:
    from embedlens.analysis.lens.pairing import Pair

Loading = checks.Load | dict[str, bool]
"""How to load a model named by its files (checked), or for a model given loaded, which loading
options were given (it refuses them)."""


def model_and_load(
    function: str, model: object, load: LoadOptions | None, keywords: dict[str, Any]
) -> tuple[Any, LoadOptions]:
    """The model (its files, or loaded) and how to load it: `model` may be a `LoadOptions` with
    its `source`; `load=` and the loading keywords build the rest. Any keyword left over is
    refused as Python refuses an unknown one (`function` names the call)."""
    model, load = _split(model, load)
    load = named(model, options_from(LoadOptions, load, keywords))
    no_other_keywords(function, keywords)
    return model, load


def lens_given(
    function: str,
    model: object,
    load: LoadOptions | None,
    options: LensOptions | None,
    keywords: dict[str, Any],
) -> tuple[Any, LoadOptions, LensOptions]:
    """`model_and_load`, and the lens's options: `options=` with the keywords of its fields set
    on it; any keyword left over is refused."""
    model, load = _split(model, load)
    load = named(model, options_from(LoadOptions, load, keywords))
    asked = options_from(LensOptions, options, keywords)
    no_other_keywords(function, keywords)
    return model, load, asked


def _split(model: object, load: LoadOptions | None) -> tuple[Any, LoadOptions | None]:
    """A `LoadOptions` given as the model made into the model (its source) and `load`."""
    if not isinstance(model, LoadOptions):
        return model, load
    if load is not None:
        raise UsageError("the model's LoadOptions are given twice: as the model and as load=")
    if model.source is None:
        raise UsageError("LoadOptions given as the model need its source")
    return model.source, model


def loading(model: object, load: LoadOptions) -> Loading:
    """How to load a model named by its files, checked; for a model already loaded, which
    loading options were given (it refuses them)."""
    if isinstance(model, (str, os.PathLike)):
        return checks.load_options(load)
    return load.given()


def models(
    model: object,
    tokenizer: Any,
    load: LoadOptions,
    against: object,
    against_tokenizer: Any,
    against_revision: str | None,
    threshold: float | None,
) -> tuple[Loading, Pair | None]:
    """How to load the model (`loading`), and with `against` the pair: B loads as A does, but
    for its revision (a loaded B refuses that alone)."""
    a_loading = loading(model, load)
    limit = checks.check_threshold(threshold, against)
    if against is None:
        if against_tokenizer is not None or against_revision is not None:
            raise UsageError("--against-revision and against_tokenizer apply only with --against")
        return a_loading, None
    from dataclasses import replace

    from embedlens.analysis.lens.pairing import Pair, Side

    if isinstance(against, (str, os.PathLike)):
        b_loading = loading(against, replace(load, source=None, revision=against_revision))
    else:
        b_loading = LoadOptions(revision=against_revision).given()
    a, b = Side(model, tokenizer, a_loading), Side(against, against_tokenizer, b_loading)  # type: ignore[arg-type]
    return a_loading, Pair(a, b, limit)
