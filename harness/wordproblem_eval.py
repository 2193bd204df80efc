"""Accuracy on word problems: sample a program per question, execute it in the sandbox, compare.

This is the embedded default's evaluation (generated test problems); the lm-eval task `gsm8k_code`
does the same on GSM8K through `lm_eval`. Problems are those whose reference example fits the
model's context (the same filter as training), so the model has room to write its answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from tqdm.auto import tqdm

from blockgen.harness.checkpoint import checkpoint_special_tokens
from blockgen.harness.data import encode_prompt
from blockgen.models.model import BlockGen
from blockgen.models.sampling import SamplerConfig, check_config, generate, paper_nfe_per_block
from blockgen.tasks.sandbox import SandboxConfig, extract_code, is_correct, run_many


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int | float


@dataclass(frozen=True)
class EvalReport:
    sampler: dict
    n: int
    correct: int
    accuracy: float
    model_calls_per_block: float
    paper_nfe_per_block: int
    outcomes: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_problems(
    model: BlockGen,
    tokenizer,
    problems: Sequence[Problem],
    sampler: SamplerConfig,
    batch_size: int = 64,
    sandbox: SandboxConfig | None = None,
    progress: bool = True,
) -> EvalReport:
    """Generate, execute and score. Prompts are batched by length so each batch gets the most room."""
    block = check_config(model, sampler)
    special = checkpoint_special_tokens(model, tokenizer)
    prompts = [encode_prompt(p.question, tokenizer, special) for p in problems]
    order = sorted(range(len(problems)), key=lambda i: len(prompts[i]))
    completions: list[str] = [""] * len(problems)
    calls, blocks = 0, 0
    bar = tqdm(total=len(problems), desc=f"{sampler.name} T={sampler.temperature}", disable=not progress, leave=False)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        room = model.config.seq_len - max(len(prompts[i]) for i in idx)
        budget = (room // block) * block
        if budget < 1:
            bar.update(len(idx))
            continue  # no room left to answer: scored as wrong
        config = SamplerConfig(**{**asdict(sampler), "max_new_tokens": budget, "seed": sampler.seed + start})
        result = generate(model, [prompts[i] for i in idx], config, eos_id=special.eos, pad_id=special.pad)
        calls += result.model_calls
        blocks += result.n_blocks
        for i, tokens in zip(idx, result.tokens):
            completions[i] = tokenizer.decode(tokens, skip_special_tokens=True)
        bar.update(len(idx))
    bar.close()
    correct, outcomes = score_completions(completions, problems, sandbox)
    return EvalReport(
        sampler=asdict(sampler),
        n=len(problems),
        correct=correct,
        accuracy=correct / max(len(problems), 1),
        model_calls_per_block=calls / max(blocks, 1),
        paper_nfe_per_block=paper_nfe_per_block(sampler),
        outcomes=outcomes,
    )


def score_completions(
    completions: Sequence[str], problems: Sequence[Problem], sandbox: SandboxConfig | None = None
) -> tuple[int, dict[str, int]]:
    """(number correct, count of each sandbox outcome): extract each program, run it, compare."""
    results = run_many([extract_code(c) for c in completions], sandbox or SandboxConfig(wall_timeout_s=2.0, cpu_time_s=2))
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
    return sum(is_correct(r, p.answer) for r, p in zip(results, problems)), outcomes


def embedded_test_problems(tokenizer, seq_len: int, n: int, seed: int = 0) -> list[Problem]:
    """The first n generated test problems whose reference example `[BOS] q SEP code EOS` fits in seq_len."""
    from blockgen.harness.tokenizer import special_tokens
    from blockgen.harness.wordproblems import generate as generate_problems

    special = special_tokens(tokenizer)
    out: list[Problem] = []
    for p in generate_problems("test", 4 * n, seed=seed):
        length = len(encode_prompt(p.question, tokenizer, special)) + len(tokenizer.encode(p.code, add_special_tokens=False)) + 1
        if length <= seq_len:
            out.append(Problem(p.question, p.answer))
        if len(out) == n:
            break
    return out
