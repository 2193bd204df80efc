"""lm-eval tasks ``gsm8k_code`` and ``gsm8k_code_embedded``: word problems answered by a program.

The model writes a TinyGSM-style ``simple_math_problem()`` for each question; the program runs in
the sandbox (`blockgen.tasks.sandbox`) and its return value is compared with the reference answer
(integers exactly, floats to 1e-3).

- ``gsm8k_code``: GSM8K's test split (``openai/gsm8k``, config ``main``, 1,319 questions), or a
  local JSON/JSONL file of the same schema (``question``, ``answer`` ending in ``#### N``) given as
  ``--metadata '{"gsm8k_path": "test.jsonl"}'``.
- ``gsm8k_code_embedded``: the offline twin, on the embedded generator's held-out test split
  (`blockgen.harness.data.wordproblems`, seed 0): the first ``embedded_problems`` (500) problems it
  draws, whatever the tokenizer, so every checkpoint sees the same problems. About 30 % have a
  structure never used in training; ``exact_match_heldout`` and ``exact_match_in_distribution``
  score the two parts apart. The generator's level is ``--metadata '{"difficulty": "hard"}'``
  (default "easy", the demo's training level: `wordproblems.DIFFICULTIES`).

Prompt: the exact ids a checkpoint was trained on, ``[BOS] question SEP`` (`encode_prompt`). lm-eval
hands the model a string, which the blockgen adapter encodes as BOS + the tokenizer's encoding, so
the context is the question followed by the separator's text (the tokenizer's SEP token such as
``<|sep|>``, or a newline for tokenizers without one), and every context is checked to encode to
exactly the training ids when the data load. The tokenizer is the checkpoint's: lm-eval passes
``--model_args`` to tasks as metadata, so ``pretrained=DIR`` names it.

Generation budget (`GSM8KCodeTask`, any lm-eval model type): each row may generate the room its
prompt leaves in the model's length (`tasks/model_info.py`), capped by a max_gen_toks the user gives;
samples record ``budget`` and ``response_tokens``, and ``budget_hits`` counts the rows that used all of it.

Scoring: `ExecutePrograms` (an lm-eval filter: it receives every response of the run at once)
extracts each program and runs them all in parallel in the sandbox, never in the evaluating
process; `process_results` compares each value with the answer. Metrics: ``exact_match`` and the
share of each outcome (``outcome_wrong_answer``, ``outcome_syntax_error``, ...); with
``--log_samples`` each sample keeps its program, outcome, value and error (``filtered_resps``, a
JSON object per sample).
"""

from __future__ import annotations

import ast
import json
import os
import re
from typing import Any

from lm_eval.api.filter import Filter
from lm_eval.api.samplers import ContextSampler
from tqdm import tqdm

from blockgen.harness.runtime.distributed import ranks_from_env
from blockgen.harness.data.wordproblems import DEFAULT_DIFFICULTY
from blockgen.tasks.model_info import checkpoint_tokenizer, model_max_length, model_path
from blockgen.tasks.owt import YamlClassTask
from blockgen.tasks.sandbox import ENTRY_POINT, SandboxConfig, SandboxResult, run_many

GSM8K_HUB = ("openai/gsm8k", "main", "test")
EMBEDDED_SEED = 0
# Every verdict but "correct", in the order the results list them.
OUTCOMES = (
    "wrong_answer", "not_a_number", "exception", "syntax_error", "timeout", "memory", "killed",
    "output_limit", "sandbox_error",
)


# ------------------------------------------------------------------------------ prompts


def prompt_contexts(questions: list[str], tokenizer, special) -> list[str]:
    """Context strings that encode to exactly `encode_prompt(question)` without its BOS.

    The separator's text is appended to each question; a tokenizer that merged it with the
    question's last characters would change the ids, so every context is checked.
    """
    from blockgen.harness.data.sources import encode_prompt

    sep = tokenizer.decode(list(special.sep), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    contexts = [q + sep for q in questions]
    got = tokenizer(contexts, add_special_tokens=False)["input_ids"] if contexts else []
    bad = [i for i, (q, ids) in enumerate(zip(questions, got)) if ids != encode_prompt(q, tokenizer, special)[1:]]
    if bad:
        raise ValueError(
            f"{len(bad)} of {len(questions)} prompts do not encode to the training ids [BOS] question SEP "
            f"with this tokenizer (separator {sep!r}); first: question {bad[0]}: {questions[bad[0]][-80:]!r}"
        )
    return contexts


def _tokenizer_from(metadata: dict[str, Any]):
    pretrained = metadata.get("pretrained")
    if not pretrained:
        raise ValueError(
            "gsm8k_code builds each prompt with the checkpoint's tokenizer, named by pretrained=DIR in "
            "--model_args (lm-eval passes model args to tasks as metadata); with a TaskManager of your "
            "own, pass metadata={'pretrained': DIR}"
        )
    return checkpoint_tokenizer(model_path(metadata))


def generation_budget(prompt_tokens: int, max_length: int, cap: int | None = None) -> int:
    """Tokens a row may generate: the room its prompt leaves in the model's length, at most `cap`
    (a user's max_gen_toks), at least 1 (a prompt that fills the model is cut by the model)."""
    room = max_length - prompt_tokens
    return max(1, room if cap is None else min(cap, room))


def _dataset(rows: list[dict], metadata: dict[str, Any]):
    """Rows with their context (``prompt``), its length in tokens with BOS (``prompt_tokens``) and the
    model's length (``max_length``), from which each request's generation budget follows."""
    from datasets import Dataset, DatasetDict

    from blockgen.harness.data.sources import encode_prompt

    tokenizer, special = _tokenizer_from(metadata)
    contexts = prompt_contexts([r["question"] for r in rows], tokenizer, special)
    max_length = model_max_length(metadata, tokenizer)
    rows = [{**r, "prompt": c, "prompt_tokens": len(encode_prompt(r["question"], tokenizer, special)), "max_length": max_length}
            for r, c in zip(rows, contexts)]
    return DatasetDict({"test": Dataset.from_list(rows)})


# ------------------------------------------------------------------------------ data


def load_gsm8k(gsm8k_path: str | None = None, **metadata):
    """GSM8K's test split from the hub, or from a local file with its schema (`gsm8k_path`)."""
    from datasets import load_dataset

    from blockgen.harness.checkpoints.hub import HubUnavailableError, hub_call

    if gsm8k_path:
        if not os.path.isfile(gsm8k_path):
            raise FileNotFoundError(f"gsm8k_path={gsm8k_path}: no such file")
        data = load_dataset("json", data_files=str(gsm8k_path), split="train")
    else:
        name, config, split = GSM8K_HUB
        try:
            data = hub_call(lambda: load_dataset(name, config, split=split), f"dataset {name} ({config}, {split})")
        except HubUnavailableError as err:
            raise HubUnavailableError(
                f"gsm8k_code: {err}\nWithout the hub: point the task at a local copy of the test split "
                "(JSON or JSONL, fields `question` and `answer` ending in `#### N`) with "
                "--metadata '{\"gsm8k_path\": \"PATH\"}', or run the offline twin: --tasks gsm8k_code_embedded"
            ) from err
    missing = {"question", "answer"} - set(data.column_names)
    if missing:
        raise ValueError(f"gsm8k_code: the data lack field(s) {sorted(missing)}; found {data.column_names}; "
                         "expected GSM8K's schema: question, answer ending in '#### N'")
    return _dataset([{"question": q, "answer": a} for q, a in zip(data["question"], data["answer"])], metadata)


def generated_test_problems(n: int, difficulty: str = DEFAULT_DIFFICULTY) -> list[dict]:
    """The first n generated test problems (seed 0) of a difficulty level: question, answer
    ('#### N'), is_heldout, structure."""
    from blockgen.harness.data.wordproblems import generate, is_heldout

    return [
        {"question": p.question, "answer": f"#### {p.answer}", "is_heldout": is_heldout(p), "structure": p.structure}
        for p in generate("test", n, seed=EMBEDDED_SEED, level=difficulty)
    ]


def load_embedded(embedded_problems: int, difficulty: str = DEFAULT_DIFFICULTY, **metadata):
    """The embedded test problems; `embedded_problems` comes from the task YAML's metadata (500) or --metadata."""
    if not isinstance(embedded_problems, int) or embedded_problems < 1:
        raise ValueError(f"embedded_problems={embedded_problems!r}; must be a positive integer")
    return _dataset(generated_test_problems(embedded_problems, difficulty), metadata)


class ZeroShot(ContextSampler):
    """The tasks' few-shot sampler: refuses any shot. The models were trained on a bare question
    (`[BOS] question SEP`), so examples in front of it would be a prompt they never saw."""

    def sample(self, n: int, eval_doc=None, df=None, **kwargs):
        if n > 0:
            raise ValueError(f"gsm8k_code tasks are zero-shot (the model sees [BOS] question SEP, as in training); "
                             f"got --num_fewshot {n}: run without --num_fewshot (or with 0)")
        return []


# ------------------------------------------------------------------------------ programs


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_CODE_START = re.compile(
    r"(?:async\s+)?def\s+\w+\s*\(|class\s+\w+|import\s+\w|from\s+[\w.]+\s+import\b|@\w"
)
# Top-level lines that may follow the function: more code, a call, an assignment, a comment.
_TOP_LEVEL = re.compile(
    r"(?:async\s+def|def|class|import|if|for|while|with|try|except|finally|else|elif|assert)\b"
    r"|from\s+[\w.]+\s+import\b|@|#|[A-Za-z_][\w.]*\s*(?:=[^=]|\(|\[|[-+*/%]=)"
)


def extract_code(completion: str, entry_point: str = ENTRY_POINT) -> str:
    """The Python program in a model completion, without leading or trailing prose.

    Takes the fenced block that defines `entry_point` (or the first fenced block, or the whole
    text), starts at the first line that opens code, stops at the first top-level line that does
    not look like code (or at a second definition of `entry_point`), then drops trailing
    top-level statements until the rest parses.
    """
    text = completion.replace("\r\n", "\n")
    blocks = _FENCE.findall(text)
    if blocks:
        text = next((b for b in blocks if f"def {entry_point}" in b), blocks[0])
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if _CODE_START.match(line)), None)
    if start is None:
        return text.strip() + "\n"
    kept: list[str] = []
    defined = False
    for line in lines[start:]:
        if re.match(rf"(?:async\s+)?def\s+{re.escape(entry_point)}\b", line):
            if defined:  # the model went on to the next problem
                break
            defined = True
        if not line.strip() or line[0] in " \t" or _TOP_LEVEL.match(line):
            kept.append(line)
        else:
            break
    # Candidate ends: before each top-level line (longest first), so prose that slipped
    # through the line filter is cut off at a statement boundary.
    ends = [len(kept)] + [
        i for i in range(len(kept) - 1, 0, -1) if kept[i].strip() and kept[i][0] not in " \t"
    ]
    for end in ends[:64]:  # bounded: each try parses the whole prefix
        code = "\n".join(kept[:end]).rstrip() + "\n"
        if _parses(code):
            return code
    return "\n".join(kept).rstrip() + "\n"


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


# ------------------------------------------------------------------------------ scoring


def program_record(program: str, result: SandboxResult) -> str:
    """What a logged sample keeps of a run, as JSON: the program, its outcome, value and error."""
    return json.dumps({"program": program, "outcome": result.outcome.value, "value": result.value, "error": result.error})


class GSM8KCodeTask(YamlClassTask):
    """Each request's generation budget is the room its prompt leaves in the model's length (so no
    program is cut for want of room), capped by a max_gen_toks the user gave (``--gen_kwargs`` or
    the model argument); every sample records its budget and length, and the results count the rows
    that used all of it (``budget_hits``)."""

    def _cap(self) -> int | None:
        for source in (self.config.generation_kwargs or {}, self.config.metadata or {}):
            if source.get("max_gen_toks") is not None:
                return int(source["max_gen_toks"])
        return None

    def construct_requests(self, doc: dict, ctx: str, **kwargs):
        request = super().construct_requests(doc, ctx, **kwargs)
        for inst in request if isinstance(request, list) else [request]:
            context, gen_kwargs = inst.arguments
            budget = generation_budget(doc["prompt_tokens"], doc["max_length"], self._cap())
            inst.arguments = (context, {**gen_kwargs, "max_gen_toks": budget})
        return request

    def apply_filters(self):
        super().apply_filters()
        instances = self._instances or []
        if not instances:
            return instances
        tokenizer, _ = _tokenizer_from(self.config.metadata or {})
        responses = [inst.resps[0] if inst.resps else "" for inst in instances]  # one per doc (repeats: 1)
        lengths = [len(ids) for ids in tokenizer(responses, add_special_tokens=False)["input_ids"]]
        for inst, n in zip(instances, lengths):
            budget = inst.arguments[1]["max_gen_toks"]
            for name, record in inst.filtered_resps.items():
                inst.filtered_resps[name] = json.dumps({**json.loads(record), "budget": budget, "response_tokens": n})
        return instances


def budget_hits(items: list[float]) -> int:
    """How many rows used their whole generation budget (their response, re-encoded, is that long)."""
    return int(sum(items))


class ExecutePrograms(Filter):
    """Extracts the program of every response and runs them all at once in the sandbox.

    YAML options: wall_timeout_s, cpu_time_s (per program) and max_workers (default: CPU count).
    """

    def __init__(self, wall_timeout_s: float = 5.0, cpu_time_s: int = 5, max_workers: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.config = SandboxConfig(wall_timeout_s=wall_timeout_s, cpu_time_s=cpu_time_s)
        self.max_workers = max_workers

    def apply(self, resps, docs) -> list[str]:
        programs = [extract_code(r[0] if r else "") for r in resps]  # one response per doc (repeats: 1)
        quiet = not ranks_from_env().is_main
        with tqdm(total=len(programs), desc="gsm8k_code: running programs in the sandbox", disable=quiet) as bar:
            results = run_many(programs, self.config, self.max_workers, progress=lambda _: bar.update())
        return [program_record(p, r) for p, r in zip(programs, results)]


# ------------------------------------------------------------------------------ answers


_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def parse_gsm8k_answer(text: str) -> int | float | None:
    """The number after the last `####` (or the first number in `text`): '1,000' -> 1000."""
    tail = text.rsplit("####", 1)[-1].replace("$", "")
    match = _NUMBER.search(tail)
    if match is None:
        return None
    number = match.group().replace(",", "")
    try:
        return float(number) if "." in number else int(number)
    except ValueError:
        return None


def is_correct(
    result: SandboxResult | int | float | None, reference: str | int | float
) -> bool:
    """Integers must match exactly; anything involving a float must be within 1e-3."""
    value = result.value if isinstance(result, SandboxResult) else result
    ref = parse_gsm8k_answer(reference) if isinstance(reference, str) else reference
    if value is None or ref is None or isinstance(value, bool) or isinstance(ref, bool):
        return False
    if isinstance(value, int) and isinstance(ref, int):
        return value == ref
    try:
        return abs(float(value) - float(ref)) <= 1e-3
    except OverflowError:
        return False


def verdict(record: dict, answer: str) -> str:
    """'correct', or why not: 'wrong_answer' (a number, not the answer) or the sandbox's outcome."""
    if record["outcome"] == "ok":
        return "correct" if is_correct(record["value"], answer) else "wrong_answer"
    return record["outcome"]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    (record,) = results
    parsed = json.loads(record)
    v = verdict(parsed, doc["answer"])
    out = {"exact_match": float(v == "correct"), **{f"outcome_{o}": float(v == o) for o in OUTCOMES}}
    if "budget" in parsed:  # written by GSM8KCodeTask (absent when the filter is called alone)
        out["budget_hits"] = float(parsed["response_tokens"] >= parsed["budget"])
    if "is_heldout" in doc:  # the embedded twin: each part alone, too
        out["exact_match_heldout" if doc["is_heldout"] else "exact_match_in_distribution"] = out["exact_match"]
    return out
