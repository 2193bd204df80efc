"""The lm-eval model type `blockgen` in this process: the math of its likelihoods (windows, LSE against
Jensen, padding and batch-size invariance, shared draws), generation (batches, budgets, seeds, stop
strings, temperature), its arguments, and the usage it records and caches. The real `lm_eval` command
is tests/test_lm_eval_command.py's; the tiny checkpoints (`ckpts`) come from tests/lm_eval_checkpoints.py.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
import sys
from pathlib import Path

import pytest
import torch

from blockgen.harness.checkpoints.checkpoint import load_checkpoint
from blockgen.harness.checkpoints.tokenizer import special_tokens
from lm_eval_checkpoints import SEQ_LEN, one_thread  # noqa: F401 (one_thread: autouse, one torch thread a test)


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
    # batch_invariant: the row-invariant batched path, bit for bit the window alone (on that path), in any order,
    # and within float rounding of the plain path's window alone
    invariant = [score_windows(model, [w], [s], k_mc=3, pad_id=1, batch_invariant=True)[0] for w, s in zip(batch, seeds)]
    assert score_windows(model, batch, seeds, k_mc=3, pad_id=0, batch_invariant=True) == invariant
    order = [2, 0, 3, 1]
    shuffled = score_windows(model, [batch[i] for i in order], [seeds[i] for i in order], k_mc=3, pad_id=0, batch_invariant=True)
    assert shuffled == [invariant[i] for i in order]
    assert [s.lse for s in invariant] == pytest.approx([s.lse for s in alone], rel=1e-5)


def test_scores_and_texts_are_bitwise_the_same_for_every_batch_size(ckpts):
    """batch_invariant: log-likelihoods, rolling log-likelihoods and a diffusion sampler's texts (the default on a
    CPU) and AR decoding's texts (batch_invariant=true) of batch sizes 1, 7 and 16, and of the requests in shuffled
    order, are bit for bit equal."""
    starts = ["the red cat sees the", "one plus two is", "the quiet mouse likes the old", "four plus four is"]
    contexts = [f"{word} {start}" for word in ("the", "a", "two", "one") for start in starts]  # 16 distinct requests
    pairs = [(c, f" {w}") for c, w in zip(contexts, ["ball", "three", "box", "eight"] * 4)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {}
    for batch in (1, 7, 16):
        lm = _lm(ckpts["mixture"], batch_size=batch, seed=3)
        assert lm.batch_invariant == {"likelihood": True, "generation": True, "autoregressive_generation": False}
        invariant = lm.with_settings(batch_invariant=True)
        assert invariant.batch_invariant == dict.fromkeys(lm.batch_invariant, True)
        plain = lm.with_settings(batch_invariant=False)
        assert plain.batch_invariant == dict.fromkeys(lm.batch_invariant, False)
        for shuffle in ((False, True) if batch == 16 else (False,)):
            rows = order if shuffle else list(range(len(pairs)))
            ll = lm.loglikelihood(_requests("loglikelihood", [pairs[i] for i in rows]))
            rolling = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(contexts[i],) for i in rows]))
            texts = lm.generate_until(_requests("generate_until", [(contexts[i], {"until": ["."], "max_gen_toks": 16}) for i in rows]))
            ar_texts = invariant.generate_until(_requests("generate_until", [
                (contexts[i], {"until": ["."], "max_gen_toks": 16, "sampler": "ar_sample", "temperature": 1.0}) for i in rows]))
            back = sorted(range(len(rows)), key=rows.__getitem__)  # undo the shuffle
            runs[batch, shuffle] = tuple([part[i] for i in back] for part in (ll, rolling, texts, ar_texts))
    first = runs[1, False]
    for key, run in runs.items():
        for part in range(4):
            diff = [(i, a, b) for i, (a, b) in enumerate(zip(run[part], first[part])) if a != b]
            assert not diff, (key, part, diff[:3])


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
        "sampler=bogus": "choose one of ['ancestral', 'eipc', 'arpc', 'confidence_threshold', 'entropy_bounded', 'low_confidence', 'ar_greedy', 'ar_sample']",
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
    from dataclasses import replace

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
        seed = derive_seed(lm.args.seed, "generate_until", prompt, replace(lm.sampler, max_new_tokens=budget).as_dict(), req.doc_id, 0)
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


def test_compile_on_a_cpu_says_so_before_the_silent_minutes(ckpts, monkeypatch, caplog):
    """compile=true on a CPU: a warning before the first batch compiles (minutes of no output)."""
    import logging

    from lm_eval.api.instance import Instance

    from blockgen.harness.evaluation.lm_eval_model import arguments, model as adapter

    class Compiling(Exception):
        pass

    def generate(*args, compile=False, **kwargs):
        raise Compiling(compile)

    monkeypatch.setattr(adapter, "generate", generate)  # stop where the compiling would start
    arguments._warned.clear()
    lm = _lm(ckpts["mixture"], compile=True)
    reqs = [Instance(request_type="generate_until", doc={}, arguments=("", {"max_gen_toks": 8}), idx=0,
                     metadata=("toy_uncond", 0, 1))]
    with caplog.at_level(logging.WARNING), pytest.raises(Compiling, match="True"):
        lm.generate_until(reqs)
    assert "compile=true on the CPU: the first batch compiles each kind of model call" in caplog.text
