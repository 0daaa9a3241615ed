"""MODEL resolution: local folders, GGUF files, and hub ids through an offline hub cache."""

from __future__ import annotations

import json
import os

from tests.models import hub_cache


def test_hub_id_resolves_from_the_cache_offline(cli, tiny, hf_home):
    snapshot = hub_cache(tiny("llama-untied"), hf_home, "tiny-org/llama-untied")
    data = cli.json("params", "tiny-org/llama-untied")
    assert data["model"] == "tiny-org/llama-untied"
    assert data["source"] == "header"
    assert data["total"] == cli.json("params", tiny("llama-untied"))["total"]
    assert (snapshot / "config.json").is_symlink()


def test_hub_revision(cli, tiny, hf_home):
    hub_cache(tiny("llama-tied"), hf_home, "tiny-org/m", sha="a" * 40)
    repo = hf_home / "hub" / "models--tiny-org--m"
    (repo / "refs" / "v1").write_text("a" * 40)
    assert cli.json("tied", "tiny-org/m", "--revision", "v1")["tied"] is True
    assert cli.json("params", "tiny-org/m", "--revision", "a" * 40)["tied"] is True
    err = cli.fails("params", "tiny-org/m", "--revision", "v2", code=1)
    assert "not in the local hub cache" in err


def test_meta_only_needs_only_the_config(cli, tiny, hf_home):
    snapshot = hub_cache(tiny("qwen3"), hf_home, "tiny-org/qwen3")
    for f in snapshot.iterdir():
        if f.name != "config.json":
            f.unlink()
    assert cli.json("params", "tiny-org/qwen3", "--meta-only")["source"] == "meta"
    # Without cached weights, the default falls back to the config, and says so.
    result = cli("params", "tiny-org/qwen3", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["source"] == "meta"
    assert "counted from the config on the meta device" in result.stderr


def test_uncached_repo_offline(cli, hf_home):
    err = cli.fails("params", "nobody/not-cached", code=1)
    assert "error: 'nobody/not-cached' is not in the local hub cache" in err
    assert "HF_HUB_OFFLINE" in err


def test_missing_path(cli, tmp_path):
    err = cli.fails("params", tmp_path / "nope", code=1)
    assert f"no such file or directory: '{tmp_path / 'nope'}'" in err
    cli.fails("tied", "./relative/missing", code=1)


def test_folder_without_config(cli, tmp_path):
    (tmp_path / "weights.txt").write_text("x")
    err = cli.fails("params", tmp_path, code=1)
    assert "has no config.json" in err and "weights.txt" in err


def test_gguf_in_a_folder(cli, smollm2, tmp_path):
    link = tmp_path / "m"
    link.mkdir()
    os.symlink(smollm2, link / smollm2.name)
    assert cli.json("params", link)["total"] == 134_515_008


def test_not_a_model_file(cli, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    err = cli.fails("params", f, code=1)
    assert "is a file but not a model" in err


def test_bad_repo_id(cli):
    err = cli.fails("params", "a b c", code=1)
    assert "neither an existing path nor a hub repo id" in err
