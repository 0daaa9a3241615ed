"""The under-trained scan's numerics: Lanczos for the first principal component, Q8_0 rows."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedlens.analysis.vocab.component import EXACT_WIDTH, first_component, top_eigenvector


def _exact_top(a: np.ndarray) -> np.ndarray:
    return np.linalg.eigh(a)[1][:, -1]


def test_lanczos_matches_eigh_with_a_dominant_component():
    rng = np.random.default_rng(1)
    shared = rng.standard_normal(300)
    rows = rng.standard_normal((2000, 300)) + 4.0 * rng.standard_normal((2000, 1)) * shared
    covariance = np.cov(rows, rowvar=False)
    u, steps, residual = top_eigenvector(covariance)
    assert residual <= 1e-9
    assert steps < 40  # a dominant component converges in a few checks
    assert abs(float(u @ _exact_top(covariance))) == pytest.approx(1.0, abs=1e-12)


def test_lanczos_matches_eigh_without_a_dominant_component():
    """Random rows: the top two eigenvalues are within 1% and Lanczos still finds the first."""
    rows = np.random.default_rng(2).standard_normal((4000, 400))
    covariance = np.cov(rows, rowvar=False)
    values = np.linalg.eigvalsh(covariance)
    assert values[-1] / values[-2] < 1.05
    u, _, residual = top_eigenvector(covariance)
    assert residual <= 1e-9
    assert abs(float(u @ _exact_top(covariance))) == pytest.approx(1.0, abs=1e-8)


def test_lanczos_on_a_rank_one_matrix_stops_early():
    v = np.arange(1.0, 301.0)
    u, steps, _ = top_eigenvector(np.outer(v, v))
    assert steps <= 8
    assert abs(float(u @ v)) / np.linalg.norm(v) == pytest.approx(1.0, abs=1e-12)


def test_smollm2_first_component_is_the_exact_one(smollm2):
    """On the real model (d = 576, above EXACT_WIDTH): Lanczos gives eigh's vector for the same
    sampled covariance."""
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    source = resolve(str(smollm2))
    table = locate(source, "output")
    rows = open_rows(source, table)
    assert rows.shape[1] > EXACT_WIDTH
    u, how = first_component(rows)
    assert how.startswith("Lanczos")
    v = rows.shape[0]
    sample = rows.take(list(range(0, v, -(-v // 16384)))).astype(np.float64)
    covariance = np.cov(sample, rowvar=False, bias=True)
    assert abs(float(u @ _exact_top(covariance))) == pytest.approx(1.0, abs=1e-6)


def test_q8_0_rows_are_ggufs():
    import gguf
    from gguf.quants import dequantize, quantize

    from embedlens.model.matrix import _dequantize_q8_0

    q8 = gguf.GGMLQuantizationType.Q8_0
    x = np.random.default_rng(3).standard_normal((70, 128)).astype(np.float32)
    x[5] *= 1e4  # large scales
    raw = quantize(x, q8)
    assert np.array_equal(_dequantize_q8_0(raw, 128, None), dequantize(raw, q8))
    out = np.empty((70, 128), np.uint32)
    assert np.array_equal(_dequantize_q8_0(raw, 128, out), dequantize(raw, q8))


def test_q8_0_rows_are_ggufs_to_the_bit_for_any_scale():
    """Every int8 value against every kind of float16 scale (subnormal, largest, zero of
    either sign, infinite, NaN): gguf's float32 values, bit for bit, with the row read in place
    (a strided view of the file's blocks) or from a copy."""
    import gguf
    from gguf.quants import dequantize

    from embedlens.model.matrix import _dequantize_q8_0

    rng = np.random.default_rng(4)
    specials = [6e-8, 6.1e-5, 65504.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -0.5, 0.0123]
    scales = np.concatenate([specials, rng.standard_normal(117 - len(specials))])
    blocks = np.empty((117 * 4, 34), np.uint8)
    blocks[:, :2] = np.repeat(scales.astype(np.float16), 4).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(0, 256, (117 * 4, 32), dtype=np.uint8)
    blocks[0, 2:] = np.arange(-128, 128, 8, dtype=np.int8).view(np.uint8)
    raw = blocks.reshape(117, 4 * 34)
    want = dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32).view(np.uint32)
    assert np.array_equal(_dequantize_q8_0(raw, 128, None).view(np.uint32), want)
    wide = np.zeros((117, 4 * 34 + 6), np.uint8)
    wide[:, 3 : 3 + 4 * 34] = raw  # rows that are not contiguous
    got = _dequantize_q8_0(wide[:, 3 : 3 + 4 * 34], 128, np.empty((117, 128), np.uint32))
    assert np.array_equal(got.view(np.uint32), want)


def test_passes_give_the_same_figures_on_any_number_of_threads(smollm2, monkeypatch):
    """The passes split the rows between threads (one per core); the reference rows' mean adds
    the blocks' sums in order, so a machine with more cores prints the same figures. On the
    real model (49,152 Q4_1 rows; 20,000 reference rows, more than are taken one by one)."""
    from embedlens.analysis.vocab import component as pc
    from embedlens.analysis.vocab import passes
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    source = resolve(str(smollm2))
    rows = open_rows(source, locate(source, "output"))
    reference = list(range(0, 40_000, 2))
    assert len(reference) > pc.SAMPLE_ROWS
    seen = []
    for n in (1, 2, 3):
        monkeypatch.setattr(passes, "workers", lambda v, n=n: n)
        stats = passes.row_stats(rows, reference)
        seen.append((passes.reference_mean(rows, reference), stats))
    (mean, first), others = seen[0], seen[1:]
    for other_mean, stats in others:
        assert np.array_equal(other_mean, mean)
        assert np.array_equal(stats.indicator, first.indicator, equal_nan=True)
        assert np.array_equal(stats.norms, first.norms)
        assert np.array_equal(stats.signature, first.signature)
        assert np.array_equal(stats.mean_distance, first.mean_distance)
    single = np.asarray(rows.take(reference), dtype=np.float64).mean(axis=0)
    assert np.allclose(mean, single, rtol=1e-5, atol=1e-7)


def _openblas() -> tuple[Any, Any] | None:
    """numpy's OpenBLAS thread count getter and setter, or None where its BLAS is another."""
    import ctypes

    with open("/proc/self/maps", encoding="utf-8") as maps:
        paths = [line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line]
    for path in paths:
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_openblas_", "openblas_"):
            for suffix in ("64_", ""):
                get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    return get, put
    return None


def test_the_scan_gives_the_same_figures_on_any_number_of_blas_threads(tmp_path):
    """The scan's sums are its own (`sums`), not BLAS's matrix-vector kernels, whose order
    depends on their threads: every row's figures and the component are the same bits on one
    BLAS thread and on four, on a Q6_K table read in pieces of 683 rows of 768 (products BLAS
    splits between threads). BLAS's thread count is set for the test and set back."""
    from embedlens.analysis.vocab import component as pc
    from embedlens.analysis.vocab import passes
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    blas = _openblas()
    if blas is None:
        pytest.skip("numpy's BLAS is not an OpenBLAS whose threads this test can set")
    get, put = blas
    source = resolve(str(_q6_k_table(tmp_path / "table.Q6_K.gguf", 20_000, 768)))
    rows = open_rows(source, locate(source, "input"))
    assert passes.pieces(0, rows.pass_rows, 768)[0] == (0, 683)
    reference = list(range(0, 20_000, 3))
    before = get()
    seen = []
    try:
        for threads in (1, 4):
            put(threads)
            seen.append((pc.component(rows), passes.row_stats(rows, reference)))
    finally:
        put(before)
    (one, first), (four, other) = seen
    assert np.array_equal(one[0], four[0]) and one[1] == four[1]
    for name in ("indicator", "norms", "signature", "mean_distance"):
        a, b = getattr(first, name), getattr(other, name)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


_SCALE_BYTES = {  # where a block keeps its float16 scales
    "Q6_K": slice(-2, None),
    "Q4_K": slice(0, 4),
    "Q2_K": slice(-4, None),
    "Q5_0": slice(0, 2),
    "IQ4_NL": slice(0, 2),
}


@pytest.mark.parametrize("qtype", [*_SCALE_BYTES, "BF16", "F16"])
def test_gguf_typed_rows_are_ggufs_in_few_calls(tmp_path, monkeypatch, qtype):
    """Rows of types read through the gguf package's formulas: the values its dequantize()
    gives, from blocks and from scattered rows, but in calls of many rows (dequantize() makes
    one call per 16 rows: a [262144, 1024] Q6_K table took seconds)."""
    import gguf
    from gguf import quants

    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    kind = gguf.GGMLQuantizationType[qtype]
    elems, size = gguf.GGML_QUANT_SIZES[kind]
    n, width = 3000, 512
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, (n, width // elems, size), dtype=np.uint8)
    if qtype in ("BF16", "F16"):  # finite values
        values = rng.standard_normal((n, width)).astype(np.float32)
        data = (values.view(np.uint32) >> 16).astype(np.uint16) if qtype == "BF16" else values
        data = data.astype(np.float16) if qtype == "F16" else data
        data = data.view(np.uint8).reshape(n, width // elems, size)
    else:  # each block's float16 scales small and finite
        at = _SCALE_BYTES[qtype]
        count = len(range(size)[at]) // 2
        scales = rng.uniform(1e-4, 1e-3, (n, width // elems, count)).astype(np.float16)
        data[:, :, at] = scales.view(np.uint8).reshape(n, width // elems, 2 * count)
    path = tmp_path / f"table.{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(width)
    writer.add_tensor("token_embd.weight", data.reshape(n, -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw = data.reshape(n, -1)
    whole = quants.dequantize(raw, kind).reshape(n, width)
    assert np.isfinite(whole).all()
    own = getattr(quants, qtype, None)
    calls: list[int] = []
    if own is not None:
        real = own.dequantize_rows.__func__
        monkeypatch.setattr(
            own, "dequantize_rows", classmethod(lambda c, r: calls.append(len(r)) or real(c, r))
        )
    source = resolve(str(path))
    rows = open_rows(source, locate(source, "input"))
    blocks = [rows.block(s, min(n, s + rows.pass_rows)) for s in range(0, n, rows.pass_rows)]
    assert np.array_equal(np.concatenate(blocks).view(np.uint32), whole.view(np.uint32))
    ids = [2999, 7, 1500, 7, 42]
    assert np.array_equal(rows.take(ids).view(np.uint32), whole[ids].view(np.uint32))
    if qtype == "Q6_K":  # unpacked here (model/q6_k.py): gguf's formula is never called
        assert calls == []
    elif own is not None:  # 1 MiB of float32 at a call: 512 rows of 512
        assert calls and max(calls) == 512 and len(calls) <= n // 512 + 3


def test_q6_k_rows_are_ggufs_to_the_bit():
    """Q6_K unpacked eight bytes at a time gives gguf's values bit for bit, whatever the bytes:
    every 6-bit value, every int8 scale, any float16 `d` (NaN, infinities, subnormals)."""
    from gguf import GGMLQuantizationType, quants

    from embedlens.model.q6_k import dequantize_q6_k

    rng = np.random.default_rng(7)
    n, width = 40, 1024
    raw = rng.integers(0, 256, (n, width // 256 * 210), dtype=np.uint8)
    blocks = raw.reshape(-1, 210)
    specials = np.array([np.nan, np.inf, -np.inf, 6e-8, -0.0, 65504.0], dtype=np.float16)
    blocks[: len(specials), 208:] = specials.view(np.uint8).reshape(-1, 2)
    blocks[10, :192] = 0xFF  # every value 63 (31 once 32 is taken off)
    blocks[11, :192] = 0x00  # every value 0 (-32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = quants.dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float32)
        got = dequantize_q6_k(raw, width)
        out = np.full((n, width), 7, np.uint32)
        into = dequantize_q6_k(raw, width, out)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(out.view(np.float32).view(np.uint32), want.view(np.uint32))
    assert np.shares_memory(into, out)


def test_q6_k_rows_are_read_without_gguf(tmp_path):
    """Reading a Q6_K table imports neither gguf (0.1 s) nor torch."""
    import subprocess
    import sys

    import gguf

    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (300, 210), dtype=np.uint8)
    data[:, -2:] = np.full((300, 1), 1e-3, np.float16).view(np.uint8)
    path = tmp_path / "table.Q6_K.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_tensor("token_embd.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code = (
        "import sys\n"
        "from embedlens.io.source import resolve\n"
        "from embedlens.model.matrix import locate, open_rows\n"
        f"source = resolve({str(path)!r})\n"
        "rows = open_rows(source, locate(source, 'input'))\n"
        "print(float(abs(rows.block(0, 300)).sum() > 0), 'gguf' in sys.modules, "
        "'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1.0", "False", "False"]


def test_many_reference_rows_read_the_matrix_in_two_passes(smollm2, monkeypatch):
    """With more reference rows than are taken one by one, every row is converted twice (the
    pass that sums them, then the products') and the component's sample once more, apart;
    the figures are the same whether the component was begun early, on its own thread
    (`Matrix.begun`), or found when the products need it."""
    import threading

    from embedlens.analysis.vocab import component as pc
    from embedlens.analysis.vocab import passes, signals
    from embedlens.io.source import resolve
    from embedlens.model.matrix import Rows, locate, open_rows

    source = resolve(str(smollm2))
    rows = open_rows(source, locate(source, "output"))
    reference = list(range(1, 40_000, 2))
    assert len(reference) > pc.SAMPLE_ROWS
    converted: list[int] = []
    convert = Rows._convert

    def counted(self: Rows, raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        converted.append(raw.shape[0])
        return convert(self, raw, out)

    monkeypatch.setattr(Rows, "_convert", counted)
    v = rows.shape[0]
    sample = len(range(0, v, pc.sample_stride(v)))
    now = passes.row_stats(rows, reference)
    assert sum(converted) == 2 * v + sample
    matrix = signals.Matrix.begun(rows, "token_embd.weight", "input")
    assert matrix.early is not None
    early = passes.row_stats(rows, reference, matrix.early)
    assert not any(t.name.startswith("embedlens-component") for t in threading.enumerate())
    assert early.component == now.component
    for name in ("indicator", "norms", "signature", "mean_distance"):
        a, b = getattr(early, name), getattr(now, name)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


def test_a_component_thread_raises_its_error_where_its_result_is_asked():
    """A component that fails on its thread fails the scan that asks for it, with its own
    error, and leaves no thread."""
    import threading

    from embedlens.analysis.vocab import component as pc
    from embedlens.errors import CheckpointError

    class Broken:
        shape = (100, 8)

        def take(self, ids: list[int]) -> np.ndarray:
            raise CheckpointError("the rows could not be read")

    component = pc.begin_component(Broken())  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="could not be read"):
        component.result()
    component.wait()
    assert not any(t.name.startswith("embedlens-component") for t in threading.enumerate())


def test_pieces_cover_a_block_and_keep_large_products_large():
    """A block is cut into pieces of at least PIECE_VALUES values (the last taking the rest),
    in order and without gaps; a block too small for two pieces stays whole."""
    from embedlens.analysis.vocab.passes import PIECE_VALUES, pieces

    for start, stop, d in [
        (0, 4096, 1024),
        (8192, 12288, 1024),
        (0, 5461, 768),
        (0, 1000, 1024),
        (40960, 41733, 768),
        (0, 7281, 576),
        (0, 292, 896),
        (5, 6, 64),
    ]:
        got = pieces(start, stop, d)
        assert got[0][0] == start and got[-1][1] == stop
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
        if len(got) > 1:
            assert all((b - a) * d >= PIECE_VALUES for a, b in got)
            assert all((b - a) * d < 2 * PIECE_VALUES + d for a, b in got)
        else:
            assert (stop - start) * d < 2 * PIECE_VALUES + 2 * d
    assert len(pieces(0, 4096, 1024)) == 8


def test_a_sum_carried_from_piece_to_piece_is_the_blocks_sum_to_the_bit():
    """The reference pass sums a K-quant's 16 MiB block a piece at a time, each piece behind a
    row holding the sum so far: the bits einsum gives over the whole block, whatever the
    values (zeros of both signs, NaN, infinities, cancelling rows) and weights."""
    from embedlens.analysis.vocab.passes import _Carried

    class Held:
        def __init__(self, table: np.ndarray) -> None:
            self.table = table

        def block_into(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
            out[...] = self.table[start:stop]
            return out

    rng = np.random.default_rng(11)
    n, d = 3000, 48
    scales = 10.0 ** rng.integers(-6, 6, (n, 1))
    table = (rng.standard_normal((n, d)) * scales).astype(np.float32)
    table[5] = -0.0
    table[6, :3] = [np.nan, np.inf, -np.inf]
    table[7] = -table[8]
    for fraction in (1.0, 0.5, 0.01, 0.0):
        weights = (rng.random(n) < fraction).astype(np.float32)
        weights[6] = 0.0 if fraction < 1 else 1.0
        whole = np.einsum("i,ij->j", weights, table)
        for size in (1, 7, 500, 2999):
            total = np.zeros(d, dtype=np.float32)
            carried = _Carried(d)
            for a in range(0, n, size):
                carried.add(Held(table), weights, a, min(n, a + size), total)  # type: ignore[arg-type]
            assert np.array_equal(total.view(np.uint32), whole.view(np.uint32)), (fraction, size)


def _q6_k_table(path: Path, n: int, width: int) -> Path:
    """A GGUF holding an [n, width] Q6_K embedding of random blocks, each block's float16 scale
    small and finite."""
    import gguf

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (n, width // 256, 210), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-3, (n, width // 256)).astype(np.float16)
    data[:, :, -2:] = scales.view(np.uint8).reshape(n, width // 256, 2)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(width)
    writer.add_tensor(
        "token_embd.weight", data.reshape(n, -1), raw_dtype=gguf.GGMLQuantizationType.Q6_K
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_refused_vocabulary_leaves_no_component_thread(tmp_path, monkeypatch):
    """`vocab` begins each matrix's component before it reads the tokenizer; when the tokenizer
    is refused, the call raises that error and no thread is left running."""
    import threading
    import time

    import embedlens
    from embedlens.analysis.vocab import component as pc
    from embedlens.errors import UnsupportedError

    begun: list[int] = []
    real = pc.component

    def slow(rows: Any) -> Any:  # still running when the tokenizer is refused
        begun.append(rows.shape[0])
        time.sleep(0.5)
        return real(rows)

    monkeypatch.setattr(pc, "component", slow)
    path = _q6_k_table(tmp_path / "table.Q6_K.gguf", 20_000, 512)  # no tokenizer in it
    with pytest.raises(UnsupportedError, match="no tokenizer"):
        embedlens.vocab(path)
    assert begun == [20_000]
    assert not any(t.name.startswith("embedlens-component") for t in threading.enumerate())


def test_pieces_give_the_whole_blocks_figures(tmp_path, monkeypatch):
    """On a Q6_K table (16 MiB blocks of 8,192 rows of 512, read in 2 MiB pieces, the last
    block shorter): the reference rows' mean and every row's figures are those whole blocks
    give, to the bit."""
    from embedlens.analysis.vocab import component as pc
    from embedlens.analysis.vocab import passes
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    source = resolve(str(_q6_k_table(tmp_path / "table.Q6_K.gguf", 20_000, 512)))
    rows = open_rows(source, locate(source, "input"))
    assert rows.pass_rows == 8192
    assert len(passes.pieces(16384, 20_000, 512)) == 3
    reference = list(range(0, 20_000, 3))
    assert len(reference) > pc.SAMPLE_ROWS // 4
    pieced = passes._reference_pass(rows, reference), passes.row_stats(rows, reference)
    monkeypatch.setattr(passes, "PIECE_VALUES", 1 << 40)
    assert len(passes.pieces(0, rows.pass_rows, rows.shape[1])) == 1
    whole = passes._reference_pass(rows, reference), passes.row_stats(rows, reference)
    assert np.array_equal(pieced[0], whole[0])
    for name in ("indicator", "norms", "signature", "mean_distance"):
        a, b = getattr(pieced[1], name), getattr(whole[1], name)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


class _Table:
    """Rows held in memory (what identical_rows takes from a matrix)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def take(self, ids: list[int]) -> np.ndarray:
        return self.table[ids]


def test_identical_rows_by_signature():
    """Equal signatures are compared in full (a zero of either sign is one signature); NaN
    signatures are never equal; rows past the limit are left out."""
    from embedlens.analysis.vocab.passes import identical_rows

    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    table[7] = table[2]
    table[9] = table[2]
    sig = np.arange(10, dtype=np.float32)
    sig[[3, 5]] = np.nan
    rows: Any = _Table(table)
    assert identical_rows(rows, sig, 10) == []
    sig[2], sig[7], sig[9] = 0.0, -0.0, 0.0
    assert identical_rows(rows, sig, 10) == [[2, 7, 9]]
    assert identical_rows(rows, sig, 9) == [[2, 7]]
    sig[4] = sig[6] = 1.5  # equal signatures, different rows
    assert identical_rows(rows, sig, 10) == [[2, 7, 9]]


def _pairs_in_stable_order(signature: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Neighbours with equal signatures when every row is put in stable order."""
    order = np.argsort(signature[:limit], kind="stable")
    sig = signature[order]
    return [(int(order[k]), int(order[k + 1])) for k in np.flatnonzero(sig[1:] == sig[:-1])]


def test_identical_rows_match_a_stable_order_of_every_row(monkeypatch):
    """Only the rows whose signature another row shares are put in order: the pairs compared
    are those a stable sort of every row gives, in the same order."""
    from embedlens.analysis.vocab import passes

    rng = np.random.default_rng(5)
    compared: list[tuple[int, int]] = []

    def equal(a: np.ndarray, b: np.ndarray) -> bool:
        compared.append((int(a[0]), int(b[0])))
        return True

    for _ in range(200):
        n = int(rng.integers(2, 300))
        sig = rng.integers(0, max(2, n // 3), n).astype(np.float32) * rng.choice([1, -1], n)
        sig[rng.random(n) < 0.1] = np.nan
        sig[rng.random(n) < 0.05] = -0.0
        limit = int(rng.integers(1, n + 1))
        compared.clear()
        monkeypatch.setattr(passes.np, "array_equal", equal)
        rows: Any = _Table(np.arange(n, dtype=np.float32)[:, None])
        passes.identical_rows(rows, sig, limit)
        monkeypatch.undo()
        assert compared == _pairs_in_stable_order(sig, limit)
