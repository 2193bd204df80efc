"""One word per meaning: the data source "wordproblems" and the tokenizer "local" were both spelled
"embedded" (a word now kept for the offline tasks and grids). Stored configs keep the old spelling
and still work: a run's training state resumes, a prepared cache keeps its key (pinned below with the
keys the code before the rename computed), and the command line names the valid choices.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from blockgen.harness.data import wordproblems
from blockgen.harness.checkpoints.checkpoint import TRAINING_STATE
from blockgen.harness.cli import build_parser, config_from_args, main
from blockgen.harness.data.sources import RENAMED, SOURCES, DataConfig, current_names
from blockgen.harness.data.prepare import META, prepared_dir
from blockgen.harness.training.presets import preset
from blockgen.harness.training.train import train


def test_one_alias_table_maps_the_old_spelling():
    assert RENAMED == {"source": {"embedded": "wordproblems"}, "tokenizer": {"embedded": "local"}}
    stored = {"source": "embedded", "tokenizer": "embedded", "n_train": 5000, "path": None}
    assert current_names(stored) == {"source": "wordproblems", "tokenizer": "local", "n_train": 5000, "path": None}
    assert current_names({"source": "embedded", "dropped_too_long": 0}) == {"source": "wordproblems", "dropped_too_long": 0}
    today = {"source": "text", "tokenizer": "gpt2"}
    assert current_names(today) == today
    assert DataConfig() == DataConfig(source="wordproblems", tokenizer="local")


def test_the_old_spelling_is_refused_where_configs_are_made():
    with pytest.raises(ValueError, match=r"source='embedded' is now spelled 'wordproblems'; choose one of \['wordproblems'"):
        DataConfig(source="embedded")
    with pytest.raises(ValueError, match="tokenizer='embedded' is now spelled 'local'; choose 'local', a local directory or a hub name"):
        DataConfig(tokenizer="embedded")
    with pytest.raises(ValueError, match=r"unknown data source 'wikipedia'; choose one of \['wordproblems', 'tinygsm', 'owt', 'text', 'language'\]"):
        DataConfig(source="wikipedia")


def test_the_command_line_takes_the_new_names_and_names_the_choices(capsys):
    args = build_parser().parse_args(["train", "--preset", "ci", "--data.source", "text", "--data.tokenizer", "local"])
    assert config_from_args(args).data == replace(preset("ci").data, source="text", tokenizer="local")
    args = build_parser().parse_args(["prepare-data", "--preset", "owt-embedded-ar", "--data.source", "wordproblems"])
    assert config_from_args(args).data.source == "wordproblems"
    with pytest.raises(SystemExit):
        main(["train", "--preset", "ci", "--data.source", "embedded"])
    err = capsys.readouterr().err
    assert "invalid choice: 'embedded'" in err and all(repr(s) in err for s in SOURCES)


@pytest.fixture
def fixed_problems(monkeypatch):
    """A generator that returns the same three problems whatever its version (the keys below hash them)."""
    monkeypatch.setattr(wordproblems, "generate", lambda split, n, seed=0, level="easy": [
        SimpleNamespace(question=f"q{i} {split} {seed} {level}", code=f"c{i}") for i in range(min(n, 3))])


def test_cache_keys_are_the_ones_computed_before_the_rename(fixed_problems, tmp_path, monkeypatch):
    """The directories `prepared_dir` gave these configs when both names were "embedded" (computed with
    that code): caches prepared then are found, neither rebuilt nor mixed with others. The word problems'
    local tokenizer splits digits since 2026-11-29: its key changed then on purpose (was ...012ebf8fb7b0c9d5),
    so a cache of the plain BPE's tokens is never read with the new tokenizer."""
    assert str(prepared_dir(DataConfig(tokenizer="gpt2", cache_dir="c"), 128)) == "c/prepared-embedded-184426cee9688543"
    local = DataConfig(n_train=200, n_val=8, vocab_size=300, cache_dir="c")
    assert str(prepared_dir(local, 128)) == "c/prepared-embedded-5ed678183f0d9850"
    assert str(prepared_dir(DataConfig(source="tinygsm", path="x.jsonl", tokenizer="gpt2", cache_dir="c"), 128)) == \
        "c/prepared-tinygsm-79871da5861f18a4"
    monkeypatch.chdir(tmp_path)
    for i in range(30):
        (tmp_path / f"d{i:02d}.txt").write_text(f"document number {i}: some words")
    text = DataConfig(source="text", path="d*.txt", vocab_size=300, cache_dir="c")
    assert str(prepared_dir(text, 64)) == "c/prepared-text-b2713f6ea7ba164f"


def test_a_run_stored_with_the_old_names_resumes_on_its_cache(tmp_path):
    """A run whose training state and prepared cache spell the data "embedded" (as runs before the
    rename do) resumes without a config mismatch, on the same cache; its checkpoint says "wordproblems"."""
    data = DataConfig(n_train=200, n_val=8, vocab_size=512, cache_dir=str(tmp_path / "data"))
    config = replace(preset("ci"), data=data, out_dir=str(tmp_path / "run"), device="cpu", max_steps=1, eval_every=1,
                     save_every=1)
    ckpt = train(config, progress=False)
    state_path = ckpt / TRAINING_STATE
    state = torch.load(state_path, weights_only=False)
    assert state["config"]["data"]["source"] == "wordproblems"
    state["config"]["data"].update(source="embedded", tokenizer="embedded")  # as written before the rename
    torch.save(state, state_path)
    (cache,) = (tmp_path / "data").glob("prepared-*")
    assert cache == prepared_dir(data, config.seq_len) and cache.name.startswith("prepared-embedded-")
    meta = json.loads((cache / META).read_text())
    meta["info"]["source"] = meta["data"]["source"] = "embedded"
    meta["data"]["tokenizer"] = "embedded"
    (cache / META).write_text(json.dumps(meta))

    train(replace(config, max_steps=2), progress=False)
    assert torch.load(state_path, weights_only=False)["step"] == 2
    assert list((tmp_path / "data").glob("prepared-*")) == [cache]
    assert json.loads((ckpt / "config.json").read_text())["training"]["data"]["source"] == "wordproblems"
