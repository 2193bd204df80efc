"""The trained artefacts that more than one test module reads, as session fixtures built at most once per
`make test` whichever xdist worker asks first (tests/machine_share.py: `built_once`). tests/conftest.py
registers them. Tests read them and never change them; one that would takes a copy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lm_eval_checkpoints import build_lm_eval_checkpoints
from machine_share import built_once


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """The lm-eval tests' tiny checkpoints on `blockgen_toy` text: a (1, 8) mixture and an AR model."""
    return built_once(tmp_path_factory, "lm_eval_ckpts", build_lm_eval_checkpoints)


def train_ci_preset(folder: Path, seed: int = 0, steps: int | None = None) -> Path:
    """The `ci` preset (a micro (1, 4) mixture, 40 steps on generated word problems) trained into `folder/ci`."""
    from blockgen.harness.training.presets import preset
    from blockgen.harness.training.train import train

    config = preset("ci")
    config = replace(config, out_dir=str(folder / "ci"), seed=seed, max_steps=steps or config.max_steps,
                     data=replace(config.data, cache_dir=str(folder / "data")))
    return Path(train(config, progress=False))


@pytest.fixture(scope="session")
def ci_checkpoint(tmp_path_factory) -> Path:
    """The `ci` preset's checkpoint at seed 0 (tests/test_gsm8k_code.py, tests/test_outcomes.py, tests/test_leaderboard.py)."""
    return built_once(tmp_path_factory, "ci_checkpoint", train_ci_preset)
