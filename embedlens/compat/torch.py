"""torch: its private parts embedlens uses, each on the releases it was checked on, with the
public path elsewhere and under EMBEDLENS_PLAIN=1 (the same values either way).

- `batched_copy`: `torch._foreach_copy_`, one call for many pieces (the prefetch's float32
  copies, `embedlens.model.prefetch`); else each piece by the public `Tensor.copy_`;
- `put_tensor`: a module's own parameter or buffer replaced in place by writing the module's
  table of them (`_parameters`, `_buffers`), no registration hooks run; else the public
  `setattr`, which registers the same tensor under the same name;
- `PICKLED_TENSOR`: the global a `torch.save` file's pickle names to rebuild each tensor (a private
  function of torch's, part of the file format); `io.torchzip` matches it by name, calling
  nothing of torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from embedlens.compat import checked_release

if TYPE_CHECKING:
    from torch import Tensor, nn

PICKLED_TENSOR = ("torch._utils", "_rebuild_tensor_v2")
"""(module, name) of the global each tensor of a `torch.save` zip is rebuilt by in its pickle."""

TORCH_CHECKED = ((2, 13), (2, 15))
"""The torch releases these were checked on: from the first, up to the second (2.13.x and
2.14.x, the releases CI runs)."""


def batched_copy() -> Callable[[list[Any], list[Any]], None] | None:
    """torch's `_foreach_copy_(targets, sources)` where it may be taken; None: copy each piece
    with `Tensor.copy_`."""
    import torch

    if not checked_release("torch", *TORCH_CHECKED):
        return None
    found: Callable[[list[Any], list[Any]], None] | None = getattr(torch, "_foreach_copy_", None)
    return found


def put_tensor(module: nn.Module, name: str, value: Tensor) -> None:
    """`module`'s own parameter or buffer `name` (one it has) replaced by `value` (an
    `nn.Parameter` for a parameter)."""
    if not checked_release("torch", *TORCH_CHECKED):
        setattr(module, name, value)
    elif name in module._parameters:
        module._parameters[name] = value  # type: ignore[assignment]
    else:
        module._buffers[name] = value
