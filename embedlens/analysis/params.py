"""`params`: who owns the parameters, grouped by role and by block part."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from embedlens.analysis.params_parts import main_model, parts_of
from embedlens.errors import CheckpointError, UsageError
from embedlens.io.source import resolve
from embedlens.model.anatomy import Placement, place
from embedlens.model.inventory import Inventory, from_model, take_inventory
from embedlens.model.loaded import (
    check_loaded,
    is_spec,
    loaded_config,
    loaded_name,
    on_meta,
    spec_text,
)
from embedlens.model.loading import check_choices
from embedlens.model.quant import kinds
from embedlens.options import LoadOptions, weights_load
from embedlens.reports.params import (
    BlockRow,
    BookkeepingRow,
    MoEInfo,
    ParamGroup,
    ParamsReport,
    ParamsSource,
)

GROUP_ORDER = (
    "embedding", "lm_head", "position_embedding", "blocks", "final_norm", "towers", "other",
)  # fmt: skip
PART_ORDER = ("attention", "mlp", "experts", "router", "norms", "other")
META_FALLBACK = "no safetensors or GGUF headers to read: counted from the config on the meta device"

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from embedlens.model.loaded import ModelSpec


def params(
    model: ModelSpec | PreTrainedModel,
    *,
    meta_only: bool = False,
    load: LoadOptions | bool | None = None,
    per_block: bool = False,
    revision: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> ParamsReport:
    """Who owns the parameters: embedding, LM head, blocks, norms (tied weights counted once).

    model: a hub id, a folder, a .gguf file, or a loaded transformers model (counted as it is,
        never moved or changed; meta_only, load, revision and dtype do not apply to it).
    By default the figures come from the checkpoint's safetensors or GGUF headers (no weights
    read), else from the config on the meta device; meta_only: always from the config on the
    meta device; load: a `LoadOptions`, from the weights loaded with it (its fields may be given
    as keywords instead: revision, dtype, device, trust_remote_code; load=True, the former
    spelling, loads with the keywords, whose dtype is 'auto').
    """
    keywords = dict(
        revision=revision, dtype=dtype, device=device, trust_remote_code=trust_remote_code
    )
    options, weights = weights_load("params", model, load, keywords)
    if not is_spec(model):
        built = check_loaded(
            model,
            meta_only=meta_only,
            load=weights,
            revision=revision is not None,
            dtype=dtype != "auto",
        )
        meta = on_meta(built)
        inv = from_model(built, loaded_config(built), loaded=not meta)
        return params_report(
            loaded_name(built), inv, "meta" if meta else "weights", per_block=per_block
        )
    check_modes(meta_only=meta_only, load=weights, dtype=options.dtype, device=options.device)
    spec = spec_text(model)
    inv, used, _ = take_inventory(
        resolve(spec, options.revision),
        "meta" if meta_only else "weights" if weights else None,
        trust_remote_code=options.trust_remote_code,
        dtype=options.dtype,
        device=options.device,
    )
    if used == "meta" and not meta_only:
        inv.notes.insert(0, META_FALLBACK)
    return params_report(spec, inv, used, per_block=per_block)


def check_modes(*, meta_only: bool, load: bool, dtype: str, device: str) -> None:
    """UsageError for --meta-only with --load, or an unknown dtype or device."""
    if meta_only and load:
        raise UsageError("--meta-only and --load exclude each other")
    check_choices(dtype, device)


Entry = tuple[int, int | None, str | None]
"""(parameters, bytes, dtype) of one tensor."""


def _group_rows(
    key_of: dict[str, list[Entry]],
    order: tuple[str, ...],
    total: int,
    *,
    bytes_known: bool,
) -> list[ParamGroup]:
    """One row per named group, in order: parameters, share of the total, bytes when known,
    what they are stored as and the bits that takes a parameter."""
    rows = []
    for name in order:
        entries = key_of.get(name)
        if not entries:
            continue
        n = sum(e[0] for e in entries)
        b = sum(e[1] or 0 for e in entries) if bytes_known else None
        kinds_of = sorted({e[2] for e in entries if e[2]})
        dtype = ", ".join(kinds_of) if kinds_of and all(e[2] for e in entries) else None
        bits = b * 8 / n if b is not None and n else None
        rows.append(ParamGroup(name, n, n / total, b, dtype, bits))
    return rows


def _block_rows(per_layer: dict[int, dict[str, int]]) -> list[BlockRow]:
    """One row per decoder block, its parameters by part."""
    return [
        BlockRow(
            layer=layer, params=sum(parts.values()), **{k: parts.get(k, 0) for k in PART_ORDER}
        )
        for layer, parts in sorted(per_layer.items())
    ]


def _forward_flops(by_role: dict[str, list[Entry]], used: int, head_flops: int) -> int:
    """A token's forward pass: 2 per weight used, but lookups (embeddings) cost no product."""
    gathered = sum(e[0] for e in by_role.get("embedding", []))
    gathered += sum(e[0] for e in by_role.get("position_embedding", []))
    head_weights = sum(e[0] for e in by_role.get("lm_head", []))
    return 2 * (used - gathered - head_weights) + head_flops


def _placed(inv: Inventory) -> list[tuple[Placement, Entry]]:
    """Each item's placement, with its parameters, bytes and dtype."""
    head_names = [inv.head] if inv.head else []
    embed_names = [inv.embedding] if inv.embedding else []
    return [
        (place(i.name, embedding=embed_names, head=head_names), (i.numel, i.nbytes, i.dtype))
        for i in inv.items
    ]


def params_report(
    model: str, inv: Inventory, source: ParamsSource, *, per_block: bool = False
) -> ParamsReport:
    """Count the inventory by role; shares are of the unique total (tied weights once)."""
    placed = _placed(inv)
    total = sum(e[0] for _, e in placed)
    if total <= 0:
        raise CheckpointError("the model has no parameters")
    bytes_known = all(e[1] is not None for _, e in placed)

    def group_rows(key_of: dict[str, list[Entry]], order: tuple[str, ...]) -> list[ParamGroup]:
        return _group_rows(key_of, order, total, bytes_known=bytes_known)

    by_role: dict[str, list[Entry]] = defaultdict(list)
    by_part: dict[str, list[Entry]] = defaultdict(list)
    per_layer: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for p, e in placed:
        by_role[p.role].append(e)
        if p.role == "blocks" and p.part is not None and p.layer is not None:
            by_part[p.part].append(e)
            per_layer[p.layer][p.part] += e[0]

    embedding = sum(e[0] for e in by_role.get("embedding", []))
    head_matrix = next((i.numel for i in inv.items if i.name == inv.head), 0)
    v, d = inv.vocab_size, inv.hidden_size
    main_total, main_experts = main_model(inv, placed)
    moe = _moe(inv, total, sum(e[0] for e in by_part.get("experts", [])), main_total, main_experts)
    head_flops = 2 * inv.embedding_shape[0] * inv.embedding_shape[-1]
    forward = _forward_flops(
        by_role, moe.active_params if moe is not None else main_total, head_flops
    )
    total_bytes = sum(e[1] or 0 for _, e in placed) if bytes_known else None
    return ParamsReport(
        model=model,
        source=source,
        total=total,
        embedding=embedding,
        lm_head=0 if inv.tied else head_matrix,
        tied=inv.tied,
        embedding_fraction=embedding / total,
        embedding_lm_head_fraction=(embedding + (0 if inv.tied else head_matrix)) / total,
        vocab_size=v,
        hidden_size=d,
        num_layers=inv.num_layers,
        dtype=inv.dtype,
        total_bytes=total_bytes,
        head_flops_per_token=head_flops,
        forward_flops_per_token=forward,
        head_flops_fraction=head_flops / forward,
        groups=group_rows(by_role, GROUP_ORDER),
        block_parts=group_rows(by_part, PART_ORDER),
        moe=moe,
        blocks=_block_rows(per_layer) if per_block else [],
        skipped=list(inv.skipped),
        notes=[*inv.notes, *_stated(inv.stated_total, total)],
        parts=parts_of(inv, placed, bytes_known=bytes_known),
        stated_total=inv.stated_total,
        **_bookkeeping(inv, total_bytes),
    )


def _bookkeeping(inv: Inventory, total_bytes: int | None) -> dict[str, Any]:
    """The report's quantisation fields: the bookkeeping by kind, its bytes, all bytes stored."""
    book = kinds(inv.bookkeeping)
    book_bytes = sum(b for _, b in book.values()) if inv.bookkeeping_known else None
    both = None if total_bytes is None or book_bytes is None else total_bytes + book_bytes
    return {
        "quantised": inv.quantised,
        "bookkeeping": [BookkeepingRow(k, n, b) for k, (n, b) in book.items()],
        "bookkeeping_bytes": book_bytes,
        "stored_bytes": both,
    }


def _stated(stated: int | None, total: int) -> list[str]:
    """A note where the checkpoint's metadata states another parameter count."""
    if stated is None or stated == total:
        return []
    return [
        f"the checkpoint's metadata states total_parameters {stated:,}; its tensors hold "
        f"{total:,} parameters (a quantiser's count of stored elements differs from the "
        "parameters packed values hold)"
    ]


def _moe(
    inv: Inventory, total: int, expert_params: int, main_total: int, main_experts: int
) -> MoEInfo | None:
    """Routed experts and the parameters a token uses (of the model proper: MTP layers, which a
    token's forward pass does not run, are left out of the active count)."""
    n_exp, top_k = inv.config.num_experts, inv.config.experts_per_token
    if not expert_params or not n_exp or not top_k or top_k > n_exp:
        return None
    active = main_total - main_experts + main_experts * top_k // n_exp
    return MoEInfo(
        num_experts=n_exp,
        experts_per_token=top_k,
        expert_params=expert_params,
        active_params=active,
        active_fraction=active / total,
    )
