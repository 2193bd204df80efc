"""`blockgen gpu-check` / `make gpu-check`: its CPU mode end to end (what CI runs), and its GPU plan."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from blockgen.harness import gpu_check
from blockgen.harness.gpu_check import CPU_SCALE, GPU_SCALE, GpuCheckConfig, run_gpu_check
from blockgen.harness.train import TrainConfig, memory_estimate
from blockgen.models.model import BlockGen
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]


# The CLI test runs every stage but the vLLM scorer's (its engine alone takes about 70 s to start on a
# CPU): tests/test_scorers.py runs the same vLLM-against-transformers comparison on a real server.
CLI_STAGES = ("train", "generate", "lm_eval")


def test_cpu_mode_through_the_real_command_line(tmp_path):
    """The stages at micro size through `blockgen gpu-check --device cpu` (about 40 s alone)."""
    out = tmp_path / "gpu-check"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "blockgen"), "gpu-check", "--device", "cpu", "--out-dir", str(out),
                           "--stages", *CLI_STAGES], cwd=REPO, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cpu" and summary["ok"] and tuple(summary["stages"]) == CLI_STAGES

    train = summary["stages"]["train"]["runs"]
    assert [(r["prior"], r["micro_batch"]) for r in train] == [(p, m) for p in ("masked", "uniform") for m in CPU_SCALE.micro_batches]
    for r in train:
        assert r["steps"] == CPU_SCALE.steps and r["s_per_step"] > 0 and r["estimate_gb"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["micro_batch"] * CPU_SCALE.seq_len / r["s_per_step"])
        assert r["mfu"] is None and r["peak_memory_gb"] is None  # no chip peak, no CUDA allocator on a CPU

    generated = summary["stages"]["generate"]["runs"]
    assert {(r["sampler"], r["batch"]) for r in generated} == {(s, b) for s in ("ar_greedy", "arpc", "ancestral") for b in (1, 64)}
    for r in generated:
        assert r["tokens"] == r["batch"] * CPU_SCALE.new_tokens and r["tokens_per_s"] > 0
    assert next(r for r in generated if r["sampler"] == "arpc")["paper_nfe_per_block"] == 8

    lm_eval = summary["stages"]["lm_eval"]
    assert 0.0 <= lm_eval["metrics"]["exact_match,sandbox"] <= 1.0 and Path(lm_eval["results"]).is_file()


def test_a_failing_stage_does_not_lose_the_others(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("generate broke")

    monkeypatch.setitem(gpu_check.STAGE_FUNCTIONS, "generate", broken)
    config = GpuCheckConfig(out_dir=str(tmp_path), device="cpu", stages=("generate", "train"), priors=("masked",),
                            micro_batches=(2, -1), steps=1)
    summary = run_gpu_check(config)
    assert summary["stages"]["generate"]["error"] == "RuntimeError: generate broke"
    ok, impossible = summary["stages"]["train"]["runs"]
    assert ok["steps"] == 1 and "error" not in ok
    assert "error" in impossible  # a run that fails (e.g. out of memory) is recorded; the others stand
    assert summary["ok"] is False
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))


def test_gpu_mode_plan():
    """What a GPU run does (not run here: no GPU): the paper's model, bf16 + compile, runs that fit 80 GB."""
    config = GpuCheckConfig(device="cuda")
    scale = config.scale()
    assert scale == GPU_SCALE and (scale.size, scale.seq_len, scale.bf16, scale.compile) == ("paper", 1024, True, True)
    assert min(scale.micro_batches) >= 8 and max(scale.micro_batches) == 32
    steps = len(config.priors) * len(scale.micro_batches) * (scale.steps + scale.warmup_steps)
    assert 40 <= steps <= 80  # "about 50 steps"
    for prior in config.priors:
        model_config = TrainConfig(prior=prior, size="paper", seq_len=1024).model_config(scale.vocab_size, {}, "cpu")
        with torch.device("meta"):
            n_params = sum(p.numel() for p in BlockGen(model_config).parameters())
        assert memory_estimate(model_config, n_params, max(scale.micro_batches), True, 1).total < 80e9
    dry = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "blockgen gpu-check --out-dir runs/gpu-check" in dry and "BLOCKGEN_VLLM_PYTHON=" in dry
    with pytest.raises(ValueError, match=r"unknown stages \['vllm'\]; choose from"):
        GpuCheckConfig(stages=("vllm",))
