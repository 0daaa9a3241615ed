"""`tied`: weigh the config flag, the checkpoint and the built model separately."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embedlens.analysis.params import check_modes
from embedlens.io.source import resolve
from embedlens.model.inventory import Inventory, InventoryMode, from_model, take_inventory
from embedlens.model.loaded import (
    check_loaded,
    is_spec,
    loaded_config,
    loaded_name,
    on_meta,
    spec_text,
)
from embedlens.options import LoadOptions, weights_load
from embedlens.reports.tied import TiedEvidence, TiedReport

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from embedlens.model.loaded import ModelSpec

ON_META = "parameter identity on meta"
LOADED = "data_ptr() of the loaded weights"


def tied(
    model: ModelSpec | PreTrainedModel,
    *,
    meta_only: bool = False,
    load: LoadOptions | bool | None = None,
    revision: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> TiedReport:
    """Whether the LM head shares the embedding's storage, and what that saves.

    model: a hub id, a folder, a .gguf file, or a loaded transformers model (its config flag and
        data_ptr() are read; it is never moved or changed; meta_only, load, revision and dtype
        do not apply to it).
    By default the evidence is the config and the checkpoint's headers; meta_only adds parameter
    identity in a build on the meta device (headers not read); load, a `LoadOptions`, adds
    data_ptr() of the weights loaded with it (as `params` takes it).
    """
    keywords = dict(
        revision=revision, dtype=dtype, device=device, trust_remote_code=trust_remote_code
    )
    options, weights = weights_load("tied", model, load, keywords)
    if not is_spec(model):
        built = check_loaded(
            model,
            meta_only=meta_only,
            load=weights,
            revision=revision is not None,
            dtype=dtype != "auto",
        )
        return _tied_loaded(built)
    check_modes(meta_only=meta_only, load=weights, dtype=options.dtype, device=options.device)
    spec = spec_text(model)
    source = resolve(spec, options.revision)
    trust = options.trust_remote_code
    header_inv = None if meta_only else take_inventory(source, "header", trust_remote_code=trust)[0]
    inv, built_model, check = header_inv, None, None
    if meta_only or weights:
        mode: InventoryMode = "meta" if meta_only else "weights"
        inv, _, built_model = take_inventory(
            source, mode, trust_remote_code=trust, dtype=options.dtype, device=options.device
        )
        check = ON_META if meta_only else LOADED
    assert inv is not None
    flag = (header_inv or inv).config.tie_word_embeddings
    if flag is None and built_model is not None:
        flag = _built_flag(built_model)
    has_head = None
    if header_inv is not None:
        has_head = header_inv.head is not None or header_inv.stored_head is not None
    return tied_report(
        spec,
        inv,
        checkpoint_has_head=has_head,
        config_flag=flag,
        same_storage=None if built_model is None else storage_shared(built_model, loaded=weights),
        storage_check=check,
    )


def _tied_loaded(model: PreTrainedModel) -> TiedReport:
    """The evidence a loaded model holds: its config's flag and its head's storage."""
    config = loaded_config(model)
    meta = on_meta(model)
    flag = config.tie_word_embeddings
    if flag is None:
        flag = _built_flag(model)
    return tied_report(
        loaded_name(model),
        from_model(model, config, loaded=not meta),
        checkpoint_has_head=None,
        config_flag=flag,
        same_storage=storage_shared(model, loaded=not meta),
        storage_check=ON_META if meta else LOADED,
    )


def _built_flag(model: Any) -> bool:
    """The tie flag of a built model's (text) config, transformers' default when unset."""
    return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))


def storage_shared(model: Any, *, loaded: bool) -> bool:
    """Whether the head's weight is the embedding's: identity on meta, data_ptr() when loaded."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return False
    if not loaded:
        return head.weight is embed.weight
    return bool(head.weight.data_ptr() == embed.weight.data_ptr())


def _verdict(
    inv: Inventory, has_head: bool | None, same_storage: bool | None, storage_check: str | None
) -> tuple[bool, str]:
    """Tied or not, and by which evidence (the built model's storage outranks the files)."""
    if same_storage is not None:
        how = f"the built model's head {'is' if same_storage else 'is not'} the embedding"
        return same_storage, f"{how} ({storage_check})"
    if has_head is False:
        return True, "the checkpoint stores no head matrix, so the head must reuse the embedding"
    if has_head and inv.tied and inv.stored_head is not None:
        return True, (
            "the checkpoint's head is a byte-identical copy of the embedding, and the config "
            "ties them"
        )
    how = "the checkpoint stores a head matrix of its own" if has_head else "the config says so"
    return inv.tied, how


def _disagreement(
    config_flag: bool | None, has_head: bool | None, same_storage: bool | None
) -> str:
    """The note for evidence that disagrees, naming each piece."""
    pieces = (
        ("config", config_flag),
        ("checkpoint_has_lm_head", has_head),
        ("same_storage", same_storage),
    )
    return "the evidence disagrees: " + ", ".join(
        f"{label}={value}" for label, value in pieces if value is not None
    )


def tied_report(
    model_name: str,
    inv: Inventory,
    *,
    checkpoint_has_head: bool | None,
    config_flag: bool | None,
    same_storage: bool | None,
    storage_check: str | None = None,
) -> TiedReport:
    """Combine the evidence into a verdict and the savings of sharing one matrix.

    `inv` is the inventory the figures come from (headers, meta build or loaded model);
    `checkpoint_has_head` is None when the checkpoint's headers were not read.
    """
    has_head = checkpoint_has_head
    notes = list(inv.notes)
    tied, how = _verdict(inv, has_head, same_storage, storage_check)
    known = [e for e in (config_flag, None if has_head is None else not has_head, same_storage)]
    consistent = len({e for e in known if e is not None}) <= 1
    if not consistent:
        notes.append(_disagreement(config_flag, has_head, same_storage))
    v, d = inv.embedding_shape[0], inv.embedding_shape[-1]
    embed_item = next((i for i in inv.items if i.name == inv.embedding), None)
    saved = v * d if tied else 0
    saved_bytes = 0
    if tied and embed_item is not None and embed_item.nbytes is not None:
        saved_bytes = embed_item.nbytes
    total = sum(i.numel for i in inv.items)
    return TiedReport(
        model=model_name,
        tied=tied,
        shape=[v, d],
        saved_params=saved,
        saved_bytes=saved_bytes,
        dtype=embed_item.dtype if embed_item is not None else inv.dtype,
        evidence=TiedEvidence(
            config=config_flag, checkpoint_has_lm_head=has_head, same_storage=same_storage
        ),
        saved_fraction=saved / total if total else 0.0,
        embedding_name=inv.embedding,
        head_name=inv.head or inv.stored_head,
        verdict=how,
        consistent=consistent,
        notes=notes,
    )
