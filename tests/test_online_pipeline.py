"""The full-scale path online (tests/online_pipeline.py): in CI, `make eval-released-owt` without OFFLINE=1 against the
hub stand-in, the cheapest path that downloads a dataset (OWT's parquet export), a tokenizer (gpt2), the scorer (gpt2-large)
and a release (jdeschena/blockgen); then the same run offline from the hub cache with the
stand-in stopped, and the two leaderboards equal. `make online-check` runs all four paths (docs/pipeline.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import online_pipeline  # noqa: E402

from blockgen.harness.reports.leaderboard import Leaderboard, read, write  # noqa: E402

needs_fixtures = pytest.mark.skipif(not (online_pipeline.FIXTURES / "released-gpt2").is_dir(),
                                    reason=f"release fixtures not found at {online_pipeline.FIXTURES}")


@needs_fixtures
def test_released_owt_online_then_offline_from_the_cache_gives_the_same_leaderboard(tmp_path):
    """About 45 s on 2 cores (two runs of a 5-setting sweep): the online path CI covers, with the paper's main release
    and the scorer in process (`make online-check` runs two releases per path and the vLLM server by the hub's name)."""
    summary = online_pipeline.run_check(["released-owt"], tmp_path, models="masked-mix", more=online_pipeline.IN_PROCESS_SCORER)
    result = summary["paths"]["released-owt"]
    assert result["rows"] == 16 and result["max_relative_difference"] == 0.0, result  # 5 settings x their metrics
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    # datasets fetched OWT online and read its cache offline
    assert "offline mode is enabled" not in (tmp_path / "online" / "released-owt.log").read_text()
    assert "offline mode is enabled" in (tmp_path / "offline" / "released-owt.log").read_text()
    board = read(tmp_path / "online" / "released-owt" / "leaderboard.json")
    assert {r.model for r in board.rows} == {"hf:jdeschena/blockgen/blockgen/multi_block_size/16/owt/0.05_0.95/absorb"}
    assert summary["weights_compared"] == 1  # the release's conversion, byte-identical online and offline
    cached = {p.name for p in (tmp_path / "hf" / "hub").iterdir()}  # what the online phase downloaded
    assert {"datasets--Skylion007--openwebtext", "models--gpt2", "models--gpt2-large", "models--jdeschena--blockgen"} <= cached
    assert {r.task for r in board.rows} == {"owt_ppl", "owt_genppl"}


def test_leaderboards_that_differ_are_told_apart(tmp_path):
    """compare_boards: a value beyond the tolerance, or a measurement on one side only, fails naming it."""
    source = Path(__file__).resolve().parents[1] / "leaderboards" / "ci_regression.json"
    rows = read(source).rows
    write(Leaderboard(rows), tmp_path / "a.json")
    assert online_pipeline.compare_boards(tmp_path / "a.json", tmp_path / "a.json")["max_relative_difference"] == 0.0
    moved = [replace(rows[0], value=rows[0].value * (1 + 1e-3)), *rows[1:]]
    write(Leaderboard(moved), tmp_path / "b.json")
    with pytest.raises(AssertionError, match=f"{rows[0].model} {rows[0].task} {rows[0].metric}"):
        online_pipeline.compare_boards(tmp_path / "a.json", tmp_path / "b.json")
    write(Leaderboard(rows[1:]), tmp_path / "c.json")
    with pytest.raises(AssertionError, match="different measurements"):
        online_pipeline.compare_boards(tmp_path / "a.json", tmp_path / "c.json")


def test_offline_hub_check_names_what_the_cache_lacks(tmp_path):
    """With HF_HUB_OFFLINE set, hub-check and `released check` read the hub cache: an empty one fails naming the first
    repository it lacks (the full-scale targets once refused every offline run, a filled cache or not)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    blockgen = [sys.executable, "-m", "blockgen.harness.cli"]
    check = subprocess.run([*blockgen, "hub-check", "--presets", "owt-ar", "--hint", "HINT"], env=env, capture_output=True, text=True)
    assert check.returncode == 1
    assert "HF_HUB_OFFLINE is set and the hub cache holds no dataset Skylion007/openwebtext at revision refs/convert/parquet" in check.stderr
    released = subprocess.run([*blockgen, "released", "check", "owt-ar", "--hint", "HINT"], env=env, capture_output=True, text=True)
    assert released.returncode == 1
    assert "neither the hub cache nor BLOCKGEN_RELEASE_DIR holds ['owt-ar']" in released.stderr
