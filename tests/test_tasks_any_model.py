"""The tasks with lm-eval's own `hf` model and their defaults, through the real `lm_eval` command.

A tiny local GPT-2 (transformers builds it from a config) with a GPT-2-style tokenizer (BOS = EOS, no
SEP, no BOS added): `gsm8k_code_embedded` runs with no extra argument, each row generating exactly
the room its prompt leaves; `owt_genppl_embedded` runs with only the scorer named. A blockgen
checkpoint gets the same per-row budgets, and its rows still make one leaderboard setting.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockgen.harness.data.sources import encode_prompt
from blockgen.harness.checkpoints.tokenizer import special_tokens

sys.path.insert(0, str(Path(__file__).parent))
from test_gsm8k_code import _bpe_without_sep, _checkpoint  # noqa: E402  the tests' GPT-2-style tokenizer
from limits import HANG_S

BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}
LENGTH = 128  # below lm-eval's default max_gen_toks (256): a fixed budget would not fit
WORD = "Ġthe"  # the constant model's only output: re-encodes to itself, so its length is exact


def _gpt2(out: Path, tok, n_positions: int, constant: bool) -> Path:
    """A 1-layer GPT-2. constant=True: it always predicts WORD (final norm -> a fixed vector, lm_head
    row WORD = that vector), so it never stops and fills every budget."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=not constant)
    model = GPT2LMHeadModel(config).eval()
    if constant:
        with torch.no_grad():
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.fill_(1.0)
            model.lm_head.weight.zero_()
            model.lm_head.weight[tok.convert_tokens_to_ids(WORD)] = 1.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok():
    return _bpe_without_sep()


@pytest.fixture(scope="module")
def constant_gpt2(tmp_path_factory, tok) -> Path:
    return _gpt2(tmp_path_factory.mktemp("gpt2_constant"), tok, LENGTH, constant=True)


@pytest.fixture(scope="module")
def random_gpt2(tmp_path_factory, tok) -> Path:
    return _gpt2(tmp_path_factory.mktemp("gpt2_random"), tok, 64, constant=False)


def lm_eval(model: str, model_args: str, task: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "lm_eval"), "--model", model, "--model_args", model_args, "--tasks", task, "--device", "cpu",
           "--output_path", str(out), "--log_samples", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=HANG_S, cwd="/")


def outputs(out: Path, task: str) -> tuple[dict, list[dict]]:
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return json.loads(results.read_text()), [json.loads(line) for line in samples.read_text().splitlines()]


@pytest.mark.runs_programs
def test_hf_gsm8k_code_embedded_with_defaults(constant_gpt2, tok, tmp_path):
    """No generation argument: each row may generate the room its prompt leaves (prompt + budget =
    the model's length); the model that never stops uses all of it, and the results count the hits."""
    r = lm_eval("hf", f"pretrained={constant_gpt2}", "gsm8k_code_embedded", tmp_path, "--limit", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    results, samples = outputs(tmp_path, "gsm8k_code_embedded")
    special = special_tokens(tok)
    budgets = []
    for s in samples:
        record = json.loads(s["filtered_resps"][0])
        prompt = encode_prompt(s["doc"]["question"], tok, special)  # [BOS] question SEP, BOS counted
        assert record["budget"] == s["arguments"]["gen_args_0"]["arg_1"]["max_gen_toks"] == LENGTH - len(prompt)
        assert s["resps"][0][0] == " the" * record["budget"] and record["response_tokens"] == record["budget"]
        assert s["budget_hits"] == 1.0 and record["outcome"] == "syntax_error"
        budgets.append(record["budget"])
    assert len(set(budgets)) > 1  # per row, not one number for the task
    metrics = results["results"]["gsm8k_code_embedded"]
    assert metrics["budget_hits,sandbox"] == 6 and metrics["exact_match,sandbox"] == 0.0
    # the AR baseline is a leaderboard row like any setting (greedy: the task does not ask to sample)
    from blockgen.harness.reports.leaderboard import rows_from_results

    (row,) = [r for r in rows_from_results(results) if r.metric == "exact_match"]
    assert (row.model, row.sampler, row.nfe_per_block, row.n, row.note) == (constant_gpt2.name, "ar_greedy", 1, 6, "lm-eval model hf")

    # the paired comparison reads the same logs (a run against itself: no difference at all)
    c = subprocess.run([str(BIN / "blockgen"), "leaderboard", "compare", str(tmp_path), str(tmp_path), "--json"],
                       capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert c.returncode == 0, c.stderr
    comparison = json.loads(c.stdout)
    assert comparison["n"] == 6 and comparison["counts"] == {"both": 0, "a_only": 0, "b_only": 0, "neither": 6}
    assert comparison["difference"] == 0.0 and comparison["p_value"] == 1.0 and not comparison["resolved"]


def test_hf_owt_genppl_embedded_with_only_the_scorer(random_gpt2, tmp_path):
    """Unconditional samples from a model whose tokenizer adds no BOS: the context is the BOS token's
    text, the budget fits the model (length - 1), and an AR baseline samples at temperature 1."""
    meta = json.dumps({"scorer_model": str(random_gpt2)})
    r = lm_eval("hf", f"pretrained={random_gpt2}", "owt_genppl_embedded", tmp_path, "--metadata", meta)
    assert r.returncode == 0, r.stderr[-3000:]
    results, samples = outputs(tmp_path, "owt_genppl_embedded")
    # the task's num_samples (64), or as many held-out passages as this Python's `pydoc_data.topics` gives:
    # the embedded text is the interpreter's (Debian's 3.11.2 gives 59, 3.11.7 more than 64)
    from blockgen.harness.evaluation.mauve_cache import ReferenceSet
    from blockgen.tasks.owt import PASSAGE_RULE, held_out_passages

    available = len(held_out_passages(ReferenceSet.of("text", None, 64, 600, PASSAGE_RULE)))
    assert len(samples) == min(64, available) > 50
    for s in samples:
        context, gen_kwargs = s["arguments"]["gen_args_0"]["arg_0"], s["arguments"]["gen_args_0"]["arg_1"]
        assert context == "<|endoftext|>"
        assert gen_kwargs["max_gen_toks"] == 64 - 1 and gen_kwargs["do_sample"] is True and gen_kwargs["temperature"] == 1.0
    texts = [s["resps"][0][0] for s in samples]
    assert len(set(texts)) > 50  # sampled, not greedy
    metrics = results["results"]["owt_genppl_embedded"]
    assert math.isfinite(metrics["gen_ppl,none"]) and metrics["gen_ppl,none"] > 1
    # the results record the settings (task config), and the row reads them: AR sampling at T 1
    recorded = results["configs"]["owt_genppl_embedded"]["generation_kwargs"]
    assert (recorded["max_gen_toks"], recorded["do_sample"], recorded["temperature"]) == (63, True, 1.0)
    from blockgen.harness.reports.leaderboard import rows_from_results

    (row,) = [r for r in rows_from_results(results) if r.metric == "gen_ppl"]
    assert (row.sampler, row.temperature, row.value) == ("ar_sample", 1.0, metrics["gen_ppl,none"])


@pytest.mark.runs_programs
def test_blockgen_gets_the_same_budgets(tok, tmp_path):
    """--model blockgen without max_gen_toks: per-row budgets too (the sampler fills its grid up to
    seq_len), in one batch per sampler setting: one usage record, one leaderboard setting."""
    from blockgen.harness.reports.leaderboard import rows_from_results

    ckpt = _checkpoint(tmp_path / "ckpt", tok)
    r = lm_eval("blockgen", f"pretrained={ckpt},sampler=ar_greedy,seed=0", "gsm8k_code_embedded", tmp_path / "out",
                "--limit", "4", "--batch_size", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    results, samples = outputs(tmp_path / "out", "gsm8k_code_embedded")
    special = special_tokens(tok)
    for s in samples:
        record = json.loads(s["filtered_resps"][0])
        assert record["budget"] == 128 - len(encode_prompt(s["doc"]["question"], tok, special))
        assert record["response_tokens"] <= record["budget"]
    usage = results["config"]["blockgen"]["tasks"]["gsm8k_code_embedded"]["generate_until"]
    # One batch per setting: the budgets differ by row, one usage record carries the largest.
    budgets = {json.loads(s["filtered_resps"][0])["budget"] for s in samples}
    (setting,) = usage["settings"]
    assert len(budgets) > 1 and setting["max_gen_toks"] == max(budgets) and setting["requests"] == len(samples)
    rows = rows_from_results(results)
    (em,) = [row for row in rows if row.metric == "exact_match"]
    assert em.sampler == "ar_greedy" and em.total_calls == usage["model_calls"]
    # --batch_size auto: the size chosen is recorded, by lm-eval and by the adapter
    assert results["config"]["batch_sizes"] == [results["config"]["blockgen"]["batch_size"]] == [16]
