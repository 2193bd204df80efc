"""`metrics.jsonl`: a training run's record of every step, one JSON object per line, written by rank 0.

One reader for every program that reads it (training's resume, `blockgen curves`, gpu-check's DDP stage). A run
stopped while writing a line (killed, out of disk) leaves that last line without its newline: it was never
complete, so readers drop it and a resumed run removes it before appending. Any other line that is not a JSON
object is an error naming the file and the line. Imports nothing heavy: `blockgen curves` runs without torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def _complete_lines(lines: list[str]) -> list[str]:
    """The lines (with their ends) that were written whole, blank ones left out."""
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]  # torn: the run stopped while writing it
    return [line for line in lines if line.strip()]


def _record(line: str, path: Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{path}, line {number}: not a JSON record ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
    return record


def read_records(path: str | Path) -> list[dict]:
    """The records of a `metrics.jsonl` (or of the training folder holding one), in the order written."""
    given = Path(path)
    path = given / METRICS_FILE if given.is_dir() else given
    if not path.is_file():
        raise FileNotFoundError(f"{given}: no {METRICS_FILE} (a `blockgen train` output folder has one)")
    lines = _complete_lines(path.read_text().splitlines(keepends=True))
    return [_record(line, path, i) for i, line in enumerate(lines, 1)]


def keep_records_up_to(path: Path, step: int) -> None:
    """Drop the records after `step` (logged by a run killed after its last checkpoint) and a torn last line."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for i, line in enumerate(_complete_lines(lines), 1) if _record(line, path, i)["step"] <= step]
    if kept != lines:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


class MetricsLog:
    """Rank 0's record of every step: `metrics.jsonl` and TensorBoard event files beside it in `tensorboard/`
    (the numeric fields as scalars, `train/...` and `val/...`). A resumed run first drops what a killed run
    logged after its last checkpoint: the lines (`keep_records_up_to`), and the events, hidden by TensorBoard's
    purge of the steps after it."""

    def __init__(self, out: Path, step: int, enabled: bool) -> None:
        self.path, self.board = out / METRICS_FILE, None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # imports torch and tensorboard: only where a run writes

        keep_records_up_to(self.path, step)
        self.board = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1 if step else None)

    def write(self, record: dict) -> None:
        if self.board is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.board.add_scalar(f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}", value, record["step"])

    def losses(self) -> list[float]:
        """The losses of the records kept (rank 0; none elsewhere): a resumed run's running average starts from them."""
        if self.board is None or not self.path.is_file():
            return []
        return [record["loss"] for record in read_records(self.path)]

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
