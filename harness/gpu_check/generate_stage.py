"""The generate stage of `blockgen gpu-check`: `generate()` tokens/s and ms per model call for AR greedy
(the plain AR baseline), ARPC and ancestral (a BlockGen mixture of block sizes 1 and 16) with random
weights, at batch 1, at the sweep's batch (`Grid.batch_size`: 32 on the full-scale grids, 8 on the
offline ones) and, on a GPU, at 64; no EOS, so every row makes all its tokens; float32 with TF32 off, the
sweep's default. GPU: AR greedy and ARPC also with `compile=True` (the calls compiled and replayed as
CUDA graphs), side by side with eager runs made just before (`graphs`: ms per call, tokens/s, speed-up,
compile time, rows whose tokens match eager). CPU: not measured (compiling takes minutes there, and a
CPU has no CUDA graphs). `batch_invariance`: ancestral and AR greedy at the largest batch on the fastest path and with
`batch_invariant=True` (the cost), and whether three rows keep their alone tokens in the batch (on a GPU this is the
first measurement of the row-invariant mode under cuBLAS: docs/lm_eval.md, "Batch invariance").
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from blockgen.harness.gpu_check.config import TRAIN_BLOCK_SIZES, TRAIN_BLOCK_WEIGHTS, UNLIMITED, Budget, GpuCheckConfig, Scale, mark_truncated
from blockgen.harness.gpu_check.timing import free_memory, sweep_tf32, sync


GRAPH_SAMPLERS = ("ar_greedy", "arpc")  # the samplers timed with compile=True as well (GPU)


def _timed_generate(model, prompts: list[list[int]], sampler_config, device: str, compile: bool = False):
    """(result, seconds) of one `generate` call; no EOS (-1), so every row makes all its tokens."""
    from blockgen.models.sampling import generate

    sync(device)
    start = time.perf_counter()
    result = generate(model, prompts, sampler_config, eos_id=-1, pad_id=0, compile=compile)
    sync(device)
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


# batch_invariant=True against the fastest path, at the stage's largest batch (64 on a GPU): its cost, and whether
# rows keep their alone results bit for bit (docs/lm_eval.md, "Batch invariance"; bench/README.md for the CPU figures)
INVARIANCE_SAMPLERS = ("ancestral", "ar_greedy")


def _invariance_run(model, prompts: list[list[int]], sampler_config, device: str) -> dict:
    """Seconds of the batch on the fastest path and in the row-invariant mode (per-row seeds), and how many of rows
    0, middle and last keep, in the batch, the tokens they get alone in the invariant mode."""
    from blockgen.models.backbone import INVARIANT_MATRIX_GROUP
    from blockgen.models.sampling import generate

    seeds = list(range(len(prompts)))

    def timed(rows: list[int], invariant: bool):
        sync(device)
        start = time.perf_counter()
        result = generate(model, [prompts[i] for i in rows], sampler_config, eos_id=-1, pad_id=0,
                          seeds=[seeds[i] for i in rows], batch_invariant=invariant)
        sync(device)
        return result, time.perf_counter() - start

    everyone = list(range(len(prompts)))
    fastest, fastest_s = timed(everyone, False)
    invariant, invariant_s = timed(everyone, True)
    checked = sorted({0, len(prompts) // 2, len(prompts) - 1})
    same = sum(timed([i], True)[0].tokens[0] == invariant.tokens[i] for i in checked)
    tokens = sum(len(t) for t in fastest.tokens)
    return {"batch": len(prompts), "fastest_tokens_per_s": tokens / fastest_s, "invariant_tokens_per_s": tokens / invariant_s,
            "matrix_group": INVARIANT_MATRIX_GROUP.get(torch.device(device).type),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "cost": invariant_s / fastest_s, "rows_checked": checked, "rows_same_alone": same,
            "fastest_rows_same": sum(a == b for a, b in zip(fastest.tokens, invariant.tokens))}


def _row_streams_match(device: str) -> bool:
    """The sampler's random words on `device` are those of the CPU, bit for bit (exact int64 arithmetic)."""
    from blockgen.models.diffusion import RowStreams

    seeds = [0, 1, 2**62 + 3, -5]
    on_device = RowStreams(seeds).bits((len(seeds), 64, 16), device).cpu()
    return bool(torch.equal(on_device, RowStreams(seeds).bits((len(seeds), 64, 16))))


def stage_generate(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    from blockgen.harness.training.train_config import TrainConfig
    from blockgen.models.model import BlockGen
    from blockgen.models.sampler_config import SamplerConfig

    cuda = device.startswith("cuda")
    base = TrainConfig(size=scale.size, seq_len=scale.seq_len)
    models = {  # (train config, block size of its sampler's calls)
        "ar": (replace(base, block_sizes=(1,), block_weights=(1.0,), architecture="ar"), 1),
        "mixture": (replace(base, block_sizes=TRAIN_BLOCK_SIZES, block_weights=TRAIN_BLOCK_WEIGHTS), 16),
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
    rows, graph_rows, not_run = [], [], []
    batches = config.generate_batches or scale.generate_batches  # a caller's own scale still takes the config's batches
    graph_batches = (min(batches), max(batches))
    gen = torch.Generator().manual_seed(config.seed)
    with sweep_tf32(device):  # float32 without TF32: what the sweep's generation runs by default
        for sampler, (model_name, sampler_config) in samplers.items():
            for batch in batches:
                if not budget.allows():
                    not_run.append(f"{sampler} batch {batch}")
                    continue
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
                    if not budget.allows():
                        not_run.append(f"{sampler} batch {batch} compile=True")
                        continue
                    graph_row: dict = {"sampler": sampler, "batch": batch}
                    graph_rows.append(graph_row)
                    try:
                        graph_row.update(_graph_run(built[model_name], prompts, sampler_config, device))
                    except Exception as err:  # noqa: BLE001 - a failing compile is a finding: the row says so
                        graph_row["error"] = row["error"] = f"compile=True: {type(err).__name__}: {str(err)[:500]}"
    invariance = []
    with sweep_tf32(device):
        for sampler in INVARIANCE_SAMPLERS:
            model_name, sampler_config = samplers[sampler]
            if not budget.allows():
                not_run.append(f"{sampler} batch {max(batches)} batch_invariant")
                continue
            run: dict = {"sampler": sampler}
            invariance.append(run)
            try:
                prompts = torch.randint(0, scale.vocab_size, (max(batches), scale.prompt_len), generator=gen).tolist()
                run.update(_invariance_run(built[model_name], prompts, replace(sampler_config, max_new_tokens=scale.new_tokens), device))
            except Exception as err:  # noqa: BLE001 - a failing mode is a finding: the row says so
                run["error"] = f"{type(err).__name__}: {str(err)[:500]}"
    if cuda:
        graphs: dict = {"measured": True, "mode": "reduce-overhead (CUDA graphs)", "runs": graph_rows}
        torch._dynamo.reset()  # the graphs and their memory pools go with the models
    else:
        graphs = {"measured": False, "why": "CPU mode: generate(compile=True) is not timed (compiling takes minutes on "
                  "a CPU, which has no CUDA graphs); `make gpu-check` on a GPU measures it"}
    del built
    free_memory(device)
    result = {"size": scale.size, "prompt_len": scale.prompt_len, "precision": "float32", "runs": rows, "graphs": graphs,
              "batch_invariance": invariance}
    if cuda:
        result["row_streams_same_as_cpu"] = _row_streams_match(device)
        if not result["row_streams_same_as_cpu"]:
            result["error"] = "the samplers' random words (RowStreams) on the GPU differ from the CPU's"
    return mark_truncated(result, not_run, budget)
