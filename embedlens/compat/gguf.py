"""gguf: embedlens' shortcuts over the package's layout and its reader's own methods, each on
the releases it was checked on (`GGUF_CHECKED`), with the public path elsewhere (one note) and
under EMBEDLENS_PLAIN=1 (no note); the same values either way.

- `constants`: gguf's constants module loaded alone from its file (`import gguf` pulls in its
  reader, writer and numpy); else `import gguf.constants`;
- `header_reader`: gguf's GGUFReader taking each long array whole through its own methods
  (`_get_field_parts`, `_get`); else `plain_reader`, which reads the whole header (seconds on a
  large vocabulary).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import struct
from pathlib import Path
from typing import Any

from embedlens.compat import checked_release, public_path
from embedlens.errors import MissingDependencyError

GGUF_CHECKED = ((0, 10), (0, 20))
"""The gguf releases whose layout embedlens' shortcuts were checked against: 0.10 to 0.19 (a
constants module that imports nothing of the package; the reader's own methods, see
`header_reader`)."""


def constants() -> Any:
    """gguf's constants module loaded alone; with EMBEDLENS_PLAIN=1, or (one note) on a release
    outside GGUF_CHECKED, `import gguf.constants`, the package with it."""
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "reading GGUF files needs the 'gguf' package", hint="pip install gguf"
        )
    fits = checked_release("gguf", *GGUF_CHECKED)
    if not fits:
        if fits is False:
            public_path(
                "gguf's table of types comes from `import gguf` (slower): gguf's release "
                "is not one from 0.10 to 0.19"
            )
        try:
            return importlib.import_module("gguf.constants")
        except ImportError as e:
            raise MissingDependencyError(
                f"the 'gguf' package fails to import: {e}", hint="pip install -U gguf"
            ) from None
    path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
    module_spec = importlib.util.spec_from_file_location("embedlens._gguf_constants", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


READER_SHAPES = {
    "_get_field_parts": ("self", "orig_offs", "raw_type"),
    "_get": ("self", "offset", "dtype", "count", "override_order"),
}
"""The parameters of the reader's own methods `header_reader` uses, as those releases have
them."""


def reader_fits() -> bool:
    """Whether `header_reader` may be used (else `plain_reader`)."""
    fits = checked_release("gguf", *GGUF_CHECKED)
    if fits is None:
        return False
    why = None
    if not fits:
        why = "gguf's release is not one from 0.10 to 0.19"
    else:
        from gguf import GGUFReader

        for method, shape in READER_SHAPES.items():
            try:
                params = tuple(inspect.signature(getattr(GGUFReader, method)).parameters)
            except (AttributeError, TypeError, ValueError):
                params = None
            if params != shape:
                why = f"gguf's GGUFReader.{method} is not as embedlens knows it"
                break
        if why is None and not isinstance(getattr(GGUFReader, "gguf_scalar_to_np", None), dict):
            why = "gguf's GGUFReader.gguf_scalar_to_np is not as embedlens knows it"
    if why is not None:
        public_path(f"gguf's reader reads the whole header to check the rows (slower): {why}")
    return why is None


def plain_reader(path: Path) -> Any:
    """gguf's GGUFReader on the header's file, as gguf has it."""
    from gguf import GGUFReader

    return GGUFReader(path)


def header_reader(path: Path, spans: dict[int, int]) -> Any:
    """gguf's GGUFReader on `path`, stepping over each long string array by its span (`spans`:
    where its items start -> where it ends, as embedlens measured) and taking each numeric array
    whole. It walks the header itself (keys, values, tensor infos, alignment, data offset):
    a wrong span would derail its walk, not pass it."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class HeaderReader(GGUFReader):
        """GGUFReader that takes a long array whole instead of one item at a time."""

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item, count = (
                int(x)
                for x in struct.unpack("<IQ", self.data[orig_offs : orig_offs + 12].tobytes())
            )
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            types = [GGUFValueType.ARRAY, GGUFValueType(item)]
            start = orig_offs + 12  # past the array's item type and length
            if item == GGUFValueType.STRING and start in spans:
                return spans[start] - orig_offs, parts, [], types
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item))
            if scalar is None:
                return super()._get_field_parts(orig_offs, raw_type)
            parts.append(self._get(start, scalar, count))
            return int(sum(p.nbytes for p in parts)), parts, [2], types

    return HeaderReader(path)
