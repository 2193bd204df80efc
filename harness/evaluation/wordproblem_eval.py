"""Accuracy on the embedded word problems, through lm-eval's task `gsm8k_code_embedded`.

One code path: the demo's numbers come from lm-eval on the same task a user runs with `lm_eval --model
blockgen --tasks gsm8k_code_embedded`, through the project's one call of lm-eval (`sweep.run_task`);
this module only names the setting and reads the results back.
"""

from __future__ import annotations

import json
from pathlib import Path

from blockgen.models.sampler_config import SamplerConfig

TASK = "gsm8k_code_embedded"


def evaluate_embedded(
    checkpoint: str | Path,
    sampler: SamplerConfig,
    n_problems: int = 500,
    max_gen_toks: int | None = None,
    batch_size: int = 32,
    device: str = "cpu",
    limit: int | None = None,
    difficulty: str | None = None,
    results_path: str | Path | None = None,
) -> dict:
    """Run `gsm8k_code_embedded` on a checkpoint with one sampler; the task's numbers and the run's calls.

    `difficulty`: the generator's level of the test problems (None: the task's default).
    `results_path`: also write lm-eval's results (what `lm_eval --output_path` holds) there as JSON, and
    the per-problem samples (what `--log_samples` keeps: program, outcome, exact_match per problem) beside
    it as JSON lines (`samples_path`), which `blockgen leaderboard compare` pairs."""
    metadata = {"embedded_problems": n_problems}
    if difficulty is not None:
        metadata["difficulty"] = difficulty
    out = evaluate_task(checkpoint, sampler, TASK, metadata, max_gen_toks, batch_size, device, limit, results_path)
    return report(out)


def evaluate_task(checkpoint: str | Path, sampler: SamplerConfig, task: str, metadata: dict, max_gen_toks: int | None = None,
                  batch_size: int = 32, device: str = "cpu", limit: int | None = None,
                  results_path: str | Path | None = None) -> dict:
    """One lm-eval task on a checkpoint with one sampler (`sweep.run_task`): lm-eval's output. `metadata`: the
    task's own settings. `results_path`: the results written there as JSON, the per-document samples beside
    them (`samples_path`), both atomically, samples first (results imply samples)."""
    from blockgen.harness.evaluation.lm_eval_model.arguments import sampler_model_args
    from blockgen.harness.evaluation.sweep import run_task

    model_args = {"pretrained": str(checkpoint), **sampler_model_args(sampler)}
    if max_gen_toks is not None:
        model_args["max_gen_toks"] = max_gen_toks
    # lm-eval passes model args to tasks as metadata when it builds the TaskManager itself; ours
    # indexes only this project's tasks (lm-eval's own few thousand cost seconds), so pass them here.
    out = run_task("blockgen", model_args, task, {**model_args, **metadata}, batch_size=batch_size, device=device,
                   limit=limit, log_samples=results_path is not None)
    if results_path is not None:
        from lm_eval.utils import handle_non_serializable

        path = Path(results_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        samples = out.pop("samples", {}).get(task, [])
        tmp = samples_path(path).with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(s, default=handle_non_serializable) + "\n" for s in samples))
        tmp.replace(samples_path(path))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2, default=handle_non_serializable))
        tmp.replace(path)
    return out


def samples_path(results_path: str | Path) -> Path:
    """Where `evaluate_embedded` keeps the per-problem samples of a results file: X.json -> X.samples.jsonl."""
    path = Path(results_path)
    return path.with_name(f"{path.stem}.samples.jsonl")


def report(out: dict) -> dict:
    """The demo's summary of one `simple_evaluate` result of the task."""
    metrics = {k.split(",")[0]: v for k, v in out["results"][TASK].items() if "," in k}
    usage = out["config"]["blockgen"]["tasks"][TASK]["generate_until"]
    from blockgen.harness.evaluation.lm_eval_model.usage import merge_budgets

    (settings,) = merge_budgets(usage["settings"])  # one sampler per run (rows' budgets may differ)
    n = out["n-samples"][TASK]["effective"]
    return {
        "sampler": {k: settings[k] for k in ("sampler", "steps", "ge", "warmup", "temperature", "block_size", "max_gen_toks")},
        "n": n,
        "accuracy": metrics["exact_match"],
        "accuracy_stderr": metrics["exact_match_stderr"],
        "accuracy_in_distribution": metrics.get("exact_match_in_distribution"),
        "accuracy_heldout": metrics.get("exact_match_heldout"),
        "outcomes": {k[len("outcome_"):]: v for k, v in metrics.items() if k.startswith("outcome_") and not k.endswith("_stderr")},
        "paper_nfe_per_block": settings["paper_nfe_per_block"],
        "model_calls_per_block": settings["model_calls_per_block"],
        "model_calls": usage["model_calls"],
        "truncated_prompts": usage["truncated_requests"],
        "budget_hits": metrics.get("budget_hits"),
    }
