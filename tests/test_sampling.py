"""Samplers and the KV cache against uncached, by-hand definitions (tiny random models, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from blockgen.models.backbone import ModelShape
from blockgen.models.diffusion import RowStreams, UniformPrior, sample_categorical
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.sampler_config import (
    BLOCK_LAYOUTS,
    SAMPLERS,
    SamplerConfig,
    calls_per_block,
    paper_nfe_per_block,
    renoise_count,
    step_alphas,
)
from blockgen.models.sampling import (
    Decoder,
    GenerationResult,
    ancestral_step,
    check_config,
    generate,
    max_prompt_len,
    split_prompt,
)

V = 40


def tiny_model(prior: str = "masked", causal: bool = True, sizes=(1, 4, 8), seed: int = 0, std: float = 0.2) -> BlockGen:
    weights = tuple(1 / len(sizes) for _ in sizes)
    config = BlockGenConfig(
        vocab_size=V, seq_len=64, prior=prior, block_sizes=sizes, block_weights=weights, causal_clean=causal,
        shape=ModelShape(n_layers=2, d_model=32, n_heads=4, cond_dim=16, dropout=0.0),
    )
    torch.manual_seed(seed)
    model = BlockGen(config).eval()
    with torch.no_grad():  # adaLN and the output layer start at zero: scale everything up
        for p in model.parameters():
            p.normal_(0, std)
    return model


@pytest.fixture(scope="module")
def masked():
    return tiny_model("masked")


@pytest.fixture(scope="module")
def uniform():
    return tiny_model("uniform")


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


# ------------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("name", ["ancestral", "eipc", "arpc"])
def test_masked_never_changes_unmasked_tokens(masked, name):
    """Ancestral: a visible token never changes and the block ends clean. PC samplers: ends clean."""
    trajectory = []
    config = SamplerConfig(name, steps=5, ge=2, max_new_tokens=16, block_size=8, seed=4)
    result = generate(masked, [[1, 2, 3], [4]], config, eos_id=-1, pad_id=0, trace=lambda b, i, z: trajectory.append(z.clone()))
    mask = masked.prior.mask_id
    for block in range(2):
        steps = trajectory[block * 5 : (block + 1) * 5]
        assert not (steps[-1] == mask).any()
        if name == "ancestral":
            for before, after in zip(steps, steps[1:]):
                visible = before != mask
                assert torch.equal(after[visible], before[visible])
    assert all(len(t) == 16 and all(0 <= v < V for v in t) for t in result.tokens)


def hand_informed_steps(steps: int, ge: int, warmup: int) -> list[int]:
    return [i for i in range(warmup, steps, ge)]


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
def test_model_calls_follow_the_rule(masked, monkeypatch, layout):
    """Counted forward passes == the documented rule; the paper label == appendix D's formula.

    Grid layout: prompts of 2 and 3 tokens sit in the first block, so 16 new tokens take 3 blocks.
    """
    calls = []
    real = masked.dit.forward_cached
    monkeypatch.setattr(masked.dit, "forward_cached", lambda *a, **k: calls.append(1) or real(*a, **k))
    block = 8
    n_blocks = 3 if layout == "grid" else 2
    for steps in range(1, 8) if layout == "prompt_end" else (1, 4, 7):
        for ge in range(1, 4):
            for warmup in range(steps):
                for name in ("ancestral", "eipc", "arpc"):
                    if name == "ancestral" and (ge, warmup) != (1, 0):
                        continue
                    config = SamplerConfig(name, steps=steps, ge=ge, warmup=warmup, block_size=block, max_new_tokens=2 * block, layout=layout)
                    calls.clear()
                    result = generate(masked, [[1, 2], [3, 4, 5]], config, eos_id=-1, pad_id=0)
                    informed = hand_informed_steps(steps, ge, warmup) if name != "ancestral" else []
                    # k = max(1, round((1 - alpha_s) n)) before the last step: only the last step's pass is skipped
                    skipped = [i for i in informed if i == steps - 1]
                    assert all(renoise_count(i, steps, n, 1e-3) >= 1 for i in range(steps - 1) for n in (1, 5, block))
                    assert renoise_count(steps - 1, steps, block, 1e-3) == 0
                    passes = len(informed) - len(skipped) if name == "arpc" else 0
                    assert result.n_blocks == n_blocks
                    assert len(calls) == result.model_calls == n_blocks * (steps + passes)
                    assert result.model_calls_per_block == steps + passes == calls_per_block(config, block)
                    paper = steps + (steps - 1 - warmup) // ge + 1 if name == "arpc" else steps
                    assert result.paper_nfe_per_block == paper
                    if name == "arpc":
                        assert paper - result.model_calls_per_block == len(skipped)
    # The worked examples of appendix D, at L' = 16: no informed step has k = 0, so label == count.
    for (steps, ge, warmup), nfe in {(3, 3, 0): 4, (12, 3, 0): 16, (14, 4, 8): 16}.items():
        config = SamplerConfig("arpc", steps=steps, ge=ge, warmup=warmup, block_size=16)
        assert paper_nfe_per_block(config) == calls_per_block(config, 16) == nfe
    assert calls_per_block(SamplerConfig("arpc", steps=4, ge=3), 16) == paper_nfe_per_block(SamplerConfig("arpc", steps=4, ge=3)) - 1


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("name", ["ancestral", "eipc", "arpc", "ar_sample"])
def test_seed_reproducibility(prior, name, masked, uniform):
    model = masked if prior == "masked" else uniform
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [11]]

    def run(seed):
        return generate(model, prompts, SamplerConfig(name, steps=4, ge=2, max_new_tokens=16, seed=seed), eos_id=-1, pad_id=0).tokens

    first = run(0)
    assert run(0) == first
    assert run(1) != first


def greedy_by_hand(model: BlockGen, prompt: list[int], n: int) -> list[int]:
    """argmax decoding with the plain training forward at block size 1 on the growing sequence."""
    seq = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(n):
            noise = model.prior.fully_noised(seq.shape)
            logits = model.dit.forward_train(seq, noise, 1)[:, -1:]
            nxt = model.prior.denoiser_log_probs(logits, noise[:, -1:]).argmax(-1)
            seq = torch.cat([seq, nxt], dim=1)
    return seq[0, len(prompt) :].tolist()


@pytest.mark.parametrize("prior", ["masked", "uniform"])
def test_greedy_ar_equals_argmax_by_hand(prior, masked, uniform):
    model = masked if prior == "masked" else uniform
    prompt = [3, 14, 15, 9, 2, 6]
    result = generate(model, [prompt], SamplerConfig("ar_greedy", max_new_tokens=20), eos_id=-1, pad_id=0)
    assert result.tokens[0] == greedy_by_hand(model, prompt, 20)
    assert result.model_calls == 20 and result.paper_nfe_per_block == 1


def test_batch_of_prompts_equals_each_alone(masked):
    """Greedy AR on a left-padded batch == each prompt alone (near-ties may flip an argmax)."""
    prompts = [[1], [5, 4, 3, 2, 1, 9, 8], [], [7, 7, 7, 7, 30, 31, 32, 33, 34, 35, 36, 37]]
    config = SamplerConfig("ar_greedy", max_new_tokens=16)
    batch = generate(masked, prompts, config, eos_id=-1, pad_id=0).tokens
    for p, got in zip(prompts, batch):
        want = generate(masked, [p], config, eos_id=-1, pad_id=0).tokens[0]
        if got != want:  # only acceptable at a near-tie of the two top logits
            i = next(k for k in range(len(want)) if got[k] != want[k])
            seq = torch.tensor([p + want[:i]])
            noise = masked.prior.fully_noised(seq.shape)
            with torch.inference_mode():
                top = masked.dit.forward_train(seq, noise, 1)[0, -1, :V].topk(2).values
            assert top[0] - top[1] < 1e-4


# -------------------------------------------------- stopping, with a scripted network


class Script:
    """Stands in for `DiT.forward_cached`: the noisy token at position p strongly predicts `target(p)`.

    Diffusion calls (one block id per row) and AR passes are told apart by the layout; AR passes
    return `ar_bias(p)` on the proposed token, so the AR scores are known.
    """

    def __init__(self, vocab: int, target, ar_bias=None):
        self.vocab, self.target, self.ar_bias = vocab, target, ar_bias
        self.batches: list[int] = []
        self.kinds: list[str] = []

    def __call__(self, tokens, layout, cache, n_commit=0, n_noisy=None, sigma=None):
        layout = layout.expand(tokens.shape[0])
        noisy = layout.noisy[0]
        pos = layout.positions[:, noisy]
        logits = torch.zeros(*pos.shape, self.vocab)
        logits.scatter_(-1, self.target(pos)[..., None], 50.0)
        block_ids = layout.block_ids[:, noisy]
        is_ar = pos.shape[1] > 1 and bool((block_ids[:, 1:] != block_ids[:, :1]).any())
        self.batches.append(tokens.shape[0])
        self.kinds.append("ar" if is_ar else "diffusion")
        if is_ar and self.ar_bias is not None:
            proposal = tokens[:, ~noisy][:, -pos.shape[1] :]
            logits = torch.zeros(*pos.shape, self.vocab)
            logits.scatter_(-1, proposal[..., None], self.ar_bias(pos).float()[..., None])
        return logits


EOS = 0


def eos_at_9(pos):
    return torch.where(pos == 9, EOS, 3 + pos % 5)


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
@pytest.mark.parametrize("name", ["ancestral", "ar_greedy"])
def test_eos_stop_and_length(monkeypatch, name, layout):
    """EOS at absolute position 9; BOS == EOS opens every prompt and EOS also sits inside prompts."""
    config = SamplerConfig(name, steps=2, block_size=None if name == "ar_greedy" else 4, max_new_tokens=10, layout=layout)
    model = tiny_model("masked")
    script = Script(V + 1, eos_at_9)
    monkeypatch.setattr(model.dit, "forward_cached", script)
    prompts = [[EOS, 5], [EOS, 1, 2, 3, 4, 5, 6], [EOS] + [EOS, 1] * 6, [EOS, 2, 2, 2]]
    lengths = [len(p) for p in prompts]
    result = generate(model, prompts, config, eos_id=EOS, pad_id=1)
    for p, n, got, reason in zip(prompts, lengths, result.tokens, result.finish_reasons):
        expected = [3 + q % 5 for q in range(n, n + 10)]
        if n <= 9:  # generated EOS at position 9: cut there (later tokens of its block too)
            assert got == expected[: 9 - n] and reason == "eos"
        else:
            assert got == expected and reason == "length"
    assert EOS not in sum(result.tokens, [])
    assert script.batches[0] == 4 and script.batches[-1] < 4  # finished rows left the batch

    # A per-row stop callback, checked after each committed block.
    script.batches.clear()
    stops = [None, lambda ids: len(ids) >= 1, None, lambda ids: 4 in ids]
    result = generate(model, prompts, config, eos_id=-1, pad_id=1, stop=stops)
    assert result.finish_reasons == ["length", "stop", "length", "stop"]
    step = config.block_size or 1
    first = step - (lengths[1] % step if layout == "grid" else 0)  # a grid's first block holds the prompt's tail
    assert len(result.tokens[1]) == first and 4 in result.tokens[3]
    assert [len(t) for t in (result.tokens[0], result.tokens[2])] == [10, 10]


def scripted_informed_model(name: str, prior: str, monkeypatch) -> BlockGen:
    """A model whose proposal at position p is 3 + p % 5 and whose scores fall with the position: by
    more than `SCORE_GRID` for ARPC, by less (confident tokens, entropies ~1e-20) for EIPC."""
    model = tiny_model(prior)
    vocab = V + 1 if prior == "masked" else V
    if name == "arpc":  # AR score decreasing with the position (>= 0.06 nats a step): the bottom k are the last k
        script = Script(vocab, lambda pos: 3 + pos % 5, ar_bias=lambda pos: 6.0 - 0.5 * pos)
    else:  # diffusion confidence decreasing with the position, every entropy far below the grid
        real = Script(vocab, lambda pos: 3 + pos % 5)

        def script(tokens, layout, cache, n_commit=0, **kwargs):
            logits = real(tokens, layout, cache, n_commit)
            expanded = layout.expand(tokens.shape[0])
            noisy = expanded.noisy[0]
            offset = expanded.positions[:, noisy] - expanded.block_ids[:, noisy]  # index inside the block
            return logits * (1.0 - 0.05 * offset[..., None].float())

    monkeypatch.setattr(model.dit, "forward_cached", script)
    return model


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("name", ["arpc", "eipc"])
def test_informed_step_renoises_all_k_lowest(monkeypatch, name, prior):
    """Exactly the k = round((1 - alpha_s) L') lowest-scoring positions are re-noised, every one of
    them with a draw from the prior ([MASK]; for uniform the prior draw of that step), the rest stay
    x~. Scores are compared on `SCORE_GRID`: ARPC's differ by more and pick the last k; EIPC's differ
    by float noise only, tie, and go to the first k generated positions. Grid layout: a prompt tail is
    never chosen and k counts the positions the row generates."""
    model = scripted_informed_model(name, prior, monkeypatch)
    draws = []
    if prior == "uniform":  # record the prior draws: the informed step's re-noising is the second one
        real_sample = UniformPrior.prior_sample
        monkeypatch.setattr(UniformPrior, "prior_sample", lambda self, *a, **k: draws.append(real_sample(self, *a, **k)) or draws[-1])
    steps, block = 2, 8
    alpha_s = step_alphas(0, steps, 1e-3)[1]
    assert renoise_count(0, steps, block, 1e-3) == round((1 - alpha_s) * block) == 4
    prompts = [[], [1] * 8, [1, 2, 3], [1] * 7, [1] * 13]  # grid tails 0, 0, 3, 7, 5
    for layout in BLOCK_LAYOUTS:
        after_informed = []
        draws.clear()
        config = SamplerConfig(name, steps=steps, ge=5, block_size=block, max_new_tokens=block, seed=0, layout=layout)
        generate(model, prompts, config, eos_id=-1, pad_id=1, trace=lambda b, i, z: after_informed.append(z) if (b, i) == (0, 0) else None)
        z = after_informed[0]
        for r, p in enumerate(prompts):
            tail = len(p) % block if layout == "grid" else 0
            start = len(p) - tail  # the block's first position
            proposal = 3 + (start + torch.arange(block)) % 5
            proposal[:tail] = torch.tensor(p[start:])
            k = renoise_count(0, steps, block - tail, 1e-3)
            assert k == max(1, round((1 - alpha_s) * (block - tail)))
            at = torch.arange(block)
            # ARPC: the last k, the lowest scores; EIPC: a tie, the k lowest positions after the tail
            chosen = at >= block - k if name == "arpc" else (at >= tail) & (at < tail + k)
            noise = model.prior.mask_id if prior == "masked" else draws[1][r]
            expected = torch.where(chosen, torch.as_tensor(noise), proposal)
            assert torch.equal(z[r], expected), (layout, r, z[r], expected)
            if prior == "masked":
                assert int((z[r] == model.prior.mask_id).sum()) == k


def test_row_streams_draw_per_row():
    """Per-row draws: the right distribution, and a row's draws are the same alone or in a batch."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    draws = sample_categorical(probs.expand(2, 20_000, 4), RowStreams([0, 1]))
    for row in draws:
        freq = torch.bincount(row, minlength=4).double() / row.numel()
        assert (freq - probs.double()).abs().max() < 0.015 and freq[1] == 0
    p = torch.softmax(torch.randn(5, 6, 11, generator=torch.Generator().manual_seed(0)), -1)
    batch = sample_categorical(p, RowStreams([7, 8, 9, 10, 11]))
    for r, seed in enumerate([7, 8, 9, 10, 11]):
        assert torch.equal(batch[r], sample_categorical(p[r : r + 1], RowStreams([seed]))[0])
    streams = RowStreams([3, 4, 5])
    streams.uniform((3, 2))
    kept = streams.select([2])
    alone = RowStreams([5])
    alone.uniform((1, 2))
    assert torch.equal(kept.uniform((1, 4)), alone.uniform((1, 4)))  # the kept row goes on with its own stream
    with pytest.raises(ValueError, match="3 rows"):
        streams.uniform((2, 4))


def _splitmix_reference(seed: int, call: int, position: int) -> int:
    """RowStreams' word in plain Python integers mod 2^64 (the definition, no torch)."""
    mask, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    return mix((mix((mix(seed & mask) + call * gamma) & mask) + (position + 1) * gamma) & mask)


ROW_STREAM_SEEDS = [0, 1, 12345, 2**63 - 1, -1, 2**40 + 7]


def _row_stream_words() -> list[list[int]]:
    streams = RowStreams(ROW_STREAM_SEEDS)
    words = [streams.bits((len(ROW_STREAM_SEEDS), 3, 5)).view(len(ROW_STREAM_SEEDS), -1) for _ in range(3)]
    return [[w & ((1 << 64) - 1) for w in torch.stack(words, 1).flatten(1).tolist()[r]] for r in range(len(ROW_STREAM_SEEDS))]


def test_row_streams_are_splitmix64_bit_for_bit():
    """The int64 tensor arithmetic (wrapping products, emulated logical shifts) is exactly splitmix64's
    definition, so every device and CPU kernel that does int64 arithmetic draws the same words."""
    words = _row_stream_words()
    for r, seed in enumerate(ROW_STREAM_SEEDS):
        expected = [_splitmix_reference(seed, call, p) for call in range(3) for p in range(15)]
        assert words[r] == expected, seed
    u = RowStreams([9]).uniform((1, 4))
    assert u.dtype == torch.float64
    assert u[0].tolist() == [(_splitmix_reference(9, 0, p) >> 11) * 2.0**-53 for p in range(4)]


def test_row_streams_are_the_same_on_the_portable_cpu_kernels():
    """The same words from ATen's non-vectorised kernels (ATEN_CPU_CAPABILITY=default) as from this CPU's."""
    draw = f"s = RowStreams({ROW_STREAM_SEEDS}); words = [s.bits((6, 3, 5)).tolist() for _ in range(3)]"
    code = f"import json; from blockgen.models.diffusion import RowStreams; {draw}; print(json.dumps(words))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    scope = {"RowStreams": RowStreams}
    exec(draw, scope)
    assert json.loads(out.stdout) == scope["words"]


def test_row_streams_are_uniform_and_independent():
    """Kolmogorov-Smirnov against U[0, 1) per row and across calls, and no correlation between
    neighbouring rows, calls or positions (200,000 draws; fixed seeds, exact integer arithmetic)."""
    u = RowStreams(range(8)).uniform((8, 25_000))
    v = torch.cat([RowStreams([s]).uniform((1, 1)) for s in range(20_000)])  # first draws of 20,000 seeds
    for sample in (u.flatten(), v.flatten(), *u):
        x = sample.sort().values
        n = len(x)
        grid = torch.arange(1, n + 1, dtype=torch.float64) / n
        ks = torch.maximum(grid - x, x - (grid - 1 / n)).max().item()
        assert ks < 1.95 / n**0.5  # the 0.1% critical value
    assert ((u >= 0) & (u < 1)).all()
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:]), (v[:-1], v[1:])):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(corr) < 4 / a.numel() ** 0.5


# ------------------------------------------------------------------------------ uniform prior


def test_uniform_step_is_the_plug_in_posterior():
    """With a one-hot denoiser, the uniform ancestral step draws from prior.posterior(z_t, x)."""
    model = tiny_model("uniform")
    prior = model.prior
    c, z_t = 7, 12
    alpha_t, alpha_s = step_alphas(1, 3, 1e-3)
    n = 40_000
    z = torch.full((n, 1), z_t)
    x_probs = torch.nn.functional.one_hot(torch.full((n, 1), c), V).float()
    draws = ancestral_step(prior, z, x_probs, alpha_t, alpha_s, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws.view(-1), minlength=V).double() / n
    want = prior.posterior(torch.tensor(z_t), torch.nn.functional.one_hot(torch.tensor(c), V).double(), alpha_t, alpha_s)
    assert (freq - want).abs().max() < 0.01
    assert want[c] > 0.2 and want[z_t] > 0.2  # both "jump to x" and "stay" are exercised


def test_uniform_ancestral_runs_and_ends_on_the_denoiser(monkeypatch, uniform):
    result = generate(uniform, [[1, 2], [3]], SamplerConfig("ancestral", steps=3, max_new_tokens=16), eos_id=-1, pad_id=0)
    assert all(len(t) == 16 and all(0 <= v < V for v in t) for t in result.tokens)
    model = tiny_model("uniform")
    monkeypatch.setattr(model.dit, "forward_cached", Script(V, lambda pos: 3 + pos % 5))
    result = generate(model, [[1, 2]], SamplerConfig("ancestral", steps=3, block_size=8, max_new_tokens=16), eos_id=-1, pad_id=0)
    assert result.tokens[0] == [3 + p % 5 for p in range(2, 18)]  # at s = 0 the posterior is x itself


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


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
def test_per_row_seeds_make_rows_batch_independent(prior, layout, masked, uniform):
    """batch_invariant: a row's text is bit for bit the same alone, in batches of 7 and 16 mixed-length
    prompts and in shuffled order, for every sampler; calls and blocks are the rows' sums."""
    model = masked if prior == "masked" else uniform
    lengths = [0, 1, 3, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20, 23, 30]
    prompts = [[(7 * r + j) % V for j in range(n)] for r, n in enumerate(lengths)]
    seeds = [1000 + 37 * r for r in range(len(prompts))]
    for name in SAMPLERS:
        config = SamplerConfig(name, steps=4, ge=2, temperature=0.7, max_new_tokens=12, layout=layout)

        def run(rows: list[int]) -> GenerationResult:
            return generate(model, [prompts[r] for r in rows], config, eos_id=-1, pad_id=0,
                            seeds=[seeds[r] for r in rows], batch_invariant=True)

        alone = [run([r]) for r in range(len(prompts))]
        texts = [a.tokens[0] for a in alone]
        batch = run(list(range(16)))
        assert batch.tokens == texts, name
        assert batch.model_calls == sum(a.model_calls for a in alone) and batch.n_blocks == sum(a.n_blocks for a in alone)
        assert run(list(range(7))).tokens == texts[:7], name
        shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(3)).tolist()
        assert run(shuffled).tokens == [texts[r] for r in shuffled], name
    assert generate(model, prompts[:2], config, eos_id=-1, pad_id=0, batch_invariant=True).tokens == [
        generate(model, [p], replace(config, seed=config.seed + r), eos_id=-1, pad_id=0).tokens[0] for r, p in enumerate(prompts[:2])
    ]  # default: row i uses config.seed + i
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        generate(model, prompts[:3], config, eos_id=-1, pad_id=0, seeds=[1, 2])


def test_batched_logits_depend_on_the_batch_shape(masked):
    """Why batch_invariant exists: batched, the network's logits for one row move in the last bits
    with the batch (the CPU's kernels block their sums by shape); a row run alone is bit for bit
    reproducible. Skipped on a CPU whose kernels happen to agree for these shapes."""
    x = torch.randint(0, V, (16, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone = masked.dit.forward_train(x[:1], x[:1], 8)
        assert torch.equal(alone, masked.dit.forward_train(x[:1], x[:1], 8))
        batched = {n: masked.dit.forward_train(x[:n], x[:n], 8)[:1] for n in (2, 7, 16)}
    for n, logits in batched.items():  # the same numbers up to rounding: a kernel effect, not a bug
        torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
    if all(torch.equal(logits, alone) for logits in batched.values()):
        pytest.skip("this CPU's kernels give batch-independent logits for these shapes")


def test_grid_layout_keeps_the_prompt_tail_and_the_room(masked):
    """Grid: the tail is never returned and a prompt of P tokens gets up to seq_len - P new tokens;
    prompts whose length is a multiple of L' sample exactly as with prompt_end."""
    block, seq_len = 8, masked.config.seq_len
    config = SamplerConfig("eipc", steps=3, block_size=block, max_new_tokens=seq_len - 21, layout="grid")
    assert max_prompt_len(masked, config) == 21
    assert max_prompt_len(masked, replace(config, layout="prompt_end")) == seq_len - 48  # 43 new tokens: 6 whole blocks
    prompt = list(range(1, 22))
    result = generate(masked, [prompt, [2, 3]], config, eos_id=-1, pad_id=0)
    assert [len(t) for t in result.tokens] == [43, 43]
    assert result.n_blocks == 6  # ceil((2 + 43) / 8); the 21-token prompt's row needs 6 as well
    with pytest.raises(ValueError, match=r"seq_len 64.*truncate prompts to 21 tokens"):
        generate(masked, [prompt + [1]], config, eos_id=-1, pad_id=0)
    with pytest.raises(ValueError, match="truncate prompts to 16 tokens"):
        generate(masked, [prompt], replace(config, layout="prompt_end"), eos_id=-1, pad_id=0)
    aligned = [list(range(1, 17)), [], [5] * 8]
    for name in ("ancestral", "arpc"):
        runs = [generate(masked, aligned, SamplerConfig(name, steps=3, max_new_tokens=16, layout=layout), eos_id=-1, pad_id=0)
                for layout in BLOCK_LAYOUTS]
        assert runs[0].tokens == runs[1].tokens and runs[0].model_calls == runs[1].model_calls


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(name="beam"), ["ancestral", "eipc", "arpc", "ar_greedy", "ar_sample"]),
        (dict(steps=0), ["steps", ">= 1"]),
        (dict(name="arpc", ge=0), ["ge", ">= 1"]),
        (dict(name="eipc", warmup=-1), ["warmup", ">= 0"]),
        (dict(name="arpc", steps=4, warmup=4), ["warmup", "0..3"]),
        (dict(temperature=0.0), ["temperature"]),
        (dict(name="ar_sample", temperature=-1.0), ["temperature"]),
        (dict(name="ar_greedy", block_size=16), ["block_size", "1"]),
        (dict(block_size=1), ["ar_sample", "ar_greedy"]),
        (dict(max_new_tokens=0), ["max_new_tokens"]),
        (dict(layout="aligned"), ["layout", "grid", "prompt_end"]),
    ],
)
def test_bad_sampler_configs(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplerConfig(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_configs_checked_against_the_model(masked):
    assert SamplerConfig("ar_greedy", temperature=0.0).temperature == 0.0  # greedy ignores it
    assert check_config(masked, SamplerConfig("arpc")) == 8  # default: the largest trained size
    with pytest.raises(ValueError, match=r"\[1, 4, 8\]"):
        check_config(masked, SamplerConfig("ancestral", block_size=16))
    with pytest.raises(ValueError, match="block size 1 in the training mixture.*ancestral"):
        check_config(tiny_model(sizes=(4, 8)), SamplerConfig("arpc"))
    with pytest.raises(ValueError, match="causal_clean"):
        check_config(tiny_model(causal=False), SamplerConfig("arpc", block_size=4))
    with pytest.raises(ValueError, match=r"\[4, 8\]"):
        check_config(tiny_model(sizes=(4, 8)), SamplerConfig("ar_greedy"))
    with pytest.raises(ValueError, match="seq_len"):
        generate(masked, [[1] * 60], SamplerConfig("ancestral", max_new_tokens=8), eos_id=-1, pad_id=0)
    assert set(SAMPLERS) == {"ancestral", "eipc", "arpc", "ar_greedy", "ar_sample"}


def test_cli_samples_a_checkpoint(tmp_path, capsys):
    from blockgen.harness.checkpoints.checkpoint import save_checkpoint
    from blockgen.harness.cli import main
    from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe

    tok = train_bpe(["three apples and two pears make five fruits"] * 20, vocab_size=270)
    special = special_tokens(tok)
    config = BlockGenConfig(
        vocab_size=len(tok), seq_len=64, block_sizes=(1, 8), block_weights=(0.5, 0.5),
        shape=ModelShape(n_layers=1, d_model=32, n_heads=4, cond_dim=16, dropout=0.0), special_tokens=special.to_dict(),
    )
    save_checkpoint(tmp_path / "ckpt", BlockGen(config), tokenizer=tok)
    out = tmp_path / "samples.jsonl"
    argv = ["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "three apples", "--prompt", "", "--num-samples", "2",
            "--sampler", "arpc", "--steps", "3", "--ge", "3", "--max-new-tokens", "16", "--batch-size", "3", "--out", str(out)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["paper_nfe_per_block"] == 4 and rows[0]["sampler"]["name"] == "arpc"
    assert all(len(r["tokens"]) <= 16 and special.eos not in r["tokens"] for r in rows)
    assert "model calls per block" in capsys.readouterr().out
    # Sample j is seeded --seed + j: the same samples at any --batch-size, and with either layout flag.
    one = tmp_path / "one.jsonl"
    assert main(argv[:-4] + ["--batch-size", "1", "--out", str(one), "--quiet", "--layout", "grid"]) == 0
    assert [json.loads(line)["tokens"] for line in one.read_text().splitlines()] == [r["tokens"] for r in rows]
    assert main(argv[:-2] + ["--out", str(one), "--quiet", "--layout", "prompt_end"]) == 0
    assert all(json.loads(line)["sampler"]["layout"] == "prompt_end" for line in one.read_text().splitlines())
    assert main(argv[:3] + ["--prompt", "x", "--sampler", "arpc", "--block-size", "4"]) == 2
    assert "[1, 8]" in capsys.readouterr().err
    # --nfe: the paper's variant at that NFE (the rule of lm-eval's nfe= model arg), narrowed by --ge
    from blockgen.harness.evaluation.sampler_grid import pick

    by_nfe = tmp_path / "nfe.jsonl"
    base = argv[:5] + ["--sampler", "arpc", "--max-new-tokens", "16", "--quiet", "--out", str(by_nfe)]
    for extra, (steps, ge, warmup) in (([], pick("arpc", 4)[1:]), (["--ge", "1"], pick("arpc", 4, ge=1)[1:])):
        assert main(base + ["--nfe", "4", *extra]) == 0
        sampler = json.loads(by_nfe.read_text().splitlines()[0])["sampler"]
        assert (sampler["steps"], sampler["ge"], sampler["warmup"]) == (steps, ge, warmup)
    assert main(base + ["--nfe", "4", "--steps", "99"]) == 2
    assert "no arpc variant at NFE 4 with steps=99" in capsys.readouterr().err


def test_temperature_divides_the_logits(masked):
    """T -> 0 turns AR sampling into greedy decoding; T = 1 keeps the model's distribution."""
    prompts = [[1, 2, 3], [4]]
    greedy = generate(masked, prompts, SamplerConfig("ar_greedy", max_new_tokens=12), eos_id=-1, pad_id=0).tokens
    cold = generate(masked, prompts, SamplerConfig("ar_sample", temperature=1e-4, max_new_tokens=12, seed=5), eos_id=-1, pad_id=0)
    assert cold.tokens == greedy
    warm = generate(masked, prompts, SamplerConfig("ar_sample", temperature=1.0, max_new_tokens=12, seed=5), eos_id=-1, pad_id=0)
    assert warm.tokens != greedy
