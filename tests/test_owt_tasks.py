"""Tasks owt_ppl(_embedded) and owt_genppl(_embedded) through the real `lm_eval` command.

Micro checkpoints are trained here by `blockgen train` on the offline `text` source (CPython's
pydoc_data.topics) in seconds; the scorer is a micro GPT-2 from `blockgen train-scorer`. The vLLM
parts need the vLLM environment that `make test` sets up (`make vllm-env`); without it they skip,
except under CI, where they fail.
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

from blockgen.harness.checkpoints.checkpoint import load_checkpoint
from blockgen.harness.data.sources import DataConfig, chunk_documents, document_split, get_tokenizer
from blockgen.harness.checkpoints.tokenizer import special_tokens
from limits import HANG_S
from vllm_env import vllm_python

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}
SEQ_LEN = 64
N_VAL = 12  # validation chunks in training; the tasks score the same ones with --limit N_VAL


def run(*args: str, env: dict | None = None, timeout: int = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env or ENV, timeout=timeout, cwd=REPO)


def train(out: Path, cache: Path, *flags: str) -> Path:
    """`blockgen train` on the offline text; validation on N_VAL held-out chunks at the end."""
    r = run(BIN / "blockgen", "train", "--preset", "ci", "--out-dir", out, "--data.source", "text",
            "--data.vocab-size", "512", "--data.cache-dir", cache, "--data.n-val", str(N_VAL), "--seq-len", str(SEQ_LEN),
            "--eval-every", "1000", "--save-every", "1000", "--device", "cpu", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "checkpoint"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("owt")


@pytest.fixture(scope="module")
def ar_checkpoint(work) -> Path:
    return train(work / "ar", work / "data", "--block-sizes", "1", "--block-weights", "1", "--max-steps", "30")


@pytest.fixture(scope="module")
def mix_checkpoint(work) -> Path:
    return train(work / "mix", work / "data", "--block-sizes", "1", "4", "--block-weights", "0.3", "0.7",
                 "--max-steps", "30", "--k-mc", "32")


@pytest.fixture(scope="module")
def scorer_dir(work) -> Path:
    """A micro GPT-2 scorer with its own tokenizer (another vocabulary: re-tokenization is real) and a
    context of 32, so samples span several scoring windows."""
    out = work / "scorer"
    r = run(BIN / "blockgen", "train-scorer", "--out-dir", out, "--seq-len", "32", "--n-layers", "2",
            "--max-steps", "40", "--data.vocab-size", "384", "--data.cache-dir", work / "data", "--data.n-val", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def lm_eval(checkpoint: Path, task: str, out: Path, *extra: str, model_args: str = "", env: dict | None = None):
    args = f"pretrained={checkpoint}" + (f",{model_args}" if model_args else "")
    return run(BIN / "lm_eval", "--model", "blockgen", "--model_args", args, "--tasks", task, "--device", "cpu",
               "--batch_size", "8", "--output_path", out, "--log_samples", *extra, env=env)


def results(out: Path, task: str) -> tuple[dict, list[dict]]:
    res = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"][task]
    samples = [json.loads(line) for line in sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1].read_text().splitlines()]
    return {k.split(",")[0]: v for k, v in res.items() if "_stderr" not in k}, samples


def validation(run_dir: Path) -> dict:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]


def needs_windows_api():
    from blockgen.harness.evaluation.lm_eval_model.model import BlockGenLM

    if not hasattr(BlockGenLM, "loglikelihood_windows"):
        pytest.skip("the adapter has no BlockGenLM.loglikelihood_windows yet (issue 10: exact token windows "
                    "with both bounds); owt_ppl cannot run without it")


# ------------------------------------------------------------------------------- data


def test_text_source_split_is_stable_and_disjoint():
    train_docs, held_out = document_split(DataConfig(source="text"))
    assert train_docs and held_out and not set(train_docs) & set(held_out)
    assert 0.03 < len(held_out) / (len(train_docs) + len(held_out)) < 0.25
    again = document_split(DataConfig(source="text"))
    assert again == (train_docs, held_out)


def test_text_source_reads_local_files(tmp_path):
    docs = [f"Document number {i}.\n\nIt has two paragraphs, this is the second of document {i}." for i in range(60)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:30]))
    for i, d in enumerate(docs[30:]):
        (tmp_path / f"doc{i:02d}.txt").write_text(d)
    train_docs, held_out = document_split(DataConfig(source="text", path=str(tmp_path / "*")))
    assert sorted(train_docs + held_out) == sorted(docs) and held_out
    # the split follows each document's text, not the files it came from
    whole = document_split(DataConfig(source="text", path=str(tmp_path / "a.jsonl")))
    assert set(whole[1]) == {d for d in held_out if d in docs[:30]}


def test_local_tokenizer_is_trained_on_the_text_source(work):
    tok = get_tokenizer(DataConfig(source="text", vocab_size=512, cache_dir=str(work / "data")))
    assert len(tok) == 512 and any(p.name.startswith("tokenizer-text-") for p in (work / "data").iterdir())
    vocab = tok.get_vocab()
    assert all(w in vocab for w in ("Ġstatement", "Ġobject", "Ġfunction"))  # the documentation's words
    held_out = document_split(DataConfig(source="text"))[1][0]
    assert len(tok.encode(held_out, add_special_tokens=False)) < len(held_out.encode()) / 1.8


# ------------------------------------------------------------------------------- owt_ppl


def plain_causal_nll(checkpoint: Path, chunks: torch.Tensor) -> tuple[float, int]:
    """Exact NLL of an AR (block size 1) checkpoint by one causal pass over [x ; placeholders]:
    clean token i sees clean tokens <= i; the placeholder at position p sees clean tokens < p and itself."""
    model, _ = load_checkpoint(checkpoint)
    n, length = chunks.shape
    tokens = torch.cat([chunks, model.prior.fully_noised((n, length))], dim=1)
    positions = torch.arange(length).repeat(2)[None].expand(n, -1)
    i = torch.arange(length)
    mask = torch.zeros(2 * length, 2 * length, dtype=torch.bool)
    mask[:length, :length] = i[None, :] <= i[:, None]
    mask[length:, :length] = i[None, :] < i[:, None]
    mask[length:, length:] = torch.eye(length, dtype=torch.bool)
    with torch.no_grad():
        logits = model.dit._run(tokens, positions, mask, None, 0, length)
    logits = logits[..., : model.prior.vocab_size]  # the real vocabulary ([MASK] is never a target)
    nll = -logits.double().log_softmax(-1).gather(-1, chunks[..., None])[..., 0]
    return nll.sum().item(), chunks.numel()


def test_owt_ppl_of_an_ar_checkpoint_is_the_exact_causal_nll_and_training_validation(work, ar_checkpoint):
    needs_windows_api()
    out = work / "ppl-ar"
    r = lm_eval(ar_checkpoint, "owt_ppl_embedded", out, "--limit", str(N_VAL), model_args="k_mc=2")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics, samples = results(out, "owt_ppl_embedded")
    chunks = torch.tensor([s["doc"]["tokens"] for s in sorted(samples, key=lambda s: s["doc_id"])])
    # the task's chunks are training's validation chunks: same split, tokenizer, layout
    tok = get_tokenizer(DataConfig(source="text", vocab_size=512, cache_dir=str(work / "data")))
    want = chunk_documents(document_split(DataConfig(source="text"))[1], tok, special_tokens(tok), SEQ_LEN).tokens[:N_VAL]
    assert torch.equal(chunks, want)
    total, count = plain_causal_nll(ar_checkpoint, chunks)
    assert metrics["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert metrics["perplexity_jensen"] == pytest.approx(metrics["perplexity"], rel=1e-9)  # one block size
    val = validation(work / "ar")
    assert val["val_tokens"] == count
    assert metrics["nll"] == pytest.approx(val["val_nll_lse"], rel=1e-5)


def test_owt_ppl_of_a_mixture_matches_training_validation(work, mix_checkpoint):
    """Same chunks, same bounds; the Monte Carlo draws differ (training draws per batch, the adapter
    per window), so the LSE and Jensen NLLs agree to the MC error of K_MC = 32 draws."""
    needs_windows_api()
    out = work / "ppl-mix"
    r = lm_eval(mix_checkpoint, "owt_ppl_embedded", out, "--limit", str(N_VAL), model_args="k_mc=32")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics, samples = results(out, "owt_ppl_embedded")
    val = validation(work / "mix")
    assert val["val_tokens"] == sum(len(s["doc"]["tokens"]) for s in samples)
    assert metrics["nll"] == pytest.approx(val["val_nll_lse"], rel=0.015)
    assert metrics["nll_jensen"] == pytest.approx(val["val_nll_jensen"], rel=0.015)
    assert metrics["nll"] < metrics["nll_jensen"]  # LSE is the tighter bound
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["nll"]), rel=1e-9)


def test_owt_ppl_needs_a_blockgen_checkpoint(work, scorer_dir):
    """Another model type (here lm-eval's `hf` on the GPT-2 scorer) has no bounds to report: a clear error."""
    r = run(BIN / "lm_eval", "--model", "hf", "--model_args", f"pretrained={scorer_dir}", "--tasks", "owt_ppl_embedded",
            "--device", "cpu", "--limit", "2")
    assert r.returncode != 0
    assert "run it with --model blockgen" in r.stderr and "expected 'blockgen'" in r.stderr


# ------------------------------------------------------------------------------- owt_genppl


GEN_ARGS = "sampler=arpc,steps=3,ge=2,temperature=0.9"
N_SAMPLES = 8


@pytest.fixture(scope="module")
def genppl_transformers(work, mix_checkpoint, scorer_dir) -> Path:
    """owt_genppl_embedded with the in-process (transformers) scorer."""
    out = work / "gen-tf"
    meta = json.dumps({"scorer_model": str(scorer_dir), "num_samples": N_SAMPLES})
    r = lm_eval(mix_checkpoint, "owt_genppl_embedded", out, "--metadata", meta, model_args=GEN_ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_owt_genppl_end_to_end_transformers_scorer(genppl_transformers, scorer_dir):
    metrics, samples = results(genppl_transformers, "owt_genppl_embedded")
    assert len(samples) == N_SAMPLES
    texts = [s["resps"][0][0] for s in samples]
    assert all(texts)
    # recompute Gen PPL and entropy from the samples with the scorer, independently of the task
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(scorer_dir)
    model = GPT2LMHeadModel.from_pretrained(scorer_dir).eval()
    total, count, entropies, lengths = 0.0, 0, [], []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]  # special-token strings: special tokens
        lengths.append(len(ids))
        counts = torch.bincount(torch.tensor(ids)).double()
        p = counts[counts > 0] / len(ids)
        entropies.append(-(p * p.log()).sum().item())
        seq = [tok.eos_token_id, *ids]  # BOS == EOS for the GPT-2-style scorer
        w = 31  # windows of context - 1 tokens; after the first, each adds w // 2 = 15 new tokens
        for t in range(1, len(seq)):  # every token once, behind the tokens of its window before it
            start = 0 if t < w else min(w + 15 * ((t - w) // 15 + 1), len(seq)) - w
            with torch.no_grad():
                logits = model(torch.tensor([seq[start:t]])).logits[0, -1]
            total += logits.log_softmax(-1)[seq[t]].item()
            count += 1
    # Length-L samples (sample_length 'fixed', the default for a BlockGen checkpoint): every sample is
    # the whole budget, EOS kept as the scorer's EOS token; longer than one window of the 32-token scorer.
    assert min(lengths) > 31, lengths
    assert any(tok.eos_token_id in tok(text, add_special_tokens=False)["input_ids"] for text in texts)
    (path,) = genppl_transformers.rglob("results_*.json")
    report = json.loads(path.read_text())
    assert report["configs"]["owt_genppl_embedded"]["metadata"]["sample_length"] == "fixed"
    (setting,) = report["config"]["blockgen"]["tasks"]["owt_genppl_embedded"]["generate_until"]["settings"]
    assert setting["generated_tokens"] == N_SAMPLES * setting["max_gen_toks"]  # no sample stopped early
    assert metrics["unigram_entropy"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-9)
    assert metrics["gen_ppl"] == pytest.approx(math.exp(-total / count), rel=1e-5)
    assert 0.0 <= metrics["mauve"] <= 1.0


def test_sample_length_defaults_and_choices(mix_checkpoint, scorer_dir):
    """'fixed' (length L, EOS kept) for a BlockGen checkpoint, 'eos' for another model type (lm-eval's hf
    backend stops at EOS), 'fixed' refused there; a bad value names the choices."""
    from blockgen.tasks.owt import sample_length

    assert sample_length({"pretrained": str(mix_checkpoint)}) == "fixed"
    assert sample_length({"pretrained": str(mix_checkpoint), "sample_length": "eos"}) == "eos"
    assert sample_length({"pretrained": str(scorer_dir)}) == "eos"
    with pytest.raises(ValueError, match="needs a BlockGen checkpoint"):
        sample_length({"pretrained": str(scorer_dir), "sample_length": "fixed"})
    with pytest.raises(ValueError, match=r"choose from \['fixed', 'eos'\]"):
        sample_length({"pretrained": str(mix_checkpoint), "sample_length": "L"})


def test_owt_genppl_missing_scorer_fails_before_generating(work, mix_checkpoint):
    meta = json.dumps({"scorer_model": str(work / "no-such-scorer")})
    r = lm_eval(mix_checkpoint, "owt_genppl_embedded", work / "gen-missing", "--metadata", meta)
    assert r.returncode != 0
    assert "no such directory" in r.stderr and "blockgen train-scorer" in r.stderr
    assert "Running generate_until" not in r.stderr


def test_owt_genppl_vllm_scorer_agrees_with_transformers(work, mix_checkpoint, scorer_dir, genppl_transformers):
    """The same samples (same seed) scored through a vLLM server the harness starts: Gen PPL to 1e-3.
    Over 30 s (about 35 s): a real vLLM engine starts on the CPU (most of it); nothing smaller serves the model."""
    python = vllm_python()
    out = work / "gen-vllm"
    meta = json.dumps({"scorer_model": str(scorer_dir), "num_samples": N_SAMPLES, "scorer": "vllm"})
    env = {**ENV, "BLOCKGEN_VLLM_PYTHON": python, "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = lm_eval(mix_checkpoint, "owt_genppl_embedded", out, "--metadata", meta, model_args=GEN_ARGS, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    (tf, tf_samples), (vl, vl_samples) = results(genppl_transformers, "owt_genppl_embedded"), results(out, "owt_genppl_embedded")
    assert [s["resps"] for s in tf_samples] == [s["resps"] for s in vl_samples]
    assert vl["gen_ppl"] == pytest.approx(tf["gen_ppl"], rel=1e-3)
    assert vl["unigram_entropy"] == tf["unigram_entropy"] and vl["mauve"] == tf["mauve"]
    assert "starting vLLM server" in r.stderr
