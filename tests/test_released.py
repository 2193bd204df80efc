"""The paper's released checkpoints (harness/checkpoints/release_*.py) against the fixtures in the release format.

Two fixture sets (`../shared/data/released` and `../shared/data/released-gpt2`, or $BLOCKGEN_RELEASE_FIXTURES and
$BLOCKGEN_RELEASE_FIXTURES_GPT2) hold tiny random models saved as the authors' code saves a release, with the
logits, log-probabilities and NLLs that the authors' code computes for them: the first with a SmolLM-like
tokenizer (vocab_size == len), the second with a gpt2-like one (vocab_size + 1 == len: [PAD] added, which is
the masked families' [MASK]). Every fixture of both is loaded through the adapter (`pretrained=<folder>,
tokenizer=...`), the path users take, and every recorded reference is matched to 1e-4 (float32, CPU).
Corrupted copies (in tmp_path) check that each way a release can be broken gives one line naming the
file, what was expected and found, and the fix.
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

from blockgen.harness.checkpoints.checkpoint import CheckpointError, load_checkpoint
from blockgen.harness.checkpoints.hub import HubUnavailableError
from blockgen.harness.checkpoints.release_import import release_source, resolve
from blockgen.harness.checkpoints.release_paths import DATASETS, ReleaseError, ReleaseOverrides, parse_release_path
from blockgen.models.model import BlockGenConfig
from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import Decoder, generate
from limits import HANG_S

FIXTURES = Path(os.environ.get("BLOCKGEN_RELEASE_FIXTURES", Path(__file__).resolve().parents[2] / "shared/data/released"))
GPT2_FIXTURES = Path(os.environ.get("BLOCKGEN_RELEASE_FIXTURES_GPT2", FIXTURES.parent / "released-gpt2"))
SETS = {"released": FIXTURES, "released-gpt2": GPT2_FIXTURES}
FOLDERS = {name: sorted(str(p.parent.relative_to(root)) for p in root.rglob("reference.json")) if root.is_dir() else []
           for name, root in SETS.items()}
if not all(FOLDERS.values()) and os.environ.get("CI"):  # CI lays shared/ beside its clone: a skip there would hide a failure
    raise RuntimeError(f"CI: release fixtures not found at {[str(root) for root in SETS.values()]}")
needs_fixtures = pytest.mark.skipif(not all(FOLDERS.values()), reason=f"release fixtures not found at {list(SETS.values())}")
CASES = [pytest.param(name, folder, id=f"{name}/{folder}") for name, folders in FOLDERS.items() for folder in folders]
MIXTURE = "blockgen/multi_block_size/8/tiny/0.05_0.95/absorb"  # in both sets
GPT2_TOKENIZER = GPT2_FIXTURES / "tokenizer"
ATOL = 1e-4
BIN = Path(sys.executable).parent


def writable_copy(source: Path, target: Path) -> None:
    """A copy of a fixture folder that the test may change: ../shared comes without write bits (as CI lays it out),
    which root writes through and an ordinary user does not."""
    shutil.copytree(source, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)


@pytest.fixture(autouse=True)
def release_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("BLOCKGEN_RELEASE_CACHE", str(tmp_path_factory.getbasetemp() / "release-cache"))


@pytest.fixture(scope="session")
def tok64(tmp_path_factory) -> Path:
    """A 64-token character tokenizer with its own pad token: vocab_size == len == 64, as the fixtures'
    SmolLM-like one (absorb / mdlm / ar models then have 65 rows, uniform / duo 64); the hub stand-in serves it as SmolLM's."""
    from blockgen.harness.data.hub_standin_repos import smollm_like_tokenizer

    return smollm_like_tokenizer(tmp_path_factory.mktemp("tok64"))


@pytest.fixture(scope="session")
def tokenizer_of(tok64) -> dict[str, str]:
    """Each fixture set's tokenizer (the gpt2-like one ships with its set)."""
    return {"released": str(tok64), "released-gpt2": str(GPT2_TOKENIZER)}


def _lm(pretrained, **kwargs):
    from lm_eval.api.registry import get_model

    return get_model("blockgen")(pretrained=str(pretrained), device="cpu", **kwargs)


def _one_line(kind, call, *parts: str) -> str:
    """The error `call` raises: of `kind`, one line, with each of `parts` and a fix."""
    with pytest.raises(kind) as info:
        call()
    text = str(info.value)
    assert "\n" not in text and "fix: " in text, text
    for part in parts:
        assert part in text, f"{part!r} not in: {text}"
    return text


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
@pytest.mark.parametrize("fixture_set, folder", CASES)
def test_fixture_matches_the_authors_reference(fixture_set, folder, tokenizer_of):
    root = SETS[fixture_set]
    meta = json.loads((root / folder / "reference.json").read_text())
    ref = load_file(str(root / folder / "reference.safetensors"))
    lm = _lm(root / folder, tokenizer=tokenizer_of[fixture_set])
    model, prior = lm.model, lm.model.prior
    assert lm.get_model_info()["model_source"] == str((root / folder).resolve())
    assert model.dit.embed.weight.shape[0] == meta["vocab_size"]  # the authors' rows, whatever the layout
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
    writable_copy(FIXTURES / folder, copy)
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
    writable_copy(absorb, copy)
    with pytest.raises(ReleaseError, match="give algo="):
        resolve(copy, ReleaseOverrides(tokenizer=tok))
    _one_line(ReleaseError, lambda: resolve(copy, ReleaseOverrides.from_model_args(algo="blockgen", prior="uniform",
                                                                                 block_sizes="8", tokenizer=tok)),
              f"{copy.resolve()}/model.safetensors: vocab_embed.embedding has 65 rows", "gives 64 for prior=uniform",
              "fix: prior=masked (the rows fit it)")
    # The path says the prior: the hint is the tokenizer, never a prior= that the path refuses.
    _one_line(ReleaseError, lambda: resolve(absorb, ReleaseOverrides(tokenizer=str(GPT2_TOKENIZER))),
              "has 65 rows", "gives 121 or 122 for prior=masked", "fix: tokenizer=<dir> holding the tokenizer this model was trained with")
    with pytest.raises(ReleaseError, match="block size 1 contradicts the weights' block-causal clean stream"):
        resolve(copy, ReleaseOverrides.from_model_args(algo="blockgen", prior="absorb", block_sizes="1:8",
                                                       block_weights="0.05:0.95", tokenizer=tok))
    with pytest.raises(ReleaseError, match="algo=mdlm contradicts config.json type='block-dit'"):
        resolve(copy, ReleaseOverrides.from_model_args(algo="mdlm", tokenizer=tok))
    ar = tmp_path / "ar-copy"
    writable_copy(FIXTURES / "baselines/tiny/ar", ar)
    with pytest.raises(ReleaseError, match="algo=mdlm contradicts the weights: they lack the adaLN"):
        resolve(ar, ReleaseOverrides.from_model_args(algo="mdlm", tokenizer=tok))
    model = _lm(copy, algo="blockgen", prior="absorb", block_sizes=8, tokenizer=tok).model  # consistent: loads
    assert (model.config.prior, model.config.block_sizes, model.config.causal_clean) == ("masked", (8,), False)
    _one_line(ReleaseError, lambda: resolve(absorb), "the path names no dataset with a known tokenizer", "fix: tokenizer=<")
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
@pytest.mark.parametrize("fixture_set", SETS)
def test_lm_eval_command_runs_a_toy_task_on_a_fixture(tmp_path, tokenizer_of, fixture_set):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "BLOCKGEN_RELEASE_CACHE": str(tmp_path / "cache")}
    fixture, tok = SETS[fixture_set] / MIXTURE, tokenizer_of[fixture_set]
    proc = subprocess.run(
        [str(BIN / "lm_eval"), "--model", "blockgen", "--model_args", f"pretrained={fixture},tokenizer={tok},k_mc=2",
         "--tasks", "blockgen_toy_cloze,blockgen_toy_gen", "--limit", "2", "--device", "cpu", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=HANG_S, env=env, cwd="/")
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

    from blockgen.harness.training.train import warm_start
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



# ------------------------------------------------------------------------------ the gpt2 / OWT layout from the hub path


def _hub_copy(root: Path, subfolder: str, fixture_set: str = "released-gpt2", folder: str = MIXTURE) -> Path:
    """A fixture copied to `root/<subfolder>`, as `huggingface-cli download --local-dir root` lays the hub out."""
    writable_copy(SETS[fixture_set] / folder, root / subfolder)
    return root / subfolder


def _offline(monkeypatch, hub_cache: Path, release_dir: Path) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))  # no real gpt2 cached by chance
    monkeypatch.setenv("BLOCKGEN_RELEASE_DIR", str(release_dir))


@needs_fixtures
def test_owt_path_reads_gpt2_and_its_layout(tmp_path, monkeypatch):
    """`hf:jdeschena/blockgen/<owt subfolder>` reads the tokenizer `gpt2` (here a gpt2-like folder in the hub
    cache, then the same folder as tokenizer=) and the authors' gpt2 layout: 121 rows, [MASK] = [PAD] = 120."""
    sub = "blockgen/multi_block_size/8/owt/0.05_0.95/absorb"
    _hub_copy(tmp_path / "hub-copy", sub)
    _offline(monkeypatch, tmp_path / "hf-cache", tmp_path / "hub-copy")
    spec = f"hf:jdeschena/blockgen/{sub}"
    # Offline and gpt2 not cached: the hint is tokenizer=<dir>, which then works.
    text = _one_line(HubUnavailableError, lambda: resolve(spec), spec, "reads the tokenizer gpt2", "fix: tokenizer=<dir>")
    assert "make demo" not in text
    ref = load_file(str(GPT2_FIXTURES / MIXTURE / "reference.safetensors"))
    given = _lm(spec, tokenizer=str(GPT2_TOKENIZER))
    snapshot = tmp_path / "hf-cache/models--gpt2/snapshots/0"  # gpt2 as the hub cache holds it
    writable_copy(GPT2_TOKENIZER, snapshot)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs/main").write_text("0")
    named = _lm(spec)
    for lm in (given, named):
        assert release_source(lm.checkpoint_dir) == spec
        assert (lm.model.config.vocab_size, len(lm.tokenizer), lm.special.pad) == (120, 121, 120)  # [PAD] is the [MASK] row
        with torch.no_grad():
            _close(lm.model.dit.forward_train(ref["input.x0"], ref["input.xt_bs8"], 8), ref["ref.train_logits_bs8"], "owt path")
    # The same weights under a tinygsm path: SmolLM's layout (wrapped, 122 rows) refuses them.
    tinygsm = _hub_copy(tmp_path / "other", "blockgen/multi_block_size/8/tinygsm/0.05_0.95/absorb")
    _one_line(ReleaseError, lambda: resolve(tinygsm, ReleaseOverrides(tokenizer=str(GPT2_TOKENIZER))),
              "has 121 rows", "gives 122 for prior=masked", "(HuggingFaceTB/SmolLM-135M)")


# ------------------------------------------------------------------------------ corrupted copies: one line, the fix


@pytest.fixture
def gpt2_copy(tmp_path) -> Path:
    """A copy of the gpt2-layout mixture, in the release layout (its path says the setting)."""
    return _hub_copy(tmp_path, MIXTURE)


REFETCH = f"fix: fetch the release's files again (`huggingface-cli download jdeschena/blockgen --include '{MIXTURE}/*'"


def _load_copy(folder: Path, **overrides):
    return resolve(folder, ReleaseOverrides.from_model_args(tokenizer=str(GPT2_TOKENIZER), **overrides))


@needs_fixtures
@pytest.mark.parametrize("cut", ["truncated", "empty"])
def test_broken_weights_name_the_file(gpt2_copy, cut):
    weights = gpt2_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100] if cut == "truncated" else b"")
    size = f"{weights.stat().st_size:,} bytes"
    _one_line(ReleaseError, lambda: _load_copy(gpt2_copy), f"{weights}: truncated or corrupt safetensors file ({size}", REFETCH)


@needs_fixtures
@pytest.mark.parametrize("field, value, found, evidence", [
    ("hidden_size", 128, 64, "vocab_embed.embedding [121, 64]"),
    ("n_heads", 6, 4, "rotary_emb.inv_freq [8]: head_dim 16"),
    ("n_blocks", 3, 2, "blocks.0 ... blocks.1"),
    ("cond_dim", 16, 32, "sigma_map.mlp.0.weight [32, 256]"),
])
def test_config_sizes_that_contradict_the_weights_are_named(gpt2_copy, field, value, found, evidence):
    config = json.loads((gpt2_copy / "config.json").read_text())
    right = config[field]
    (gpt2_copy / "config.json").write_text(json.dumps({**config, field: value}))
    _one_line(ReleaseError, lambda: _load_copy(gpt2_copy), f"{gpt2_copy.resolve()}/config.json: {field} is {value}, "
              f"but model.safetensors has {found} ({evidence}); fix: set {field} to {found}")
    (gpt2_copy / "config.json").write_text(json.dumps({**config, field: right}))  # the fix works
    assert _load_copy(gpt2_copy).is_dir()


@needs_fixtures
@pytest.mark.parametrize("damage, found", [(None, "missing"), ('{"type": "block-dit", "hidden', "not valid JSON")])
def test_missing_or_broken_config_with_tokenizer_names_config_json(gpt2_copy, damage, found):
    config = gpt2_copy / "config.json"
    config.unlink() if damage is None else config.write_text(damage)
    text = _one_line(ReleaseError, lambda: _load_copy(gpt2_copy), f"{config}: {found}", "['tokenizer'] take a release folder",
                     REFETCH)
    assert "checkpoint of this project" not in text


@needs_fixtures
@pytest.mark.parametrize("subfolder, names", [
    ("blockgen/multi_block_size/8/tiny/0.05_0.95/Uniform", "the prior component 'Uniform' is not one of ['absorb', 'uniform']"),
    ("blockgen/single-block-size/8/tiny/uniform", "the component 'single-block-size' after blockgen/ is not one of "
                                                  "['single_block_size', 'multi_block_size']"),
    ("blockgen/single_block_size/8/uniform", "the <dataset> component is missing (blockgen/single_block_size/<block size>/"
                                             "<dataset>/<absorb|uniform>)"),
    ("blockgen/multi_block_size/8/owt/uniform", "the <weights a_b|uniform> component is missing"),
    ("baselines/duo", "the dataset component is missing (baselines/<dataset>/duo)"),
])
def test_paths_off_the_hub_naming_name_the_failing_component(tmp_path, subfolder, names):
    folder = _hub_copy(tmp_path, subfolder, folder="blockgen/multi_block_size/8/tiny/0.05_0.95/uniform")
    _one_line(ReleaseError, lambda: _load_copy(folder), f"{subfolder}: {names}", "the path does not follow the release layout",
              "fix: name the folder as the hub's subfolder (`blockgen released names` lists them), or give algo=")
    spec = f"hf:jdeschena/blockgen/{subfolder}"  # a hub path is checked before any download
    _one_line(ReleaseError, lambda: resolve(spec), f"{spec}: {subfolder}: {names}", "fix: the hub's subfolders are listed by")


@needs_fixtures
def test_following_the_layout_hint_loads(tmp_path):
    uniform = "blockgen/multi_block_size/8/tiny/0.05_0.95/uniform"
    folder = _hub_copy(tmp_path, uniform.replace("/uniform", "/Uniform"), folder=uniform)
    checkpoint = _load_copy(folder, algo="blockgen", prior="uniform", block_sizes="1:8", block_weights="0.05:0.95")
    assert json.loads((checkpoint / "config.json").read_text())["prior"] == "uniform"


@needs_fixtures
def test_tensors_that_do_not_fit_are_named_in_the_authors_keys(gpt2_copy):
    weights = load_file(str(gpt2_copy / "model.safetensors"))
    weights["output_layer.linear.weight"] = weights["output_layer.linear.weight"][:120]
    del weights["blocks.1.attn_out.weight"]
    save_file(weights, str(gpt2_copy / "model.safetensors"))
    _one_line(ReleaseError, lambda: _load_copy(gpt2_copy), f"{gpt2_copy.resolve()}/model.safetensors: does not fit config.json",
              "output_layer.linear.weight is [120, 64], expected [121, 64]", "blocks.1.attn_out.weight [64, 64] is missing",
              "fix: fetch the release's files again")


@needs_fixtures
def test_import_command_prints_one_line(gpt2_copy, capsys):
    from blockgen.harness.cli import main

    (gpt2_copy / "model.safetensors").write_bytes(b"")
    assert main(["released", "import", str(gpt2_copy), "--tokenizer", str(GPT2_TOKENIZER)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("blockgen import: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "model.safetensors: truncated or corrupt safetensors file (0 bytes" in err


def test_a_checkpoint_with_another_tokenizer_is_refused(tmp_path):
    """Issue 28: another tokenizer (there 512 tokens) in the stored 811-token checkpoint loaded silently and wrote garbage."""
    from blockgen.harness.checkpoints.tokenizer import train_bpe
    from blockgen.tasks.blockgen_toy import training_text

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(Path(__file__).resolve().parents[1] / "leaderboards/ci_gsm8k/gsm-masked-mix/checkpoint", checkpoint)
    size = len(train_bpe(training_text(400), vocab_size=512, out_dir=tmp_path / "tok512"))  # the toy text has fewer merges
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok512" / name, checkpoint / name)
    _one_line(CheckpointError, lambda: load_checkpoint(checkpoint), f"{checkpoint}/tokenizer.json: the tokenizer has {size} tokens, "
              "but config.json says vocab_size 811", "fix: put the tokenizer the model was trained with beside its weights")
    _one_line(CheckpointError, lambda: _lm(checkpoint), f"the tokenizer has {size} tokens")
