"""`blockgen train-cost`: what training will cost, from a measured training rate (rates file)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from blockgen.harness.training.presets import preset
from blockgen.harness.costs.rates import RATES_VERSION, Provenance, Rates, RateSource, TrainRate, read_rates, write_rates
from blockgen.harness.costs.train_cost import flops_per_token, report, run_cost
from limits import HANG_S

H100_MASKED = TrainRate(precision="bfloat16+tf32", prior="masked", block_sizes=(16,), micro_batch=32, seq_len=1024,
                        tokens_per_s=164_000.0, peak_memory_gb=51.0)


def rates_file(tmp_path, size="paper", training=(H100_MASKED,)):
    rates = Rates(RATES_VERSION, "NVIDIA H100 80GB HBM3", size, Provenance("test", "2026-11-27", "none", "test"), training=training)
    return write_rates(rates, tmp_path / "rates.json")


def test_a_run_costs_its_tokens_at_the_measured_rate_times_the_gpus(tmp_path):
    source = RateSource(read_rates(rates_file(tmp_path)), tmp_path / "rates.json")
    config = preset("owt-masked-mix")
    cost = run_cost("owt-masked-mix", config, 8, source)
    tokens = 1_000_000 * 512 * 1024
    assert (cost.steps, cost.tokens, cost.tokens_per_s) == (1_000_000, tokens, 164_000 * 8)
    assert cost.hours == pytest.approx(tokens / (164_000 * 8) / 3600)  # 4.6 days on 8 GPUs
    assert 4.6 < cost.hours / 24 < 4.7
    half_done = run_cost("owt-masked-mix", config, 8, source, done_steps=500_000)
    assert half_done.hours == pytest.approx(cost.hours / 2)
    uniform = run_cost("owt-uniform-mix", preset("owt-uniform-mix"), 8, source)
    assert uniform.hours == pytest.approx(cost.hours) and "uniform prior not measured" in uniform.how
    # the AR baseline and another length: derived from the measurement by the FLOPs per token of both
    for name, ratio_range in (("owt-ar", (1.9, 2.1)), ("tinygsm-masked-mix", (1.1, 1.2))):
        derived = run_cost(name, preset(name), 8, source)
        ratio = flops_per_token(replace(preset(name), seq_len=1024, architecture="blockgen")) / flops_per_token(preset(name))
        assert ratio_range[0] < ratio < ratio_range[1] and f"{ratio:.2f}x" in derived.how
        assert derived.tokens_per_s == pytest.approx(164_000 * 8 * ratio)
    nothing = RateSource(read_rates(rates_file(tmp_path, training=())), tmp_path / "rates.json")
    unpriced = run_cost("owt-masked-mix", config, 8, nothing)
    assert unpriced.hours is None and "make gpu-check" in unpriced.how


def test_report_totals_the_models_and_skips_the_steps_a_checkpoint_has_done(tmp_path):
    path = rates_file(tmp_path)
    runs = tmp_path / "runs"
    ckpt = runs / "owt-ar" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"training": {"step": 250_000}}))
    names = ["owt-ar", "owt-masked-mix", "owt-uniform-mix"]
    text = report({n: preset(n) for n in names}, 8, runs, str(path))
    source = RateSource(read_rates(path), path)
    ar = run_cost("owt-ar", preset("owt-ar"), 8, source, done_steps=250_000)
    total = ar.hours + 2 * run_cost("owt-masked-mix", preset("owt-masked-mix"), 8, source).hours
    assert text.splitlines()[0] == (f"training cost: 3 models, {total / 24:.1f} days on 8 GPUs one after another, "
                                    f"{total * 8:,.0f} GPU-hours")
    assert "owt-ar: 750,000 steps" in text and "rates: " in text
    cpu = report({n: replace(preset(n), device="cpu") for n in names}, 2, runs, str(path))
    assert "not priced" in cpu and "GPU-hours" not in cpu
    one = report({names[0]: replace(preset(names[0]), device="cpu")}, 2, runs, str(path))
    assert one.startswith("training cost: 1 model on cpu")  # not "1 models"
    # the embedded CPU presets on device auto are not priced at a GPU's rate either
    assert report({"ci": preset("ci")}, 1, runs, str(path)).startswith("training cost: 1 model on cpu: not priced")


def train_cost(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "blockgen.harness.cli", "train-cost", "--presets", "owt-masked-mix", "owt-uniform-mix", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)


def test_train_cost_command_line(tmp_path):
    runs = str(tmp_path / "runs")
    done = train_cost("--gpus", "32", "--rates", str(rates_file(tmp_path)), "--runs", runs, "--max-steps", "250000")
    assert done.returncode == 0, done.stderr
    hours = 2 * 250_000 * 512 * 1024 / (164_000 * 32) / 3600
    assert done.stdout.startswith(f"training cost: 2 models, {hours:.1f} h on 32 GPUs")
    micro = train_cost("--gpus", "8", "--rates", str(rates_file(tmp_path, size="micro")), "--runs", runs)
    assert micro.returncode == 2 and "blockgen train-cost: error:" in micro.stderr and "size" in micro.stderr
    zero = train_cost("--gpus", "0", "--runs", runs)
    assert zero.returncode == 2 and "at least 1" in zero.stderr
