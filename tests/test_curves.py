"""`blockgen curves`: training runs' loss and gradient norm side by side, as a PNG (harness/reports/curves.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from blockgen.harness.reports.curves import plot_curves
from blockgen.harness.training.metrics_log import read_records

sys.path.insert(0, str(Path(__file__).parent))
from limits import HANG_S  # noqa: E402


def _run(folder: Path, losses: list, spike_at: int | None = None, eval_every: int | None = None) -> Path:
    folder.mkdir(parents=True)
    lines = [{"step": i + 1, "loss": loss, "grad_norm": 1.0 / (i + 1), **({"loss_spike": True} if i + 1 == spike_at else {})}
             for i, loss in enumerate(losses)]
    for record in lines[eval_every - 1 :: eval_every] if eval_every else ():
        record["val_nll_lse"] = record["loss"] / 100  # far below the training loss: the axis must reach it
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_curves_of_two_runs_as_a_png_through_the_command(tmp_path):
    a = _run(tmp_path / "seed-0", [6.0 * 0.97 ** i for i in range(200)], spike_at=120)
    b = _run(tmp_path / "seed-2", [6.0 * 0.99 ** i for i in range(150)] + ["nan"])  # a stopped run's last record
    out = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, "-m", "blockgen.harness.cli", "curves", f"s0={a}", str(b), "--out", str(out)],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    from PIL import Image

    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > image.size[1] > 300
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # lines drawn, not an empty canvas
    assert len(read_records(b)) == 151


def test_a_folder_without_metrics_is_refused(tmp_path, capsys):
    """The reader's error, and the command's: one line naming the folder, exit status 2 (not a traceback)."""
    from blockgen.harness.cli import main

    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plot_curves({"x": tmp_path}, tmp_path / "c.png")
    assert main(["curves", str(tmp_path / "nope"), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockgen curves: error: ") and "nope: no metrics.jsonl" in err and err.count("\n") == 1


def test_a_line_torn_by_a_stopped_run_is_dropped_and_a_corrupt_one_is_named(tmp_path):
    """A run stopped while writing its last record leaves it without a newline: readers drop it, and a resumed
    run removes it before appending (else the next record would be glued to it). A bad line elsewhere is an error
    naming its line."""
    from blockgen.harness.training.metrics_log import keep_records_up_to

    log = _run(tmp_path / "run", [3.0, 2.0, 1.0]) / "metrics.jsonl"
    with open(log, "a") as f:
        f.write('{"step": 4, "lo')
    assert [r["step"] for r in read_records(log)] == [1, 2, 3]
    keep_records_up_to(log, 10)
    with open(log, "a") as f:  # what the resumed run appends
        f.write(json.dumps({"step": 4, "loss": 0.5}) + "\n")
    assert [r["step"] for r in read_records(log)] == [1, 2, 3, 4]
    log.write_text(log.read_text().replace('{"step": 2', 'x{"step": 2'))
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON record"):
        read_records(log)


def test_validation_nll_is_drawn_on_the_loss_axis(tmp_path):
    """A run that measured its held-out NLL (`--eval-every`) draws it beside the training loss; the same run
    without those records draws another picture."""
    from PIL import Image, ImageChops

    losses = [6.0 * 0.97 ** i for i in range(200)]
    with_val = plot_curves({"s0": _run(tmp_path / "a", losses, eval_every=20)}, tmp_path / "a.png")
    without = plot_curves({"s0": _run(tmp_path / "b", losses)}, tmp_path / "b.png")
    assert sum(1 for r in read_records(tmp_path / "a") if "val_nll_lse" in r) == 10
    with Image.open(with_val) as a, Image.open(without) as b:
        assert a.size == b.size and ImageChops.difference(a.convert("RGB"), b.convert("RGB")).getbbox() is not None
