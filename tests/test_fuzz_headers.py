"""Property tests of the header readers: any bytes end in CheckpointError or a correct parse.

Every call runs under a time limit (a hang fails the test) and under tracemalloc (an allocation
sized by a length field the file merely claims fails it too). Valid files are built byte by byte
(tests.fileformats) and checked against the reference readers: the safetensors library and
gguf-py.
"""

from __future__ import annotations

import os
import signal
import struct
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from embedlens.errors import CheckpointError
from embedlens.io.checkpoint import SAFETENSORS_BITS, SafetensorsHeader, read_safetensors_header
from embedlens.io.gguf import (
    MAX_STRING_BYTES,
    GGUFHeader,
    LazyArray,
    ggml_types,
    read_gguf_header,
)
from tests.fileformats import GGML_BLOCKS, ST_BITS, gguf_bytes, safetensors_bytes

T = TypeVar("T")
# A few seconds in the suite; EMBEDLENS_FUZZ_EXAMPLES=2000 for a longer search.
EXAMPLES = int(os.environ.get("EMBEDLENS_FUZZ_EXAMPLES", "40"))
# No "explain" phase: its line tracing slows the readers tenfold, which the time limit would
# report as a hang.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=PHASES,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
TIME_LIMIT_S = 5.0
_WORK = Path(tempfile.mkdtemp(prefix="embedlens-fuzz-"))


class Hang(Exception):
    """A reader ran past the time limit."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(
    read: Callable[[Path], T], data: bytes, *, sparse_size: int = 0, trace: bool = True
) -> T | None:
    """Write data to a file, read it; None on CheckpointError, any other exception propagates.

    sparse_size extends the file with a hole (cheap) to stand for tensor data not written.
    trace=False leaves tracemalloc off (it slows a loop over millions of items thirtyfold).
    """
    path = _WORK / "fuzzed.bin"
    with open(path, "wb") as fh:
        fh.write(data)
        if sparse_size > len(data):
            fh.truncate(sparse_size)
    size = max(len(data), sparse_size)
    if trace:
        tracemalloc.start()
    try:
        with _time_limit(TIME_LIMIT_S):
            result = read(path)
    except CheckpointError as e:
        assert e.message and "\n" not in e.message and len(e.message) < 1000, e.message
        result = None
    finally:
        _, peak = tracemalloc.get_traced_memory()  # (0, 0) when not tracing
        tracemalloc.stop()
    # Small files: a small multiple of their size. Large ones: the strings the reader may decode.
    bound = min(64 * size, 6 * MAX_STRING_BYTES) + (4 << 20)
    assert peak < bound, f"{peak} bytes for a {size}-byte file"
    return result


# --- safetensors ---------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__"
)
st_tensors = st.dictionaries(
    names,
    st.tuples(st.sampled_from(sorted(ST_BITS)), st.lists(st.integers(0, 5), max_size=3)),
    max_size=5,
)
st_metadata = st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)


def check_safetensors(h: SafetensorsHeader, size: int) -> None:
    """What a parse promises: every tensor inside the data, tiling it, sized by dtype and shape."""
    base = 8 + h.header_length
    end = base
    for t in sorted(h.tensors.values(), key=lambda t: (t.file_offset, t.nbytes)):
        assert t.file_offset == end
        assert t.nbytes * 8 == t.numel * SAFETENSORS_BITS[t.dtype]
        end += t.nbytes
    assert end == size


def agrees_with_library(data: bytes, h: SafetensorsHeader | None) -> None:
    """Whatever the safetensors library accepts, embedlens reads the same way."""
    from safetensors import deserialize

    try:
        reference = deserialize(data)
    except Exception:
        return
    if any(info["dtype"] not in SAFETENSORS_BITS for _, info in reference):
        return
    assert h is not None, "the safetensors library reads a file that embedlens refuses"
    assert sorted(h.tensors) == sorted(name for name, _ in reference)
    for name, info in reference:
        t = h.tensors[name]
        assert (list(t.shape), t.dtype) == (info["shape"], info["dtype"])
        assert t.file_offset is not None
        assert data[t.file_offset : t.file_offset + t.nbytes] == bytes(info["data"])


@FUZZ
@given(tensors=st_tensors, metadata=st_metadata)
def test_safetensors_valid_files_parse_exactly(tensors, metadata):
    data = safetensors_bytes(tensors, metadata)
    h = outcome(read_safetensors_header, data)
    assert h is not None
    check_safetensors(h, len(data))
    agrees_with_library(data, h)
    assert h.metadata == (metadata or {})
    assert {n: (t.dtype, list(t.shape)) for n, t in h.tensors.items()} == {
        n: (dtype, shape) for n, (dtype, shape) in tensors.items()
    }


@FUZZ
@given(data=st.binary(max_size=600))
def test_safetensors_any_bytes(data):
    h = outcome(read_safetensors_header, data)
    if h is not None:
        check_safetensors(h, len(data))
    agrees_with_library(data, h)


@FUZZ
@given(data=st.binary(max_size=300))
def test_safetensors_any_header(data):
    """Any header body behind a correct length field."""
    blob = struct.pack("<Q", len(data)) + data
    h = outcome(read_safetensors_header, blob)
    if h is not None:
        check_safetensors(h, len(blob))


@FUZZ
@given(tensors=st_tensors, cut=st.integers(0, 1 << 16))
def test_safetensors_any_truncation(tensors, cut):
    data = safetensors_bytes(tensors)
    assert outcome(read_safetensors_header, data[: cut % len(data)]) is None


mutations = st.lists(
    st.tuples(st.integers(0, 1 << 16), st.binary(min_size=1, max_size=4)), min_size=1, max_size=4
)


def mutate(data: bytes, edits: list[tuple[int, bytes]], *, within: int | None = None) -> bytes:
    """Overwrite a few short runs of bytes (positions wrap around the first `within` bytes)."""
    out = bytearray(data)
    span = within or len(out)
    for pos, chunk in edits:
        pos %= span
        out[pos : pos + len(chunk)] = chunk[: len(out) - pos]
    return bytes(out)


@FUZZ
@given(tensors=st_tensors.filter(bool), edits=mutations)
def test_safetensors_byte_mutations(tensors, edits):
    data = mutate(safetensors_bytes(tensors), edits)
    h = outcome(read_safetensors_header, data)
    if h is not None:
        check_safetensors(h, len(data))
    agrees_with_library(data, h)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
entry_keys = st.sampled_from(["dtype", "shape", "data_offsets", "extra"])


@FUZZ
@given(
    tensors=st_tensors.filter(bool),
    edits=st.lists(st.tuples(st.integers(0, 10), entry_keys, json_values), min_size=1, max_size=3),
    metadata=st.none() | json_values,
)
def test_safetensors_header_field_mutations(tensors, edits, metadata):
    """Any field of any entry (or __metadata__) replaced by any JSON value."""
    import json

    data = safetensors_bytes(tensors)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    keys = sorted(header)
    for i, field, value in edits:
        header[keys[i % len(keys)]][field] = value
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + data[8 + n :]
    h = outcome(read_safetensors_header, blob)
    if h is not None:
        check_safetensors(h, len(blob))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 100_000, id="nested"),
        pytest.param(b'{"a": ' + b"1" * 5000 + b"}", id="int-past-digit-limit"),
        pytest.param(
            b'{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', id="list-dtype"
        ),
        pytest.param(
            b'{"a": {"dtype": "F32", "shape": [' + b"4294967296," * 3 + b"1], "
            b'"data_offsets": [0, 4]}}',
            id="2**96-elements",
        ),
        pytest.param(
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
            b' "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
            id="overlapping-tensors",
        ),
        pytest.param(
            b'{"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}', id="half-byte-left"
        ),
    ],
)
def test_safetensors_found_by_fuzzing(body):
    """Headers that escaped as RecursionError, ValueError or TypeError, or parsed as valid."""
    blob = struct.pack("<Q", len(body)) + body + bytes(4)
    assert outcome(read_safetensors_header, blob) is None


# --- GGUF ----------------------------------------------------------------------------------

SCALARS: dict[int, st.SearchStrategy[Any]] = {
    0: st.integers(0, 255), 1: st.integers(-128, 127), 2: st.integers(0, 2**16 - 1),
    3: st.integers(-(2**15), 2**15 - 1), 4: st.integers(0, 2**32 - 1),
    5: st.integers(-(2**31), 2**31 - 1), 6: st.floats(width=32, allow_nan=False),
    7: st.booleans(), 10: st.integers(0, 2**64 - 1), 11: st.integers(-(2**63), 2**63 - 1),
    12: st.floats(allow_nan=False), 8: st.text(st.characters(codec="utf-8"), max_size=10),
}  # fmt: skip


@st.composite
def gguf_kv(draw: st.DrawFn) -> tuple[int, Any]:
    vtype = draw(st.sampled_from([*SCALARS, 9]))
    if vtype != 9:
        return vtype, draw(SCALARS[vtype])
    item = draw(st.sampled_from(sorted(SCALARS)))
    long = draw(st.booleans())
    items = draw(st.lists(SCALARS[item], min_size=257 if long else 0, max_size=260 if long else 4))
    return 9, (item, items)


@st.composite
def gguf_tensor(draw: st.DrawFn) -> tuple[tuple[int, ...], int]:
    type_id = draw(st.sampled_from(sorted(GGML_BLOCKS)))
    elems = GGML_BLOCKS[type_id][0]
    row = elems * draw(st.integers(1, 2 if elems > 1 else 8))
    rest = draw(st.lists(st.integers(1, 3), max_size=2))
    return (row, *rest), type_id


gguf_files = st.builds(
    lambda kvs, tensors, alignment: gguf_bytes(
        [(k, *v) for k, v in kvs.items()]
        + ([("general.alignment", 4, alignment)] if alignment else []),
        [(name, *t) for name, t in tensors.items()],
    ),
    st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k != "general.alignment"),
        gguf_kv(),
        max_size=5,
    ),
    st.dictionaries(st.text(min_size=1, max_size=8), gguf_tensor(), max_size=4),
    st.none() | st.sampled_from([1, 8, 64]),
)


def check_gguf(h: GGUFHeader, size: int) -> None:
    """What a parse promises: known types, whole blocks, every byte span inside the file."""
    assert h.data_offset % h.alignment == 0
    for t in h.tensors.values():
        assert t.type_id in ggml_types()
        assert t.offset >= h.data_offset and t.offset + t.nbytes <= size
        if t.ggml_shape:
            assert t.ggml_shape[0] % t.block[0] == 0
    for value in h.metadata.values():
        if isinstance(value, LazyArray):
            assert value.end <= size
            assert len(value.read()) == value.count


def _contents(field: Any) -> Any:
    """A gguf-py field's value from its public parts, as later releases' `ReaderField.contents()`
    reads it (gguf 0.11, the lowest release pyproject admits, lacks that method)."""
    from gguf import GGUFValueType

    if not field.types:
        return None

    def text(part: Any) -> str:
        return str(part.tobytes(), encoding="utf-8")

    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [text(field.parts[i]) for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == GGUFValueType.STRING:
        return text(field.parts[-1])
    return field.parts[-1].tolist()[0]


def agrees_with_gguf_py(path: Path, h: GGUFHeader) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert sorted(fields) == sorted(h.metadata)
    for key, f in fields.items():
        ours = h.metadata[key]
        ours = ours.read() if isinstance(ours, LazyArray) else ours
        theirs = _contents(f)
        assert ours == theirs or (ours != ours and theirs != theirs), key
    assert sorted(t.name for t in reader.tensors) == sorted(h.tensors)
    for t in reader.tensors:
        mine = h.tensors[t.name]
        assert (mine.type_id, mine.ggml_shape, mine.offset, mine.nbytes) == (
            int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset, int(t.n_bytes),
        )  # fmt: skip


@FUZZ
@given(data=gguf_files)
def test_gguf_valid_files_parse_exactly(data):
    h = outcome(read_gguf_header, data)
    assert h is not None
    check_gguf(h, len(data))
    agrees_with_gguf_py(_WORK / "fuzzed.bin", h)


@FUZZ
@given(data=st.binary(max_size=600))
def test_gguf_any_bytes_after_the_magic(data):
    blob = b"GGUF" + struct.pack("<I", 3) + data
    h = outcome(read_gguf_header, blob)
    if h is not None:
        check_gguf(h, len(blob))
    outcome(read_gguf_header, data)  # and without the magic


@FUZZ
@given(data=gguf_files, cut=st.integers(0, 1 << 16))
def test_gguf_any_truncation(data, cut):
    cut %= len(data)
    h = outcome(read_gguf_header, data[:cut])
    if h is not None:
        check_gguf(h, cut)


@FUZZ
@given(data=gguf_files, edits=mutations)
def test_gguf_byte_mutations(data, edits):
    mutated = mutate(data, edits)
    h = outcome(read_gguf_header, mutated)
    if h is not None:
        check_gguf(h, len(mutated))


@pytest.fixture(scope="module")
def smollm2_header(smollm2: Path) -> tuple[bytes, int]:
    """The real SmolLM2 file's header bytes (up to its tensor data) and the file's size."""
    h = read_gguf_header(smollm2)
    with open(smollm2, "rb") as fh:
        return fh.read(h.data_offset), smollm2.stat().st_size


@settings(max_examples=max(4, EXAMPLES // 5), deadline=None, phases=PHASES)
@given(edits=mutations, region=st.sampled_from([64, 4096, 1 << 21]))
def test_gguf_real_header_mutations(smollm2_header, edits, region):
    """Mutations of SmolLM2's header; its tensor data stands as a hole in a sparse file.

    Untraced: a mutated count may have the reader walk up to 4M strings, which tracemalloc slows
    past the time limit (the synthetic files above check the memory).
    """
    header, size = smollm2_header
    mutated = mutate(header, edits, within=min(region, len(header)))
    h = outcome(read_gguf_header, mutated, sparse_size=size, trace=False)
    if h is not None:
        check_gguf(h, size)


@given(n=st.integers(0, 2**64 - 1), where=st.sampled_from(["tensors", "kv", "string", "array"]))
@FUZZ
def test_gguf_huge_counts_allocate_nothing(n, where):
    """A count or length field claiming up to 2**64 - 1 is checked against the bytes left."""
    if where == "tensors":
        blob = b"GGUF" + struct.pack("<IQQ", 3, n, 0)
    elif where == "kv":
        blob = b"GGUF" + struct.pack("<IQQ", 3, 0, n)
    elif where == "string":
        blob = b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, n) + b"k"
    else:
        blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
        blob += struct.pack("<IIQ", 9, 8, n)
    blob += bytes(32)
    h = outcome(read_gguf_header, blob)
    if h is not None:
        check_gguf(h, len(blob))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(gguf_bytes([], [("w", (4,), 0), ("w", (4,), 0)]), id="duplicate-tensor-name"),
        pytest.param(gguf_bytes([("k", 4, 1), ("k", 4, 2)], [("w", (4,), 0)]), id="duplicate-key"),
        pytest.param(gguf_bytes([], [(b"w\xff", (4,), 0)]), id="name-not-utf-8"),
        pytest.param(gguf_bytes([("general.alignment", 7, True)], []), id="bool-alignment"),
    ],
)
def test_gguf_found_by_fuzzing(data):
    """GGUF headers the reader once took silently (a tensor or key lost, a name mangled)."""
    assert outcome(read_gguf_header, data) is None


def _claim(*fields: bytes) -> bytes:
    return b"GGUF" + struct.pack("<I", 3) + b"".join(fields)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(_claim(struct.pack("<QQ", 0, 1 << 40)), id="10^12-metadata-pairs"),
        pytest.param(_claim(struct.pack("<QQ", 1 << 30, 0)), id="10^9-tensors"),
        pytest.param(
            _claim(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IQ", 8, 17 << 20)),
            id="17-MiB-string",
        ),
        pytest.param(
            _claim(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IIQ", 9, 8, (1 << 22) + 1)),
            id="4M-string-array",
        ),
        pytest.param(
            _claim(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IIQQ", 9, 8, 300, 300 << 20)),
            id="string-array-spanning-300-MiB",
        ),
        pytest.param(
            _claim(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IIQQ", 9, 8, 300, 2**64 - 1)),
            id="string-of-2^64-1-bytes-in-an-array",
        ),
        pytest.param(
            _claim(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IIQQ", 9, 8, 300, 2**62)),
            id="string-of-2^62-bytes-in-an-array",
        ),
    ],
)
def test_gguf_claims_are_bounded_whatever_the_file_size(header):
    """In a 400 MB file (a hole after the header) these claims fit in the file, yet are refused:
    the caps hold whatever the file's size."""
    assert outcome(read_gguf_header, header, sparse_size=400 << 20) is None


@pytest.mark.slow
def test_gguf_longest_string_array_is_walked_in_time():
    """4M strings (the cap, 16 times the largest vocabulary), here all empty: read in time."""
    header = _claim(struct.pack("<QQQ", 0, 1, 1), b"k", struct.pack("<IIQ", 9, 8, 1 << 22))
    h = outcome(read_gguf_header, header, sparse_size=200 << 20, trace=False)
    assert h is not None
    array = h.metadata["k"]
    assert isinstance(array, LazyArray) and array.count == 1 << 22
    assert array.end - array.start == 8 << 22


def test_every_ggml_type_the_gguf_package_lists_is_read(tmp_path):
    """The type table comes from gguf's: a tensor of each type it lists (MXFP4 among them
    where it lists it: gguf 0.11 predates it) is read with gguf's block and byte sizes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    mxfp4 = getattr(GGMLQuantizationType, "MXFP4", None)
    assert mxfp4 is None or mxfp4 in GGML_QUANT_SIZES
    for qtype in GGMLQuantizationType:
        if qtype not in GGML_QUANT_SIZES:
            continue
        elems, size = GGML_QUANT_SIZES[qtype]
        path = tmp_path / f"{qtype.name}.gguf"
        path.write_bytes(gguf_bytes([], [("w", (elems * 2, 3), int(qtype))]))
        info = read_gguf_header(path).tensors["w"]
        assert (info.type_name, info.block, info.row_bytes) == (qtype.name, (elems, size), 2 * size)


def test_gguf_tensor_offsets_must_keep_the_alignment(tmp_path):
    raw = bytearray(gguf_bytes([], [("a", (32,), 0), ("b", (32,), 0)]))
    at = raw.index(b"\x01\x00\x00\x00\x00\x00\x00\x00b") + 9 + 4 + 8 + 4
    struct.pack_into("<Q", raw, at, 132)  # 128 + 4: inside the file, off the 32-byte grid
    path = tmp_path / "odd.gguf"
    path.write_bytes(bytes(raw) + bytes(64))
    with pytest.raises(CheckpointError, match="tensor 'b' starts at data offset 132, which breaks"):
        read_gguf_header(path)
