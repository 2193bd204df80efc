"""CI regression of gsm8k_code by per-problem outcomes (harness/reports/outcomes.py), end to end on a tiny checkpoint.

A `ci`-preset model (trained here in seconds) is stored as the outcomes store's checkpoint; `blockgen
regression update --to STORE` writes its outcomes through the real sweep and lm-eval, and `blockgen regression
check --against STORE` (the real CLI) reruns them. Edited stored outcomes and another checkpoint stand for a regression."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blockgen.harness.reports import outcomes as oc
from limits import HANG_S
from shared_fixtures import train_ci_preset

BLOCKGEN = [sys.executable, "-m", "blockgen.harness.cli"]
LIMIT = 6
ENV_KEYS = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def cli(*args) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([*BLOCKGEN, *map(str, args)], capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, **ENV_KEYS})


@pytest.fixture(scope="module")
def store(tmp_path_factory, ci_checkpoint) -> dict:
    """A store with a tiny checkpoint (the `ci` preset's, shared) and its outcomes, and a rerun's results root
    kept for the tests."""
    work = tmp_path_factory.mktemp("outcomes")
    checkpoint = ci_checkpoint
    store = work / "store"
    done = cli("regression", "update", "--to", store, "--limit", LIMIT, "--checkpoint", checkpoint, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    rerun = cli("regression", "check", "--against", store, "--out-dir", work / "rerun", "--no-progress")
    return {"work": work, "store": store, "checkpoint": checkpoint, "rerun": rerun, "results": work / "rerun"}


def stored_doc(store: Path) -> dict:
    return json.loads((store / oc.OUTCOMES).read_text())


def test_update_stores_every_setting_with_lm_evals_numbers(store):
    doc = stored_doc(store["store"])
    assert [s["label"] for s in doc["settings"]] == ["ancestral-4-1-0-T0.1", "eipc-4-2-0-T0.1", "arpc-3-2-1-T0.1",
                                                     "ar_greedy-1-1-0-T0.1"]
    assert doc["limit"] == LIMIT and len(doc["problems"]) == LIMIT
    from blockgen.harness.checkpoints.checkpoint import checkpoint_hash

    ckpt = oc.checkpoint_dir(store["store"])
    assert doc["provenance"]["checkpoint_sha"] == checkpoint_hash(ckpt)
    assert not (ckpt / "training_state.pt").exists() and (store["checkpoint"] / "training_state.pt").exists()
    # each stored accuracy is lm-eval's own exact_match of the rerun (identical runs), and per problem
    # the stored verdict is the sample's outcome
    for s in doc["settings"]:
        (results,) = (store["results"] / "gsm-masked-mix" / s["label"]).rglob("results_*.json")
        assert json.loads(results.read_text())["results"]["gsm8k_code_embedded"]["exact_match,sandbox"] == s["accuracy"]
        assert s["accuracy"] == sum(o[0] for o in s["outcomes"].values()) / LIMIT
        assert all(o[1] == "correct" if o[0] else o[1] != "correct" for o in s["outcomes"].values())


def test_rerun_is_identical_and_passes(store):
    r = store["rerun"]
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert ": passed" in r.stdout and "4 same (of 4 settings)" in r.stdout


def edited_store(store: dict, name: str, edit) -> Path:
    """A copy of the store whose stored outcomes `edit` changed (the checkpoint is shared by a symlink)."""
    copy = store["work"] / name
    copy.mkdir()
    (copy / "gsm-masked-mix").symlink_to(store["store"] / "gsm-masked-mix")
    doc = stored_doc(store["store"])
    edit(doc)
    (copy / oc.OUTCOMES).write_text(json.dumps(doc))
    return copy


def test_worse_setting_fails_with_its_changed_problems_listed(store):
    # the stored ARPC answers were all right: the rerun (the same model, 0 of 6 right) lost all 6
    def all_right(doc):
        s = next(s for s in doc["settings"] if s["label"] == "arpc-3-2-1-T0.1")
        s["outcomes"] = {i: [1, "correct", o[2]] for i, o in s["outcomes"].items()}

    rerun = {label: s for label, s in oc.collect(store["store"], store["results"], LIMIT).items()}
    assert sum(o.exact_match for o in rerun["arpc-3-2-1-T0.1"].problems.values()) == 0  # the micro model answers none
    r = cli("regression", "check", "--against", edited_store(store, "worse", all_right), "--results", store["results"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert ": FAILED" in r.stdout
    row = next(line for line in r.stdout.splitlines() if "arpc-3-2-1-T0.1" in line and line.startswith("WORSE"))
    # exact McNemar by hand: 0 of 6 discordant problems for the rerun, two-sided 2 / 2^6
    assert "6 (+0 -6)" in row and row.split()[-1] == f"{2 / 2 ** 6:.2g}"
    for i, o in rerun["arpc-3-2-1-T0.1"].problems.items():
        assert f"  {i}: correct -> {o.verdict}" in r.stdout
    assert "3 same, 1 WORSE (of 4 settings)" in r.stdout


def test_a_few_changed_problems_are_listed_but_pass(store):
    def one_right(doc):
        s = next(s for s in doc["settings"] if s["label"] == "eipc-4-2-0-T0.1")
        s["outcomes"]["2"] = [1, "correct", s["outcomes"]["2"][2]]

    r = cli("regression", "check", "--against", edited_store(store, "one", one_right), "--results", store["results"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "  2: correct -> " in r.stdout and "1 changed" in r.stdout


def test_missing_setting_fails(store):
    results = store["work"] / "missing"
    shutil.copytree(store["results"], results)
    shutil.rmtree(results / "gsm-masked-mix" / "ar_greedy-1-1-0-T0.1")
    r = cli("regression", "check", "--against", store["store"], "--results", results)
    assert r.returncode == 1 and "MISSING" in r.stdout


def test_another_model_changes_responses_and_is_named(store):
    """Another checkpoint (a perturbed model) against the stored outcomes: its changed responses are counted."""
    other = store["work"] / "other"
    oc.store_checkpoint(train_ci_preset(store["work"] / "seed1", seed=1, steps=20), oc.checkpoint_dir(other))
    r = cli("regression", "check", "--against", store["store"], "--runs", other, "--no-progress")
    assert "is not the one the outcomes were stored for" in r.stdout
    table = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["same"], ["changed"], ["WORSE"])]
    assert len(table) == 4 and sum(int(cells[-2]) for cells in table) > 0, r.stdout  # responses changed
    for cells in table:  # a setting is "same" exactly when neither an outcome nor a response changed
        assert (cells[0] == "same") == (cells[6] == "0" and cells[-2] == "0"), r.stdout
    assert r.returncode == 0  # the micro models answer nothing right either way: not worse


def test_store_checkpoint_casts_weights_and_drops_training_state(store, tmp_path):
    import torch
    from safetensors.torch import load_file

    from blockgen.harness.checkpoints.checkpoint import load_checkpoint

    oc.store_checkpoint(store["checkpoint"], tmp_path / "half", "float16")
    assert sorted(p.name for p in (tmp_path / "half").iterdir()) == sorted(
        p.name for p in store["checkpoint"].iterdir() if p.name != "training_state.pt")
    half, full = load_file(str(tmp_path / "half" / "model.safetensors")), load_file(str(store["checkpoint"] / "model.safetensors"))
    assert {v.dtype for v in half.values() if v.is_floating_point()} == {torch.float16}
    model, _ = load_checkpoint(tmp_path / "half")
    for name, p in model.state_dict().items():
        assert p.dtype == torch.float32 and torch.equal(p, full[name].to(torch.float16).to(torch.float32))
    with pytest.raises(oc.OutcomesError, match="choose one of"):
        oc.store_checkpoint(store["checkpoint"], tmp_path / "x", "int8")
