"""Write a GGUF file's weights rounded to another type, with gguf's own quantiser.

    python bench/retype_gguf.py IN.gguf OUT.gguf Q8_0

Every tensor stored in a quantised type other than TYPE is dequantised and quantised again to
TYPE (`gguf.quants`); float tensors (norms) and tensors already of TYPE are copied as they are,
with every metadata key. The result is the same model rounded differently: `embedlens lens IN
PROMPT --against OUT` shows what the rounding changes, layer by layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

KEPT = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")
"""Tensor types copied as they are (float and integer tensors are not quantised)."""


def retype(source: Path, target: Path, type_name: str) -> dict[str, int]:
    """Write `source` to `target` with its quantised tensors rounded to `type_name`; returns how
    many tensors were rounded and how many copied."""
    import gguf
    import numpy as np
    from gguf import quants

    _check_release(gguf)
    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(target, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    done = {"rounded": 0, "copied": 0}
    for t in reader.tensors:
        if t.tensor_type.name in KEPT or t.tensor_type == qtype:
            data, kind = np.asarray(t.data), t.tensor_type
            done["copied"] += 1
        else:
            values = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            data, kind = quants.quantize(values, qtype), qtype
            done["rounded"] += 1
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return done


def _check_release(gguf: Any) -> None:
    """SystemExit naming what is missing where the installed gguf cannot copy a file's
    metadata as read (gguf 0.11, the lowest release embedlens admits, has neither)."""
    import inspect

    missing = []
    if not hasattr(gguf.ReaderField, "contents"):
        missing.append("ReaderField.contents()")
    if "sub_type" not in inspect.signature(gguf.GGUFWriter.add_key_value).parameters:
        missing.append("GGUFWriter.add_key_value(sub_type=)")
    if missing:
        from importlib.metadata import version

        raise SystemExit(
            f"error: retype_gguf.py copies metadata with gguf's {' and '.join(missing)}, which "
            f"gguf {version('gguf')} lacks\nhint: run it with a newer gguf (pip install -U gguf)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("type", help="a GGUF type gguf can quantise to: Q8_0, Q4_0, Q5_0, ...")
    opts = parser.parse_args()
    done = retype(opts.source, opts.target, opts.type)
    print(f"wrote {opts.target}: {done['rounded']} tensors rounded to {opts.type}, "
          f"{done['copied']} copied", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
