"""Parameter shares: group an inventory by role and by block part."""

from __future__ import annotations

from collections import defaultdict

from embedlens.model.anatomy import Placement, place
from embedlens.model.inventory import Inventory
from embedlens.reports.params import (
    BlockRow,
    MoEInfo,
    ParamGroup,
    ParamsReport,
    ParamsSource,
)

GROUP_ORDER = ("embedding", "lm_head", "position_embedding", "blocks", "final_norm", "other")
PART_ORDER = ("attention", "mlp", "experts", "router", "norms", "other")


def params_report(
    model: str, inv: Inventory, source: ParamsSource, *, per_block: bool = False
) -> ParamsReport:
    """Count the inventory by role; shares are of the unique total (tied weights once)."""
    head_names = [inv.head] if inv.head else []
    embed_names = [inv.embedding] if inv.embedding else []
    placed: list[tuple[Placement, int, int | None]] = [
        (place(i.name, embedding=embed_names, head=head_names), i.numel, i.nbytes)
        for i in inv.items
    ]
    total = sum(n for _, n, _ in placed)
    if total <= 0:
        from embedlens.errors import CheckpointError

        raise CheckpointError("the model has no parameters")
    bytes_known = all(b is not None for _, _, b in placed)

    def group_rows(key_of: dict[str, list[tuple[int, int | None]]], order: tuple[str, ...]):
        rows = []
        for name in order:
            entries = key_of.get(name)
            if not entries:
                continue
            n = sum(e[0] for e in entries)
            b = sum(e[1] or 0 for e in entries) if bytes_known else None
            rows.append(ParamGroup(name=name, params=n, fraction=n / total, bytes=b))
        return rows

    by_role: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
    by_part: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
    per_layer: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for p, n, b in placed:
        by_role[p.role].append((n, b))
        if p.role == "blocks" and p.part is not None and p.layer is not None:
            by_part[p.part].append((n, b))
            per_layer[p.layer][p.part] += n

    embedding = sum(n for n, _ in by_role.get("embedding", []))
    head_matrix = next((i.numel for i in inv.items if i.name == inv.head), 0)
    v, d = inv.vocab_size, inv.hidden_size
    moe = _moe(inv, total, sum(n for n, _ in by_part.get("experts", [])))
    head_flops = 2 * inv.embedding_shape[0] * inv.embedding_shape[-1]
    gathered = embedding + sum(n for n, _ in by_role.get("position_embedding", []))
    used = moe.active_params if moe is not None else total
    head_weights = sum(n for n, _ in by_role.get("lm_head", []))
    forward = 2 * (used - gathered - head_weights) + head_flops
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
        total_bytes=sum(b or 0 for _, _, b in placed) if bytes_known else None,
        head_flops_per_token=head_flops,
        forward_flops_per_token=forward,
        head_flops_fraction=head_flops / forward,
        groups=group_rows(by_role, GROUP_ORDER),
        block_parts=group_rows(by_part, PART_ORDER),
        moe=moe,
        blocks=[
            BlockRow(
                layer=layer, params=sum(parts.values()), **{k: parts.get(k, 0) for k in PART_ORDER}
            )
            for layer, parts in sorted(per_layer.items())
        ]
        if per_block
        else [],
        skipped=list(inv.skipped),
        notes=list(inv.notes),
    )


def _moe(inv: Inventory, total: int, expert_params: int) -> MoEInfo | None:
    n_exp, top_k = inv.config.num_experts, inv.config.experts_per_token
    if not expert_params or not n_exp or not top_k or top_k > n_exp:
        return None
    active = total - expert_params + expert_params * top_k // n_exp
    return MoEInfo(
        num_experts=n_exp,
        experts_per_token=top_k,
        expert_params=expert_params,
        active_params=active,
        active_fraction=active / total,
    )
