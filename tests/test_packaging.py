"""The distribution: one `blockgen` namespace, the start-up hook, the task YAMLs; nothing generic."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]


def test_wheel_holds_one_namespace_and_the_hook(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=HANG_S,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("blockgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"blockgen", "blockgen-lm-eval-hook.pth", next(t for t in top if t.endswith(".dist-info"))}
    for module in ("blockgen/models/backbone.py", "blockgen/harness/training/train.py", "blockgen/tasks/sandbox/runner.py",
                   "blockgen/tasks/sandbox/child.py",
                   "blockgen/tasks/blockgen_toy_cloze.yaml", "blockgen/lm_eval/__main__.py",
                   "blockgen/harness/reports/templates/leaderboard.html",  # the page's template (package data)
                   "blockgen/harness/costs/measured_rates/nvidia-h100-80gb-hbm3.json"):  # the stored rates the dry run prices with
        assert module in names


def test_editable_install_maps_the_folders():
    import blockgen.harness
    import blockgen.models
    import blockgen.tasks

    assert Path(blockgen.models.__file__).parent == REPO / "models"
    assert Path(blockgen.harness.__file__).parent == REPO / "harness"
    assert Path(blockgen.tasks.__file__).parent == REPO / "tasks"
    site = [p for p in sys.path if p.endswith("site-packages")]
    for generic in ("models", "tasks", "harness"):
        assert not any((Path(p) / generic).exists() or (Path(p) / f"{generic}.py").exists() for p in site)
