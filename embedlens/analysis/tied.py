"""Tied weights: weigh the config flag, the checkpoint and the built model separately."""

from __future__ import annotations

from typing import Any

from embedlens.model.inventory import Inventory
from embedlens.reports.tied import TiedEvidence, TiedReport


def storage_shared(model: Any, *, loaded: bool) -> bool:
    """Whether the head's weight is the embedding's: identity on meta, data_ptr() when loaded."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return False
    if not loaded:
        return head.weight is embed.weight
    return bool(head.weight.data_ptr() == embed.weight.data_ptr())


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
    if same_storage is not None:
        tied = same_storage
        how = f"the built model's head {'is' if tied else 'is not'} the embedding ({storage_check})"
    elif has_head is False:
        tied = True
        how = "the checkpoint stores no head matrix, so the head must reuse the embedding"
    elif has_head and inv.tied and inv.stored_head is not None:
        tied = True
        how = "the checkpoint's head is a byte-identical copy of the embedding, and the config ties them"
    else:
        tied = inv.tied
        how = "the checkpoint stores a head matrix of its own" if has_head else "the config says so"
    known = [e for e in (config_flag, None if has_head is None else not has_head, same_storage)]
    consistent = len({e for e in known if e is not None}) <= 1
    if not consistent:
        notes.append(
            "the evidence disagrees: "
            + ", ".join(
                f"{label}={value}"
                for label, value in (
                    ("config", config_flag),
                    ("checkpoint_has_lm_head", has_head),
                    ("same_storage", same_storage),
                )
                if value is not None
            )
        )
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
