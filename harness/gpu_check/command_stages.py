"""The stages of `blockgen gpu-check` that start other programs (torchrun, `blockgen train`, `lm_eval`, the
vLLM server): each program gets the time left before its stage's deadline as its timeout; one that exceeds
it is killed with its process group (`StageTimeout`) and the stage is an error that says so.

- ddp: with 2 or more GPUs, `torchrun --standalone --nproc_per_node=2 -m blockgen.harness.cli train
  --preset ci` for 20 steps over NCCL; on a CPU the same command with 2 gloo processes and 4 steps; with
  one GPU it is skipped with the reason (not a failure: it does not apply). s/step and tokens/s (both
  processes) from the run's metrics.jsonl, the first step (start-up) left out. Not timed as a rate: the
  ci preset is a micro model, so the stage checks the launcher, the process group and the collectives.
- lm_eval: a small model trained by the real `blockgen train` (preset `ci`) on this device (the ddp
  stage's checkpoint when it ran in this check), then `lm_eval --model blockgen --device DEVICE --tasks
  gsm8k_code_embedded` on it (the score of a model this small is near 0: the stage checks the path, not
  the accuracy).
- scorers: the vLLM scorer against the transformers scorer on the same texts (the offline GPT-2 of
  `blockgen train-scorer`): Gen PPL of each, their relative difference, tokens/s, the server's start-up.
  On a CPU it is skipped, with the reason, when no vLLM environment is found (`make vllm-env`,
  $BLOCKGEN_VLLM_PYTHON). On CUDA a missing vLLM environment or a CPU build of vLLM fails the stage, with
  the fix (`vllm_server.CUDA_VLLM_FIX`): GPT-2 Large would be scored on the CPU, which is no check of the GPU;
  and any stage that skipped itself fails the check (`stage_failed`), except ddp on one GPU. Not yet done:
  running one `owt_genppl` setting through `blockgen sweep` with the scorer beside the model
  (docs/training.md, TODO).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from blockgen.harness.gpu_check.config import DDP_PRESET, UNLIMITED, Budget, GpuCheckConfig, Scale
from blockgen.harness.gpu_check.timing import median
from blockgen.harness.training.metrics_log import read_records


def _bin(name: str) -> str:
    """A console script of this environment (lm_eval, blockgen, torchrun), next to the running interpreter."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


class StageTimeout(RuntimeError):
    """A subprocess that ran past its stage's deadline (killed, with its process group)."""


def _run(cmd: list[str], log: Path, budget: Budget = UNLIMITED) -> float:
    """Run a command with its output in `log`, within the stage's deadline; raise with the log's tail when it
    fails, `StageTimeout` when it runs past the deadline. Returns seconds."""
    timeout = budget.left()
    if timeout <= 0:
        raise StageTimeout(f"`{' '.join(cmd[:4])} ...` not started: the stage's budget share was spent")
    start = time.perf_counter()
    with open(log, "w") as f:
        # its own session: on a timeout the whole group goes (torchrun's workers, lm_eval's children)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=None if math.isinf(timeout) else timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise StageTimeout(f"`{' '.join(cmd[:4])} ...` ran past the stage's deadline ({timeout:.0f} s left when it "
                               f"started; --budget-s gives the check more time); killed; log {log}") from None
        except BaseException:  # e.g. Ctrl-C: no orphaned workers
            _kill_group(proc)
            raise
    if code != 0:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` exited with {code}; log {log}:\n{tail}")
    return time.perf_counter() - start


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this check started, SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _train_cmd(device: str, out_dir: Path, data_dir: Path, steps: int | None = None) -> list[str]:
    """`blockgen train --preset ci` on this device (bf16 on CUDA), the arguments after the launcher."""
    cmd = ["train", "--preset", DDP_PRESET, "--out-dir", str(out_dir), "--device", device, "--data.cache-dir", str(data_dir)]
    if steps is not None:  # one checkpoint and one validation, at the end
        cmd += ["--max-steps", str(steps), "--save-every", str(steps), "--eval-every", str(steps)]
    if device.startswith("cuda"):
        cmd += ["--precision", "bf16"]
    return cmd


def _ddp_checkpoint(out: Path) -> Path:
    return out / "ddp" / "model" / "checkpoint"


def stage_ddp(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    """Two processes of `blockgen train` under torchrun: NCCL on 2 GPUs, gloo on the CPU."""
    work = out / "ddp"
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: an old checkpoint would be resumed (and evaluated by lm_eval)
    cuda = device.startswith("cuda")
    if cuda and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible: the DDP run needs 2", "applies": False}
    if not budget.allows():
        return {"truncated": "budget: no time left for the DDP run", "not_run": [f"{DDP_PRESET} x 2 processes"]}
    work.mkdir(parents=True)
    model_dir = work / "model"
    cmd = [_bin("torchrun"), "--standalone", "--nproc_per_node=2", "-m", "blockgen.harness.cli",
           *_train_cmd("cuda" if cuda else "cpu", model_dir, out / "data", scale.ddp_steps)]
    seconds = _run(cmd, work / "train.log", budget)
    records = read_records(model_dir)
    timed = records[1:]  # the first step includes start-up (and the process group's first collectives)
    s_step = median([r["step_seconds"] for r in timed])
    return {"world_size": 2, "backend": "nccl" if cuda else "gloo", "preset": DDP_PRESET, "steps": len(records),
            "timed_steps": len(timed), "s_per_step": s_step, "tokens_per_s": median([r["tokens_per_s"] for r in timed]),
            "seconds": seconds, "checkpoint": str(model_dir / "checkpoint")}


def stage_lm_eval(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    work = out / "lm_eval"
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: `blockgen train` would resume an old checkpoint
    if not budget.allows():
        return {"truncated": "budget: no time left for training and lm_eval", "not_run": ["train", "lm_eval"]}
    work.mkdir(parents=True)
    result: dict = {}
    checkpoint = _ddp_checkpoint(out)
    if "ddp" in config.stages and (checkpoint / "config.json").is_file():  # trained by this check's ddp stage
        result["model"] = f"the ddp stage's checkpoint ({checkpoint})"
    else:
        model_dir = work / "model"
        result["train_seconds"] = _run([_bin("blockgen"), *_train_cmd(device, model_dir, out / "data")], work / "train.log", budget)
        checkpoint = model_dir / "checkpoint"
        result["model"] = f"trained here ({checkpoint})"
    results = work / "results"
    eval_cmd = [_bin("lm_eval"), "--model", "blockgen", "--device", device, "--tasks", "gsm8k_code_embedded",
                "--limit", str(scale.lm_eval_limit), "--batch_size", "8", "--output_path", str(results),
                "--model_args", f"pretrained={checkpoint},sampler=arpc,steps=4,ge=2,temperature=0.5,max_gen_toks=32"]
    result["lm_eval_seconds"] = _run(eval_cmd, work / "lm_eval.log", budget)
    (path,) = sorted(results.rglob("results_*.json"))[-1:]
    metrics = json.loads(path.read_text())["results"]["gsm8k_code_embedded"]
    return {**result, "limit": scale.lm_eval_limit, "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "results": str(path)}


def stage_scorers(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    from blockgen.harness.data.sources import DataConfig, document_split
    from blockgen.harness.evaluation.scorer_config import ScorerConfig, ScorerError
    from blockgen.harness.evaluation.scorers import TransformersScorer, VLLMScorer, gen_ppl, score_texts
    from blockgen.harness.evaluation.vllm_server import (
        CUDA_VLLM_FIX,
        check_vllm_installed,
        require_cuda_build,
        vllm_build,
        vllm_python,
    )
    from blockgen.harness.training.train_scorer import ScorerTrainConfig, train_scorer

    python = vllm_python()
    try:
        if device.startswith("cuda"):  # a CPU build would score on the CPU: not a check of the GPU
            require_cuda_build(vllm_build(python))
        else:
            check_vllm_installed(python)
    except ScorerError as err:
        if device.startswith("cuda"):
            return {"error": str(err), "fix": CUDA_VLLM_FIX}
        return {"skipped": f"no vLLM environment: {err}"}
    if not budget.allows():
        return {"truncated": "budget: no time left for the scorers", "not_run": ["transformers", "vllm"]}
    work = out / "scorers"
    data = DataConfig(source="text", cache_dir=str(work / "data"))
    scorer_config = ScorerTrainConfig(out_dir=str(work / "scorer"), max_steps=scale.scorer_steps, data=data)
    scorer_dir = str(train_scorer(scorer_config, progress=False))
    texts = [doc[:1200] for doc in document_split(data)[1]][: scale.scorer_texts]
    result: dict = {"texts": len(texts), "vllm_python": python}
    scorer_device = device if device.startswith("cuda") else "cpu"
    start = time.perf_counter()
    tf_scores = score_texts(TransformersScorer(ScorerConfig(model=scorer_dir, device=scorer_device)), texts, progress=False)
    tf_seconds = time.perf_counter() - start
    tokens = sum(s.tokens for s in tf_scores)
    if not budget.allows():  # the transformers side measured; the server's start-up would run past the deadline
        result.update(tokens=tokens, transformers_tokens_per_s=tokens / tf_seconds)
        return {**result, "truncated": "budget: no time left to start the vLLM server", "not_run": ["vllm"]}
    start = time.perf_counter()
    # the server's start-up waits no longer than the stage's deadline (ScorerError past it: the stage's error)
    with VLLMScorer(ScorerConfig(backend="vllm", model=scorer_dir, start_timeout=budget.left())) as vllm:
        started = time.perf_counter()
        vllm_scores = score_texts(vllm, texts, progress=False)
        vllm_seconds = time.perf_counter() - started
    a, b = gen_ppl(tf_scores), gen_ppl(vllm_scores)
    result.update(tokens=tokens, transformers_gen_ppl=a, vllm_gen_ppl=b, relative_difference=abs(a - b) / a,
                  transformers_tokens_per_s=tokens / tf_seconds, vllm_tokens_per_s=tokens / vllm_seconds,
                  vllm_start_seconds=started - start)
    return result
