"""The synthetic-language tasks `synthlang_gen` and `synthlang_nll` (tasks/synthlang.py): the exact
scores against hand computation and the true process's own samples, the refusal of a tokenizer that
cannot spell the language, and both tasks through the real `lm_eval` command with lm-eval's `hf`
model (a tiny GPT-2 trained here on the language). `blockgen` runs them in `make demo`'s end-to-end test
(tests/test_train.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from blockgen.harness.data.language import DOC_SYMBOLS, TEST_SEED, documents, load_language
from blockgen.harness.data.sources import DataConfig, get_tokenizer
from blockgen.tasks import synthlang

sys.path.insert(0, str(Path(__file__).parent))
from limits import HANG_S  # noqa: E402

BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}


def _doc(language_name: str, before: int, n: int) -> dict:
    return {"before": before, "continuation_symbols": n, "language": language_name}


def _score(language_name: str, prompts: list[int], continuations: list[str], n: int) -> dict:
    """Every metric of synthlang_gen over (prompt's last word, continuation) pairs, as lm-eval aggregates them."""
    per_doc = [synthlang.gen_results(_doc(language_name, b, n), [c]) for b, c in zip(prompts, continuations)]
    items = lambda k: [d[k] for d in per_doc]  # noqa: E731
    return {"invalid": float(np.mean(items("invalid"))), "invalid_pairs": float(np.mean(items("invalid_pairs"))), "true_nll": synthlang.mean_nll(items("true_nll")),
            "unigram_tv": synthlang.unigram_tv(items("unigram_tv")), "bigram_tv": synthlang.bigram_tv(items("bigram_tv")),
            "bigram_tv_true": synthlang.bigram_tv_true(items("bigram_tv_true")), "words": float(np.mean(items("words")))}


def test_one_continuation_scored_by_hand():
    tiny = load_language("tiny")
    p = tiny.transitions
    a = 0
    b, c = int(np.flatnonzero(p[a])[0]), None
    c = int(np.flatnonzero(p[b])[0])
    impossible = int(np.flatnonzero(p[b] == 0)[0])
    valid = synthlang.gen_results(_doc("tiny", a, 2), [f" {tiny.words[b]} {tiny.words[c]} {tiny.words[a]}"])  # 3rd word cut
    assert valid["invalid"] == valid["invalid_pairs"] == 0.0 and valid["words"] == 2
    nll, n = valid["true_nll"]
    assert n == 2 and math.isclose(nll, -math.log(p[a, b] * p[b, c]))
    broken = synthlang.gen_results(_doc("tiny", a, 2), [f"{tiny.words[b]} {tiny.words[impossible]}"])
    assert broken["invalid"] == 1.0 and broken["invalid_pairs"] == 0.5
    assert math.isclose(broken["true_nll"][0], -math.log(p[a, b])) and broken["true_nll"][1] == 1  # the valid pair
    unknown = synthlang.gen_results(_doc("tiny", a, 2), [f"{tiny.words[b]} qqq"])
    assert unknown["invalid"] == 1.0 and unknown["invalid_pairs"] == 0.5 and unknown["unigram_tv"]["ids"] == [b, None]
    first_pair = synthlang.gen_results(_doc("tiny", a, 1), [tiny.words[int(np.flatnonzero(p[a] == 0)[0])]])
    assert first_pair["invalid"] == 1.0  # the pair (prompt's last word, first word) counts
    short = synthlang.gen_results(_doc("tiny", a, 4), [tiny.words[b]])
    assert short["invalid"] == 1.0 and short["invalid_pairs"] == 0.75  # three missing words
    assert synthlang.gen_results(_doc("tiny", a, 2), [""])["invalid_pairs"] == 1.0
    # unknown words are mass outside the marginals: a continuation of unknown words is as far as can be
    nonsense = synthlang.gen_results(_doc("tiny", a, 2), ["qqq rrr"])["bigram_tv"]
    assert synthlang.bigram_tv([nonsense]) == synthlang.unigram_tv([nonsense]) == 1.0


def test_the_true_process_scores_its_own_floor_and_a_collapsed_sampler_does_not():
    """Samples of the process itself: nothing invalid, NLL per word near the entropy rate, n-gram distances
    at the floor `*_tv_true` measures. One fixed continuation for every prompt (a sampler that collapsed
    onto a likely string): a low NLL but n-gram distances far above the floor."""
    language = load_language("default")
    rng = np.random.default_rng(11)
    prompts = language.sample(256, 1, rng)[:, 0]
    rows = language.sample(256, 32, rng, before=prompts)
    honest = _score("default", prompts.tolist(), [language.text(r) for r in rows], 32)
    assert honest["invalid"] == 0.0 and honest["words"] == 32
    assert abs(honest["true_nll"] - language.entropy_rate) < 0.05
    assert abs(honest["bigram_tv"] - honest["bigram_tv_true"]) < 0.05
    # greedy continuation from each prompt: the most likely next word, repeatedly
    greedy = []
    for b in prompts:
        seq, state = [], int(b)
        for _ in range(32):
            state = int(np.argmax(language.transitions[state]))
            seq.append(state)
        greedy.append(language.text(seq))
    collapsed = _score("default", prompts.tolist(), greedy, 32)
    assert collapsed["invalid"] == collapsed["invalid_pairs"] == 0.0 and collapsed["true_nll"] < language.entropy_rate - 0.3
    assert collapsed["bigram_tv"] > honest["bigram_tv_true"] + 0.3


def test_a_tokenizer_that_cannot_spell_a_word_is_refused_naming_it():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    language = load_language("default")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(language.words) if i != 3}}  # the 4th word is missing
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(ValueError, match=f"cannot spell the language's word '{language.words[3]}'"):
        synthlang.check_spelling(language, fast)
    assert synthlang.check_spelling(language, get_tokenizer(_language_data())) == 1


def test_prompts_and_documents_are_the_fixed_held_out_set():
    language = load_language("default")
    docs = synthlang.load_documents(documents=5)["test"]
    held_out = documents(language, 5, TEST_SEED)
    assert docs["text"] == held_out
    assert all(math.isclose(lp, language.log_prob(language.parse(t))) for lp, t in zip(docs["true_logprob"], docs["text"]))
    prompts = synthlang.load_prompts(prompts=5, prompt_symbols=15)["test"]
    assert [p.split() for p in prompts["prompt"]] == [d.split()[:15] for d in held_out]
    assert prompts["before"] == [language.index[d.split()[14]] for d in held_out]
    with pytest.raises(ValueError, match=f"a held-out document has {DOC_SYMBOLS} words"):
        synthlang.load_prompts(prompt_symbols=DOC_SYMBOLS + 1)
    with pytest.raises(ValueError, match="prompts=0"):
        synthlang.load_prompts(prompts=0)


# ------------------------------------------------------------------------------ the real command


def _language_data(cache: Path | None = None) -> DataConfig:
    base = DataConfig(source="language", n_train=2000, n_val=32)
    return base if cache is None else replace(base, cache_dir=str(cache))


@pytest.fixture(scope="module")
def language_gpt2(tmp_path_factory) -> Path:
    """A 2-layer GPT-2 trained for 150 steps on the language with its local tokenizer (BOS + document)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("gpt2_language")
    data = _language_data(out / "data")
    tok = get_tokenizer(data)  # BOS, EOS, PAD and SEP of its own
    ids = [[tok.bos_token_id, *tok.encode(d, add_special_tokens=False)] for d in documents(load_language("default"), 2000, 0)]
    x = torch.tensor([r for r in ids if len(r) == 1 + DOC_SYMBOLS])  # one token per word
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        batch = x[torch.randint(len(x), (32,), generator=gen)]
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    return out / "model"


def _lm_eval(model: str, model_args: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "lm_eval"), "--model", model, "--model_args", model_args, "--tasks", "synthlang_gen,synthlang_nll",
           "--device", "cpu", "--output_path", str(out), "--log_samples", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=HANG_S, cwd="/")


def test_hf_gpt2_trained_on_the_language_runs_both_tasks(language_gpt2, tmp_path):
    language = load_language("default")
    meta = json.dumps({"prompts": 24, "documents": 24})
    r = _lm_eval("hf", f"pretrained={language_gpt2}", tmp_path, "--metadata", meta, "--batch_size", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    (results,) = tmp_path.rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"]
    nll, gen = metrics["synthlang_nll"], metrics["synthlang_gen"]
    held_out = [language.parse(t) for t in documents(language, 24, TEST_SEED)]
    exact = -sum(language.log_prob(s) for s in held_out) / sum(map(len, held_out))
    assert math.isclose(nll["true_nll,none"], exact, rel_tol=1e-9)
    assert math.isclose(nll["nll_gap,none"], nll["nll,none"] - nll["true_nll,none"], rel_tol=1e-9)
    assert math.isclose(nll["entropy_rate,none"], language.entropy_rate)
    # it learned the language: far better than a uniform guess over the words, not better than the truth
    assert nll["true_nll,none"] < nll["nll,none"] < math.log(len(language.words))
    (samples,) = tmp_path.rglob("samples_synthlang_gen_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 24
    for s in rows:  # sampled at temperature 1 with room for 32 one-token words
        gen_kwargs = s["arguments"]["gen_args_0"]["arg_1"]
        assert gen_kwargs["do_sample"] is True and gen_kwargs["temperature"] == 1.0 and gen_kwargs["max_gen_toks"] == 32
    assert 0 <= gen["invalid,none"] < 1 and gen["words,none"] > 16
    assert gen["bigram_tv_true,none"] < gen["bigram_tv,none"] <= 1
