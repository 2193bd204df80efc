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


def test_declared_ranges_accept_the_tested_versions_and_the_cpu_pins():
    """pyproject.toml declares ranges, not pins, so an image's own torch stays; the versions docs/lm_eval.md says
    were tested, and constraints-cpu.txt's pins (make setup), all lie inside them."""
    import re
    import tomllib

    from packaging.requirements import Requirement

    declared = {r.name: r.specifier for r in map(Requirement, tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])}
    assert str(declared["torch"]) and not str(declared["torch"]).startswith("==")  # a range
    doc = (REPO / "docs" / "lm_eval.md").read_text()
    section = doc.split("## Installing into an existing environment", 1)[1].split("\n## ", 1)[0]
    tested = re.findall(r"torch (\d+\.\d+\.\d+)", section)
    assert {"2.11.0", "2.13.0"} <= set(tested)
    for version in tested:
        assert declared["torch"].contains(version), (version, declared["torch"])
    pins = [Requirement(line) for line in (REPO / "constraints-cpu.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert {p.name for p in pins} >= {"torch", "transformers"}
    for pin in pins:
        (version,) = [spec.version for spec in pin.specifier]
        assert declared[pin.name].contains(version), (pin, declared[pin.name])
    assert "-c constraints-cpu.txt" in (REPO / "Makefile").read_text()
