"""The lm-eval model type `blockgen`: the math of its likelihoods, and the real `lm_eval` command.

Tiny checkpoints are trained here for a few dozen steps on `blockgen_toy` text (no hub, no GPU).
The end-to-end runs go through the unmodified `lm_eval` command (found via the start-up hook),
`torchrun -m lm_eval` (two CPU ranks over gloo) and `python -m blockgen.lm_eval`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockgen.harness.checkpoints.checkpoint import checkpoint_hash, load_checkpoint, save_checkpoint
from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe
from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.tasks.blockgen_toy import training_text
from limits import HANG_S

BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}
TASKS = "blockgen_toy_cloze,blockgen_toy_ppl,blockgen_toy_gen,blockgen_toy_mc"
SEQ_LEN = 64


# ------------------------------------------------------------------------------ checkpoints


@contextlib.contextmanager
def _one_thread():
    """Tiny models on a shared 2-core machine: extra threads only contend (one thread is ~10x faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    with _one_thread():
        yield


def _train(out: Path, tok, block_sizes, block_weights, steps: int, seed: int) -> Path:
    torch.manual_seed(seed)
    special = special_tokens(tok)
    config = BlockGenConfig(vocab_size=len(tok), seq_len=SEQ_LEN, prior="masked", block_sizes=block_sizes,
                            block_weights=block_weights, shape=ModelShape(n_layers=2, d_model=32, n_heads=4, cond_dim=16, dropout=0.0),
                            special_tokens=special.to_dict())
    model = BlockGen(config)
    # Whole documents packed into rows that start at position 0, as the adapter scores them.
    rows, row = [], []
    for line in training_text(400, seed=seed):
        ids = [special.bos, *tok.encode(line, add_special_tokens=False), special.eos]
        if len(row) + len(ids) > SEQ_LEN:
            rows.append(row + [special.pad] * (SEQ_LEN - len(row)))
            row = []
        row += ids
    data = torch.tensor(rows)
    mask = (data != special.pad).float()
    n = len(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        pick = torch.randint(0, n, (8,), generator=gen)
        size = block_sizes[int(torch.multinomial(torch.tensor(block_weights), 1, generator=gen))]
        t = model.schedule.t_from_uniform(torch.rand(8, generator=gen))
        total, count = model.loss(data[pick], mask[pick], size, t, generator=gen)
        opt.zero_grad()
        (total / count).backward()
        opt.step()
    model.eval()
    return save_checkpoint(out, model, tok)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm_eval_ckpts")
    tok = train_bpe(training_text(400), vocab_size=400)  # whole words: the toy vocabulary is small
    with _one_thread():
        return {
            "mixture": _train(root / "mixture", tok, (1, 8), (0.2, 0.8), steps=60, seed=0),
            "ar": _train(root / "ar", tok, (1,), (1.0,), steps=40, seed=1),
        }


def _lm(path: Path, **kwargs):
    from lm_eval.api.registry import get_model

    return get_model("blockgen")(pretrained=str(path), device="cpu", **kwargs)


def _requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


# ------------------------------------------------------------------------------ the math


def test_windows_score_each_target_token_once():
    from blockgen.harness.evaluation.lm_eval_model.scoring import windows

    context, target = [100, 101, 102], list(range(150))
    ws = windows(context, target, 64)
    assert all(len(w.tokens) <= 64 and w.n_context >= 1 for w in ws)
    assert [t for w in ws for t in w.tokens[w.n_context :]] == target
    short = windows(list(range(80)), [7, 8], 64)  # long context: left-truncated, target kept whole
    assert short == [(tuple(range(18, 80)) + (7, 8), 62)]


def test_score_matches_nll_bounds_and_lse_beats_jensen(ckpts):
    """A window scored in a padded batch == BlockGen.nll_bounds on the window alone, same draws; LSE >= Jensen."""
    from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows
    from blockgen.models.diffusion import RowStreams

    model, tok = load_checkpoint(ckpts["mixture"])
    special = special_tokens(tok)
    ids = [special.bos, *tok.encode("the red cat sees the ball . two plus one is three", add_special_tokens=False)]
    assert len(ids) % 8  # the last block is partial
    window, longer = Window(tuple(ids), 4), Window(tuple(ids + ids), 3)
    score = score_windows(model, [longer, window], [99, 1234], k_mc=4, pad_id=special.pad)[1]

    x = torch.tensor([ids])  # unpadded: the last block is partial, as training_layout allows
    scored = torch.zeros_like(x, dtype=torch.bool)
    scored[0, 4:] = True
    condition = ~scored
    lse, jensen = model.nll_bounds(x, scored, 4, condition, RowStreams([1234]))
    assert score.lse == pytest.approx(lse.item(), rel=1e-5)
    assert score.jensen == pytest.approx(jensen.item(), rel=1e-5)
    assert -score.lse >= -score.jensen  # logLik_LSE >= logLik_Jensen
    assert score.lse > 0


def test_score_does_not_depend_on_padding(ckpts):
    """Padding is invisible: two pad ids give identical numbers, window lengths on and off the block grid."""
    from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows

    model, tok = load_checkpoint(ckpts["mixture"])
    ids = tok.encode("the old fox likes the box . one plus four is five . the dog sees the cat", add_special_tokens=False)
    batch = [Window(tuple(ids[:n]), 3) for n in (16, 13, 8, 5)]  # multiples of L' = 8 and not
    assert len(batch[0].tokens) == 16 and len(batch[1].tokens) % 8
    seeds = [5, 6, 7, 8]
    one, other = (score_windows(model, batch, seeds, k_mc=3, pad_id=pad) for pad in (0, len(tok) - 1))
    assert [s.lse for s in one] == [s.lse for s in other]  # bitwise: padding never enters a real token's logits
    assert [s.greedy for s in one] == [s.greedy for s in other]
    alone = [score_windows(model, [w], [s], k_mc=3, pad_id=1)[0] for w, s in zip(batch, seeds)]
    assert [s.lse for s in one] == pytest.approx([s.lse for s in alone], rel=1e-5)
    # batch_invariant: each window as a batch of one, so bit for bit the window alone, in any order
    assert score_windows(model, batch, seeds, k_mc=3, pad_id=0, batch_invariant=True) == alone
    order = [2, 0, 3, 1]
    shuffled = score_windows(model, [batch[i] for i in order], [seeds[i] for i in order], k_mc=3, pad_id=0, batch_invariant=True)
    assert shuffled == [alone[i] for i in order]


def test_scores_and_texts_are_bitwise_the_same_for_every_batch_size(ckpts):
    """batch_invariant: log-likelihoods and rolling log-likelihoods (the default on a CPU) and texts
    (batch_invariant=true) of batch sizes 1, 7 and 16, and of the requests in shuffled order, are bit
    for bit equal."""
    starts = ["the red cat sees the", "one plus two is", "the quiet mouse likes the old", "four plus four is"]
    contexts = [f"{word} {start}" for word in ("the", "a", "two", "one") for start in starts]  # 16 distinct requests
    pairs = [(c, f" {w}") for c, w in zip(contexts, ["ball", "three", "box", "eight"] * 4)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {}
    for batch in (1, 7, 16):
        lm = _lm(ckpts["mixture"], batch_size=batch, seed=3)
        assert lm.batch_invariant == {"likelihood": True, "generation": False}  # the default on a CPU
        invariant = lm.with_settings(batch_invariant=True)
        assert invariant.batch_invariant == {"likelihood": True, "generation": True}
        for shuffle in ((False, True) if batch == 16 else (False,)):
            rows = order if shuffle else list(range(len(pairs)))
            ll = lm.loglikelihood(_requests("loglikelihood", [pairs[i] for i in rows]))
            rolling = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(contexts[i],) for i in rows]))
            texts = invariant.generate_until(_requests("generate_until", [(contexts[i], {"until": ["."], "max_gen_toks": 16}) for i in rows]))
            back = sorted(range(len(rows)), key=rows.__getitem__)  # undo the shuffle
            runs[batch, shuffle] = ([ll[i] for i in back], [rolling[i] for i in back], [texts[i] for i in back])
    first = runs[1, False]
    for key, run in runs.items():
        assert run == first, key


def test_choices_of_one_context_share_their_draws(ckpts):
    """Common random numbers: windows with one seed see the same noise at the same positions, so two
    choices that differ in one token differ less between them than across seeds."""
    from blockgen.models.diffusion import RowStreams

    g = RowStreams([3, 3, 4])
    draws = g.uniform((3, 10))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    short = RowStreams([3]).uniform((1, 6))
    assert torch.equal(short[0], draws[0, :6])  # a shorter window: the same draws at its positions
    assert not torch.equal(g.uniform((3, 10)), draws)  # the next call: new draws


def test_ar_checkpoint_is_exact_and_seed_free(ckpts):
    """block_sizes == (1,): loglikelihood is the exact AR log-likelihood, whatever the seed or K_MC."""
    model, tok = load_checkpoint(ckpts["ar"])
    special = special_tokens(tok)
    context, continuation = "the green horse chases the", " river ."
    ctx = [special.bos, *tok.encode(context, add_special_tokens=False)]
    cont = tok.encode(context + continuation, add_special_tokens=False)[len(ctx) - 1 :]
    x = torch.tensor([ctx + cont])
    with torch.no_grad():  # the AR likelihood straight from the network: every noisy token fully noised
        logits = model.dit.forward_train(x, model.prior.fully_noised(x.shape), 1)
        log_p = logits[..., : model.prior.vocab_size].log_softmax(-1)[0]
    exact = sum(log_p[p, x[0, p]].item() for p in range(len(ctx), x.shape[1]))

    results = [_lm(ckpts["ar"], seed=seed, k_mc=k).loglikelihood(_requests("loglikelihood", [(context, continuation)]))[0]
               for seed, k in ((0, 8), (7, 2))]
    assert results[0][0] == pytest.approx(exact, abs=1e-4)
    assert results[0] == results[1]


def test_bad_model_args_name_the_choices(ckpts, tmp_path):
    from lm_eval.api.registry import get_model

    from blockgen.harness.checkpoints.checkpoint import CheckpointError

    cls = get_model("blockgen")
    cases = {
        "sampler=bogus": "choose one of ['ancestral', 'eipc', 'arpc', 'ar_greedy', 'ar_sample']",
        "block_size=4": "choose one of [1, 8]",
        "steps=0": "steps=0; must be an integer >= 1",
        "k_mc=0": "k_mc=0; must be an integer >= 1",
        "temperatur=0.5": "valid: [",
        "sampler=arpc,warmup=8,steps=8": "choose warmup in 0..7",
    }
    for extra, message in cases.items():
        with pytest.raises(ValueError) as err:
            cls.create_from_arg_string(f"pretrained={ckpts['mixture']},{extra}", {"device": "cpu"})
        assert message in str(err.value), (extra, str(err.value))
    with pytest.raises(CheckpointError, match="does not exist"):
        cls.create_from_arg_string(f"pretrained={tmp_path / 'missing'}", {"device": "cpu"})
    with pytest.raises(ValueError, match=r"autoregressive \(block sizes \[1\]\); choose one of \['ar_greedy', 'ar_sample'\]"):
        cls.create_from_arg_string(f"pretrained={ckpts['ar']},sampler=arpc", {"device": "cpu"})
    with pytest.raises(ValueError) as err:  # the list shows what a user may set, not lm-eval's internals
        cls.create_from_arg_string(f"pretrained={ckpts['mixture']},temperatur=0.5", {"device": "cpu"})
    listed = str(err.value).split("valid: ")[1]
    assert "'layout'" in listed and "'k_mc'" in listed
    assert not {"batch_size", "device", "max_batch_size"} & set(listed.strip("[]").replace("'", "").split(", "))
    run = tmp_path / "run"  # a training run's folder: the error names the checkpoint inside it
    run.mkdir()
    (run / "checkpoint").symlink_to(ckpts["mixture"])
    with pytest.raises(CheckpointError, match=f"training run's folder; its checkpoint is pretrained={run / 'checkpoint'}"):
        cls.create_from_arg_string(f"pretrained={run}", {"device": "cpu"})
    with pytest.raises(ValueError, match="choose a positive integer or 'auto'"):
        cls.create_from_arg_string(f"pretrained={ckpts['mixture']}", {"device": "cpu", "batch_size": "0"})


def test_batch_size_auto_on_cpu_is_the_documented_default(ckpts):
    from blockgen.harness.evaluation.lm_eval_model.model import AUTO_BATCH_SIZE_CPU

    for value in ("auto", "auto:4"):
        assert _lm(ckpts["mixture"], batch_size=value, max_batch_size=64).batch_size == AUTO_BATCH_SIZE_CPU
    assert _lm(ckpts["mixture"], batch_size="auto", max_batch_size=4).batch_size == 4


def test_generation_override_and_stop_strings(ckpts):
    lm = _lm(ckpts["mixture"], sampler="ancestral", steps=2)
    gen = {"until": ["."], "max_gen_toks": 16, "sampler": "eipc", "steps": 4}
    args = [("the red cat sees the", gen), ("one plus two is", {"until": ["\n"], "max_gen_toks": 8})]
    first = lm.generate_until(_requests("generate_until", args))
    assert "." not in first[0]
    assert first == lm.generate_until(_requests("generate_until", args[::-1]))[::-1]  # order-free
    with pytest.raises(ValueError, match="choose one of"):
        lm.generate_until(_requests("generate_until", [("x", {"sampler": "nope"})]))


PROMPTS = ["the red cat sees the", "one plus two is", "the quiet mouse", "four plus four is", "the", "three plus one"]


def test_batched_generation_makes_fewer_calls(ckpts):
    """batch_invariant=false batches for real: batch size 16 makes far fewer model calls than batch
    size 1 at the same calls per block (its texts agree up to the float rounding of the batch's
    shapes; bitwise equality is the invariant mode's, tested above); repeats of one request (lm-eval's
    `repeats`) draw different samples."""
    args = [(p, {"until": ["."], "max_gen_toks": 16}) for p in PROMPTS * 2]
    runs = {}
    for batch in (1, 16):
        lm = _lm(ckpts["mixture"], batch_size=batch, seed=1, batch_invariant=False)
        runs[batch] = (lm.generate_until(_requests("generate_until", args)), lm.usage.report()["-"]["generate_until"])
    (one,), (batched,) = runs[1][1]["settings"], runs[16][1]["settings"]
    assert one["generated_tokens"] > 0 and batched["generated_tokens"] > 0
    assert one["model_calls_per_block"] == batched["model_calls_per_block"] == 8  # ancestral, 8 steps: NFE 8
    assert batched["model_calls"] < one["model_calls"] / 4
    first, second = runs[16][0][: len(PROMPTS)], runs[16][0][len(PROMPTS) :]
    assert first != second  # the second copy of each request is a second sample


def _budget_requests(budgets: list[int], task: str = "toy_budgets"):
    """One generate_until request per document of one task, each with its own max_gen_toks (as
    gsm8k_code gives each document the room its prompt leaves) and no stop string."""
    from lm_eval.api.instance import Instance

    return [Instance(request_type="generate_until", doc={}, idx=0, metadata=(task, d, 1),
                     arguments=(PROMPTS[d % len(PROMPTS)], {"until": [], "max_gen_toks": b})) for d, b in enumerate(budgets)]


def _counting_generate(monkeypatch) -> list[dict]:
    """Record every call of `generate` the adapter makes: its rows' budgets, seeds and generated ids."""
    import blockgen.harness.evaluation.lm_eval_model.model as adapter

    calls, real = [], adapter.generate

    def counted(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append({"budgets": list(kwargs["max_new_tokens"]), "seeds": list(kwargs["seeds"]), "tokens": result.tokens,
                      "config_budget": args[2].max_new_tokens, "model_calls": result.model_calls,
                      "reasons": result.finish_reasons, "compile": kwargs["compile"]})
        return result

    monkeypatch.setattr(adapter, "generate", counted)
    return calls


BUDGETS = [3, 17, 9, 24, 5, 12, 20, 7, 14, 11]  # ten documents, ten budgets


def test_one_batch_per_setting_whatever_the_budgets(ckpts, monkeypatch):
    """Documents of one task whose budgets all differ share batches: ceil(n / gen_batch_size) calls of
    `generate` (gen_batch_size, not batch_size), each row within its own budget and seeded as alone
    (its seed derives from its own settings, budget included); one usage record for the setting."""
    from dataclasses import asdict, replace

    from blockgen.harness.evaluation.lm_eval_model.scoring import derive_seed

    calls = _counting_generate(monkeypatch)
    lm = _lm(ckpts["mixture"], batch_size=1, gen_batch_size=4, seed=1, steps=2, batch_invariant=False)
    reqs = _budget_requests(BUDGETS)
    texts = lm.generate_until(reqs)
    assert len(calls) == math.ceil(len(BUDGETS) / 4) == 3 and [len(c["budgets"]) for c in calls] == [4, 4, 2]
    rows = {seed: (budget, ids) for c in calls for seed, budget, ids in zip(c["seeds"], c["budgets"], c["tokens"])}
    for c in calls:
        assert c["config_budget"] == max(c["budgets"])  # the batch's SamplerConfig carries its largest budget
    assert len(rows) == len(BUDGETS)
    for req, budget, text in zip(reqs, BUDGETS, texts):
        context = req.args[0]
        prompt = lm._with_bos(lm.tok_encode(context))
        seed = derive_seed(lm.args.seed, "generate_until", prompt, asdict(replace(lm.sampler, max_new_tokens=budget)), req.doc_id, 0)
        row_budget, ids = rows[seed]
        assert row_budget == budget and len(ids) <= budget, (req.doc_id, budget, len(ids))
        assert text == lm._decode(ids)
    # not cut short by the batch: a row stops at its own budget or at EOS (no stop strings here)
    ends = [(reason, len(ids) == budget) for c in calls for reason, budget, ids in zip(c["reasons"], c["budgets"], c["tokens"])]
    assert all(full if reason == "length" else reason == "eos" for reason, full in ends), ends
    assert any(reason == "length" for reason, _ in ends)
    (record,) = lm.usage.report()["toy_budgets"]["generate_until"]["settings"]
    assert record["requests"] == len(BUDGETS) and record["max_gen_toks"] == max(BUDGETS)
    assert record["model_calls"] == sum(c["model_calls"] for c in calls)
    assert record["generated_tokens"] == sum(len(ids) for _, ids in rows.values())
    info = lm.get_model_info()["blockgen"]
    assert (info["batch_size"], info["gen_batch_size"]) == (1, 4)
    assert not any(c["compile"] for c in calls)  # eager unless compile=true


def test_ignore_eos_generates_the_whole_budget_and_agrees_up_to_eos(ckpts, monkeypatch):
    """gen_kwargs ignore_eos=true (owt_genppl's length-L samples): every row makes its whole budget with
    EOS kept in its text; up to its first EOS a row is the sample the EOS-stopped request makes (the same
    seed and the same draws: the stream of a row counts its own calls)."""
    calls = _counting_generate(monkeypatch)
    lm = _lm(ckpts["mixture"], seed=2, steps=2, temperature=1.0, batch_invariant=True)
    budget, n = 24, 12
    texts, rows = {}, {}
    for ignore in (False, True):
        reqs = _budget_requests([budget] * n)
        for r in reqs:
            r.arguments = (r.arguments[0], {**r.arguments[1], "ignore_eos": ignore})
        texts[ignore] = lm.generate_until(reqs)
        rows[ignore] = {seed: ids for c in calls for seed, ids in zip(c["seeds"], c["tokens"])}
        calls.clear()
    assert rows[False].keys() == rows[True].keys()  # the same seeds: ignore_eos does not enter them
    stopped, full = ([rows[k][seed] for seed in sorted(rows[False])] for k in (False, True))
    eos = lm.special.eos
    assert all(len(ids) == budget for ids in full)
    assert any(eos in ids for ids in full)  # the check below compares prefixes, not whole rows
    for short, long in zip(stopped, full):
        assert short == (long[: long.index(eos)] if eos in long else long)
    eos_text = lm.tokenizer.decode([eos])
    assert sum(eos_text in t for t in texts[True]) == sum(eos in ids for ids in full)  # EOS kept in the text
    assert not any(eos_text in t for t in texts[False])
    with pytest.raises(ValueError, match="ignore_eos='yes'"):
        lm.generate_until(_requests("generate_until", [("a", {"until": [], "ignore_eos": "yes"})]))


def test_compile_model_argument_reaches_generate(ckpts, monkeypatch):
    """--model_args compile=True (lm-eval's parsing) makes every generate call compile; a non-bool is
    refused. That compiled generation equals eager is tests/test_graphs.py's."""
    import blockgen.harness.evaluation.lm_eval_model.model as adapter
    from lm_eval.api.registry import get_model

    seen, real = [], adapter.generate
    monkeypatch.setattr(adapter, "generate", lambda *a, **kw: seen.append(kw["compile"]) or real(*a, **{**kw, "compile": False}))
    lm = get_model("blockgen").create_from_arg_string(f"pretrained={ckpts['mixture']},seed=1,steps=2,compile=True", {"device": "cpu"})
    lm.generate_until(_budget_requests([4, 6]))
    assert seen and all(seen)
    with pytest.raises(ValueError, match="compile='yes'; must be true or false"):
        _lm(ckpts["mixture"], compile="yes")


def test_mixed_budget_batches_are_bitwise_the_rows_alone(ckpts, monkeypatch):
    """batch_invariant=true: batches that mix budgets give, row for row, the texts of batches of one
    (gen_batch_size=1: one call per document); without gen_batch_size, batch_size sizes the batches."""
    calls = _counting_generate(monkeypatch)
    runs = {}
    for model_args in ({"gen_batch_size": 1, "batch_size": 16}, {"gen_batch_size": len(BUDGETS)}, {"batch_size": 3}):
        calls.clear()
        lm = _lm(ckpts["mixture"], seed=4, steps=2, batch_invariant=True, **model_args)
        runs[json.dumps(model_args)] = (lm.generate_until(_budget_requests(BUDGETS)), len(calls))
    (alone, n_alone), (together, n_together), (by_batch_size, n_by_batch_size) = runs.values()
    assert (n_alone, n_together, n_by_batch_size) == (len(BUDGETS), 1, math.ceil(len(BUDGETS) / 3))
    assert together == alone and by_batch_size == alone


def test_gen_batch_size_is_validated(ckpts):
    from lm_eval.api.registry import get_model

    cls = get_model("blockgen")
    for value in ("0", "-2", "auto", "x", "1.5"):
        with pytest.raises(ValueError) as err:
            cls.create_from_arg_string(f"pretrained={ckpts['mixture']},gen_batch_size={value}", {"device": "cpu"})
        assert "; choose a positive integer, or leave gen_batch_size unset for generation batches of --batch_size" in str(err.value)
        assert str(err.value).startswith("gen_batch_size="), str(err.value)
    lm = cls.create_from_arg_string(f"pretrained={ckpts['mixture']},gen_batch_size=5", {"device": "cpu", "batch_size": 2})
    assert (lm.batch_size, lm.gen_batch_size) == (2, 5)
    assert lm.with_settings(steps=2).gen_batch_size == 5  # kept, as the batch size is
    assert _lm(ckpts["mixture"], batch_size=3).gen_batch_size == 3  # unset: the batch size


def test_documents_with_one_prompt_draw_their_own_samples(ckpts):
    """Unconditional sampling (owt_genppl): every document has the same empty prompt. Seeds derive from
    the global document id, so the samples differ, and a document's sample is the same whichever
    documents share its rank (here: all six, or only the odd ones, as a second torchrun rank has)."""
    from lm_eval.api.instance import Instance

    def run(doc_ids):
        lm = _lm(ckpts["mixture"], batch_size=4, seed=1)
        reqs = [Instance(request_type="generate_until", doc={}, arguments=("", {"max_gen_toks": 16}), idx=0,
                         metadata=("toy_uncond", d, 1)) for d in doc_ids]
        return dict(zip(doc_ids, lm.generate_until(reqs)))

    every = run(list(range(6)))
    assert len(set(every.values())) == 6
    assert run([1, 3, 5]) == {d: every[d] for d in (1, 3, 5)}


def test_ar_checkpoint_follows_do_sample_and_temperature(ckpts):
    """As lm-eval's hf backend: greedy by default and with do_sample=False; do_sample=True or a
    temperature > 0 samples (ar_sample), and the samples change with the seed."""
    def run(seed: int, **gen):
        lm = _lm(ckpts["ar"], seed=seed)
        texts = lm.generate_until(_requests("generate_until", [(p, {"max_gen_toks": 12, **gen}) for p in PROMPTS]))
        (settings,) = lm.usage.report()["-"]["generate_until"]["settings"]
        return texts, settings["sampler"], settings["temperature"]

    greedy, name, _ = run(0)
    assert name == "ar_greedy" and run(5) == run(0) == run(0, do_sample=False)
    for gen in ({"do_sample": True}, {"temperature": 0.9}):
        (a, name, temperature), (b, _, _) = run(0, **gen), run(1, **gen)
        assert name == "ar_sample" and temperature == gen.get("temperature", 1.0)
        assert a != b and greedy not in (a, b)


def test_temperature_zero_with_a_diffusion_sampler_is_refused(ckpts):
    lm = _lm(ckpts["mixture"])
    with pytest.raises(ValueError, match="temperature=0 asks for greedy decoding, which diffusion sampler 'ancestral' "
                                         "does not have; set a temperature > 0"):
        lm.generate_until(_requests("generate_until", [("the", {"temperature": 0, "do_sample": False})]))


def test_seed_defaults_to_the_torch_seed_lm_eval_sets(ckpts):
    """Without model arg `seed`, --seed (which seeds torch before the model is built) changes the samples."""
    def texts(torch_seed: int, **kwargs):
        torch.manual_seed(torch_seed)
        lm = _lm(ckpts["mixture"], **kwargs)
        return lm.args.seed, lm.generate_until(_requests("generate_until", [(p, {"max_gen_toks": 8}) for p in PROMPTS]))

    (seed, five), (_, six) = texts(5), texts(6)
    assert seed == 5 and five != six and texts(5) == (5, five)
    assert texts(5, seed=7) == texts(6, seed=7)  # an explicit seed wins


def test_empty_context_generates_up_to_seq_len_minus_one(ckpts):
    """Unconditional samples (context "": the prompt is BOS) may fill the whole window on the grid layout."""
    lm = _lm(ckpts["mixture"], seed=2)
    (text,) = lm.generate_until(_requests("generate_until", [("", {"max_gen_toks": SEQ_LEN - 1})]))
    report = lm.usage.report()["-"]["generate_until"]
    assert report["settings"][0]["max_gen_toks"] == SEQ_LEN - 1 and report["truncated_requests"] == 0
    too_long = lm.generate_until(_requests("generate_until", [("", {"max_gen_toks": 5 * SEQ_LEN})]))
    assert lm.usage.report()["-"]["generate_until"]["settings"][-1]["max_gen_toks"] == SEQ_LEN - 1  # clamped, recorded
    assert isinstance(too_long[0], str)


def test_mc_stderr_is_a_calibrated_error_bar_and_crn_shrinks_differences(ckpts):
    """The delta-method MC standard error matches the spread of the bound over seeds (conservatively:
    the draws are stratified), and two choices of one context differ with a smaller error than their
    own errors combined (common random numbers)."""
    from blockgen.harness.evaluation.lm_eval_model.mc_error import RequestScore, paired_mc_stderr
    from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows

    model, tok = load_checkpoint(ckpts["mixture"])
    context = [special_tokens(tok).bos, *tok.encode("the happy dog chases the", add_special_tokens=False)]
    a, b = (Window(tuple(context + tok.encode(w, add_special_tokens=False)), len(context)) for w in (" box .", " tree ."))
    scores = [score_windows(model, [a, b], [seed, seed], k_mc=4, pad_id=0) for seed in range(48)]
    spread = statistics.stdev(s[0].lse for s in scores)
    reported = statistics.fmean(RequestScore(-s[0].lse, False, (s[0],)).mc_stderr for s in scores)
    assert 0.5 * reported < spread < 1.2 * reported
    pairs = [(RequestScore(-x.lse, False, (x,)), RequestScore(-y.lse, False, (y,))) for x, y in scores]
    paired = statistics.fmean(paired_mc_stderr(x, y) for x, y in pairs)
    assert paired < 0.8 * statistics.fmean(math.hypot(x.mc_stderr, y.mc_stderr) for x, y in pairs)
    assert statistics.stdev(x.logp - y.logp for x, y in pairs) < 1.2 * paired


def test_use_cache_is_keyed_by_checkpoint(ckpts, tmp_path):
    """Two checkpoints sharing one --use_cache file never read each other's answers."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from blockgen.lm_eval import tasks_dir

    tasks = TaskManager(include_path=tasks_dir(), include_defaults=False)  # skips indexing lm-eval's own tasks

    def run(name: str, cache: str | None) -> float:
        out = lm_eval.simple_evaluate(model="blockgen", model_args=f"pretrained={ckpts[name]},k_mc=2",
                                      tasks=["blockgen_toy_cloze"], limit=3, device="cpu", use_cache=cache,
                                      bootstrap_iters=0, log_samples=False, task_manager=tasks)
        return out["results"]["blockgen_toy_cloze"]["perplexity,none"]

    cache = str(tmp_path / "cache")
    mixture, ar = run("mixture", cache), run("ar", cache)  # same requests, same cache file
    assert ar == run("ar", None) != mixture
    assert run("mixture", cache) == mixture
    db = sqlite3.connect(cache + "_rank0.db")
    tables = [t for (t,) in db.execute("select name from sqlite_master where type='table'") if t.startswith("blockgen-")]
    assert [db.execute(f'select count(*) from "{t}"').fetchone()[0] for t in tables] == [3, 3]  # one table per checkpoint


@pytest.mark.parametrize("former", ["blockgen.harness.lm_eval_adapter", "blockgen.harness.evaluation.lm_eval_adapter"])
def test_usage_stored_by_an_earlier_version_still_loads(former, tmp_path, monkeypatch):
    """A --use_cache file keeps each task's `Usage` pickled under the module it lived in then; the usage
    table's decoder finds it at its home today, with its figures, through SqliteDict as the model reads it."""
    import types

    from sqlitedict import SqliteDict

    from blockgen.harness.evaluation.lm_eval_model.usage import Usage, load_stored_usage

    then = types.ModuleType(former)  # the class as an earlier version defined it, at its module path then
    then.Usage = type("Usage", (), {"__module__": former})
    monkeypatch.setitem(sys.modules, former, then)
    stored = then.Usage()
    stored.__dict__.update(Usage().__dict__)
    stored.counts["toy", "loglikelihood"].update(requests=3)
    with SqliteDict(str(tmp_path / "cache.db"), tablename="usage-x", autocommit=True) as db:
        db["key"] = stored
    monkeypatch.delitem(sys.modules, former)  # that module is gone today
    with SqliteDict(str(tmp_path / "cache.db"), tablename="usage-x", decode=load_stored_usage) as db:
        loaded = db["key"]
    assert type(loaded) is Usage
    assert Usage.merge([loaded]).report()["toy"]["loglikelihood"]["requests"] == 3


# ------------------------------------------------------------------------------ the real commands


def _run(cmd: list[str], timeout: int = HANG_S, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV, cwd="/")
    return proc


def _results(out_dir: Path) -> dict:
    (path,) = out_dir.rglob("results_*.json")
    return json.loads(path.read_text())


def _eval_args(ckpt: Path, out: Path, limit: int = 4, batch: int = 3, tasks: str = TASKS) -> list[str]:
    return ["--model", "blockgen", "--model_args", f"pretrained={ckpt},k_mc=2,steps=4,seed=3",
            "--tasks", tasks, "--limit", str(limit), "--batch_size", str(batch),
            "--output_path", str(out), "--log_samples"]


@pytest.fixture(scope="session")
def single_process(ckpts, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single")
    proc = _run([str(BIN / "lm_eval"), *_eval_args(ckpts["mixture"], out)])  # device: lm-eval's cuda:0 default
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not torch.cuda.is_available():
        assert "CUDA is not available; using the CPU" in proc.stderr
    return {"results": _results(out), "out": out}


METRICS = {"blockgen_toy_cloze": ["perplexity,none", "acc,none"],
           "blockgen_toy_ppl": ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"],
           "blockgen_toy_gen": ["exact_match,none"],
           "blockgen_toy_mc": ["acc,none"]}


def test_lm_eval_command_runs_three_task_types(ckpts, single_process):
    results = single_process["results"]
    for task, metrics in METRICS.items():
        for metric in metrics:
            assert math.isfinite(results["results"][task][metric]), (task, metric)
    assert results["results"]["blockgen_toy_ppl"]["word_perplexity,none"] > 1
    info = results["config"]
    assert info["model_sha"] == checkpoint_hash(ckpts["mixture"])
    assert info["blockgen"]["block_sizes"] == [1, 8] and info["blockgen"]["block_weights"] == [0.2, 0.8]
    assert info["blockgen"]["k_mc"] == 2 and info["blockgen"]["seed"] == 3
    assert info["blockgen"]["sampler"]["name"] == "ancestral" and info["blockgen"]["sampler"]["steps"] == 4
    # what each task really ran with (docs/lm_eval.md: "What the results JSON records")
    tasks = info["blockgen"]["tasks"]
    gen = tasks["blockgen_toy_gen"]["generate_until"]
    (row,) = gen["settings"]
    assert (row["sampler"], row["steps"], row["layout"], row["max_gen_toks"], row["block_size"]) == ("ancestral", 4, "grid", 8, 8)
    assert row["paper_nfe_per_block"] == row["model_calls_per_block"] == 4
    assert gen["model_calls"] == row["model_calls"] > 0 and gen["requests"] == row["requests"] == 4
    assert gen["truncated_requests"] == 0 and gen["generated_tokens"] > 0
    cloze = tasks["blockgen_toy_cloze"]["loglikelihood"]
    assert cloze["requests"] == 4 and cloze["k_mc"] == 2 and cloze["choice_docs"] == 0
    assert sorted(cloze["mc_stderr_by_doc"]) == ["0", "1", "2", "3"] and cloze["mc_stderr_mean"] >= 0
    mc = tasks["blockgen_toy_mc"]["loglikelihood"]
    assert mc["requests"] == 36 and mc["choice_docs"] == 4 and 0 <= mc["expected_seed_disagreement"] <= 0.5
    assert all(len(v) == 9 for v in mc["mc_stderr_by_doc"].values())
    assert tasks["blockgen_toy_ppl"]["loglikelihood_rolling"]["requests"] == 4
    (samples,) = single_process["out"].rglob("samples_blockgen_toy_gen_*.jsonl")
    for line in samples.read_text().splitlines():
        text = json.loads(line)["resps"][0][0]
        assert "\n" not in text and "." not in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_ranks_agree_with_one_process(ckpts, single_process, tmp_path):
    env = {**ENV, "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           "-m", "lm_eval", *_eval_args(ckpts["mixture"], tmp_path, batch=2), "--device", "cpu"]
    proc = _run(cmd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Building contexts for blockgen_toy_ppl on rank 1" in proc.stderr  # the work really was split
    dp, single = _results(tmp_path)["results"], single_process["results"]["results"]
    for task, metrics in METRICS.items():
        for metric in metrics:
            # equal up to float32 rounding: the two runs batch different windows together
            assert dp[task][metric] == pytest.approx(single[task][metric], rel=1e-6), (task, metric)
    assert _generated(tmp_path) == _generated(single_process["out"])  # the same texts, whatever the rank
    dp_tasks = _results(tmp_path)["config"]["blockgen"]["tasks"]  # rank 0 reports both ranks' work
    single_tasks = single_process["results"]["config"]["blockgen"]["tasks"]
    for task, kind in (("blockgen_toy_gen", "generate_until"), ("blockgen_toy_mc", "loglikelihood")):
        assert dp_tasks[task][kind]["requests"] == single_tasks[task][kind]["requests"]
    assert dp_tasks["blockgen_toy_gen"]["generate_until"]["generated_tokens"] == \
        single_tasks["blockgen_toy_gen"]["generate_until"]["generated_tokens"]
    dp_se, single_se = (t["blockgen_toy_mc"]["loglikelihood"]["mc_stderr_by_doc"] for t in (dp_tasks, single_tasks))
    assert sorted(dp_se) == sorted(single_se)
    for doc in single_se:
        assert dp_se[doc] == pytest.approx(single_se[doc], rel=1e-4, abs=1e-6)


def _generated(out: Path) -> dict[int, str]:
    (samples,) = out.rglob("samples_blockgen_toy_gen_*.jsonl")
    return {(row := json.loads(line))["doc_id"]: row["resps"][0][0] for line in samples.read_text().splitlines()}


def test_python_m_blockgen_lm_eval_without_the_hook(ckpts, single_process, tmp_path):
    """The fallback works with the start-up hook off; batch size 1 gives the numbers of batch size 3."""
    env = {**ENV, "BLOCKGEN_LM_EVAL_HOOK": "0"}
    proc = _run([sys.executable, "-m", "blockgen.lm_eval",
                 *_eval_args(ckpts["mixture"], tmp_path, batch=1, tasks="blockgen_toy_cloze"), "--device", "cpu"],
                env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _results(tmp_path)["results"], single_process["results"]["results"]
    for metric in METRICS["blockgen_toy_cloze"]:
        assert got["blockgen_toy_cloze"][metric] == pytest.approx(want["blockgen_toy_cloze"][metric], rel=1e-6)
    probe = "from lm_eval.api.registry import get_model\ntry:\n get_model('blockgen')\nexcept ValueError:\n print('absent')"
    assert _run([sys.executable, "-c", probe], env=env).stdout.strip() == "absent"


def test_lm_eval_checks_gen_kwargs_and_chat_template_before_any_request(ckpts):
    """A bad gen_kwargs of a generation task listed after a log-likelihood task fails before any request
    runs; --apply_chat_template on a checkpoint without a chat template says so."""
    base = [str(BIN / "lm_eval"), "--model", "blockgen", "--model_args", f"pretrained={ckpts['mixture']}",
            "--tasks", "blockgen_toy_cloze,blockgen_toy_gen", "--limit", "1", "--device", "cpu"]
    proc = _run([*base, "--gen_kwargs", "steps=0"])
    assert proc.returncode != 0
    assert "blockgen, task blockgen_toy_gen: gen_kwargs" in proc.stderr and "steps=0; must be an integer >= 1" in proc.stderr
    assert "Running loglikelihood requests" not in proc.stderr and "Building contexts" not in proc.stderr
    proc = _run([*base, "--apply_chat_template"])
    assert proc.returncode != 0
    assert "has no chat template (BlockGen models are trained on plain text); run without --apply_chat_template" in proc.stderr


def test_lm_eval_truncation_is_reported(ckpts, tmp_path):
    """Prompts that do not fit (here: --num_fewshot 12 examples in a 64-token window) are cut with a
    warning that counts requests and tokens and names --num_fewshot; the results JSON counts them too."""
    proc = _run([str(BIN / "lm_eval"), "--model", "blockgen", "--model_args", f"pretrained={ckpts['mixture']},k_mc=2,steps=4",
                 "--tasks", "blockgen_toy_cloze,blockgen_toy_gen", "--limit", "2", "--device", "cpu",
                 "--num_fewshot", "12", "--output_path", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind, task in (("loglikelihood", "blockgen_toy_cloze"), ("generate_until", "blockgen_toy_gen")):
        assert f"blockgen {kind}, task {task}: 2 of 2 requests'" in proc.stderr
        counts = _results(tmp_path)["config"]["blockgen"]["tasks"][task][kind]
        assert counts["truncated_requests"] == 2 and counts["truncated_tokens"] > 0
    assert "the prompts carry --num_fewshot 12 examples: lower --num_fewshot" in proc.stderr


def test_lm_eval_bad_model_args_fail_early(ckpts, tmp_path):
    proc = _run([str(BIN / "lm_eval"), "--model", "blockgen", "--model_args",
                 f"pretrained={ckpts['mixture']},sampler=nope", "--tasks", "blockgen_toy_cloze", "--limit", "1"])
    assert proc.returncode != 0
    assert "unknown sampler 'nope'; choose one of ['ancestral', 'eipc', 'arpc', 'ar_greedy', 'ar_sample']" in proc.stderr


def test_hook_leaves_hf_model_working(ckpts, tmp_path):
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (lm-eval[hf])")
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(ckpts["mixture"]))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    proc = _run([str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={tmp_path / 'gpt2'}",
                 "--tasks", "blockgen_toy_cloze", "--limit", "2", "--device", "cpu", "--output_path", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert math.isfinite(_results(tmp_path / "out")["results"]["blockgen_toy_cloze"]["acc,none"])


def test_start_up_hook_is_cheap():
    """Python start-up imports only the hook (no torch, no lm-eval); lm-eval's own models stay registered."""
    proc = _run([sys.executable, "-X", "importtime", "-c", "pass"])
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "blockgen._lm_eval_hook" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "lm_eval", "numpy", "transformers")}
    probe = ("from lm_eval.api.registry import model_registry, get_model\n"
             "print(sorted(n for n in ('hf', 'vllm', 'dummy', 'blockgen') if n in model_registry))\n"
             "import sys; print('torch' in sys.modules)")
    assert _run([sys.executable, "-c", probe]).stdout.split() == ["['blockgen',", "'dummy',", "'hf',", "'vllm']", "False"]


def test_hook_failures_are_warnings(monkeypatch):
    import blockgen.lm_eval
    from blockgen import _lm_eval_hook as hook

    def broken(module):
        raise RuntimeError("boom")

    monkeypatch.setattr(blockgen.lm_eval, "register_model", broken)
    with pytest.warns(RuntimeWarning, match="could not hook into lm_eval.api.registry .*boom"):
        hook._run("lm_eval.api.registry", object())
