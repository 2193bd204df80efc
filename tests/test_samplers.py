"""The samplers (ancestral, EIPC, ARPC, AR greedy and sampled) against by-hand definitions: what each step may
change, model calls against the documented rule and appendix D's NFE, seeds, greedy AR against argmax by
hand; stopping at EOS and at a stop callback, and the informed step's re-noising, with a scripted network;
the uniform prior's step against its posterior (tiny random models, CPU)."""

from __future__ import annotations

import pytest
import torch

from blockgen.models.diffusion import UniformPrior
from blockgen.models.model import BlockGen
from blockgen.models.sampler_config import (
    BLOCK_LAYOUTS,
    SamplerConfig,
    calls_per_block,
    paper_nfe_per_block,
    renoise_count,
    step_alphas,
)
from blockgen.models.sampling import ancestral_step, generate
from sampling_models import V, tiny_model


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
