"""The paper's released checkpoints (harness/released.py) against the fixtures in the release format.

The fixtures (`../shared/data/released`, or $BLOCKGEN_RELEASE_FIXTURES) are tiny random models saved as
the authors' code saves a release, with the logits, log-probabilities and NLLs that the authors' code
computes for them. Every fixture is loaded through the adapter (`pretrained=<folder>,tokenizer=...`),
the path users take, and every recorded reference is matched to 1e-4 (float32, CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockgen.harness.hub import HubUnavailableError
from blockgen.harness.released import (
    DATASETS,
    ReleaseError,
    ReleaseOverrides,
    parse_release_path,
    release_source,
    resolve,
)
from blockgen.models.model import BlockGenConfig
from blockgen.models.sampling import Decoder, SamplerConfig, generate

FIXTURES = Path(os.environ.get("BLOCKGEN_RELEASE_FIXTURES", Path(__file__).resolve().parents[2] / "shared/data/released"))
FOLDERS = sorted(str(p.parent.relative_to(FIXTURES)) for p in FIXTURES.rglob("reference.json")) if FIXTURES.is_dir() else []
if not FOLDERS and os.environ.get("CI"):  # CI lays shared/ beside its clone: a skip there would hide a failure
    raise RuntimeError(f"CI: release fixtures not found at {FIXTURES}")
needs_fixtures = pytest.mark.skipif(not FOLDERS, reason=f"release fixtures not found at {FIXTURES}")
ATOL = 1e-4
BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def release_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("BLOCKGEN_RELEASE_CACHE", str(tmp_path_factory.getbasetemp() / "release-cache"))


@pytest.fixture(scope="session")
def tok64(tmp_path_factory) -> Path:
    """A 64-token character tokenizer with its own pad token: vocab_size == len == 64, as the fixtures'
    SmolLM-like one (absorb / mdlm / ar models then have 65 rows, uniform / duo 64)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<bos>", "<eos>", "<pad>", "<unk>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!'-:;\n=+*/()ABCDEFGH")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    assert len(vocab) == 64
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    out = tmp_path_factory.mktemp("tok64")
    fast.save_pretrained(str(out))
    return out


def _lm(pretrained, **kwargs):
    from lm_eval.api.registry import get_model

    return get_model("blockgen")(pretrained=str(pretrained), device="cpu", **kwargs)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= ATOL, f"{what}: max |diff| {diff:.2e}"


def _close_log_probs(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The authors' -1e6 placeholders (mask column, carry-over) are -inf here: same pattern, finite entries equal."""
    finite = want > -1e5
    assert torch.equal(finite, got > -1e5), f"{what}: the pattern of -1e6 / -inf entries differs"
    _close(got[finite], want[finite], what)


# ------------------------------------------------------------------------------ exactness


@needs_fixtures
@pytest.mark.parametrize("folder", FOLDERS)
def test_fixture_matches_the_authors_reference(folder, tok64):
    meta = json.loads((FIXTURES / folder / "reference.json").read_text())
    ref = load_file(str(FIXTURES / folder / "reference.safetensors"))
    lm = _lm(FIXTURES / folder, tokenizer=str(tok64))
    model, prior = lm.model, lm.model.prior
    assert lm.get_model_info()["model_source"] == str((FIXTURES / folder).resolve())
    x0 = ref["input.x0"]
    checked = 0
    with torch.no_grad():
        if meta["algo"] == "ar":
            _close(model.dit.forward_ar(x0), ref["ref.logits"], "logits")
            z = prior.fully_noised(x0.shape)
            logits = model.dit.forward_train(x0, z, 1)  # row i predicts x0[i]
            _close_log_probs(prior.denoiser_log_probs(logits, z)[:, 1:], ref["ref.log_probs"][:, :-1], "log_probs")
            _close(-prior.log_prob_clean(logits, x0, z)[:, 1:], ref["ref.nll_per_token"], "nll_per_token")
            lse, jensen = model.nll_bounds(x0, torch.ones(x0.shape))  # exact: no Monte Carlo
            _close(lse.float(), ref["ref.nll_per_token"].sum(-1), "sequence NLL")
            checked = 4
        elif meta["algo"] in ("mdlm", "duo_base"):
            t, xt = ref["input.t"][:, 0], ref["input.xt"]
            sigma = model.sigma(t) if model.config.time_conditioning else torch.zeros_like(t)
            _close(sigma, ref["ref.sigma_backbone"], "sigma fed to the backbone")
            logits = model.dit.forward_full(xt, model.sigma(t))
            _close(logits, ref["ref.logits"], "logits")
            _close_log_probs(prior.denoiser_log_probs(logits, xt), ref["ref.log_probs"], "log_probs")
            _close(prior.nelbo(logits, x0, xt, t, model.schedule), ref["ref.nll_per_token"], "nll_per_token")
            checked = 4
        else:
            assert list(model.config.block_sizes) == [b for b in meta["block_sizes"]]
            for b in meta["block_sizes"]:
                xt = ref[f"input.xt_bs{b}"]
                logits = model.dit.forward_train(x0, xt, b)
                _close(logits, ref[f"ref.train_logits_bs{b}"], f"train logits, block size {b}")
                _close_log_probs(prior.denoiser_log_probs(logits, xt), ref[f"ref.train_log_probs_bs{b}"], f"train log_probs {b}")
                nll = (-prior.log_prob_clean(logits, x0, xt) if b == 1
                       else prior.nelbo(logits, x0, xt, ref["input.t"][:, 0], model.schedule))
                _close(nll, ref[f"ref.nll_per_token_bs{b}"], f"nll_per_token, block size {b}")
                checked += 3
            b, prefix = max(meta["block_sizes"]), ref["input.gen_prefix"].tolist()
            pad = lm.special.pad
            for use_cache in (False, True):  # the sampler's own decoder: prompt committed, then two calls
                dec = Decoder(model, prefix, pad, b, use_cache=use_cache)
                first, second = dec.denoise(ref["input.gen_block_a"]), dec.denoise(ref["input.gen_block_b"])
                names = ("gen_cache_step0", "gen_cache_step1") if use_cache else ("gen_nocache_a", "gen_nocache_b")
                _close(first, ref[f"ref.{names[0]}_logits"], names[0])
                _close(second, ref[f"ref.{names[1]}_logits"], names[1])
                if not use_cache:
                    _close_log_probs(prior.denoiser_log_probs(second, ref["input.gen_block_b"]),
                                     ref["ref.gen_nocache_b_log_probs"], "gen_nocache_b log_probs")
                checked += 2
            if "ref.gen_ar_logits" in ref:  # mixtures: the AR step and ARPC's verification pass
                ar = Decoder(model, prefix, pad, 1, use_cache=False).denoise(ref["input.ar_token"])
                _close(ar, ref["ref.gen_ar_logits"], "gen_ar")
                _close(Decoder(model, [[]] * len(prefix), pad, 1).denoise(ref["input.ar_token"]), ref["ref.gen_ar_first_logits"],
                       "gen_ar_first")
                logits, _ = Decoder(model, prefix, pad, b, use_cache=False).ar_pass(ref["input.verify_gen"], ref["input.verify_xt"])
                _close(logits, ref["ref.verify_nocache_logits"], "verify_nocache")
                _close_log_probs(prior.denoiser_log_probs(logits, ref["input.verify_xt"]), ref["ref.verify_nocache_log_probs"],
                                 "verify_nocache log_probs")
                dec = Decoder(model, prefix, pad, b)
                dec.denoise(ref["input.gen_block_a"])  # commits the prompt
                logits, _ = dec.ar_pass(ref["input.verify_gen"], ref["input.verify_xt"])
                _close(logits, ref["ref.verify_cache_logits"], "verify_cache")
                checked += 5
    assert checked >= 4


@needs_fixtures
def test_weights_with_and_without_inv_freq_load_the_same(tmp_path, tok64):
    folder = "blockgen/multi_block_size/8/tiny/0.05_0.95/absorb"
    copy = tmp_path / folder
    shutil.copytree(FIXTURES / folder, copy)
    weights = load_file(str(copy / "model.safetensors"))
    assert "rotary_emb.inv_freq" in weights
    save_file({k: v for k, v in weights.items() if k != "rotary_emb.inv_freq"}, str(copy / "model.safetensors"))
    ref = load_file(str(FIXTURES / folder / "reference.safetensors"))
    a = _lm(FIXTURES / folder, tokenizer=str(tok64)).model
    b = _lm(copy, tokenizer=str(tok64)).model
    x0, xt = ref["input.x0"], ref["input.xt_bs8"]
    with torch.no_grad():
        assert torch.equal(a.dit.forward_train(x0, xt, 8), b.dit.forward_train(x0, xt, 8))
    weights["rotary_emb.inv_freq"] = weights["rotary_emb.inv_freq"] * 2  # another rotary base: refused
    save_file(weights, str(copy / "model.safetensors"))
    with pytest.raises(ReleaseError, match="inv_freq is not the base-10000 table"):
        resolve(copy, ReleaseOverrides(tokenizer=str(tok64)))


# ------------------------------------------------------------------------------ settings and overrides


@pytest.mark.parametrize("subfolder, algo, prior, sizes, weights, x0_causal, dataset", [
    ("baselines/owt/ar", "ar", "masked", None, None, None, "owt"),
    ("baselines/tinygsm/duo", "duo", "uniform", None, None, None, "tinygsm"),
    ("baselines/owt/mdlm", "mdlm", "masked", None, None, None, "owt"),
    ("blockgen/single_block_size/16/owt/absorb", "blockgen", "masked", (16,), (1.0,), False, "owt"),
    ("blockgen/single_block_size/32/tinygsm/uniform", "blockgen", "uniform", (32,), (1.0,), False, "tinygsm"),
    ("blockgen/multi_block_size/16/owt/0.05_0.95/absorb", "blockgen", "masked", (1, 16), (0.05, 0.95), True, "owt"),
    ("blockgen/multi_block_size/16/owt/uniform/uniform", "blockgen", "uniform", (1, 2, 4, 8, 16), (0.2,) * 5, True, "owt"),
    ("blockgen/multi_block_size/32/tinygsm/0.01_0.99/uniform", "blockgen", "uniform", (1, 32), (0.01, 0.99), True, "tinygsm"),
    ("/data/copy/blockgen/multi_block_size/16/tinygsm/0.1_0.9/absorb", "blockgen", "masked", (1, 16), (0.1, 0.9), True, "tinygsm"),
])
def test_release_path_encodes_the_setting(subfolder, algo, prior, sizes, weights, x0_causal, dataset):
    s = parse_release_path(subfolder)
    assert (s.algo, s.prior, s.block_sizes, s.x0_causal, s.dataset) == (algo, prior, sizes, x0_causal, dataset)
    assert s.block_weights == (pytest.approx(weights) if weights else None)
    assert s.tokenizer == DATASETS[dataset].tokenizer
    assert parse_release_path("/some/where/my-model").algo is None


@needs_fixtures
def test_inconsistent_overrides_fail_clearly(tmp_path, tok64):
    tok = str(tok64)
    absorb = FIXTURES / "blockgen/single_block_size/8/tiny/absorb"
    with pytest.raises(ReleaseError, match="prior=uniform contradicts the release, whose path says prior=absorb"):
        resolve(absorb, ReleaseOverrides.from_model_args(prior="uniform", tokenizer=tok))
    with pytest.raises(ReleaseError, match="block_sizes=.*contradicts the release"):
        resolve(absorb, ReleaseOverrides.from_model_args(block_sizes="1:8", block_weights="0.5:0.5", tokenizer=tok))
    # A copy outside the release layout: the setting comes from overrides, checked against the weights.
    copy = tmp_path / "my-model"
    shutil.copytree(absorb, copy)
    with pytest.raises(ReleaseError, match="give algo="):
        resolve(copy, ReleaseOverrides(tokenizer=tok))
    with pytest.raises(ReleaseError, match="64 tokens, so prior=uniform needs 64 embedding rows, but the weights have 65; "
                                           "the rows fit prior=masked"):
        resolve(copy, ReleaseOverrides.from_model_args(algo="blockgen", prior="uniform", block_sizes="8", tokenizer=tok))
    with pytest.raises(ReleaseError, match="block size 1 contradicts the weights' block-causal clean stream"):
        resolve(copy, ReleaseOverrides.from_model_args(algo="blockgen", prior="absorb", block_sizes="1:8",
                                                       block_weights="0.05:0.95", tokenizer=tok))
    with pytest.raises(ReleaseError, match="algo=mdlm contradicts config.json type='block-dit'"):
        resolve(copy, ReleaseOverrides.from_model_args(algo="mdlm", tokenizer=tok))
    ar = tmp_path / "ar-copy"
    shutil.copytree(FIXTURES / "baselines/tiny/ar", ar)
    with pytest.raises(ReleaseError, match="algo=mdlm contradicts the weights: they lack the adaLN"):
        resolve(ar, ReleaseOverrides.from_model_args(algo="mdlm", tokenizer=tok))
    model = _lm(copy, algo="blockgen", prior="absorb", block_sizes=8, tokenizer=tok).model  # consistent: loads
    assert (model.config.prior, model.config.block_sizes, model.config.causal_clean) == ("masked", (8,), False)
    with pytest.raises(ReleaseError, match="the path names no dataset with a known tokenizer"):
        resolve(absorb)
    with pytest.raises(ValueError, match="prior='gaussian'; choose 'masked'"):
        ReleaseOverrides.from_model_args(prior="gaussian")
    project = tmp_path / "project"  # overrides on a checkpoint of this project are refused
    (project).mkdir()
    (project / "config.json").write_text(json.dumps({"model_type": "blockgen"}))
    with pytest.raises(ReleaseError, match=r"is a checkpoint of this project: \['prior'\] apply to released"):
        resolve(project, ReleaseOverrides(prior="masked"))


def test_old_config_without_the_new_fields_loads():
    old = {"model_type": "blockgen", "vocab_size": 10, "seq_len": 16, "block_sizes": [1, 4], "block_weights": [0.5, 0.5]}
    config = BlockGenConfig.from_dict(old)
    assert (config.architecture, config.adaln, config.time_conditioning, config.cond_silu) == ("blockgen", True, False, False)


# ------------------------------------------------------------------------------ hub and offline


@needs_fixtures
def test_hf_spec_reads_a_local_copy_offline_and_names_what_to_do_without_one(monkeypatch, tok64):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("BLOCKGEN_RELEASE_DIR", str(FIXTURES))
    spec = "hf:jdeschena/blockgen/baselines/tiny/mdlm"
    lm = _lm(spec, tokenizer=str(tok64))
    assert release_source(lm.checkpoint_dir) == spec
    assert lm.get_model_info()["model_checkpoint"] == spec  # leaderboard rows name the release
    missing = "hf:jdeschena/blockgen/blockgen/single_block_size/16/owt/absorb"
    with pytest.raises(HubUnavailableError) as err:
        resolve(missing)
    text = str(err.value)
    assert "HF_HUB_OFFLINE=1" in text and "BLOCKGEN_RELEASE_DIR=DIR" in text and "make demo" in text
    assert "--include 'blockgen/single_block_size/16/owt/absorb/*'" in text


# ------------------------------------------------------------------------------ the baselines as models


@needs_fixtures
def test_baselines_generate_with_their_own_network(tok64):
    ref = load_file(str(FIXTURES / "baselines/tiny/ar/reference.safetensors"))
    ar = _lm(FIXTURES / "baselines/tiny/ar", tokenizer=str(tok64)).model
    prompts = [ref["input.x0"][0, :5].tolist(), ref["input.x0"][1, :3].tolist()]  # left-padded to one batch
    out = generate(ar, prompts, SamplerConfig(name="ar_greedy", max_new_tokens=6), eos_id=-1, pad_id=0).tokens
    for prompt, got in zip(prompts, out):  # brute force: argmax of the full causal pass, token by token
        seq = list(prompt)
        for _ in range(6):
            logits = ar.dit.forward_ar(torch.tensor([seq]))[0, -1, : ar.prior.vocab_size]
            seq.append(int(logits.argmax()))
        assert got == seq[len(prompt):]
    # AR training loss: next-token cross-entropy over the real vocabulary, first token excluded
    x = ref["input.x0"]
    total, count = ar(x, torch.ones(x.shape), 1, torch.rand(2))
    want = -ar.dit.forward_ar(x)[:, :-1, :64].log_softmax(-1).gather(-1, x[:, 1:, None]).sum()
    assert count == x.numel() - 2 and torch.allclose(total, want, atol=1e-4)

    duo = _lm(FIXTURES / "baselines/tiny/duo", tokenizer=str(tok64)).model  # full sequence, time-conditioned
    z = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    dec = Decoder(duo, [[], []], 0, 32)
    got = dec.denoise(z, alpha_t=0.4)
    assert torch.allclose(got, duo.dit.forward_full(z, duo.sigma(torch.full((2,), 0.6 / 0.999))), atol=1e-5)
    assert not torch.allclose(got, dec.denoise(z, alpha_t=0.9), atol=1e-3)  # the sampler's time reaches the network
    result = generate(duo, [[1, 5, 6]], SamplerConfig(steps=4, block_size=32, max_new_tokens=8), eos_id=-1, pad_id=0)
    assert len(result.tokens[0]) == 8 and result.model_calls == 4


@needs_fixtures
def test_one_run_scores_blockgen_and_the_baselines(tok64):
    """The adapter's likelihood on each family: exact for AR (equals the reference NLL), MC bounds otherwise."""
    ref = load_file(str(FIXTURES / "baselines/tiny/ar/reference.safetensors"))
    x0 = ref["input.x0"][0].tolist()
    scores = {}
    for folder in ("baselines/tiny/ar", "baselines/tiny/mdlm", "baselines/tiny/duo", "blockgen/multi_block_size/8/tiny/0.05_0.95/absorb"):
        lm = _lm(FIXTURES / folder, tokenizer=str(tok64), k_mc=2, add_bos=False)
        (logp, _), = lm._loglikelihood_tokens([(("", ""), x0[:1], x0[1:])])  # x0[0] given, 31 tokens scored
        scores[folder] = logp
        assert logp < 0
    assert scores["baselines/tiny/ar"] == pytest.approx(-float(ref["ref.nll_per_token"][0].sum()), abs=1e-4)


@needs_fixtures
def test_lm_eval_command_runs_a_toy_task_on_a_fixture(tmp_path, tok64):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "BLOCKGEN_RELEASE_CACHE": str(tmp_path / "cache")}
    fixture = FIXTURES / "blockgen/multi_block_size/8/tiny/0.05_0.95/absorb"
    proc = subprocess.run(
        [str(BIN / "lm_eval"), "--model", "blockgen", "--model_args", f"pretrained={fixture},tokenizer={tok64},k_mc=2",
         "--tasks", "blockgen_toy_cloze,blockgen_toy_gen", "--limit", "2", "--device", "cpu", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(path.read_text())
    assert results["config"]["model_checkpoint"] == str(fixture.resolve())
    assert results["results"]["blockgen_toy_cloze"]["perplexity,none"] > 1
    assert results["config"]["blockgen"]["block_sizes"] == [1, 8]
    assert results["config"]["blockgen"]["tasks"]["blockgen_toy_gen"]["generate_until"]["requests"] == 2


@needs_fixtures
def test_training_can_start_from_a_release(tok64):
    """`init_from` takes a release: its weights land in a model of this project with the same network options."""
    from transformers import PreTrainedTokenizerFast

    from blockgen.harness.train import warm_start
    from blockgen.models.backbone import ModelShape
    from blockgen.models.model import BlockGen

    folder = FIXTURES / "blockgen/multi_block_size/8/tiny/0.05_0.95/absorb"
    config = BlockGenConfig(vocab_size=64, seq_len=32, prior="masked", block_sizes=(1, 8), block_weights=(0.05, 0.95),
                            shape=ModelShape(n_layers=2, d_model=64, n_heads=4, cond_dim=16, dropout=0.0), cond_silu=True)
    model = BlockGen(config).eval()
    warm_start(model, folder, PreTrainedTokenizerFast.from_pretrained(str(tok64)))
    ref = load_file(str(folder / "reference.safetensors"))
    with torch.no_grad():
        _close(model.dit.forward_train(ref["input.x0"], ref["input.xt_bs8"], 8), ref["ref.train_logits_bs8"], "warm-started")

