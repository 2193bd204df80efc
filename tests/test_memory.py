"""Memory at full scale: the chunked float64 NELBO, the micro-batch knob, the start-of-training estimate."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blockgen.harness.data.sources import DataConfig
from blockgen.harness.training.presets import preset
from blockgen.harness.training.flops_memory import memory_estimate, names_the_knob
from blockgen.harness.training.train import train
from blockgen.models import diffusion
from blockgen.models.backbone import ModelShape
from blockgen.models.diffusion import LogLinearSchedule, UniformPrior
from blockgen.models.model import BlockGen, BlockGenConfig

REPO = Path(__file__).resolve().parents[1]
SCHEDULE = LogLinearSchedule()


def uniform_inputs(b=3, l=11, v=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prior = UniformPrior(v)
    x = torch.randint(0, v, (b, l), generator=gen)
    t = torch.rand(b, generator=gen) * 0.98 + 0.01
    z = prior.noise(x, SCHEDULE.alpha(t)[:, None], generator=gen)
    logits = (torch.randn(b, l, v, generator=gen) * 3).requires_grad_()
    return prior, logits, x, z, t


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def flat_inputs(logits, x, z, t):
    """`UniformPrior._nelbo_tokens`' arguments for the whole batch: one float64 pass, no chunks, no checkpoint."""
    a = SCHEDULE.alpha(t).double()[:, None].expand(x.shape).reshape(-1)
    da = SCHEDULE.d_alpha(t).double()[:, None].expand(x.shape).reshape(-1)
    return logits.reshape(-1, logits.shape[-1]), x.reshape(-1), z.reshape(-1), a, da


@pytest.mark.parametrize("chunk", [1, 4, 7, 33, 10**9])
def test_uniform_nelbo_in_chunks_equals_the_whole(chunk):
    """Values and gradients: chunks (dividing the 33 tokens or not, checkpointed) == one plain pass."""
    prior, logits, x, z, t = uniform_inputs()
    whole = prior._nelbo_tokens(*flat_inputs(logits, x, z, t)).float().view(x.shape)
    (g_whole,) = torch.autograd.grad(whole.double().sum(), logits)
    parts = prior.nelbo(logits, x, z, t, SCHEDULE, chunk_tokens=chunk)
    (g_parts,) = torch.autograd.grad(parts.double().sum(), logits)
    torch.testing.assert_close(parts, whole, rtol=0, atol=0)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the evaluation path (no checkpointing)
        torch.testing.assert_close(prior.nelbo(logits, x, z, t, SCHEDULE, chunk_tokens=chunk), whole.detach(), rtol=0, atol=0)


def test_chunked_nelbo_keeps_only_the_logits_for_backward():
    """Whole, autograd keeps several float64 copies of (B, L, V); in chunks only the logits remain."""
    prior, logits, x, z, t = uniform_inputs(b=4, l=64, v=300)
    logits_bytes = logits.numel() * logits.element_size()
    whole = saved_bytes(lambda: prior._nelbo_tokens(*flat_inputs(logits, x, z, t)))  # one plain float64 pass
    chunked = saved_bytes(lambda: prior.nelbo(logits, x, z, t, SCHEDULE, chunk_tokens=16))
    assert whole > 5 * logits_bytes  # float64 log_softmax, exp, log(...): each twice the float32 logits
    assert chunked < 1.1 * logits_bytes


def test_validation_and_owt_ppl_bounds_do_not_depend_on_the_chunk(monkeypatch):
    """`nll_bounds` (validation, owt_ppl) goes through the same NELBO: a tiny chunk changes nothing."""
    cfg = BlockGenConfig(vocab_size=50, seq_len=16, prior="uniform", block_sizes=(1, 4), block_weights=(0.5, 0.5),
                         shape=ModelShape(n_layers=1, d_model=32, n_heads=2, cond_dim=16, dropout=0.0))
    torch.manual_seed(0)
    model = BlockGen(cfg).eval()
    x = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 16)
    want = model.nll_bounds(x, mask, 4, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(diffusion, "NELBO_CHUNK_TOKENS", 5)
    got = model.nll_bounds(x, mask, 4, generator=torch.Generator().manual_seed(2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("prior,dropout,architecture", [("masked", 0.0, "blockgen"), ("uniform", 0.0, "blockgen"),
                                                        ("masked", 0.1, "blockgen"), ("masked", 0.0, "ar")])
def test_activation_formula_matches_what_autograd_keeps(prior, dropout, architecture):
    """The estimate's activations (fp32, per micro-batch) against the saved tensors of a real forward."""
    block = 1 if architecture == "ar" else 4
    cfg = BlockGenConfig(vocab_size=500, seq_len=128, prior=prior, block_sizes=(block,),
                         shape=ModelShape(n_layers=3, d_model=128, n_heads=4, cond_dim=32, dropout=dropout),
                         architecture=architecture, adaln=architecture != "ar")
    torch.manual_seed(0)
    model = BlockGen(cfg).train()
    batch = 4
    x = torch.randint(0, 500, (batch, 128))
    measured = saved_bytes(lambda: model(x, torch.ones(batch, 128), block, torch.full((batch,), 0.5)))
    n_params = sum(p.numel() for p in model.parameters())
    estimate = memory_estimate(cfg, n_params, batch, bf16=False, world=1)
    # (the weights, which autograd also "saves" for matmuls, are counted apart in the estimate)
    activations = measured - sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    assert abs(estimate.activations - activations) / activations < 0.12, (estimate.activations, activations)


def test_full_scale_presets_fit_an_80gb_gpu():
    """`make -n train-owt NGPU=8` / `train-tinygsm`: at most 32 x 1,024 tokens per GPU, estimate < 80 GB."""
    for target in ("train-owt", "train-tinygsm"):
        dry = subprocess.run(["make", "-n", target, "NGPU=8"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        lines = [line for line in dry.splitlines() if "torchrun" in line and " train " in line]
        assert lines
        for line in lines:
            name = re.search(r"--preset (\S+)", line).group(1)
            flag = re.search(r"--micro-batch (\d+)", line)
            config = preset(name)
            micro = int(flag.group(1)) if flag else config.micro_batch
            assert micro is not None and micro * config.seq_len <= 32 * 1024, (name, micro)
            assert config.grad_accum(8) * 8 * micro == config.batch_size
            model_config = config.model_config(50_258, {}, "cpu")  # GPT-2's vocabulary, SmolLM's is smaller
            with torch.device("meta"):
                n_params = sum(p.numel() for p in BlockGen(model_config).parameters())
            assert memory_estimate(model_config, n_params, micro, bf16=True, world=8).total < 80e9


def test_micro_batch_sets_the_accumulation_and_errors_name_the_knobs():
    config = preset("owt-masked-16")
    assert (config.micro_batch, config.grad_accum(16), config.grad_accum(8), config.grad_accum(1)) == (32, 1, 2, 16)
    assert preset("ci").grad_accum(2) == 1  # None: the process's whole share
    with pytest.raises(ValueError, match=r"--micro-batch / MICRO_BATCH"):
        preset("owt-masked-16", micro_batch=24).grad_accum(8)
    with pytest.raises(ValueError, match=r"micro_batch=0"):
        preset("ci", micro_batch=0)


def test_out_of_memory_names_the_knob():
    with pytest.raises(torch.OutOfMemoryError, match=r"--micro-batch \(Makefile: MICRO_BATCH\), e\.g\. to 16"):
        with names_the_knob(32, 2):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 13.00 GiB")


def test_training_accumulates_micro_batches_and_prints_the_estimate(tmp_path, capsys):
    data = DataConfig(n_train=200, n_val=8, vocab_size=512, cache_dir=str(tmp_path / "cache"))
    config = preset("ci", out_dir=str(tmp_path / "run"), data=data, batch_size=16, micro_batch=4, max_steps=2,
                    eval_every=2, save_every=2)
    train(config, progress=False)
    out = capsys.readouterr().out
    assert "4 sequences per process and micro-batch, 4 micro-batches per step" in out
    assert re.search(r"activations [\d.]+ MB per micro-batch of 4", out)
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2


def test_plain_ar_likelihood_is_a_causal_pass_over_growing_prefixes():
    """The `owt-ar` model: the loss and the likelihood are -sum_i log p(x_i | x_<i), each factor from
    the network run on the prefix x_<i alone (so nothing after i can leak in); x_0 is given."""
    config = preset("owt-embedded-ar")
    assert (config.architecture, config.block_sizes, config.prior) == ("ar", (1,), "masked")
    model_config = config.model_config(40, {}, "cpu")
    assert (model_config.architecture, model_config.adaln) == ("ar", False)
    torch.manual_seed(0)
    model = BlockGen(model_config).eval()
    for p in model.parameters():  # a trained-looking, non-trivial network
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 12)
    loss_mask[1, 7:] = 0  # a shorter answer in the second row
    want = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(1, 12):
            logits = model.dit.forward_ar(x[:, :i])[:, -1, :40].double()  # the [MASK] row is never predicted
            want += -logits.log_softmax(-1).gather(-1, x[:, i, None])[:, 0] * loss_mask[:, i]
        lse, jensen = model.nll_bounds(x, loss_mask, k_mc=4)
        total, count = model(x, loss_mask, 1, torch.full((2,), 0.5))
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(jensen.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total.double(), want.sum(), rtol=1e-5, atol=1e-5)
    assert count == loss_mask[:, 1:].sum()  # position 0 is given, not predicted


def test_plain_ar_preset_trains_and_keeps_its_architecture(tmp_path):
    """A few steps of `owt-embedded-ar` (what CI's pipeline trains): the loss falls, the checkpoint is AR."""
    from blockgen.harness.checkpoints.checkpoint import read_config

    config = preset("owt-embedded-ar", out_dir=str(tmp_path / "ar"), max_steps=30, eval_every=30, save_every=30,
                    data=replace(preset("owt-embedded-ar").data, cache_dir=str(tmp_path / "cache")))
    checkpoint = train(config, progress=False)
    records = [json.loads(line) for line in (tmp_path / "ar" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in records[-5:]) < sum(r["loss"] for r in records[:5])
    saved = read_config(checkpoint)
    assert (saved.architecture, saved.adaln, saved.block_sizes) == ("ar", False, (1,))
    assert preset("owt-embedded-blockgen-b1").architecture == "blockgen"
    assert preset("gsm-ar").architecture == "blockgen"  # the demo's mixtures warm-start from its weights


def test_plain_ar_flops_count_its_l_tokens():
    """MFU of the AR baseline: the formula (N = L) against torch's FlopCounterMode on forward + backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from blockgen.harness.training.flops_memory import training_flops_per_step

    config = preset("owt-embedded-ar", seq_len=64).model_config(300, {}, "cpu")
    model = BlockGen(config)
    x = torch.randint(0, 300, (4, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # attention as counted matmuls
        total, count = model(x, torch.ones(4, 64), 1, torch.full((4,), 0.5))
        (total / count).backward()
    assert 0.99 < training_flops_per_step(config, 4) / counter.get_total_flops() <= 1.0
