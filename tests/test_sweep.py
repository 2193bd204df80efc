"""`blockgen sweep` (harness/evaluation/sweep.py): grids, deduplication, one model load and one scorer per sweep.

- Every named grid's dry run (the real CLI) lists no setting twice; greedy AR decoding runs once
  whatever the temperatures; the sampler families follow the block sizes.
- `BlockGenLM.with_settings` on one loaded model generates exactly what a model built with those
  arguments generates.
- A real sweep of 3 `owt_genppl_embedded` settings on a micro mixture, scored through vLLM (the
  `make vllm-env` environment): one model load, ONE vLLM server, one in-process scorer copy, one
  results file with its samples per setting; a rerun skips them all and starts nothing; another
  limit, scorer setting or checkpoint is not skipped.
- The vLLM server's flags on a CUDA build (float16, GPU share), the GPU of each torchrun rank (also
  under an inherited CUDA_VISIBLE_DEVICES), `check-vllm` refusing a CPU build for CUDA, and the
  in-process scorer shared inside a sweep only.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest

from blockgen.harness import cli
from blockgen.harness.evaluation import sweep
from blockgen.harness.evaluation.grids import GRIDS, Grid, ModelSource
from blockgen.harness.evaluation import evaluations as grid_evaluations
from blockgen.harness.evaluation.evaluations import Evaluation, evaluations, families
from blockgen.harness.evaluation.sweep import SweepConfig, run_sweep
from blockgen.models.sampler_config import SamplerConfig
from limits import HANG_S
from vllm_env import vllm_python

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_dry_run_lists_no_setting_twice(name):
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["sweep", name, "--dry-run"]) == 0
    lines = [line for line in out.getvalue().splitlines() if not line.startswith(("#", "total:"))]
    g = GRIDS[name]
    todo = evaluations(g)
    assert len(lines) == len(todo) > 0
    assert len(set(lines)) == len(lines)  # no line twice
    assert len({s.key(g.k_mc) for s in todo}) == len(todo)
    assert len({(s.run, s.task, s.label) for s in todo}) == len(todo)  # one results folder per setting
    assert f"total: {len(todo)} settings, {len(g.models)} model loads" in out.getvalue()


@pytest.mark.parametrize("scale, variable, grid", [
    ("OFFLINE=1", "MODELS_OWT", "owt-embedded"), ("OFFLINE=1", "MODELS_GSM", "gsm8k-embedded"), ("OFFLINE=0", "MODELS_OWT", "owt"),
    ("OFFLINE=0", "MODELS_GSM", "gsm8k"), ("OFFLINE=0", "MODELS_OWT_RELEASED", "released-owt"),
    ("OFFLINE=0", "MODELS_GSM_RELEASED", "released-gsm8k")])
def test_the_makefile_asks_the_grid_for_its_models(scale, variable, grid):
    """The Makefile lists no model: `blockgen sweep GRID --list-models` says them, from the grid itself."""
    listed = subprocess.run([str(BIN / "blockgen"), "sweep", grid, "--list-models"], capture_output=True, text=True, check=True)
    assert listed.stdout.split() == list(GRIDS[grid].models)
    make = subprocess.run(["make", "--no-print-directory", "-s", "-f", "Makefile", "-f", "-", scale, "show"], cwd=REPO, text=True,
                          input=f"show:\n\t@echo $({variable})\n", capture_output=True, check=True)
    assert make.stdout.split() == list(GRIDS[grid].models)


@pytest.mark.parametrize("target, grid", [("eval-owt", "owt"), ("eval-gsm8k", "gsm8k")])
def test_full_scale_eval_is_one_launch_for_every_model(target, grid):
    """`make -n eval-owt NGPU=8`: one torchrun of 8 ranks runs the whole grid (every model, every
    setting), not one process per setting."""
    lines = subprocess.run(["make", "-n", target, "NGPU=8"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    launches = [line for line in lines.splitlines() if "torchrun" in line or "lm_eval" in line or " sweep " in line]
    assert len(launches) == 1, launches
    (launch,) = launches
    assert "--nproc_per_node=8" in launch and f"sweep {grid} " in launch and "--device cuda" in launch
    assert set(GRIDS[grid].models) <= set(launch.split("--models", 1)[1].split("--device")[0].split())


@pytest.mark.parametrize("target, temps", [("eval-owt", "TEMPS_OWT"), ("eval-gsm8k", "TEMPS_GSM")])
def test_every_make_variable_of_a_sweep_reaches_its_option(target, temps):
    """TEMPS_*, LIMIT, K_MC, EVAL_BATCH and EVAL_ARGS each become the sweep's option (TEMPS_* were once dropped:
    the Makefile passed them where no parameter read them)."""
    variables = [f"{temps}=0.7 1.0", "LIMIT=3", "K_MC=2", "EVAL_BATCH=5", "EVAL_ARGS=--seed 7", "DRY_RUN=1"]
    lines = subprocess.run(["make", "-n", target, "NGPU=8", *variables], cwd=REPO, capture_output=True, text=True, check=True).stdout
    (launch,) = [line for line in lines.splitlines() if " sweep " in line]
    for option in ("--temperatures 0.7 1.0", "--limit 3", "--k-mc 2", "--batch-size 5", "--seed 7", "--dry-run"):
        assert option in " ".join(launch.split()), (option, launch)


def test_greedy_runs_once_whatever_the_temperature():
    g = GRIDS["owt"]
    ar = [s for s in evaluations(g) if s.run == "owt-ar" and s.sampler is not None]
    greedy = [s for s in ar if s.sampler.name == "ar_greedy"]
    sampled = [s for s in ar if s.sampler.name == "ar_sample"]
    assert len(greedy) == 1 and greedy[0].temperature == g.temperatures[0]
    assert sorted(s.temperature for s in sampled) == sorted(g.temperatures)
    # the per-process grid's count, less the 7 repeated greedy runs
    assert len(evaluations(g)) == len(g.models) + sum(
        len(grid_evaluations.samplers(g, grid_evaluations.model_block_sizes(g, m, ""))) * len(g.temperatures) for m in g.models) - 7


def test_sampler_families_follow_block_sizes():
    assert families((1,)) == ("ar",)
    assert families((1, 16)) == ("arpc",) and families((1, 2, 4, 8, 16)) == ("arpc",)
    assert families((16,)) == families((1024,)) == ("ancestral", "eipc")
    s = Evaluation("r", "ckpt", "t", SamplerConfig("arpc", 6, 3, 0))
    assert s.label == "arpc-6-3-0-T1.0"  # the per-process Makefile's results folder
    assert s.model_args(2) == {"pretrained": "ckpt", "k_mc": 2, "sampler": "arpc", "steps": 6, "ge": 3, "warmup": 0,
                               "temperature": 1.0}


# ------------------------------------------------------------------------------ real runs


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=ENV, timeout=HANG_S, cwd=REPO)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("sweep")
    r = run(BIN / "blockgen", "train", "--preset", "ci", "--out-dir", work / "runs" / "owt-embedded-mix",
            "--data.source", "text", "--data.vocab-size", "512", "--data.cache-dir", work / "data", "--data.n-val", "8",
            "--seq-len", "48", "--block-sizes", "1", "4", "--block-weights", "0.3", "0.7", "--max-steps", "10",
            "--eval-every", "1000", "--save-every", "1000", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run(BIN / "blockgen", "train-scorer", "--out-dir", work / "scorer", "--seq-len", "32", "--n-layers", "2",
            "--max-steps", "10", "--data.vocab-size", "384", "--data.cache-dir", work / "data", "--data.n-val", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    return work


def test_with_settings_generates_what_a_fresh_model_generates(work):
    import torch

    from blockgen.harness.evaluation.lm_eval_model.model import BlockGenLM

    ckpt = str(work / "runs" / "owt-embedded-mix" / "checkpoint")
    prompts = ["The", "In a module", ""]

    class Req:
        def __init__(self, i, text):
            self.args, self.task_name, self.doc_id, self.idx = (text, {"until": [], "max_gen_toks": 12}), "t", i, 0

    requests = [Req(i, p) for i, p in enumerate(prompts)]
    base = BlockGenLM(pretrained=ckpt, k_mc=2, seed=7, device="cpu", batch_size=2)
    for args in ({"sampler": "arpc", "steps": 3, "ge": 2, "warmup": 1, "temperature": 0.8},
                 {"sampler": "ancestral", "steps": 2, "temperature": 1.2}, {"sampler": "ar_greedy"}):
        switched = base.with_settings(pretrained=ckpt, k_mc=2, **args)
        fresh = BlockGenLM(pretrained=ckpt, k_mc=2, seed=7, device="cpu", batch_size=2, **args)
        assert switched.sampler == fresh.sampler and switched.fingerprint == fresh.fingerprint
        assert switched.generate_until(requests, disable_tqdm=True) == fresh.generate_until(requests, disable_tqdm=True)
        assert switched.model is base.model  # the weights are shared, not reloaded
    assert base.sampler.name == "ancestral"  # the loaded instance keeps its own settings
    with pytest.raises(ValueError, match="pick the loaded weights"):
        base.with_settings(pretrained="elsewhere")


def test_sweep_of_genppl_settings_starts_one_vllm_server_and_skips_on_rerun(work, monkeypatch):
    """Three Gen PPL settings in one sweep share one vLLM server; a rerun skips them. Over 30 s (about 30 s):
    a real vLLM engine starts on the CPU, the point of the test."""
    python = vllm_python()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    temperatures = (0.8, 1.0, 1.2)
    monkeypatch.setitem(GRIDS, "test-genppl", Grid(
        "owt", ("mix",), "owt_genppl_embedded", None, temperatures, ancestral_nfe=(), eipc=(),
        arpc=(SamplerConfig("arpc", 3, 2, 1),), k_mc=2, limit=2, batch_size=2, source=ModelSource.EMBEDDED))
    metadata = {"scorer": "vllm", "scorer_model": str(work / "scorer"), "scorer_vllm_python": python, "num_samples": 2}
    config = SweepConfig("test-genppl", runs=str(work / "runs"), metadata=metadata, progress=False)
    report = run_sweep(config)
    assert (report.ran, report.skipped, report.model_loads) == (3, 0, 1)
    assert report.vllm_starts == 1  # one server for every owt_genppl setting
    assert report.scorer_loads == 1  # one in-process copy for MAUVE's features
    for t in temperatures:
        folder = work / "runs" / "results" / "owt-embedded-mix" / f"arpc-3-2-1-T{t}"
        (path,) = folder.glob("*/results_*.json")
        results = json.loads(path.read_text())
        assert math.isfinite(results["results"]["owt_genppl_embedded"]["gen_ppl,none"])
        assert results["config"]["blockgen"]["sampler"]["temperature"] == t
        assert results["config"]["model"] == "blockgen"
        assert results["configs"]["owt_genppl_embedded"]["metadata"]["scorer_url"].startswith("http://127.0.0.1:")
        (samples,) = folder.glob("*/samples_owt_genppl_embedded_*.jsonl")
        assert len(samples.read_text().splitlines()) == 2  # per-sample outcomes kept
    again = run_sweep(config)
    assert (again.ran, again.skipped, again.model_loads, again.vllm_starts, again.scorer_loads) == (0, 3, 0, 0, 0)
    # another limit, scorer setting or checkpoint is another result: not skipped
    g, (s, *_) = GRIDS["test-genppl"], evaluations(GRIDS["test-genppl"], str(work / "runs"))
    folder = work / "runs" / "results" / s.run / s.label
    sha = json.loads(next(folder.glob("*/results_*.json")).read_text())["config"]["model_sha"]
    assert sweep._done(folder, sweep._mark(s, g, sha, metadata))
    assert not sweep._done(folder, sweep._mark(s, replace(g, limit=3), sha, metadata))
    assert not sweep._done(folder, sweep._mark(s, g, sha, {**metadata, "num_samples": 3}))
    assert not sweep._done(folder, sweep._mark(s, g, "0" * 64, metadata))


def test_seed_seeds_as_lm_eval_does_and_is_recorded(work):
    """`blockgen sweep --seed S` (docs/testing.md: `EVAL_ARGS="--seed S"`) seeds as `lm_eval --seed S`:
    python's random, numpy, torch (the adapter's seed) and few-shot sampling, recorded in each results
    file; a results file of another seed is not taken for this one, so the default seed runs anew."""
    out = work / "seeded"
    metadata = {"scorer": "transformers", "scorer_model": str(work / "scorer"), "num_samples": 2}

    def sweep_cli(*extra: str) -> dict:
        r = run(BIN / "blockgen", "sweep", "owt-embedded", "--runs", work / "runs", "--models", "mix", "--limit", "2",
                "--k-mc", "1", "--out-dir", out, "--metadata", json.dumps(metadata), "--no-progress", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1].removeprefix("sweep: "))

    def recorded() -> set[tuple]:
        files = [json.loads(p.read_text()) for p in out.glob("owt-embedded-mix/*/*/results_*.json")]
        return {(*(r["config"][f"{k}_seed"] for k in ("random", "numpy", "torch", "fewshot")), r["config"]["blockgen"]["seed"],
                 r["blockgen_sweep"]["seed"]) for r in files}

    assert sweep_cli("--seed", "5")["ran"] == 2  # likelihood and ARPC at T = 1
    assert recorded() == {(5, 5, 5, 5, 5, 5)}
    g = replace(GRIDS["owt-embedded"], models=("mix",), limit=2, k_mc=1)  # the command's
    (s,) = [s for s in evaluations(g, str(work / "runs")) if s.sampler is None]
    sha = json.loads(next((out / s.run / s.label).glob("*/results_*.json")).read_text())["config"]["model_sha"]
    assert sweep._done(out / s.run / s.label, sweep._mark(s, g, sha, metadata, 5))
    assert not sweep._done(out / s.run / s.label, sweep._mark(s, g, sha, metadata, 6))
    assert sweep_cli()["ran"] == 2  # lm-eval's defaults: another seed, not skipped
    assert recorded() == {(5, 5, 5, 5, 5, 5), (0, 1234, 1234, 1234, 1234, None)}


def test_missing_checkpoint_and_unknown_model_are_one_line(tmp_path):
    """A missing checkpoint names its folder and the command that trains it; a model the grid lacks lists
    the grid's models (not every preset)."""
    r = run(BIN / "blockgen", "sweep", "gsm8k-embedded", "--runs", tmp_path, "--models", "ar")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"no checkpoint in {tmp_path}/tinygsm-embedded-ar/checkpoint" in line
    assert f"blockgen train --preset tinygsm-embedded-ar --out-dir {tmp_path}/tinygsm-embedded-ar" in line
    assert "make train-tinygsm OFFLINE=1" in line
    r = run(BIN / "blockgen", "sweep", "owt-embedded", "--models", "maskd-mix", "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "['maskd-mix']" in line and "['ar', 'masked-mix', 'uniform-mix']" in line
    assert "tinygsm" not in line and "gsm-ar" not in line  # the grid's models, not all the presets


# ------------------------------------------------------------------------------ scorer flags on a GPU


def test_vllm_server_flags_and_gpu_per_rank():
    from blockgen.harness.evaluation.scorer_config import ScorerConfig
    from blockgen.harness.evaluation.vllm_server import (VLLMBuild, VLLMServer, server_dtype, server_environment,
                                                          server_gpu)

    cuda = VLLMBuild("py", "vllm", "0.32.0", "12.8")
    cpu = VLLMBuild("py", "vllm-cpu", "0.32.0", None)
    assert not VLLMBuild("py", "vllm", "0.32.0", None).cuda  # a CPU torch under the vllm package is no CUDA build
    config = ScorerConfig(backend="vllm", model="m")
    assert (server_dtype(config, cuda), server_dtype(config, cpu)) == ("float16", "float32")  # FlashAttention: no fp32
    assert server_dtype(ScorerConfig(backend="vllm", model="m", vllm_dtype="bfloat16"), cuda) == "bfloat16"
    gpu_cmd = VLLMServer(config).command("py", 8000, cuda)
    assert gpu_cmd[gpu_cmd.index("--dtype") + 1] == "float16" and "--gpu-memory-utilization" in gpu_cmd
    assert "--enforce-eager" in VLLMServer(config).command("py", 8000, cpu)
    assert server_gpu({}) is None  # outside torchrun: the environment as it is
    assert server_gpu({"LOCAL_RANK": "3"}) == "3"
    assert server_gpu({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "5"  # SLURM's list, not GPU 1
    assert server_gpu({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "2"}) == "2"
    # vllm-cpu: a small KV cache and no dynamo unless the caller says otherwise; a GPU build: neither
    assert server_environment({}, cpu) == {"VLLM_CPU_KVCACHE_SPACE": "2", "TORCHDYNAMO_DISABLE": "1",
                                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert server_environment({"TORCHDYNAMO_DISABLE": "0", "VLLM_CPU_KVCACHE_SPACE": "8"}, cpu)["TORCHDYNAMO_DISABLE"] == "0"
    assert server_environment({"LOCAL_RANK": "1"}, cuda) == {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1"}


def test_vllm_server_share_is_sized_from_the_free_memory():
    """--gpu-memory-utilization: half the GPU when the evaluated model leaves that free, less when it holds
    more (what is free less the headroom: vLLM refuses a share that is not free), a clear error when
    the server would get under MIN_SERVER_GIB; the command passes the sized share."""
    from blockgen.harness.evaluation.scorer_config import ScorerConfig, ScorerError
    from blockgen.harness.evaluation.vllm_server import GPU_HEADROOM, VLLMBuild, VLLMServer, gpu_memory_share

    gib = 2**30
    assert gpu_memory_share(70 * gib, 80 * gib) == 0.5
    assert gpu_memory_share(30 * gib, 80 * gib) == pytest.approx(30 / 80 - GPU_HEADROOM, abs=1e-3)
    with pytest.raises(ScorerError, match="lower --batch_size"):
        gpu_memory_share(int(5.5 * gib), 80 * gib)
    server = VLLMServer(ScorerConfig(backend="vllm", model="m"))
    server.memory_share = 0.325
    cmd = server.command("py", 8000, VLLMBuild("py", "vllm", "0.32.0", "12.8"))
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.325"


def test_check_vllm_names_the_build_and_refuses_a_cpu_build_for_cuda():
    python = vllm_python()
    ok = subprocess.run([str(BIN / "blockgen"), "scorers", "check-vllm", "--python", python],
                        capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert ok.returncode == 0 and "vllm-cpu" in ok.stdout and "CPU build" in ok.stdout, ok.stderr
    refused = subprocess.run([str(BIN / "blockgen"), "scorers", "check-vllm", "--python", python,
                              "--device", "cuda"], capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert refused.returncode == 1 and "VLLM_PACKAGE=vllm" in refused.stderr


def test_borrowed_featurizer_is_shared_only_inside_a_sweep(work):
    from blockgen.harness.evaluation import scorers
    from blockgen.harness.evaluation.scorer_config import ScorerConfig

    config = ScorerConfig(model=str(work / "scorer"))
    with scorers.borrow_featurizer(config) as a, scorers.borrow_featurizer(config) as b:
        assert a is not b  # outside a sweep: one per call, freed after
    with scorers.shared_scorers():
        with scorers.borrow_featurizer(config) as a:
            pass
        with scorers.borrow_featurizer(ScorerConfig(backend="vllm", model=str(work / "scorer"), url="http://x")) as b:
            assert a is b  # the server's settings do not make another in-process copy


@pytest.mark.parametrize("target", ["demo", "demo-seeds", "sweep"])
@pytest.mark.parametrize("seeds", ["x", "0", ""])
def test_make_refuses_a_seed_count_that_is_not_one_or_more(target, seeds):
    """`make demo SEEDS=x` said "argument --seeds: expected at least one argument" (the seq it builds came out empty);
    now make names SEEDS before anything runs (`-o setup`: the installed environment is not looked at)."""
    r = subprocess.run(["make", "-s", "-o", "setup", target, f"SEEDS={seeds}"], cwd=REPO, capture_output=True, text=True,
                       timeout=HANG_S)
    assert r.returncode == 2 and f"make: SEEDS={seeds}: give the number of training seeds, 1 or more" in r.stderr, r.stderr
