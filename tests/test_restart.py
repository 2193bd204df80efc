"""Restarts: `kill -9` of a 2-process torchrun training run, then the same command again.

The rerun resumes from the last checkpoint and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockgen.harness.checkpoint import TRAINING_STATE, finish_interrupted_save
from blockgen.harness.train import keep_records_up_to
from limits import HANG_S

PY = sys.executable
MAX_STEPS = 30


def train_command(out: Path, cache: Path) -> list[str]:
    return [
        PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "blockgen.harness.cli",
        "train", "--preset", "ci", "--out-dir", str(out), "--max-steps", str(MAX_STEPS), "--save-every", "5",
        "--eval-every", str(MAX_STEPS), "--device", "cpu", "--data.cache-dir", str(cache),
    ]


def run(cmd: list[str], cwd: Path) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def saved_step(out: Path) -> int:
    config = out / "checkpoint" / "config.json"
    return json.loads(config.read_text())["training"]["step"] if config.is_file() else 0


def test_kill_dash_nine_then_rerun_matches_uninterrupted_run(tmp_path):
    cache = tmp_path / "data-cache"
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(train_command(straight, cache), tmp_path)  # also trains and caches the tokenizer

    cmd = train_command(killed, cache)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + HANG_S
    try:  # kill the launcher and both workers at once, as a lost machine would, past a checkpoint
        while len(logged_steps(killed)) < 8 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed_from = saved_step(killed)
    assert 5 <= resumed_from < MAX_STEPS, f"killed at checkpoint step {resumed_from}: the kill missed the run"
    assert max(logged_steps(killed)) > resumed_from or resumed_from % 5 == 0

    run(cmd, tmp_path)  # the same command again
    assert logged_steps(killed) == list(range(1, MAX_STEPS + 1))  # each step logged once
    a = torch.load(straight / "checkpoint" / TRAINING_STATE, weights_only=False)
    b = torch.load(killed / "checkpoint" / TRAINING_STATE, weights_only=False)
    assert a["step"] == b["step"] == MAX_STEPS
    for part in ("model", "ema"):
        for key in a[part]:
            torch.testing.assert_close(a[part][key], b[part][key], rtol=0, atol=1e-6, msg=f"{part}.{key}")
    ema_a = load_file(str(straight / "checkpoint" / "model.safetensors"))
    ema_b = load_file(str(killed / "checkpoint" / "model.safetensors"))
    for key in ema_a:
        torch.testing.assert_close(ema_a[key], ema_b[key], rtol=0, atol=1e-6)


def test_a_save_killed_between_its_renames_is_completed(tmp_path):
    ckpt = tmp_path / "checkpoint"
    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "checkpoint.tmp").mkdir()
    (tmp_path / "checkpoint.tmp" / "config.json").write_text("{}")
    finish_interrupted_save(ckpt)
    assert (ckpt / "config.json").is_file() and not (tmp_path / "checkpoint.tmp").exists()


@pytest.mark.parametrize("has_old", [False, True])
def test_a_partial_tmp_is_never_promoted_over_a_checkpoint(tmp_path, has_old):
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("complete")
    (tmp_path / "checkpoint.tmp").mkdir()
    if has_old:
        (tmp_path / "checkpoint.old").mkdir()
    finish_interrupted_save(ckpt)
    assert (ckpt / "config.json").read_text() == "complete"
    (tmp_path / "lonely").mkdir()
    (tmp_path / "lonely.tmp").mkdir()  # no .old: the save died while writing .tmp
    finish_interrupted_save(tmp_path / "lonely-missing")
    assert not (tmp_path / "lonely-missing").exists()


def test_metrics_after_the_last_checkpoint_are_dropped(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    keep_records_up_to(log, 5)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5]


# ------------------------------------------------------------------------------ what the runs log and train


def test_flops_formula_matches_torch_flop_counter():
    """training_flops_per_step against torch's FlopCounterMode on a real forward + backward (micro model)."""
    from torch.utils.flop_counter import FlopCounterMode

    from blockgen.harness.train import training_flops_per_step
    from blockgen.models.backbone import SIZES
    from blockgen.models.model import BlockGen, BlockGenConfig

    config = BlockGenConfig(vocab_size=300, seq_len=64, block_sizes=(1, 16), block_weights=(0.5, 0.5), shape=SIZES["micro"])
    model = BlockGen(config)
    x = torch.randint(0, 300, (4, 64))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the math backend runs attention as matmuls the counter sees (it does not count fused CPU kernels)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        total, count = model(x, torch.ones(4, 64), 16, torch.full((4,), 0.5))
        (total / count).backward()
    counted = counter.get_total_flops()
    formula = training_flops_per_step(config, batch_size=4)
    # the formula leaves out adaLN and the time embedding (once per sequence)
    assert 0.99 < formula / counted <= 1.0, (formula, counted)  # measured: 0.998


def test_presets_are_the_papers_baselines():
    from blockgen.harness.presets import BENCHMARKS, PRESETS

    for scale in ("", "-embedded"):
        owt, gsm = PRESETS[f"owt{scale}-masked-mix-flat"], PRESETS[f"tinygsm{scale}-uniform-mix"]
        assert (owt.block_sizes, owt.block_weights) == ((1, 2, 4, 8, 16), (0.2,) * 5)
        assert (gsm.prior, gsm.block_sizes, gsm.block_weights) == ("uniform", (1, 16), (0.05, 0.95))
        assert PRESETS[f"owt{scale}-ar"].block_sizes == (1,)
        assert PRESETS[f"owt{scale}-mdlm"].block_sizes == (PRESETS[f"owt{scale}-mdlm"].seq_len,)
        assert PRESETS[f"tinygsm{scale}-duo"].prior == "uniform"
        assert {PRESETS[f"owt{scale}-{p}-{b}"].block_sizes for p in ("masked", "uniform") for b in (4, 8, 16)} == {(4,), (8,), (16,)}
    owt = PRESETS["owt-masked-mix"]
    assert (owt.seq_len, owt.batch_size, owt.max_steps, owt.lr, owt.size, owt.data.source) == (1024, 512, 1_000_000, 3e-4, "paper", "owt")
    assert PRESETS["tinygsm-ar"].max_steps == 250_000 and PRESETS["owt-embedded-ar"].data.source == "text"
    assert all(PRESETS[f"{b}-{v}"].out_dir == f"runs/{b}-{v}" for b, (_, variants) in BENCHMARKS.items() for v in variants)
