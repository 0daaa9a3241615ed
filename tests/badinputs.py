"""Bad model inputs, each built in a fresh folder from a copy of a good one (never in place).

A maker takes (tmp, tiny, smollm2): a folder of its own, the tiny-model factory, and the path of
the real SmolLM2 GGUF, and returns the path to give as MODEL.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fileformats import gguf_bytes, gguf_value

Maker = Callable[[Path, Callable[..., Path], Path], Path]
MAKERS: dict[str, Maker] = {}


def maker(fn: Maker) -> Maker:
    MAKERS[fn.__name__.replace("_", "-")] = fn
    return fn


def _copy(tmp: Path, tiny: Callable[..., Path], **kwargs: Any) -> Path:
    dst = tmp / "model"
    shutil.copytree(tiny("llama-tied", **kwargs), dst)
    return dst


def _st_header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_write(path: Path, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@maker
def missing_path(tmp, tiny, smol):
    return tmp / "no-such-model"


@maker
def empty_folder(tmp, tiny, smol):
    (tmp / "empty").mkdir()
    return tmp / "empty"


@maker
def no_config(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    (folder / "config.json").unlink()
    return folder


@maker
def config_empty(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    (folder / "config.json").write_bytes(b"")
    return folder


@maker
def config_not_utf8(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    (folder / "config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    return folder


@maker
def config_a_list(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    (folder / "config.json").write_text("[1, 2, 3]")
    return folder


@maker
def encoder_only(tmp, tiny, smol):
    """A BERT config (no architectures listed) beside the tiny model's weights and tokenizer."""
    folder = _copy(tmp, tiny)
    config = {"model_type": "bert", "vocab_size": 72, "hidden_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "intermediate_size": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@maker
def st_truncated(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return folder


@maker
def st_header_beyond_file(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    return folder


@maker
def st_header_not_json(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8:16] = b"\xff\xfe{[<<>>"
    weights.write_bytes(bytes(raw))
    return folder


@maker
def st_offsets_outside(tmp, tiny, smol):
    """One tensor's data_offsets moved past the end of the data."""
    folder = _copy(tmp, tiny)
    weights = folder / "model.safetensors"
    header, data = _st_header(weights)
    name = next(k for k in sorted(header) if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + len(data), end + len(data)]
    _st_write(weights, header, data)
    return folder


@maker
def st_overlapping(tmp, tiny, smol):
    """Two tensors of the same size sharing their bytes (the data left with a hole)."""
    folder = _copy(tmp, tiny)
    weights = folder / "model.safetensors"
    header, data = _st_header(weights)
    names = [k for k in sorted(header) if k != "__metadata__" and k.endswith("norm.weight")]
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
    _st_write(weights, header, data)
    return folder


@maker
def shard_missing(tmp, tiny, smol):
    folder = _copy(tmp, tiny, max_shard_size="20KB")
    sorted(folder.glob("model-*.safetensors"))[-1].unlink()
    return folder


@maker
def index_not_json(tmp, tiny, smol):
    folder = _copy(tmp, tiny, max_shard_size="20KB")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    return folder


@maker
def index_shard_outside(tmp, tiny, smol):
    folder = _copy(tmp, tiny, max_shard_size="20KB")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../../etc/passwd"
    index.write_text(json.dumps(data))
    return folder


@maker
def gguf_empty(tmp, tiny, smol):
    (tmp / "empty.gguf").write_bytes(b"")
    return tmp / "empty.gguf"


@maker
def gguf_fake(tmp, tiny, smol):
    (tmp / "fake.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 64)
    return tmp / "fake.gguf"


@maker
def gguf_not_gguf(tmp, tiny, smol):
    (tmp / "text.gguf").write_text("this is a text file named like a model\n" * 4)
    return tmp / "text.gguf"


@maker
def gguf_truncated(tmp, tiny, smol):
    with open(smol, "rb") as fh:
        (tmp / "short.gguf").write_bytes(fh.read(5000))
    return tmp / "short.gguf"


@maker
def gguf_version_1(tmp, tiny, smol):
    (tmp / "v1.gguf").write_bytes(gguf_bytes([], [("w", (32,), 0)], version=1))
    return tmp / "v1.gguf"


@maker
def gguf_unsupported_quant(tmp, tiny, smol):
    """SmolLM2's header with its embedding's ggml type changed to 99 (no such type); the tensor
    data stands as a hole of the same size (a sparse file)."""
    from embedlens.io.gguf import read_gguf_header

    header = read_gguf_header(smol)
    with open(smol, "rb") as fh:
        raw = bytearray(fh.read(header.data_offset))
    name = b"token_embd.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", raw, at)
    struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 99)
    out = tmp / "q99.gguf"
    with open(out, "wb") as fh:
        fh.write(raw)
        fh.truncate(smol.stat().st_size)
    return out


@maker
def not_a_model_file(tmp, tiny, smol):
    (tmp / "notes.txt").write_text("hello")
    return tmp / "notes.txt"


def _gguf_rewrite(
    src: Path,
    out: Path,
    *,
    meta: dict[str, tuple[int, Any]] | None = None,
    shift: dict[str, int] | None = None,
) -> Path:
    """A copy of a GGUF file with metadata values replaced (key -> (type, value)) and tensor
    offsets moved by a number of bytes; the header is written again, the data copied as it is."""
    from embedlens.io.gguf import LazyArray, read_gguf_header

    header = read_gguf_header(src)
    with open(src, "rb") as fh:
        raw = fh.read(header.data_offset)
    first = next(iter(header.tensors))
    infos_at = raw.index(struct.pack("<Q", len(first)) + first.encode())
    body = bytearray(raw[:infos_at])
    for key, (vtype, value) in reversed(
        sorted((meta or {}).items(), key=lambda kv: _kv_start(raw, kv[0]))
    ):
        old = header.metadata[key]
        start = _kv_start(raw, key)
        end = old.end if isinstance(old, LazyArray) else _kv_end(header, raw, key, start)
        body[start:end] = struct.pack("<I", vtype) + gguf_value(vtype, value)
    for name, info in header.tensors.items():
        offset = info.offset - header.data_offset + (shift or {}).get(name, 0)
        body += (
            struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(info.ggml_shape))
        )
        body += b"".join(struct.pack("<Q", d) for d in info.ggml_shape)
        body += struct.pack("<IQ", info.type_id, offset)
    body += bytes(-len(body) % header.alignment)
    with open(src, "rb") as fh, open(out, "wb") as dst:
        dst.write(body)
        fh.seek(header.data_offset)
        shutil.copyfileobj(fh, dst, 1 << 22)
    return out


def _kv_start(raw: bytes, key: str) -> int:
    """Where a metadata key's value type starts (just after the key)."""
    needle = struct.pack("<Q", len(key)) + key.encode()
    return raw.index(needle) + len(needle)


def _kv_end(header: Any, raw: bytes, key: str, start: int) -> int:
    """Where a short metadata value ends: the next key's length field, or the tensor infos."""
    keys = list(header.metadata)
    nxt = keys[keys.index(key) + 1]
    return _kv_start(raw, nxt) - 8 - len(nxt.encode())


def _st_reshape(folder: Path, name: str, shape: list[int]) -> None:
    """Give one tensor of model.safetensors a new shape (its bytes cut to fit, or kept)."""
    weights = folder / "model.safetensors"
    header, data = _st_header(weights)
    begin, _ = header[name]["data_offsets"]
    size = 4
    for d in shape:
        size *= d
    header[name]["shape"] = shape
    header[name]["data_offsets"] = [begin, begin + size]
    others = [k for k in header if k not in ("__metadata__", name)]
    # tensors after it keep their offsets: the shrunken one leaves a hole, so they are moved up
    shift = header[name]["data_offsets"][1] - _st_header(weights)[0][name]["data_offsets"][1]
    cut = _st_header(weights)[0][name]["data_offsets"][1]
    for k in others:
        b, e = header[k]["data_offsets"]
        if b >= cut:
            header[k]["data_offsets"] = [b + shift, e + shift]
    _st_write(weights, header, data[: begin + size] + data[cut:])


@maker
def embedding_width_0(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    _st_reshape(folder, "model.embed_tokens.weight", [72, 0])
    return folder


@maker
def embedding_rows_0(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    _st_reshape(folder, "model.embed_tokens.weight", [0, 32])
    return folder


@maker
def config_nested_deep(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    config = json.loads((folder / "config.json").read_text())
    text = json.dumps(config)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (folder / "config.json").write_text(text)
    return folder


@maker
def config_symlink_loop(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("config.json")
    return folder


@maker
def gguf_unaligned(tmp, tiny, smol):
    """SmolLM2 with its embedding's offset moved 4 bytes off the file's 32-byte alignment."""
    return _gguf_rewrite(smol, tmp / "unaligned.gguf", shift={"token_embd.weight": 4})


def _smol_strings(smol: Path, key: str) -> list[bytes]:
    from embedlens.io.gguf import read_gguf_header

    array = read_gguf_header(smol).metadata[key]
    with open(smol, "rb") as fh:
        fh.seek(array.start)
        buf = fh.read(array.end - array.start)
    out, pos = [], 0
    for _ in range(array.count):
        (n,) = struct.unpack_from("<Q", buf, pos)
        out.append(buf[pos + 8 : pos + 8 + n])
        pos += 8 + n
    return out


@maker
def gguf_merge_without_space(tmp, tiny, smol):
    merges = _smol_strings(smol, "tokenizer.ggml.merges")
    merges[5] = merges[5].replace(b" ", b"")
    meta = {"tokenizer.ggml.merges": (9, (8, merges))}
    return _gguf_rewrite(smol, tmp / "merges.gguf", meta=meta)


@maker
def gguf_tokens_as_numbers(tmp, tiny, smol):
    count = len(_smol_strings(smol, "tokenizer.ggml.tokens"))
    meta = {"tokenizer.ggml.tokens": (9, (5, list(range(count))))}
    return _gguf_rewrite(smol, tmp / "numbers.gguf", meta=meta)


@maker
def gguf_token_not_utf8(tmp, tiny, smol):
    tokens = _smol_strings(smol, "tokenizer.ggml.tokens")
    tokens[7] = b"\xff\xfe" + tokens[7]
    meta = {"tokenizer.ggml.tokens": (9, (8, tokens))}
    return _gguf_rewrite(smol, tmp / "latin.gguf", meta=meta)


def _gguf_hide(smol: Path, out: Path, keys: list[str]) -> Path:
    """A copy of a GGUF file whose metadata keys are renamed (last letter to 'X'): as if absent."""
    data = smol.read_bytes()
    for key in keys:
        stored = struct.pack("<Q", len(key)) + key.encode()
        assert data.count(stored) == 1, key
        data = data.replace(stored, struct.pack("<Q", len(key)) + key[:-1].encode() + b"X")
    out.write_bytes(data)
    return out


@maker
def gguf_no_tokenizer(tmp, tiny, smol):
    return _gguf_hide(smol, tmp / "notok.gguf", ["tokenizer.ggml.model"])


@maker
def gguf_tokenizer_unknown(tmp, tiny, smol):
    return _gguf_rewrite(smol, tmp / "foo.gguf", meta={"tokenizer.ggml.model": (8, "foo")})


@maker
def gguf_no_merges(tmp, tiny, smol):
    return _gguf_hide(smol, tmp / "nomerges.gguf", ["tokenizer.ggml.merges"])


@maker
def rope_type_unknown(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "bogus", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@maker
def tokenizer_without_added_tokens(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    data = json.loads((folder / "tokenizer.json").read_text())
    del data["added_tokens"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


@maker
def no_tokenizer_json(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    (folder / "tokenizer.json").unlink()
    return folder


def _chat_template(tmp: Path, tiny: Callable[..., Path], template: str) -> Path:
    folder = _copy(tmp, tiny)
    (folder / "chat_template.jinja").write_text(template)
    return folder


INTEGER_NUMPY = {
    "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "U8": "u1", "BOOL": "?",
}  # fmt: skip


def st_as_integer(folder: Path, name: str, dtype: str) -> None:
    """Store one float32 tensor of model.safetensors as an integer dtype (its values times 100,
    rounded), the tensors after it moved to fit."""
    import numpy as np

    weights = folder / "model.safetensors"
    header, data = _st_header(weights)
    tensors = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )
    out = bytearray()
    for k in tensors:
        begin, end = header[k]["data_offsets"]
        raw = data[begin:end]
        if k == name:
            values = np.frombuffer(raw, dtype="<f4") * 100
            raw = np.rint(values).astype(INTEGER_NUMPY[dtype]).tobytes()
            header[k]["dtype"] = dtype
        header[k]["data_offsets"] = [len(out), len(out) + len(raw)]
        out += raw
    _st_write(weights, header, bytes(out))


@maker
def embedding_int8(tmp, tiny, smol):
    folder = _copy(tmp, tiny)
    st_as_integer(folder, "model.embed_tokens.weight", "I8")
    return folder


@maker
def chat_template_loops(tmp, tiny, smol):
    # 10**10 turns: the sandbox caps one range at 100,000, so two are nested
    return _chat_template(
        tmp,
        tiny,
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    )


@maker
def chat_template_huge(tmp, tiny, smol):
    return _chat_template(tmp, tiny, "{{ 'x' * 20000000 }}")


def config_chat_template(tmp: Path, tiny: Callable[..., Path], template: str) -> Path:
    """The tiny model with its chat template in tokenizer_config.json."""
    folder = _copy(tmp, tiny)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@maker
def chat_template_repeats(tmp, tiny, smol):
    # one string multiplication of 10 GB, in C: no timer interrupts it
    return config_chat_template(tmp, tiny, "{{ 'x' * 10**10 }}")


@maker
def chat_template_power(tmp, tiny, smol):
    return config_chat_template(tmp, tiny, "{{ 7 ** 10000000000 }}")


@maker
def chat_template_range(tmp, tiny, smol):
    return config_chat_template(tmp, tiny, "{% for i in range(10**10) %}x{% endfor %}")


@maker
def chat_template_raises(tmp, tiny, smol):
    return config_chat_template(
        tmp, tiny, "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    )
