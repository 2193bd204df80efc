"""What a long run shows: progress lines instead of tqdm's redraws when stderr is a file, prepare-data's
rows and rows/s, and TensorBoard event files that hold what metrics.jsonl holds (also after a resume)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torch.utils.tensorboard import SummaryWriter

from blockgen.harness.runtime.progress import Progress
from limits import HANG_S


def test_progress_in_a_log_file_prints_whole_lines_at_its_interval():
    stream = io.StringIO()  # not a terminal: no bar
    bar = Progress("run", total=5, unit="steps", every_steps=2, every_s=None, stream=stream)
    for _ in range(5):
        bar.set_postfix(loss="1.234")
        bar.update(1)
    bar.write("step 5: validation")
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(",")[0] for line in lines[:3]] == ["run: 2/5 (40%) steps", "run: 4/5 (80%) steps", "run: 5/5 (100%) steps"]
    assert all("steps/s" in line and "loss 1.234" in line for line in lines[:3])
    assert "eta" in lines[0] and lines[3] == "step 5: validation"


def test_progress_of_another_rank_prints_nothing():
    stream = io.StringIO()
    bar = Progress("run", total=3, every_steps=1, stream=stream, enabled=False)
    bar.update(3)
    bar.write("hidden")
    bar.close()
    assert stream.getvalue() == ""


def scalars(board: Path, tag: str) -> dict[int, float]:
    """step -> value of the events TensorBoard shows (every step once)."""
    events = EventAccumulator(str(board))
    events.Reload()
    steps = [e.step for e in events.Scalars(tag)]
    assert len(steps) == len(set(steps)), steps
    return {e.step: e.value for e in events.Scalars(tag)}


def train(out: Path, cache: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "blockgen.harness.cli", "train", "--preset", "ci", "--out-dir", str(out), "--max-steps", str(steps),
           "--eval-every", "4", "--save-every", "4", "--log-every", "2", "--device", "cpu", "--data.cache-dir", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_training_to_a_log_file_writes_lines_and_tensorboard_events(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    first = train(out, cache, 4)
    for stream in (first.stdout, first.stderr):
        assert "\r" not in stream  # no redraws in a log file
    assert "run: 2/4 (50%) steps" in first.stderr and "run: 4/4 (100%) steps" in first.stderr
    prepared = [line for line in first.stderr.splitlines() if line.startswith("prepare-data wordproblems:")]
    assert prepared and "rows/s" in prepared[-1] and "(100%)" in prepared[-1]
    # a killed run's events after its last checkpoint (step 4): the resumed run logs steps 5, 6 again
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + json.dumps({"step": 5, "loss": 99.0}) + "\n")
    with SummaryWriter(str(out / "tensorboard")) as killed:
        killed.add_scalar("train/loss", 99.0, 5)
    train(out, cache, 6)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    losses = scalars(out / "tensorboard", "train/loss")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert losses[r["step"]] == pytest.approx(r["loss"], rel=1e-6)  # stored as float32
    val = scalars(out / "tensorboard", "val/nll_lse")
    assert sorted(val) == [4, 6] and val[4] == pytest.approx(records[3]["val_nll_lse"], rel=1e-6)
