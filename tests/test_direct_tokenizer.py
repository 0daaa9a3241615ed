"""The lens reads a folder's tokenizer.json with the `tokenizers` library only where that gives
the ids transformers gives; on every fixture, which way it goes and why.

Direct: each tiny family's folder (tokenizer_config.json names transformers' generic class, every
special token is an added token of tokenizer.json), SmolLM2 and the Qwen3-shaped bench checkpoint
as folders. Through transformers: a GGUF file (transformers rebuilds its tokenizer from the
metadata), and the variants below, each with what transformers would do differently.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from embedlens.compat.transformers.direct_tokenizer import DirectTokenizer, open_tokenizer
from embedlens.io.source import resolve
from embedlens.model import loading
from tests.models import FAMILIES

TEXTS = [
    "the king of France is",
    "<s> king </s> queen <pad>",  # special tokens inside the text
    "zebra unknown words",  # not in the vocabulary
    "  Paris ,  é ü 中 🤖\n\tthe",  # spaces, accents, other scripts, control characters
    "the<unk>king",
    "",
]


def transformers_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def assert_same(direct: DirectTokenizer, expected: Any) -> None:
    """The same ids, texts, entries, length, special tokens and chat rendering."""
    for text in TEXTS:
        assert direct(text)["input_ids"] == expected(text)["input_ids"], text
        plain = direct(text, add_special_tokens=False)["input_ids"]
        assert plain == expected(text, add_special_tokens=False)["input_ids"], text
    assert len(direct) == len(expected)
    for i in range(len(expected)):
        assert direct.decode([i]) == expected.decode([i]), i
        assert direct.convert_ids_to_tokens(i) == expected.convert_ids_to_tokens(i), i
    assert (direct.unk_token, direct.unk_token_id) == (expected.unk_token, expected.unk_token_id)
    assert direct.special_tokens_map == expected.special_tokens_map
    assert direct.get_vocab() == expected.get_vocab()
    if expected.chat_template:
        chat = [{"role": "user", "content": "the king"}]
        for extra in ({}, {"enable_thinking": False}):
            ours = direct.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **extra
            )
            theirs = expected.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **extra
            )
            assert ours == theirs


def opened(folder: Path) -> DirectTokenizer | None:
    return open_tokenizer(folder, json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_is_read_directly_with_transformers_ids(tiny, family):
    folder = tiny(family)
    direct = opened(folder)
    assert direct is not None
    assert_same(direct, transformers_tokenizer(folder))


def test_the_lens_loads_a_folder_s_tokenizer_directly_and_a_gguf_s_through_transformers(
    tiny, smollm2
):
    folder = loading.load_tokenizer(resolve(str(tiny("llama-tied"))))
    assert isinstance(folder, DirectTokenizer)
    gguf = loading.load_tokenizer(resolve(str(smollm2)))
    assert not isinstance(gguf, DirectTokenizer)  # rebuilt by transformers from the metadata


def test_bench_checkpoints_as_folders_are_read_directly(smol_folder, tmp_path):
    """SmolLM2 saved as a folder (byte-level BPE, a chat template), and the Qwen3-shaped bench
    checkpoint's word tokenizer with its 151,669 entries."""
    bench = bench_module()
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps(bench.tiny_qwen3_config()))
    bench.write_word_tokenizer(qwen, 151669)
    for folder in (smol_folder, qwen):
        direct = opened(folder)
        assert direct is not None, folder
        assert_same(direct, transformers_tokenizer(folder))


def bench_module() -> Any:
    """bench/run.py, imported under a name of its own."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "run.py"
    spec = importlib.util.spec_from_file_location("embedlens_bench_run", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smol_folder(smollm2, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer and config as transformers saves them (no weights: not read here)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2-folder")
    kwargs = {"gguf_file": smollm2.name}
    AutoTokenizer.from_pretrained(smollm2.parent, **kwargs).save_pretrained(folder)
    config = AutoConfig.from_pretrained(smollm2.parent, **kwargs).to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def variant(tiny: Any, tmp: Path, settings: dict[str, Any], config: dict[str, Any]) -> Path:
    """The tiny Llama's folder with tokenizer_config.json and config.json entries changed."""
    folder = tmp / "model"
    shutil.copytree(tiny("llama-tied"), folder)
    for name, changes in (("tokenizer_config.json", settings), ("config.json", config)):
        data = json.loads((folder / name).read_text())
        data.update(changes)
        (folder / name).write_text(json.dumps(data))
    return folder


def raw_ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)


def test_a_special_token_transformers_would_add_goes_through_transformers(tiny, tmp_path):
    """A special token that is no added token of tokenizer.json: transformers adds it, so its
    tokenizer is one longer and reads the token whole, where tokenizer.json splits it."""
    folder = variant(tiny, tmp_path, {"mask_token": "<mask>"}, {})
    assert opened(folder) is None
    theirs = transformers_tokenizer(folder)
    assert theirs("<mask>", add_special_tokens=False)["input_ids"] == [len(theirs) - 1]
    assert raw_ids(folder, "<mask>") != [len(theirs) - 1]


def test_an_added_token_tokenizer_json_lacks_goes_through_transformers(tiny, tmp_path):
    """tokenizer_config.json lists an added token tokenizer.json lacks: transformers adds it."""
    from tokenizers import Tokenizer

    token = {"content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}  # fmt: skip
    folder = variant(tiny, tmp_path, {"added_tokens_decoder": {"72": token}}, {})
    assert opened(folder) is None
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert len(transformers_tokenizer(folder)) == raw.get_vocab_size(with_added_tokens=True) + 1


@pytest.mark.parametrize(
    ("settings", "config", "why"),
    [
        ({"tokenizer_class": "GPT2Tokenizer"}, {}, "a model's own class rebuilds the tokenizer"),
        ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, {}, "repository code"),
        ({"split_special_tokens": True}, {}, "special tokens are split as text"),
        ({"clean_up_tokenization_spaces": True}, {}, "decoded text is cleaned up"),
        # qwen2: transformers overrules a hub config's class with Qwen2Tokenizer
        ({}, {"model_type": "qwen2"}, "transformers' own class for this model type"),
        ({"bos_token": {"content": "<s>"}}, {}, "a special token transformers reads otherwise"),
        (
            {"added_tokens_decoder": {"1": {"content": "<s>", "special": False}}},
            {},
            "an added token listed again with other settings",
        ),
    ],
)
def test_what_transformers_would_read_otherwise_goes_through_transformers(
    tiny, tmp_path, settings, config, why
):
    assert opened(variant(tiny, tmp_path, settings, config)) is None, why


def test_a_malformed_tokenizer_config_is_left_to_transformers(tiny, tmp_path):
    folder = variant(tiny, tmp_path, {}, {})
    (folder / "tokenizer_config.json").write_text("{not json")
    assert opened(folder) is None


def test_tokenizer_json_is_parsed_once_where_tokenizers_settles_embedlens_check(
    tiny, tmp_path, monkeypatch
):
    """A tokenizer.json the `tokenizers` library reads, with added tokens (so its 'added_tokens'
    list is there), is not parsed again by embedlens' own check; one without any added token
    still is, and is refused as before when the list is missing."""
    from embedlens.errors import CheckpointError
    from embedlens.model import tokenizer

    checked: list[Path] = []
    check = tokenizer.check_tokenizer_json

    def counted(path: Path) -> None:
        checked.append(path)
        check(path)

    monkeypatch.setattr(tokenizer, "check_tokenizer_json", counted)
    folder = variant(tiny, tmp_path, {}, {})
    assert isinstance(loading.load_tokenizer(resolve(str(folder))), DirectTokenizer)
    assert checked == []
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"] = []
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TokenizersBackend"})
    )
    assert isinstance(loading.load_tokenizer(resolve(str(folder))), DirectTokenizer)
    assert checked == [folder.resolve() / "tokenizer.json"]
    del data["added_tokens"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="has no 'added_tokens' list"):
        loading.load_tokenizer(resolve(str(folder)))
