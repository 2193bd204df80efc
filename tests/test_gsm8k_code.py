"""The lm-eval tasks gsm8k_code and gsm8k_code_embedded: prompts, scoring, and the real commands.

Prompts are checked token for token against the training encoder (`encode_prompt`) for both kinds
of tokenizer: a BPE with a SEP token (the local tokenizer, the default) and a Hugging Face tokenizer without
one. End to end runs use the unmodified `lm_eval` command and `torchrun -m lm_eval` on micro
checkpoints; GSM8K comes from a local copy of the real test split (../shared, tests only).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blockgen.harness.checkpoints.checkpoint import save_checkpoint
from blockgen.harness.data.sources import encode_prompt
from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe
from blockgen.harness.data.wordproblems import generate, is_heldout
from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.tasks import gsm8k_code
from blockgen.tasks.gsm8k_code import OUTCOMES, ExecutePrograms, is_correct, parse_gsm8k_answer, process_results
from blockgen.tasks.sandbox import Outcome, SandboxResult
from limits import HANG_S

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.json"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}
GEN_ARGS = "sampler=arpc,steps=4,ge=2,temperature=0.5,max_gen_toks=32,seed=5"


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def gsm8k() -> list[dict]:
    """The real test split in GSM8K's hub schema (question, answer)."""
    if not GSM8K.exists():
        pytest.skip(f"{GSM8K} not found")
    return [{"question": r["prompt"], "answer": r["response_ground_truth"]} for r in json.loads(GSM8K.read_text())]


@pytest.fixture(scope="module")
def gsm8k_file(gsm8k, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gsm8k") / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gsm8k))
    return path


def _sep_bpe():
    problems = generate("train", 600, level="hard")  # the full variety: a vocabulary closer to GSM8K's
    return train_bpe([p.question for p in problems] + [p.code for p in problems], 400)


def _bpe_without_sep():
    """A GPT-2-style byte-level BPE: one special token (BOS = EOS), no SEP, no PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    problems = generate("train", 600, level="hard")  # the full variety: a vocabulary closer to GSM8K's
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.question for p in problems] + [p.code for p in problems], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def _checkpoint(out: Path, tok, block_sizes=(1, 16), block_weights=(0.2, 0.8)) -> Path:
    torch.manual_seed(0)
    config = BlockGenConfig(vocab_size=len(tok), seq_len=128, prior="masked", block_sizes=block_sizes,
                            block_weights=block_weights, shape=ModelShape(n_layers=1, d_model=32, n_heads=4, cond_dim=16, dropout=0.0),
                            special_tokens=special_tokens(tok).to_dict())
    return save_checkpoint(out, BlockGen(config).eval(), tok)


@pytest.fixture(scope="module")
def gsm_ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gsm8k_ckpts")
    return {"sep": _checkpoint(root / "sep", _sep_bpe()), "no_sep": _checkpoint(root / "no_sep", _bpe_without_sep())}


@pytest.fixture(scope="module")
def trained(ci_checkpoint) -> Path:
    """A micro mixture (block sizes 1 and 4) trained for 40 steps on generated word problems: the `ci` preset,
    shared with other modules (tests/shared_fixtures.py)."""
    return ci_checkpoint


def _run(cmd: list[str], timeout: int = HANG_S, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV, cwd="/")


def _results(out_dir: Path) -> dict:
    (path,) = out_dir.rglob("results_*.json")
    return json.loads(path.read_text())


def _samples(out_dir: Path, task: str) -> list[dict]:
    (path,) = out_dir.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------ prompts


@pytest.mark.parametrize("kind", ["sep", "no_sep"])
def test_prompts_are_the_training_ids(kind, gsm_ckpts, gsm8k_file):
    """Every GSM8K and embedded context, encoded as the adapter encodes it (BOS + tokenizer), is
    exactly `encode_prompt`'s [BOS] question SEP, for a tokenizer with a SEP token and one without."""
    from lm_eval.api.registry import get_model

    import blockgen.lm_eval

    blockgen.lm_eval.register()
    tok, special = gsm8k_code.checkpoint_tokenizer(str(gsm_ckpts[kind]))
    assert (special.sep == (tok.sep_token_id,)) == (kind == "sep")
    if kind == "no_sep":
        assert special.sep == tuple(tok.encode("\n", add_special_tokens=False)) and special.bos == special.eos
    lm = get_model("blockgen")(pretrained=str(gsm_ckpts[kind]), device="cpu")
    for load, kwargs in ((gsm8k_code.load_gsm8k, {"gsm8k_path": str(gsm8k_file)}),
                         (gsm8k_code.load_embedded, {"embedded_problems": 200})):
        docs = load(pretrained=str(gsm_ckpts[kind]), **kwargs)["test"]
        assert len(docs) == (1319 if load is gsm8k_code.load_gsm8k else 200)
        for doc in docs:
            assert [lm.prefix_token_id, *lm.tok_encode(doc["prompt"])] == encode_prompt(doc["question"], tok, special)


def test_prompt_mismatch_is_an_error(gsm_ckpts):
    """A separator the tokenizer merges into the question's end would change the ids: refused."""
    tok, special = gsm8k_code.checkpoint_tokenizer(str(gsm_ckpts["no_sep"]))
    assert tok.convert_ids_to_tokens(tok.encode("How many", add_special_tokens=False))[-1] == "Ġmany"
    merging = replace(special, sep=tuple(tok.encode("ny", add_special_tokens=False)))  # "ma" + "ny" -> "many"
    with pytest.raises(ValueError, match=r"1 of 2 prompts do not encode to the training ids"):
        gsm8k_code.prompt_contexts(["How many?", "How ma"], tok, merging)


def test_task_needs_the_checkpoint_and_the_data(gsm_ckpts, tmp_path):
    with pytest.raises(ValueError, match="pretrained=DIR"):
        gsm8k_code.load_embedded(embedded_problems=4)  # the YAML metadata gives the count
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "response_ground_truth": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match=r"lack field\(s\) \['answer', 'question'\]"):
        gsm8k_code.load_gsm8k(gsm8k_path=str(bad), pretrained=str(gsm_ckpts["sep"]))


def test_embedded_problems_are_fixed_and_mixed():
    docs = gsm8k_code.generated_test_problems(500)
    assert docs == gsm8k_code.generated_test_problems(500)  # deterministic, whatever the tokenizer
    problems = generate("test", 500, seed=0)
    assert [d["question"] for d in docs] == [p.question for p in problems]
    assert [d["is_heldout"] for d in docs] == [is_heldout(p) for p in problems]
    assert 100 < sum(d["is_heldout"] for d in docs) < 200  # about 30 % held-out structures
    assert all(d["answer"] == f"#### {p.answer}" for d, p in zip(docs, problems))


# ------------------------------------------------------------------------------ scoring


ANSWER = "Some reasoning.\n#### 18"
HAND_WRITTEN = {  # completion -> verdict against ANSWER (or the answer given)
    "right": ("def simple_math_problem() -> int:\n    eggs = 16 - 3 - 4\n    return eggs * 2\n", "correct"),
    "right_with_prose": ("Here:\n```python\ndef simple_math_problem():\n    return 18\n```\nThe answer is 18.", "correct"),
    "wrong": ("def simple_math_problem():\n    return 17\n", "wrong_answer"),
    "float_close": ("def simple_math_problem():\n    return 36 / 2 + 0.0004\n", "correct"),
    "float_off": ("def simple_math_problem():\n    return 18.01\n", "wrong_answer"),
    "printed_not_returned": ("def simple_math_problem():\n    print(18)\n", "not_a_number"),
    "returns_string": ("def simple_math_problem():\n    return '18'\n", "not_a_number"),
    "no_function": ("result = 18\nprint(result)\n", "exception"),
    "no_code": ("I think the answer is 18.", "syntax_error"),
    "syntax_error": ("def simple_math_problem(:\n    return 18\n", "syntax_error"),
    "exception": ("def simple_math_problem():\n    return 18 / 0\n", "exception"),
    "endless_loop": ("def simple_math_problem():\n    while True:\n        pass\n", "timeout"),
    "memory": ("def simple_math_problem():\n    return len(bytearray(2**40))\n", "memory"),
    "kills_evaluator": (f"import os\ndef simple_math_problem():\n    os.kill({os.getpid()}, 9)\n    return 18\n", "exception"),
    "kills_parent": ("import os, signal\ndef simple_math_problem():\n    os.kill(os.getppid(), 9)\n    return 18\n", "exception"),
    "writes_outside": ("def simple_math_problem():\n    open('/etc/blockgen-pwned', 'w').write('x')\n    return 18\n", "exception"),
    "fork_bomb": ("import os\ndef simple_math_problem():\n    while True:\n        try:\n            os.fork()\n"
                  "        except OSError:\n            pass\n", "timeout"),
    "huge_int_subclass": ("class Liar(int):\n    def bit_length(self):\n        return 1\n"
                          "def simple_math_problem():\n    return Liar(10 ** 5000)\n", "wrong_answer"),
}


@pytest.mark.whole_machine
@pytest.mark.runs_programs
def test_scoring_of_hand_written_programs():
    """Right, wrong, float, printed, no function, syntax error, exception, endless loop, hostile:
    each gets its verdict, the filter runs them all at once, and the evaluator is untouched."""
    before = (os.getcwd(), sorted(os.listdir("/proc/self/fd")), dict(os.environ))
    names = list(HAND_WRITTEN)
    completions = [[HAND_WRITTEN[n][0]] for n in names]
    docs = [{"question": "q", "answer": ANSWER} for _ in names]
    records = ExecutePrograms(wall_timeout_s=1.5, cpu_time_s=1, max_workers=2).apply(completions, docs)
    for name, record, doc in zip(names, records, docs):
        parsed = json.loads(record)  # what --log_samples keeps
        assert set(parsed) == {"program", "outcome", "value", "error"}
        metrics = process_results(doc, [record])
        want = HAND_WRITTEN[name][1]
        assert metrics["exact_match"] == float(want == "correct"), (name, parsed)
        for outcome in OUTCOMES:
            assert metrics[f"outcome_{outcome}"] == float(want == outcome), (name, outcome, parsed)
        assert "exact_match_heldout" not in metrics and "exact_match_in_distribution" not in metrics
    assert json.loads(records[names.index("right_with_prose")])["program"] == "def simple_math_problem():\n    return 18\n"
    assert json.loads(records[names.index("float_close")])["value"] == pytest.approx(18.0004)
    assert not Path("/etc/blockgen-pwned").exists()
    assert (os.getcwd(), sorted(os.listdir("/proc/self/fd")), dict(os.environ)) == before
    # the embedded twin's docs also score each part of its split
    held = process_results({"answer": ANSWER, "is_heldout": True}, [records[0]])
    seen = process_results({"answer": ANSWER, "is_heldout": False}, [records[2]])
    assert held["exact_match_heldout"] == 1.0 and "exact_match_in_distribution" not in held
    assert seen["exact_match_in_distribution"] == 0.0 and "exact_match_heldout" not in seen


def test_parse_gsm8k_answer_on_every_record(gsm8k) -> None:
    answers = [parse_gsm8k_answer(r["answer"]) for r in gsm8k]
    assert all(isinstance(a, int) for a in answers)
    raw = [r["answer"].rsplit("####", 1)[1].strip() for r in gsm8k]
    assert answers == [int(a.replace(",", "")) for a in raw]
    with_commas = [a for a, text in zip(answers, raw) if "," in text]
    assert with_commas and all(a >= 1000 for a in with_commas)


def test_parse_gsm8k_answer_formats() -> None:
    assert parse_gsm8k_answer("so 3 + 4 = 7\n#### 1,000") == 1000
    assert parse_gsm8k_answer("#### $1,450,000") == 1450000
    assert parse_gsm8k_answer("#### -3") == -3
    assert parse_gsm8k_answer("#### 2.5") == 2.5
    assert parse_gsm8k_answer("42") == 42
    assert parse_gsm8k_answer("#### none") is None


def test_is_correct() -> None:
    assert is_correct(18, "#### 18")
    assert is_correct(18.0, "#### 18")
    assert is_correct(17.9995, "#### 18")
    assert not is_correct(18.002, "#### 18")
    assert not is_correct(17, "#### 18")
    assert is_correct(1000, "#### 1,000")
    assert is_correct(2.5, 2.5004)
    assert not is_correct(10**20 + 1, 10**20)  # integers compare exactly
    assert not is_correct(None, "#### 18")
    assert not is_correct(True, "#### 1")
    assert not is_correct(float("nan"), "#### 18")
    assert not is_correct(10**400, "#### 18")  # too large for a float, no exception
    assert not is_correct(SandboxResult(Outcome.NOT_A_NUMBER, error="str"), "#### 18")
    assert is_correct(SandboxResult(Outcome.OK, value=18), "#### 18")


@pytest.mark.whole_machine
@pytest.mark.runs_programs
def test_scoring_accepts_reference_programs_and_rejects_others():
    """The generator's own programs score right through the task's filter and scoring (with trailing text
    after the program); a changed answer or a printed one does not."""
    problems = generate("test", 12, seed=3)
    docs = [{"question": p.question, "answer": f"#### {p.answer}"} for p in problems]

    def score(completions: list[str]) -> tuple[float, Counter]:
        records = ExecutePrograms(wall_timeout_s=2.0, cpu_time_s=2).apply([[c] for c in completions], docs)
        correct = sum(process_results(d, [r])["exact_match"] for d, r in zip(docs, records))
        return correct, Counter(json.loads(r)["outcome"] for r in records)

    assert score([p.code + "\n<|eos|> trailing text" for p in problems]) == (12, {"ok": 12})
    assert score([p.code.replace("return result", "return result + 1") for p in problems])[0] == 0
    assert score([p.code.replace("return result", "print(result)") for p in problems])[0] == 0  # printing is not returning


# ------------------------------------------------------------------------------ the real commands


def _check_run(out: Path, task: str, n: int) -> dict:
    """What every run must report: metrics with stderr, outcome shares, the sampler's NFE and calls,
    truncation; samples that keep program, outcome and value, consistent with the metrics."""
    from blockgen.tasks.sandbox import SandboxConfig, run_program

    results = _results(out)
    metrics = results["results"][task]
    shares = [metrics[f"outcome_{o},sandbox"] for o in OUTCOMES]
    assert metrics["exact_match,sandbox"] + sum(shares) == pytest.approx(1.0)
    assert isinstance(metrics["exact_match_stderr,sandbox"], float)
    assert results["n-samples"][task]["effective"] == n
    usage = results["config"]["blockgen"]["tasks"][task]["generate_until"]
    from blockgen.harness.evaluation.lm_eval_model.usage import merge_budgets

    (settings,) = merge_budgets(usage["settings"])  # rows whose prompts leave less room than max_gen_toks differ
    assert settings["max_gen_toks"] == 32 and metrics["budget_hits,sandbox"] <= n
    assert settings["sampler"] == "arpc" and settings["steps"] == 4 and settings["ge"] == 2
    assert settings["paper_nfe_per_block"] == 4 + (4 - 1 - 0) // 2 + 1
    assert settings["model_calls_per_block"] > 0 and usage["model_calls"] == settings["model_calls"] > 0
    assert usage["requests"] == n and 0 <= usage["truncated_requests"] <= n
    samples = _samples(out, task)
    assert len(samples) == n
    cfg = SandboxConfig()
    for s in samples[:4]:  # rerun a few logged programs: the same outcome and value
        record = json.loads(s["filtered_resps"][0])
        again = run_program(record["program"], cfg)
        assert (again.outcome.value, again.value) == (record["outcome"], record["value"])
        assert s["exact_match"] == float(record["outcome"] == "ok" and is_correct(record["value"], s["target"]))
    return metrics


def _lm_eval_args(ckpt: Path, task: str, out: Path, limit: int, metadata: dict | None = None) -> list[str]:
    args = ["--model", "blockgen", "--model_args", f"pretrained={ckpt},{GEN_ARGS}", "--tasks", task,
            "--limit", str(limit), "--batch_size", "4", "--device", "cpu", "--output_path", str(out), "--log_samples"]
    return args + (["--metadata", json.dumps(metadata)] if metadata else [])


@pytest.mark.runs_programs
def test_lm_eval_gsm8k_code_on_the_real_split(gsm_ckpts, gsm8k_file, tmp_path):
    proc = _run([str(BIN / "lm_eval"), *_lm_eval_args(gsm_ckpts["sep"], "gsm8k_code", tmp_path, 8,
                                                       {"gsm8k_path": str(gsm8k_file)})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(tmp_path, "gsm8k_code", 8)
    samples = _samples(tmp_path, "gsm8k_code")
    real = json.loads(GSM8K.read_text())
    assert [s["doc"]["question"] for s in samples] == [r["prompt"] for r in real[:8]]
    assert all(s["doc"]["prompt"] == s["doc"]["question"] + "<|sep|>" for s in samples)


def test_gsm8k_code_without_hub_or_file_names_the_twin(gsm_ckpts):
    proc = _run([str(BIN / "lm_eval"), "--model", "blockgen", "--model_args", f"pretrained={gsm_ckpts['sep']}",
                 "--tasks", "gsm8k_code", "--limit", "1", "--device", "cpu"])
    assert proc.returncode != 0
    assert "gsm8k_code_embedded" in proc.stderr and "gsm8k_path" in proc.stderr, proc.stderr[-3000:]


def test_few_shot_is_refused(gsm_ckpts):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from blockgen.lm_eval import register, tasks_dir

    register()
    pretrained = str(gsm_ckpts["sep"])
    tasks = TaskManager(include_path=str(tasks_dir()), include_defaults=False,
                        metadata={"pretrained": pretrained, "embedded_problems": 4})
    with pytest.raises(ValueError, match="zero-shot .* got --num_fewshot 2"):
        lm_eval.simple_evaluate(model="blockgen", model_args={"pretrained": pretrained}, tasks=["gsm8k_code_embedded"],
                                task_manager=tasks, num_fewshot=2, device="cpu", limit=2)


def test_embedded_task_takes_its_problem_count_from_the_yaml(gsm_ckpts):
    """gsm8k_code_embedded.yaml's metadata is the one home of the default count (500; the dry run's
    cost reads it too); --metadata overrides it."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from blockgen.harness.costs.eval_cost import task_metadata
    from blockgen.lm_eval import register, tasks_dir

    register()
    assert task_metadata("gsm8k_code_embedded")["embedded_problems"] == 500
    for extra, expected in (({}, 500), ({"embedded_problems": 7}, 7)):
        manager = TaskManager(include_path=str(tasks_dir()), include_defaults=False,
                              metadata={"pretrained": str(gsm_ckpts["sep"]), **extra})
        task = get_task_dict(["gsm8k_code_embedded"], manager)["gsm8k_code_embedded"]
        assert len(list(task.test_docs())) == expected


@pytest.fixture(scope="module")
def twin_single(trained, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("twin_single")
    proc = _run([str(BIN / "lm_eval"), *_lm_eval_args(trained, "gsm8k_code_embedded", out, 12)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "metrics": _check_run(out, "gsm8k_code_embedded", 12)}


@pytest.mark.runs_programs
def test_lm_eval_twin_on_a_trained_checkpoint(twin_single):
    metrics, samples = twin_single["metrics"], _samples(twin_single["out"], "gsm8k_code_embedded")
    held = [s for s in samples if s["doc"]["is_heldout"]]
    seen = [s for s in samples if not s["doc"]["is_heldout"]]
    assert held and seen  # the first 12 problems hold both kinds
    assert metrics["exact_match_heldout,sandbox"] == pytest.approx(sum(s["exact_match"] for s in held) / len(held))
    assert metrics["exact_match_in_distribution,sandbox"] == pytest.approx(sum(s["exact_match"] for s in seen) / len(seen))


@pytest.mark.runs_programs
def test_torchrun_two_ranks_agree_with_one_process(trained, twin_single, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
           "-m", "lm_eval", *_lm_eval_args(trained, "gsm8k_code_embedded", tmp_path, 12)]
    proc = _run(cmd, env={**ENV, "GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Building contexts for gsm8k_code_embedded on rank 1" in proc.stderr  # the work really was split
    dp = _check_run(tmp_path, "gsm8k_code_embedded", 12)
    single = twin_single["metrics"]
    assert {k: v for k, v in dp.items() if k != "alias"} == pytest.approx({k: v for k, v in single.items() if k != "alias"})


@pytest.mark.runs_programs
def test_demo_accuracy_comes_from_the_task(trained):
    """The demo's evaluation is `simple_evaluate` on gsm8k_code_embedded (one code path)."""
    from blockgen.harness.evaluation.wordproblem_eval import evaluate_embedded
    from blockgen.models.sampler_config import SamplerConfig

    report = evaluate_embedded(trained, SamplerConfig("arpc", steps=4, ge=2, temperature=0.5), n_problems=12,
                               max_gen_toks=32, batch_size=4)
    assert report["n"] == 12 and report["sampler"]["sampler"] == "arpc"
    assert report["paper_nfe_per_block"] == 6 and report["model_calls"] > 0
    assert math.isclose(report["accuracy"] + sum(report["outcomes"].values()), 1.0)
    assert report["accuracy_in_distribution"] is not None and report["accuracy_heldout"] is not None
