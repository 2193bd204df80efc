"""The KV cache against the training layout: cached logits (token- and block-causal), the AR verifier pass,
left-padded batches and the grid layout's first block equal forward_train's, and generation with the
cache equals generation without it (tiny random models, CPU)."""

from __future__ import annotations

import pytest
import torch

from blockgen.models.model import BlockGen
from blockgen.models.sampler_config import BLOCK_LAYOUTS, SamplerConfig
from blockgen.models.sampling import Decoder, generate, split_prompt
from sampling_models import V, tiny_model


def noisy_block(model: BlockGen, x: torch.Tensor, alpha: float, seed: int = 1) -> torch.Tensor:
    return model.prior.noise(x, torch.tensor(alpha), torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ cache vs training layout


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("causal", [True, False], ids=["token-causal", "block-causal"])
def test_cached_logits_equal_training_layout(prior, causal):
    """A noisy block through the cache (prefix committed over several calls) == forward_train."""
    sizes = (1, 4, 8) if causal else (4, 8)
    model = tiny_model(prior, causal, sizes)
    x0 = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for block_size in sizes:
            prefix = 24  # a multiple of every block size
            xt = noisy_block(model, x0, 0.5)
            want = model.dit.forward_train(x0, xt, block_size)[:, prefix : prefix + block_size]
            for use_cache in (True, False):
                prompt = 8
                dec = Decoder(model, x0[:, :prompt].tolist(), pad_id=0, block_size=block_size, use_cache=use_cache)
                # Commit the rest of the prefix block by block, flushing with throw-away calls in between.
                for start in range(prompt, prefix, block_size):
                    dec.commit(x0[:, start : start + block_size])
                    if start % 16 == 0:
                        dec.denoise(model.prior.prior_sample((2, block_size)))
                got = dec.denoise(xt[:, prefix : prefix + block_size])
                assert (got - want).abs().max() <= 1e-4, (block_size, use_cache)
                if use_cache:
                    assert len(dec.cache) == prefix


@pytest.mark.parametrize("prior", ["masked", "uniform"])
def test_ar_pass_equals_training_layout(prior):
    """The AR verifier pass over a proposal == forward_train at block size 1 on [prefix ; proposal]."""
    model = tiny_model(prior)
    x0 = torch.randint(0, V, (3, 29), generator=torch.Generator().manual_seed(2))
    prefix, n = 13, 8
    with torch.inference_mode():
        noise = model.prior.fully_noised(x0.shape)
        want = model.dit.forward_train(x0, noise, 1)[:, prefix : prefix + n]
        dec = Decoder(model, x0[:, :5].tolist(), pad_id=0, block_size=n)
        dec.commit(x0[:, 5:9])
        dec.denoise(model.prior.prior_sample((3, 4)))  # flush: the cache now holds 9 tokens
        dec.commit(x0[:, 9:prefix])
        got, _ = dec.ar_pass(x0[:, prefix : prefix + n])  # also commits the last 4 prefix tokens
        assert (got - want).abs().max() <= 1e-4
        assert len(dec.cache) == prefix
        again, _ = dec.ar_pass(x0[:, prefix : prefix + n])  # pure cache hit, proposal not committed
        assert (again - want).abs().max() <= 1e-4
        assert len(dec.cache) == prefix


def test_padded_batch_matches_single_rows(masked):
    """Left padding (positions from 0 at the first real token) changes no row's logits."""
    prompts = [[3, 1, 4], list(range(1, 12)), [], [7]]
    gen = torch.Generator().manual_seed(3)
    blocks = [torch.randint(0, V, (len(prompts), 8), generator=gen) for _ in range(2)]
    z = noisy_block(masked, torch.randint(0, V, (len(prompts), 8), generator=gen), 0.3)
    with torch.inference_mode():
        batch = Decoder(masked, prompts, pad_id=5, block_size=8)
        got = [batch.denoise(z)]
        for b in blocks:
            batch.commit(b)
            got.append(batch.denoise(z))
        got.append(batch.ar_pass(blocks[0])[0])
        for r, p in enumerate(prompts):
            alone = Decoder(masked, [p], pad_id=5, block_size=8)
            want = [alone.denoise(z[r : r + 1])]
            for b in blocks:
                alone.commit(b[r : r + 1])
                want.append(alone.denoise(z[r : r + 1]))
            want.append(alone.ar_pass(blocks[0][r : r + 1])[0])
            for g, w in zip(got, want):
                assert (g[r] - w[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("causal", [True, False], ids=["token-causal", "block-causal"])
def test_grid_first_block_equals_training_layout(prior, causal):
    """Grid layout: prompts of different lengths commit P - P mod L' tokens, their tails sit clean in
    the first noisy block; its logits (and ARPC's AR pass) == forward_train with the tail kept clean in
    the noisy stream, as training's condition_mask does. Cached and uncached; no key appears twice."""
    sizes = (1, 4, 8) if causal else (4, 8)
    model = tiny_model(prior, causal, sizes)
    block = 8
    lengths = [19, 8, 13, 3]  # tails 3, 0, 5, 3
    x0 = torch.randint(0, V, (len(lengths), 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        for use_cache in (True, False):
            splits = [split_prompt(x0[r, :n].tolist(), block, "grid") for r, n in enumerate(lengths)]
            assert [len(t) for _, t in splits] == [n % block for n in lengths]
            dec = Decoder(model, [p for p, _ in splits], pad_id=0, block_size=block, use_cache=use_cache, tails=[t for _, t in splits])
            assert dec.generated == [block - n % block for n in lengths]
            z = dec.pin(model.prior.prior_sample((len(lengths), block), generator=torch.Generator().manual_seed(1)))
            got = dec.denoise(z)
            proposal = dec.pin(torch.randint(0, V, (len(lengths), block), generator=torch.Generator().manual_seed(2)))
            got_ar = dec.ar_pass(proposal)[0] if causal else None
            for r, n in enumerate(lengths):
                g = n - n % block  # the row's grid start
                assert torch.equal(z[r, : n % block], x0[r, g:n])  # the tail, clean in the noisy block
                x = x0[r : r + 1, : g + block].clone()
                xt = model.prior.noise(x, torch.tensor(0.5), torch.Generator().manual_seed(3))
                xt[:, g : g + block] = z[r]
                want = model.dit.forward_train(x, xt, block)[:, g : g + block]
                assert (got[r] - want[0]).abs().max() <= 1e-4, (r, use_cache)
                if causal:  # the AR pass over [prefix ; proposal] at block size 1
                    x[:, g : g + block] = proposal[r]
                    want_ar = model.dit.forward_train(x, model.prior.fully_noised(x.shape), 1)[:, g : g + block]
                    assert (got_ar[r] - want_ar[0]).abs().max() <= 1e-4, (r, use_cache)
            if use_cache:
                assert len(dec.cache) == max(len(p) for p, _ in splits)  # the committed prefixes only


# ------------------------------------------------------------------ generation with and without the cache


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("causal", [True, False], ids=["token-causal", "block-causal"])
def test_uncached_generation_matches_cached(prior, causal, masked, uniform):
    """Both layouts: the KV cache changes no sample and no call count (ARPC's AR pass included)."""
    model = (masked if prior == "masked" else uniform) if causal else tiny_model(prior, causal=False, sizes=(4, 8))
    prompts = [[1, 2, 3], [4, 5], list(range(1, 12)), [6] * 8]
    names = ("ancestral", "eipc", "arpc", "ar_greedy") if causal else ("ancestral", "eipc")
    for layout in BLOCK_LAYOUTS:
        for name in names:
            config = SamplerConfig(name, steps=4, ge=2, max_new_tokens=16 if name != "ar_greedy" else 8, seed=3, layout=layout)
            cached = generate(model, prompts, config, eos_id=-1, pad_id=0)
            plain = generate(model, prompts, config, eos_id=-1, pad_id=0, use_cache=False)
            assert cached.tokens == plain.tokens and cached.model_calls == plain.model_calls, (layout, name)
            assert all(len(t) == config.max_new_tokens for t in cached.tokens)
