"""What the offline evaluation grids' cost model needs, measured in one run: seconds per batched call.

    .venv/bin/python bench/bench_eval_cost.py                     # every offline grid's presets, fp32 and bf16
    .venv/bin/python bench/bench_eval_cost.py --grids demo --repeats 1
    .venv/bin/python bench/bench_eval_cost.py --write-rates       # also write them: eval_cost.CPU_RATES_FILE
    .venv/bin/python bench/bench_eval_cost.py --write-rates FILE  # ... or FILE

For every (preset, batch size) of the offline grids (`harness/evaluation/grids.py`: owt-embedded, gsm8k-embedded,
demo, ci-gsm8k) a model of the preset's shape with RANDOM weights (cost does not depend on the
weights) is timed, as `blockgen sweep` calls it:
- a likelihood pass: `score_windows` on a batch of full-length windows at the grid's K_MC, divided by
  the passes it makes (`eval_cost.likelihood_passes`);
- a sampler call: `generate` with the preset's sampler family (ARPC 3:2:1 for mixtures with block
  size 1, ancestral 4 otherwise), EOS disabled so every row generates the grid's budget, divided by
  the model calls it reports; and an AR decoding call (`ar_greedy`) where the preset has block size 1;
- for OWT grids, one sample through owt_genppl's scoring with the offline scorer (`--scorer`,
  transformers backend, loaded once as in a sweep): Gen PPL, MAUVE features of it and its reference,
  MAUVE over the samples.
Each in float32 (the default) and under bfloat16 autocast (`dtype=bfloat16`), side by side, best of
`--repeats`; the ratio column is fp32 time / bf16 time. The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from blockgen.harness.costs import eval_cost
from blockgen.harness.costs.data_file import write_dataclass
from blockgen.harness.evaluation.grids import GRIDS
from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows
from blockgen.harness.runtime.precision import compute_precision
from blockgen.harness.training.presets import preset
from blockgen.models.model import BlockGen
from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import generate

SPECIAL = {"bos": 0, "eos": 1, "pad": 2, "sep": [3]}
OFFLINE_GRIDS = tuple(name for name, g in GRIDS.items() if g.source.cpu_scale)


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def cases(grids: list[str]) -> dict[tuple[str, int], dict]:
    """(preset, batch) -> what the grids ask of it: K_MC, task, generation budget. The batch is the
    grid's (one batch per sampler setting: per-row budgets share a batch)."""
    out: dict[tuple[str, int], dict] = {}
    for name in grids:
        g = GRIDS[name]
        cap = dict(g.model_args).get("max_gen_toks")
        for model in g.models:
            preset_name = g.run_name(model)
            budget = eval_cost.new_tokens(g.generation_task, preset(preset_name).seq_len, cap)
            out.setdefault((preset_name, g.batch_size), dict(k_mc=g.k_mc, task=g.generation_task, budget=budget))
    return out


def random_model(name: str) -> BlockGen:
    config = preset(name)
    torch.manual_seed(0)
    model = BlockGen(config.model_config(config.data.vocab_size, SPECIAL, "cpu")).eval()
    with torch.no_grad():  # non-trivial activations (the final layer is zero-initialised)
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def measure(name: str, batch: int, want: dict, dtype: str, repeats: int) -> dict[str, float | None]:
    model = random_model(name)
    cfg = model.config
    sizes = tuple(cfg.block_sizes)
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.vocab_size
    windows = [Window(tuple(torch.randint(4, vocab, (cfg.seq_len,), generator=gen).tolist()), 0) for _ in range(batch)]
    prompt_len = 1 if "genppl" in want["task"] else max(1, min(32, cfg.seq_len - want["budget"]))  # BOS / a question
    prompts = [[0, *torch.randint(4, vocab, (prompt_len - 1,), generator=gen).tolist()] for _ in range(batch)]
    seeds = list(range(batch))

    def lik():
        with compute_precision("cpu", dtype):
            score_windows(model, windows, seeds, want["k_mc"], SPECIAL["pad"])

    def run(sampler: SamplerConfig):
        def go():
            with compute_precision("cpu", dtype):
                return generate(model, prompts, sampler, -1, SPECIAL["pad"], seeds=seeds)
        return go

    with torch.no_grad():
        seconds, _ = best(lik, repeats)
        out: dict[str, float | None] = {"pass_s": seconds / eval_cost.likelihood_passes(sizes, want["k_mc"]),
                                        "call_s": None, "ar_call_s": None}
        new = min(want["budget"], cfg.seq_len - prompt_len)
        if sizes != (1,):
            family = SamplerConfig("arpc", steps=3, ge=2, warmup=1) if 1 in sizes else SamplerConfig("ancestral", steps=4)
            seconds, result = best(run(replace(family, max_new_tokens=new)), repeats)
            out["call_s"] = seconds / result.model_calls
        if 1 in sizes:
            seconds, result = best(run(SamplerConfig("ar_greedy", max_new_tokens=new)), repeats)
            out["ar_call_s"] = seconds / result.model_calls
    return out


def scorer_sample_s(scorer_dir: str, n: int, repeats: int) -> float:
    """Seconds per sample of what owt_genppl does after generating, as in a sweep (the scorer loaded
    once, outside the timing): Gen PPL score and MAUVE features of the sample and its reference
    (`owt.score_samples`), then MAUVE over the n samples (`owt.mauve_score`)."""
    import tempfile

    from blockgen.harness.evaluation.scorer_config import ScorerConfig
    from blockgen.harness.evaluation.scorers import shared_scorers
    from blockgen.tasks.blockgen_toy import training_text
    from blockgen.tasks.owt import genppl_results, mauve_score, score_samples

    config = ScorerConfig(model=scorer_dir, device="cpu")
    text = " ".join(training_text(80))
    texts = [text[i * 11: i * 11 + 600] for i in range(2 * n)]  # 600 characters: the embedded task's references
    samples, references = texts[:n], texts[n:]

    def go():
        # A fresh MAUVE cache each time: the references are featurized too (a sweep's first setting;
        # later settings reuse them, harness/evaluation/mauve_cache.py), so the rate stays an upper bound.
        with tempfile.TemporaryDirectory() as cache:
            records = score_samples(samples, references, config, Path(cache))
            mauve_score([genppl_results({}, [r])["mauve"] for r in records])

    with shared_scorers(), tempfile.TemporaryDirectory() as cache:
        score_samples(samples[:2], references[:2], config, Path(cache))  # loads the sweep's shared copy
        seconds, _ = best(go, repeats)
    return seconds / n


def sandbox_program_s(n: int, repeats: int) -> float:
    """Seconds per gsm8k_code program in the sandbox, n programs run as the task runs them (in parallel)."""
    from bench_sandbox import PROGRAMS  # bench/ is this script's folder

    from blockgen.tasks.sandbox import run_many

    programs = [PROGRAMS[i % len(PROGRAMS)][0] for i in range(n)]
    seconds, _ = best(lambda: run_many(programs), repeats)
    return seconds / n


# One real setting per offline task: (grid, model, setting label) on the trained checkpoints of --runs.
OVERHEAD_SETTINGS = {"owt_ppl_embedded": ("owt-embedded", "masked-mix", "likelihood"),
                     "owt_genppl_embedded": ("owt-embedded", "masked-mix", "arpc-6-3-0-T1.0"),
                     "gsm8k_code_embedded": ("gsm8k-embedded", "masked-mix", "arpc-3-2-1-T0.1")}


def setting_overhead_s(runs: str, scorer: str, limit: int, repeats: int, measured: eval_cost.CpuRates) -> dict[str, float]:
    """Per task: a real sweep setting's wall seconds (`sweep._evaluate`, the model and scorer already
    loaded, best of repeats) minus the work `pricing.estimate` prices from the rates just `measured`."""
    import tempfile

    from blockgen.harness.evaluation import evaluations, pricing, sweep

    out: dict[str, float] = {}
    metadata = {"scorer_model": scorer}
    with tempfile.TemporaryDirectory() as tmp:
        for task, (grid_name, model, label) in OVERHEAD_SETTINGS.items():
            g = replace(GRIDS[grid_name], limit=limit)
            found = [s for s in evaluations.evaluations(g, runs) if s.run == g.run_name(model) and s.label == label]
            if not found or not (Path(found[0].checkpoint) / "config.json").is_file():
                print(f"overhead of {task}: no checkpoint {g.run_name(model)} under {runs}; skipped")
                continue
            s = found[0]
            lm, rng = sweep._load_model(s, g, "cpu")
            pool = sweep._Scorers(metadata, "cpu", Path(tmp))
            try:
                wall, _ = best(lambda: sweep._evaluate(s, g, lm, rng, pool, Path(tmp) / task, "cpu"), repeats)
            finally:
                pool.close()
            priced = pricing.estimate(g, s, model, metadata, cpu_rates=measured).seconds
            out[task] = max(0.0, wall - priced)
            print(f"overhead of {task}: setting {s.run} {s.label} at limit {limit}: {wall:.2f} s wall, "
                  f"{priced:.2f} s priced work -> {out[task]:.2f} s per setting")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grids", nargs="+", default=list(OFFLINE_GRIDS), choices=list(OFFLINE_GRIDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: torch's)")
    parser.add_argument("--scorer", default="runs/ci-pipeline/scorer-text", help="offline Gen PPL scorer directory")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--write-rates", nargs="?", const=str(eval_cost.CPU_RATES_FILE), metavar="FILE",
                        help="write the float32 rates to FILE (default: the stored file the dry run prices with, "
                             "harness/costs/measured_rates/cpu-2-core.json)")
    parser.add_argument("--runs", default="runs/issue20-ci", help="trained offline checkpoints for the per-setting overhead")
    parser.add_argument("--overhead-limit", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.threads} torch thread(s), {os.cpu_count()} cores, torch {torch.__version__}; {load()}")
    scorer = None
    if any(GRIDS[g].benchmark == "owt" for g in args.grids) and (Path(args.scorer) / "config.json").is_file():
        scorer = scorer_sample_s(args.scorer, 16, args.repeats)
        print(f"scorer {args.scorer}: {scorer * 1e3:.1f} ms per sample (Gen PPL + MAUVE features and MAUVE, transformers, float32)")
    rates: dict[tuple[str, int], dict] = {}
    print(f"\n{'preset':<28} {'batch':>5} {'dtype':>8} {'pass ms':>9} {'call ms':>9} {'AR call ms':>10}")
    for (name, batch), want in cases(args.grids).items():
        results = {}
        for dtype in args.dtypes:
            r = results[dtype] = measure(name, batch, want, dtype, args.repeats)
            fmt = (lambda x: "-" if x is None else f"{x * 1e3:.2f}")
            print(f"{name:<28} {batch:>5} {dtype:>8} {fmt(r['pass_s']):>9} {fmt(r['call_s']):>9} {fmt(r['ar_call_s']):>10}", flush=True)
        if len(args.dtypes) == 2:
            a, b = (results[d] for d in args.dtypes)
            ratio = {k: f"{a[k] / b[k]:.2f}" for k in a if a[k] and b[k]}
            print(f"{'':<28} {'':>5} {'ratio':>8} {ratio.get('pass_s', '-'):>9} {ratio.get('call_s', '-'):>9} {ratio.get('ar_call_s', '-'):>10}")
        rates[name, batch] = results.get("float32", next(iter(results.values())))
    print(f"\n{load()}")
    sandbox = sandbox_program_s(32, args.repeats)
    print(f"sandbox: {sandbox * 1e3:.1f} ms per gsm8k_code program (32 programs, {os.cpu_count()} workers)")
    table: dict[str, tuple[eval_cost.CpuRate, ...]] = {}  # preset -> one rate per measured batch size
    for (name, batch), r in rates.items():
        rate = eval_cost.CpuRate(batch, r["pass_s"], r["call_s"], r["ar_call_s"], scorer if name.startswith("owt") else None)
        table[name] = (*table.get(name, ()), rate)
    command = " ".join([".venv/bin/python bench/bench_eval_cost.py", *(sys.argv[1:] if argv is None else argv)])
    measured = eval_cost.CpuRates(command=command, date=datetime.date.today().isoformat(), torch_threads=args.threads,
                                  cores=os.cpu_count() or 1, load_average=os.getloadavg(), rates=table,
                                  setting_overhead_s={}, sandbox_program_s=sandbox)
    # the per-setting overhead is what a real setting takes beyond the work priced from these rates
    overhead = setting_overhead_s(args.runs, args.scorer, args.overhead_limit, args.repeats, measured)
    print(f"\n{load()}")
    if args.write_rates:
        path = write_dataclass(rounded(measured, overhead), args.write_rates)
        print(f"wrote {path}")


def rounded(measured: eval_cost.CpuRates, overhead: dict[str, float]) -> eval_cost.CpuRates:
    """What the rates file keeps: seconds per call to 5 decimals, the overhead to 2, the sandbox to 4, and
    the load average when the run ended."""
    def r5(x: float | None) -> float | None:
        return None if x is None else round(x, 5)

    table = {name: tuple(eval_cost.CpuRate(r.batch, round(r.pass_s, 5), r5(r.call_s), r5(r.ar_call_s), r5(r.scorer_sample_s))
                         for r in rows) for name, rows in measured.rates.items()}
    return replace(measured, load_average=tuple(round(x, 2) for x in os.getloadavg()), rates=table,
                   setting_overhead_s={task: round(s, 2) for task, s in overhead.items()},
                   sandbox_program_s=None if measured.sandbox_program_s is None else round(measured.sandbox_program_s, 4))


if __name__ == "__main__":
    main()
