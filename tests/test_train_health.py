"""Training's health: the loss-spike rule (`LossSpikeMonitor`) without training, quiet on a healthy curve
and a warning exactly at an injected spike; then the loop's side, a run whose loss is made a spike and then
NaN, and two torchrun ranks stopping together on a non-finite loss."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from blockgen.harness.training.train import LossSpikeMonitor, NonFiniteLoss, json_number, train
from blockgen.models.model import BlockGen

sys.path.insert(0, str(Path(__file__).parent))
from limits import HANG_S  # noqa: E402
from test_train import PY, ci_config  # noqa: E402  the tests' micro training config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("health")


def healthy_curve(steps: int = 800, seed: int = 0) -> list[float]:
    """The shape of the demo's AR run: from ln(V) ~ 6.7 down to ~1e-4 (a memorised training set), with
    multiplicative batch-to-batch noise and, late, the hard batches that lift a near-zero loss by up to
    0.3 nats per token (gsm-ar's step 580: 0.072 against a running average of 0.006)."""
    rng = random.Random(seed)
    curve = [6.7 * (1e-4 / 6.7) ** (k / steps) * math.exp(rng.gauss(0, 0.25)) for k in range(steps)]
    for k in range(steps // 2, steps, 97):
        curve[k] = rng.uniform(0.05, 0.3)
    return curve


def flagged(losses: list[float]) -> list[int]:
    """The 1-based steps the monitor flags."""
    monitor = LossSpikeMonitor()
    return [step for step, loss in enumerate(losses, 1) if monitor.update(loss)]


def test_a_healthy_curve_gives_no_warning():
    assert flagged(healthy_curve()) == []
    assert flagged([1e-4, 3e-4] * 100) == []  # a tiny loss tripling is under the absolute margin
    assert flagged([2.0] * 60 + [5.9]) == []  # half a nat more, but under 3x the average


def test_the_injected_spike_is_flagged_there_only():
    curve = healthy_curve()
    curve[299] = 2.0  # step 300, where the running average is about 0.3
    assert flagged(curve) == [300]
    monitor = LossSpikeMonitor()
    for loss in curve[:299]:
        monitor.update(loss)
    avg = monitor.average
    assert 0.05 < avg < 0.5 and monitor.update(curve[299])  # what the record's loss_avg holds
    # At a high loss the ratio decides: 3x an average of 2 and more.
    assert flagged([2.0] * 60 + [6.5]) == [61]


def test_the_first_steps_never_warn():
    """An erratic start (a warm-started run's first steps jump by 2x) is not a spike: the first 10 steps
    never count, and the average they leave keeps later steps quiet."""
    start = [6.6, 5.7, 6.9, 2.3, 5.6, 12.2, 5.3, 4.9, 6.8, 4.2]  # gsm-uniform-mix's first ten steps
    assert flagged(start + [4.4, 3.8, 3.1]) == []
    assert flagged([0.1] * 5 + [9.0]) == []  # 90x, but at step 6


def test_non_finite_values_are_written_as_strings():
    assert [json_number(x) for x in (1.5, math.nan, math.inf, -math.inf)] == [1.5, "nan", "inf", "-inf"]
    assert json.loads(json.dumps({"loss": json_number(math.nan)})) == {"loss": "nan"}  # valid JSON, read back by float()


def test_a_spike_is_flagged_and_a_non_finite_loss_stops_before_its_update(workdir, monkeypatch, capsys):
    """The training loss of step 12 made 20x (a spike: flagged in its record and said), that of step 14 NaN:
    the run stops at 14 before the optimizer applies it, with the record logged and the checkpoint of
    step 10 clean; rerunning resumes from that checkpoint and drops the records after it."""
    config = ci_config(workdir, "nan", max_steps=20, batch_size=16, micro_batch=16, save_every=5, eval_every=1000)
    forward, calls, updates = BlockGen.forward, [], []

    def poisoned(self, *args, **kwargs):  # one training forward per step (micro_batch = batch_size)
        total, count = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            calls.append(len(calls) + 1)
            total = total * {12: 20.0, 14: math.nan}.get(calls[-1], 1.0)
        return total, count

    monkeypatch.setattr(BlockGen, "forward", poisoned)
    hook = register_optimizer_step_pre_hook(lambda *_: updates.append(1))
    try:
        with pytest.raises(NonFiniteLoss, match=r"^step 14: loss is nan \(grad norm nan\); .* \(step 10\)") as stopped:
            train(config, progress=False)
    finally:
        hook.remove()
    assert (stopped.value.step, len(calls), len(updates)) == (14, 14, 13)  # step 14's update never ran
    said = capsys.readouterr().err
    assert f"blockgen train: {stopped.value}" in said
    spike = [line for line in said.splitlines() if "(loss spike" in line]
    assert len(spike) == 1 and spike[0].startswith("step 12: loss "), said[-2000:]
    log = workdir / "nan" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 15))
    assert (records[-1]["loss"], records[-1]["grad_norm"]) == ("nan", "nan")
    assert [r["step"] for r in records if r.get("loss_spike")] == [12]
    assert records[11]["loss"] > 3 * records[11]["loss_avg"] > 0
    ckpt = workdir / "nan" / "checkpoint"
    assert json.loads((ckpt / "config.json").read_text())["training"]["step"] == 10
    state = torch.load(ckpt / "training_state.pt", weights_only=False)
    for weights in (load_file(str(ckpt / "model.safetensors")), state["model"]):
        assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    monkeypatch.undo()
    train(replace(config, max_steps=14), progress=False)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 15))
    assert all(math.isfinite(r["loss"]) and "loss_spike" not in r for r in records)


def test_torchrun_stops_every_rank_on_a_non_finite_loss(workdir):
    """A learning rate of 1e30 overflows at step 2: both ranks stop there (none left waiting in a
    collective: the run ends, far inside HANG_S), rank 0 says why once, no rank prints a traceback or
    crashes, and the step's record holds the non-finite value as a string."""
    out, logs = workdir / "ddp-nan", workdir / "ddp-nan-logs"
    cmd = [
        PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"--log-dir={logs}", "--tee=2",
        "-m", "blockgen.harness.cli",
        "train", "--preset", "ci", "--out-dir", str(out), "--max-steps", "6", "--lr", "1e30", "--warmup-steps", "1",
        "--save-every", "1", "--data.cache-dir", str(workdir / "data-cache"), "--device", "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=workdir)
    assert result.returncode != 0
    # each rank's own stderr (torchrun's --tee copy): rank 0 says why once; neither prints a traceback or a C++
    # abort ("terminate called ...") while leaving its process group
    rank_err = {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stderr.log")}
    assert sorted(rank_err) == [0, 1], sorted(logs.rglob("*"))
    said = "\n".join(f"--- rank {r}:\n{text[-1500:]}" for r, text in sorted(rank_err.items()))
    assert rank_err[0].count("blockgen train: step 2: loss is ") == 1 and "loss is" not in rank_err[1], said
    assert not any(bad in text for text in rank_err.values() for bad in ("Traceback", "terminate called")), said
    # torchrun's report: a rank exits 1; the other exits 1 too, or torchrun stopped it (SIGTERM) once the first had left
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)]
    assert 1 in codes and set(codes) <= {1, -signal.SIGTERM}, (codes, said)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and {records[1]["loss"], records[1]["grad_norm"]} & {"inf", "nan"}
    assert json.loads((out / "checkpoint" / "config.json").read_text())["training"]["step"] == 1
