"""`blockgen gpu-check` (`make gpu-check`): what a user with one GPU runs first, one JSON summary.

    blockgen gpu-check                      # cuda when there is one: paper size; else the same stages at micro size
    blockgen gpu-check --device cpu --stages train generate

Stages (each one's failure is recorded in the summary and the others still run):
- train: the training step of `blockgen train` (bf16 autocast, `torch.compile`, AdamW, clipping, EMA)
  on random tokens, per prior and micro-batch: s/step, tokens/s, MFU, peak memory beside the start-up
  estimate of harness/train.py. Random tokens: the cost of a step does not depend on the text, and the
  check needs neither the hub nor a prepared corpus. GPU: the paper's model (12 x 768) at L = 1,024 with
  GPT-2's vocabulary size; CPU: the micro model. Then, per run, the likelihood pass the sweep's owt_ppl
  makes (one NELBO draw at block size 16 over [x0 ; xt], eager, no gradients) in the precision the sweep
  scores likelihoods in at that size (bf16 on the GPU, float32 on the CPU), TF32 off: `likelihood_pass_s`.
- generate: `generate()` tokens/s and ms per model call at batch 1 and 64 for AR greedy (the plain AR
  baseline), ARPC and ancestral (a BlockGen mixture of block sizes 1 and 16) with random weights; no
  EOS, so every row makes all its tokens; float32 with TF32 off, the sweep's default. GPU: AR greedy and
  ARPC also with `compile=True` (the calls compiled and replayed as CUDA graphs), side by side with eager
  runs made just before (`graphs`: ms per call, tokens/s, speed-up, compile time, rows whose tokens match
  eager). CPU: not measured (compiling takes minutes there, and a CPU has no CUDA graphs).
- lm_eval: a small model trained by the real `blockgen train` (preset `ci`) on this device, then
  `lm_eval --model blockgen --device DEVICE --tasks gsm8k_code_embedded` on it (the score of a model this
  small is near 0: the stage checks the path, not the accuracy).
- scorers: the vLLM scorer against the transformers scorer on the same texts (the offline GPT-2 of
  `blockgen train-scorer`): Gen PPL of each, their relative difference, tokens/s, the server's start-up.
  On a CPU it is skipped, with the reason, when no vLLM environment is found (`make vllm-env`,
  $BLOCKGEN_VLLM_PYTHON). On CUDA a missing vLLM environment or a CPU build of vLLM fails the stage, with
  the fix (`scorers.CUDA_VLLM_FIX`): GPT-2 Large would be scored on the CPU, which is no check of the GPU;
  and any stage that skipped itself fails the check (`stage_failed`). Not yet done: running one
  `owt_genppl` setting through `blockgen sweep` with the scorer beside the model (docs/training.md, TODO).

The summary is printed as JSON and written to OUT_DIR/summary.json; `ok` is false when a stage failed
(`failed` names them; the command prints each with its fix and exits 1). The rates it measured (generate's
seconds per call, train's seconds per likelihood pass, each with the precision it ran in) go to
OUT_DIR/rates.json (harness/rates.py), which `blockgen sweep GRID --dry-run` prices full-scale grids with
when it was measured at the paper's size.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Literal

import torch

from blockgen.harness.rates import RATES_FILE, RATES_VERSION, CallRate, PassRate, Provenance, Rates, gpu_check_rates, write_rates

STAGES = ("train", "generate", "lm_eval", "scorers")


@dataclass(frozen=True)
class Scale:
    """Sizes of one mode: the paper's on a GPU, micro on a CPU (what CI runs)."""

    size: Literal["micro", "tiny", "paper"]
    seq_len: int
    vocab_size: int
    micro_batches: tuple[int, ...]
    steps: int  # timed steps per (prior, micro-batch)
    warmup_steps: int  # untimed steps first (compilation, allocator warm-up)
    compile: bool
    bf16: bool
    new_tokens: int  # generate(): tokens per row
    prompt_len: int
    lm_eval_limit: int
    scorer_texts: int


GPU_SCALE = Scale(size="paper", seq_len=1024, vocab_size=50_257, micro_batches=(8, 32), steps=12, warmup_steps=2,
                  compile=True, bf16=True, new_tokens=256, prompt_len=64, lm_eval_limit=32, scorer_texts=256)
CPU_SCALE = Scale(size="micro", seq_len=128, vocab_size=512, micro_batches=(2, 4), steps=3, warmup_steps=1,
                  compile=False, bf16=False, new_tokens=32, prompt_len=16, lm_eval_limit=4, scorer_texts=8)


@dataclass(frozen=True)
class GpuCheckConfig:
    out_dir: str = str(gpu_check_rates().parent)  # runs/gpu-check: where `blockgen sweep` looks for rates.json
    device: str = "auto"  # auto: cuda if available (paper size), else cpu (micro size)
    stages: tuple[str, ...] = STAGES
    priors: tuple[str, ...] = ("masked", "uniform")
    micro_batches: tuple[int, ...] | None = None  # None: the mode's (GPU 8 and 32, CPU 2 and 4)
    steps: int | None = None  # timed training steps per run; None: the mode's
    compile: bool | None = None  # None: on GPU
    generate_batches: tuple[int, ...] = (1, 64)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stages {unknown}; choose from {list(STAGES)}")
        bad = [p for p in self.priors if p not in ("masked", "uniform")]
        if bad:
            raise ValueError(f"unknown priors {bad}; choose from ['masked', 'uniform']")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def scale(self) -> Scale:
        base = GPU_SCALE if self.resolved_device().startswith("cuda") else CPU_SCALE
        overrides = {k: v for k, v in (("micro_batches", self.micro_batches), ("steps", self.steps), ("compile", self.compile)) if v is not None}
        return replace(base, **overrides)


def _sync(device: str) -> None:
    """Wait for queued kernels, so that wall-clock times cover the work (CUDA runs asynchronously)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- stages


def _train_run(config: GpuCheckConfig, device: str, scale: Scale, prior: str, micro: int, peak: float | None) -> dict:
    """One (prior, micro-batch) run; its tensors are freed when it returns, also after an error."""
    from blockgen.harness.train import EMA, TrainConfig, memory_estimate, training_flops_per_step, training_net
    from blockgen.models.model import BlockGen
    from blockgen.models.objectives import stratified_times

    cuda = device.startswith("cuda")
    train_config = TrainConfig(prior=prior, block_sizes=(16,), block_weights=(1.0,), size=scale.size, seq_len=scale.seq_len,
                               batch_size=micro, precision="bf16" if scale.bf16 else "fp32", compile=scale.compile)
    model_config = train_config.model_config(scale.vocab_size, {}, device)
    torch.manual_seed(config.seed)
    model = BlockGen(model_config).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    estimate = memory_estimate(model_config, n_params, micro, scale.bf16 and cuda, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    ema = EMA(model, 0.9999)
    net, _ = training_net(model, distributed=False, compile=scale.compile)  # as `blockgen train --compile`
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if scale.bf16 and cuda else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(config.seed)
    x = torch.randint(0, scale.vocab_size, (micro, scale.seq_len), generator=gen).to(device)
    loss_mask = torch.ones(micro, scale.seq_len, device=device)
    t = stratified_times(micro, 0.5, model.schedule).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds, loss, warmup_seconds = [], float("nan"), 0.0
    begin = time.perf_counter()
    for step in range(scale.warmup_steps + scale.steps):
        _sync(device)
        start = time.perf_counter()
        with autocast:
            total, count = net(x, loss_mask, 16, t)
            (total / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model, step)
        _sync(device)
        if step >= scale.warmup_steps:
            seconds.append(time.perf_counter() - start)
        elif step == scale.warmup_steps - 1:
            warmup_seconds = time.perf_counter() - begin  # includes compilation
        loss = float((total / count).detach())
    s_step = sorted(seconds)[len(seconds) // 2]  # median: robust to a stray slow step
    result = {
        "params": n_params, "warmup_seconds": warmup_seconds, "steps": len(seconds), "s_per_step": s_step, "tokens_per_s": micro * scale.seq_len / s_step,
        "mfu": None if peak is None else training_flops_per_step(model_config, micro) / s_step / peak,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        "estimate_gb": estimate.total / 1e9, "loss": loss,
    }
    del optimizer, ema, net  # the passes below need no training state
    _free(device)
    try:
        result["likelihood_pass_s"] = _likelihood_pass_seconds(model, x, loss_mask, device, likelihood_dtype(device, scale), scale)
    except Exception as err:  # noqa: BLE001 - e.g. out of memory: the training figures above still stand
        result["error"] = f"likelihood pass: {type(err).__name__}: {str(err)[:500]}"
    return result


def likelihood_dtype(device: str, scale: Scale) -> str:
    """The precision the sweep scores likelihoods in at this scale: bf16 at paper size on a GPU (the full-scale
    grids' default), float32 otherwise (the offline grids')."""
    return "bfloat16" if scale.bf16 and device.startswith("cuda") else "float32"


@contextlib.contextmanager
def _sweep_tf32(device: str):
    """TF32 off, as the sweep runs by default (training turned it on for the whole process), restored after."""
    from blockgen.harness.precision import enable_tf32

    previous = enable_tf32(False) if device.startswith("cuda") else None
    try:
        yield
    finally:
        if previous is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _likelihood_pass_seconds(model, x: torch.Tensor, loss_mask: torch.Tensor, device: str, dtype: str, scale: Scale) -> float:
    """Median seconds of one batched likelihood pass as the sweep's owt_ppl makes them (`score_windows`:
    one NELBO draw at block size 16 over [x0 ; xt], eager, no gradients, per-row streams), in `dtype`."""
    from blockgen.harness.precision import compute_precision
    from blockgen.models.diffusion import RowStreams

    model.eval()
    seconds = []
    with torch.no_grad(), _sweep_tf32(device), compute_precision(device, dtype):
        for i in range(scale.warmup_steps + scale.steps):
            streams = RowStreams(list(range(x.shape[0])))
            _sync(device)
            start = time.perf_counter()
            model.sequence_nll_draws(x, loss_mask, 16, 1, generator=streams)
            _sync(device)
            if i >= scale.warmup_steps:
                seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2]


def stage_train(config: GpuCheckConfig, device: str, scale: Scale, out: Path) -> dict:
    from blockgen.harness.train import enable_tf32, peak_flops

    if device.startswith("cuda"):
        enable_tf32()
    peak = peak_flops(device)
    runs = []
    for prior in config.priors:
        for micro in scale.micro_batches:
            run: dict = {"prior": prior, "micro_batch": micro, "seq_len": scale.seq_len}
            try:
                run.update(_train_run(config, device, scale, prior, micro, peak))
            except Exception as err:  # noqa: BLE001 - an out-of-memory run is a finding, not the end of the check
                run["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            runs.append(run)
            if scale.compile:
                torch._dynamo.reset()  # each run compiles its own model
            _free(device)
    return {"compile": scale.compile, "bf16": scale.bf16 and device.startswith("cuda"), "size": scale.size,
            "vocab_size": scale.vocab_size, "peak_tflops": None if peak is None else peak / 1e12,
            "likelihood_precision": likelihood_dtype(device, scale), "runs": runs}


GRAPH_SAMPLERS = ("ar_greedy", "arpc")  # the samplers timed with compile=True as well (GPU)


def _timed_generate(model, prompts: list[list[int]], sampler_config, device: str, compile: bool = False):
    """(result, seconds) of one `generate` call; no EOS (-1), so every row makes all its tokens."""
    from blockgen.models.sampling import generate

    _sync(device)
    start = time.perf_counter()
    result = generate(model, prompts, sampler_config, eos_id=-1, pad_id=0, compile=compile)
    _sync(device)
    return result, time.perf_counter() - start


def _graph_run(model, prompts: list[list[int]], sampler_config, device: str) -> dict:
    """Eager against compile=True (CUDA graphs) on the same prompts: the first compiled run compiles
    and records the graphs (`compile_seconds`, generation included); the next one is timed, after a
    warm eager run."""
    eager, eager_s = _timed_generate(model, prompts, sampler_config, device)
    _, compile_s = _timed_generate(model, prompts, sampler_config, device, compile=True)
    compiled, compiled_s = _timed_generate(model, prompts, sampler_config, device, compile=True)
    tokens = sum(len(t) for t in eager.tokens)
    return {
        "model_calls": eager.model_calls, "compile_seconds": compile_s,
        "eager_ms_per_call": eager_s / eager.model_calls * 1e3, "compiled_ms_per_call": compiled_s / compiled.model_calls * 1e3,
        "eager_tokens_per_s": tokens / eager_s, "compiled_tokens_per_s": tokens / compiled_s, "speedup": eager_s / compiled_s,
        "rows_same_tokens": sum(a == b for a, b in zip(eager.tokens, compiled.tokens)),
    }


def _row_streams_match(device: str) -> bool:
    """The sampler's random words on `device` are those of the CPU, bit for bit (exact int64 arithmetic)."""
    from blockgen.models.diffusion import RowStreams

    seeds = [0, 1, 2**62 + 3, -5]
    on_device = RowStreams(seeds).bits((len(seeds), 64, 16), device).cpu()
    return bool(torch.equal(on_device, RowStreams(seeds).bits((len(seeds), 64, 16))))


def stage_generate(config: GpuCheckConfig, device: str, scale: Scale, out: Path) -> dict:
    from blockgen.harness.train import TrainConfig
    from blockgen.models.model import BlockGen
    from blockgen.models.sampling import SamplerConfig

    cuda = device.startswith("cuda")
    base = TrainConfig(size=scale.size, seq_len=scale.seq_len)
    models = {  # (train config, block size of its sampler's calls)
        "ar": (replace(base, block_sizes=(1,), block_weights=(1.0,), architecture="ar"), 1),
        "mixture": (replace(base, block_sizes=(1, 16), block_weights=(0.05, 0.95)), 16),
    }
    samplers = {  # (model, sampler): the OWT grids' settings (Makefile)
        "ar_greedy": ("ar", SamplerConfig("ar_greedy")),
        "arpc": ("mixture", SamplerConfig("arpc", steps=6, ge=3, warmup=0)),
        "ancestral": ("mixture", SamplerConfig("ancestral", steps=16)),
    }
    built = {}
    for name, (train_config, _) in models.items():
        torch.manual_seed(config.seed)
        built[name] = BlockGen(train_config.model_config(scale.vocab_size, {}, device)).to(device).eval()
    rows, graph_rows = [], []
    graph_batches = (min(config.generate_batches), max(config.generate_batches))
    gen = torch.Generator().manual_seed(config.seed)
    with _sweep_tf32(device):  # float32 without TF32: what the sweep's generation runs by default
        for sampler, (model_name, sampler_config) in samplers.items():
            for batch in config.generate_batches:
                row: dict = {"sampler": sampler, "model": model_name, "block_size": models[model_name][1], "batch": batch,
                             "new_tokens": scale.new_tokens}
                rows.append(row)
                try:
                    prompts = torch.randint(0, scale.vocab_size, (batch, scale.prompt_len), generator=gen).tolist()
                    sampler_config = replace(sampler_config, max_new_tokens=scale.new_tokens)
                    result, seconds = _timed_generate(built[model_name], prompts, sampler_config, device)
                    tokens = sum(len(t) for t in result.tokens)
                    row.update(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, model_calls=result.model_calls,
                               ms_per_call=seconds / result.model_calls * 1e3, paper_nfe_per_block=result.paper_nfe_per_block)
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
                    continue
                if cuda and sampler in GRAPH_SAMPLERS and batch in graph_batches:
                    graph_row: dict = {"sampler": sampler, "batch": batch}
                    graph_rows.append(graph_row)
                    try:
                        graph_row.update(_graph_run(built[model_name], prompts, sampler_config, device))
                    except Exception as err:  # noqa: BLE001 - a failing compile is a finding: the row says so
                        graph_row["error"] = row["error"] = f"compile=True: {type(err).__name__}: {str(err)[:500]}"
    if cuda:
        graphs: dict = {"measured": True, "mode": "reduce-overhead (CUDA graphs)", "runs": graph_rows}
        torch._dynamo.reset()  # the graphs and their memory pools go with the models
    else:
        graphs = {"measured": False, "why": "CPU mode: generate(compile=True) is not timed (compiling takes minutes on "
                  "a CPU, which has no CUDA graphs); `make gpu-check` on a GPU measures it"}
    del built
    _free(device)
    result = {"size": scale.size, "prompt_len": scale.prompt_len, "precision": "float32", "runs": rows, "graphs": graphs}
    if cuda:
        result["row_streams_same_as_cpu"] = _row_streams_match(device)
        if not result["row_streams_same_as_cpu"]:
            result["error"] = "the samplers' random words (RowStreams) on the GPU differ from the CPU's"
    return result


def _bin(name: str) -> str:
    """A console script of this environment (lm_eval, blockgen), next to the running interpreter."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _run(cmd: list[str], log: Path) -> float:
    """Run a command with its output in `log`; raise with the log's tail when it fails. Returns seconds."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` exited with {proc.returncode}; log {log}:\n{tail}")
    return time.perf_counter() - start


def stage_lm_eval(config: GpuCheckConfig, device: str, scale: Scale, out: Path) -> dict:
    work = out / "lm_eval"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    train_cmd = [_bin("blockgen"), "train", "--preset", "ci", "--out-dir", str(model_dir), "--device", device,
                 "--data.cache-dir", str(work / "data")]
    if device.startswith("cuda"):
        train_cmd += ["--precision", "bf16"]
    train_seconds = _run(train_cmd, work / "train.log")
    results = work / "results"
    eval_cmd = [_bin("lm_eval"), "--model", "blockgen", "--device", device, "--tasks", "gsm8k_code_embedded",
                "--limit", str(scale.lm_eval_limit), "--batch_size", "8", "--output_path", str(results),
                "--model_args", f"pretrained={model_dir / 'checkpoint'},sampler=arpc,steps=4,ge=2,temperature=0.5,max_gen_toks=32"]
    eval_seconds = _run(eval_cmd, work / "lm_eval.log")
    (path,) = sorted(results.rglob("results_*.json"))[-1:]
    metrics = json.loads(path.read_text())["results"]["gsm8k_code_embedded"]
    return {"train_seconds": train_seconds, "lm_eval_seconds": eval_seconds, "limit": scale.lm_eval_limit,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}, "results": str(path)}


def stage_scorers(config: GpuCheckConfig, device: str, scale: Scale, out: Path) -> dict:
    from blockgen.harness.data import DataConfig, document_split
    from blockgen.harness.scorers import (
        CUDA_VLLM_FIX,
        ScorerConfig,
        ScorerError,
        TransformersScorer,
        VLLMScorer,
        check_vllm_installed,
        gen_ppl,
        require_cuda_build,
        score_texts,
        vllm_build,
        vllm_python,
    )
    from blockgen.harness.train_scorer import ScorerTrainConfig, train_scorer

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
    work = out / "scorers"
    data = DataConfig(source="text", cache_dir=str(work / "data"))
    scorer_dir = str(train_scorer(ScorerTrainConfig(out_dir=str(work / "scorer"), max_steps=20, data=data), progress=False))
    texts = [doc[:1200] for doc in document_split(data)[1]][: scale.scorer_texts]
    result: dict = {"texts": len(texts), "vllm_python": python}
    scorer_device = device if device.startswith("cuda") else "cpu"
    start = time.perf_counter()
    tf_scores = score_texts(TransformersScorer(ScorerConfig(model=scorer_dir, device=scorer_device)), texts, progress=False)
    tf_seconds = time.perf_counter() - start
    tokens = sum(s.tokens for s in tf_scores)
    start = time.perf_counter()
    with VLLMScorer(ScorerConfig(backend="vllm", model=scorer_dir)) as vllm:
        started = time.perf_counter()
        vllm_scores = score_texts(vllm, texts, progress=False)
        vllm_seconds = time.perf_counter() - started
    a, b = gen_ppl(tf_scores), gen_ppl(vllm_scores)
    result.update(tokens=tokens, transformers_gen_ppl=a, vllm_gen_ppl=b, relative_difference=abs(a - b) / a,
                  transformers_tokens_per_s=tokens / tf_seconds, vllm_tokens_per_s=tokens / vllm_seconds,
                  vllm_start_seconds=started - start)
    return result


STAGE_FUNCTIONS: dict[str, Callable[[GpuCheckConfig, str, Scale, Path], dict]] = {
    "train": stage_train, "generate": stage_generate, "lm_eval": stage_lm_eval, "scorers": stage_scorers,
}


def _device_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(name=props.name, memory_gb=props.total_memory / 1e9, cuda=torch.version.cuda)
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def run_gpu_check(config: GpuCheckConfig) -> dict:
    """Run the stages in order; each stage's result or error goes into the summary (written as JSON)."""
    device = config.resolved_device()
    scale = config.scale()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"mode": "gpu" if device.startswith("cuda") else "cpu", **_device_info(device),
                     "config": asdict(config), "scale": asdict(scale), "stages": {}}
    begin = time.perf_counter()
    for name in config.stages:
        start = time.perf_counter()
        try:
            result = STAGE_FUNCTIONS[name](config, device, scale, out)
        except Exception as err:  # noqa: BLE001 - one failing stage must not lose the others
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        result["stage_seconds"] = time.perf_counter() - start
        summary["stages"][name] = result
        _free(device)
    summary["total_seconds"] = time.perf_counter() - begin
    cuda = device.startswith("cuda")
    summary["failed"] = [name for name, r in summary["stages"].items() if stage_failed(r, cuda)]
    summary["ok"] = not summary["failed"]
    rates = measured_rates(summary, out)
    summary["rates"] = str(write_rates(rates, out / RATES_FILE)) if rates else None
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    return summary


def stage_failed(result: dict, cuda: bool) -> bool:
    """An error in the stage or in one of its runs; on a GPU also a stage that skipped itself (the scorer
    without a CUDA build of vLLM): the check is of the GPU, and a part left out of it is not checked."""
    return "error" in result or any("error" in run for run in result.get("runs", ())) or (cuda and "skipped" in result)


def measured_rates(summary: dict, out: Path) -> Rates | None:
    """The rates file of this check (harness/rates.py): the generate stage's seconds per sampler call per
    sampler, block size and batch, and the train stage's seconds per likelihood pass per prior and
    micro-batch, each in the precision it ran; None when neither stage measured anything."""
    stages = summary["stages"]
    generate, train = stages.get("generate", {}), stages.get("train", {})
    calls = tuple(CallRate(generate["precision"], r["sampler"], r["block_size"], r["batch"], r["ms_per_call"] / 1e3)
                  for r in generate.get("runs", ()) if "ms_per_call" in r)
    passes = tuple(PassRate(train["likelihood_precision"], "blockgen", r["prior"], r["micro_batch"], r["seq_len"], r["likelihood_pass_s"])
                   for r in train.get("runs", ()) if "likelihood_pass_s" in r)
    if not calls and not passes:
        return None
    scale = summary["scale"]
    provenance = Provenance(
        command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), date=summary["date_utc"] + " UTC", commit=_commit(),
        source=str(out / "summary.json"),
        notes=f"blockgen gpu-check on {summary['name']} ({summary['device']}), {scale['size']} size, random weights: "
              f"generate() with prompts of {scale['prompt_len']} and {scale['new_tokens']} new tokens, eager, TF32 off; "
              "likelihood passes: one NELBO draw at block size 16 over [x0 ; xt], eager, after the training runs")
    return Rates(RATES_VERSION, summary["name"], scale["size"], provenance, calls, passes)


def _commit() -> str:
    """The checkout's commit (with -dirty for uncommitted changes), or why there is none."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"
