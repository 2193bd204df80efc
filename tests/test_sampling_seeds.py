"""Per-row randomness: RowStreams (splitmix64 bit for bit, the same on the portable CPU kernels, uniform and
independent, one stream a row), per-row seeds that make a row's sample independent of its batch, and why
batch_invariant exists: batched logits move in the last bits with the batch shape (tiny random models, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from blockgen.models.diffusion import RowStreams, sample_categorical
from blockgen.models import samplers
from blockgen.models.sampler_config import BLOCK_LAYOUTS, SamplerConfig
from blockgen.models.sampling import GenerationResult, generate
from sampling_models import V


# ------------------------------------------------------------------------------ row streams


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


# ------------------------------------------------------------------ per-row seeds and batches


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
def test_per_row_seeds_make_rows_batch_independent(prior, layout, masked, uniform):
    """batch_invariant: a row's text is bit for bit the same alone, in batches of 7 and 16 mixed-length
    prompts and in shuffled order, for every sampler; the batch runs batched (fewer calls than the rows', each row's
    own count as alone)."""
    model = masked if prior == "masked" else uniform
    lengths = [0, 1, 3, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20, 23, 30]
    prompts = [[(7 * r + j) % V for j in range(n)] for r, n in enumerate(lengths)]
    seeds = [1000 + 37 * r for r in range(len(prompts))]
    for name in samplers.names():
        config = SamplerConfig(name, steps=4, ge=2, temperature=0.7, max_new_tokens=12, layout=layout)

        def run(rows: list[int]) -> GenerationResult:
            return generate(model, [prompts[r] for r in rows], config, eos_id=-1, pad_id=0,
                            seeds=[seeds[r] for r in rows], batch_invariant=True)

        alone = [run([r]) for r in range(len(prompts))]
        texts = [a.tokens[0] for a in alone]
        batch = run(list(range(16)))
        assert batch.tokens == texts, name
        assert batch.row_calls == [a.model_calls for a in alone] and batch.model_calls < sum(a.model_calls for a in alone)
        assert run(list(range(7))).tokens == texts[:7], name
        shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(3)).tolist()
        assert run(shuffled).tokens == [texts[r] for r in shuffled], name
    assert generate(model, prompts[:2], config, eos_id=-1, pad_id=0, batch_invariant=True).tokens == [
        generate(model, [p], replace(config, seed=config.seed + r), eos_id=-1, pad_id=0, batch_invariant=True).tokens[0]
        for r, p in enumerate(prompts[:2])
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
