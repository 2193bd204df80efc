"""The field's samplers (models/samplers/confidence_threshold.py, low_confidence.py, entropy_bounded.py) against
independent NumPy implementations of their step rules, written from the cited papers:

- Fast-dLLM's threshold rule: commit every undecided position whose drawn token has (untempered) probability
  above the threshold, at least the most confident one, at most `max_per_step`;
- LLaDA's low-confidence remasking: n positions spread over `steps` steps, the earlier steps one more, the most
  confident first;
- the EB-sampler: positions by increasing entropy, the longest prefix with sum(H) - max(H) <= gamma.

The reference replays a generation from the network's logits as the sampler saw them (recorded at each call) and
its own splitmix64 draws (plain Python integers), and must agree step by step: which rows take part in each call,
which positions are committed, to which tokens, the calls per row. Shapes and seeds the other sampling tests do not
use: 13 rows, prompts of 0-29 tokens, three blocks of 8, seeds 7000 + 11 r. Then: cached == uncached, a row alone
== in a batch of 13 (batch_invariant), the per-row counts of `GenerationResult`, and the bad-input messages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import Decoder, check_config, generate
from sampling_models import V, tiny_model

MASK64, GAMMA, MIX1, MIX2 = (1 << 64) - 1, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
GRID = 2.0**-13
BLOCK = 8
LENGTHS = [0, 3, 29, 8, 1, 13, 21, 5, 16, 10, 27, 2, 19]  # 13 rows: tails 0-7 of a block of 8
BUDGET = 2 * BLOCK + 1  # three blocks for every row, whatever its prompt's tail (0-7)
SEEDS = [7000 + 11 * r for r in range(len(LENGTHS))]
PROMPTS = [[(5 * r + 3 * j + 1) % V for j in range(n)] for r, n in enumerate(LENGTHS)]
SETTINGS = {
    "confidence_threshold": [dict(threshold=0.5), dict(threshold=0.2, max_per_step=2)],
    "low_confidence": [dict()],
    "entropy_bounded": [dict(entropy_bound=0.5), dict(entropy_bound=0.0)],
}


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def _uniforms(seed: int, block: int, call: int, n: int) -> np.ndarray:
    """A row's draws of one call of a block's own stream: splitmix64 keyed by (seed, block), then by call."""
    key = _mix(_mix(seed & MASK64) ^ ((block + 1) * MIX1 & MASK64))
    call_key = _mix((key + call * GAMMA) & MASK64)
    return np.array([(_mix((call_key + (p + 1) * GAMMA) & MASK64) >> 11) * 2.0**-53 for p in range(n)])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _plan(name: str, options: dict, steps: int, step: int, confidence, entropy, open_positions: list[int],
          generated: int) -> list[int]:
    """The positions one row commits at this step, by the papers' rules (ties: the lower position first)."""
    by_confidence = sorted(open_positions, key=lambda p: (-confidence[p], p))
    if name == "confidence_threshold":
        passing = [p for p in by_confidence if confidence[p] > options.get("threshold", 0.9)] or by_confidence[:1]
        cap = options.get("max_per_step", 0)
        return passing[:cap] if cap else passing
    if name == "low_confidence":
        share = generated // steps + (1 if step < generated % steps else 0)
        return by_confidence[:share]
    by_entropy = sorted(open_positions, key=lambda p: (entropy[p], p))
    chosen = []
    for p in by_entropy:  # the longest prefix whose entropies sum, less their largest, to at most gamma
        h = [entropy[q] for q in chosen + [p]]
        if sum(h) - max(h) > options.get("entropy_bound", 0.1):
            break
        chosen.append(p)
    return chosen or by_entropy[:1]


def _reference(name, options, prior, model, calls, steps, temperature):
    """Replays the generation: per block, per step, the rows with undecided positions must be those the recorded
    call computed; returns per block the z after every step (each row) and the calls per row."""
    mask_id, v_model = model.prior.mask_id, model.prior.model_vocab_size
    calls = list(calls)
    n_rows = len(PROMPTS)
    tails = [len(p) % BLOCK for p in PROMPTS]
    blocks, row_calls = [], [0] * n_rows
    for block in range(3):
        tail = tails if block == 0 else [0] * n_rows
        z = np.zeros((n_rows, BLOCK), dtype=np.int64)
        for r in range(n_rows):
            if prior == "masked":
                z[r] = mask_id
            else:  # the uniform prior's draw: call 0 of the block's stream
                z[r] = np.minimum((_uniforms(SEEDS[r], block, 0, BLOCK) * v_model).astype(np.int64), v_model - 1)
            z[r, : tail[r]] = PROMPTS[r][len(PROMPTS[r]) - tail[r]:] if tail[r] else []
        undecided = [[p >= tail[r] for p in range(BLOCK)] for r in range(n_rows)]
        history, step = [], 0
        while active := [r for r in range(n_rows) if any(undecided[r])]:
            rows, logits = calls.pop(0)
            assert rows == active, (block, step)
            for i, r in enumerate(rows):
                row_calls[r] += 1
                raw = logits[i].astype(np.float64)
                if prior == "masked":
                    raw[:, mask_id] = -np.inf
                log_p, log_p1 = _log_softmax(raw / temperature), _log_softmax(raw)
                p = np.exp(log_p)
                u = _uniforms(SEEDS[r], block, step + 1, BLOCK)
                cdf = p.cumsum(-1)
                x = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(-1), v_model - 1)  # inverse CDF: searchsorted right
                confidence = np.round(np.exp(log_p1[np.arange(BLOCK), x]) / GRID) * GRID
                entropy = np.round(-(p * np.where(p > 0, log_p, 0.0)).sum(-1) / GRID) * GRID
                open_positions = [q for q in range(BLOCK) if undecided[r][q]]
                for q in _plan(name, options, steps, step, confidence, entropy, open_positions, BLOCK - tail[r]):
                    z[r, q] = x[q]
                    undecided[r][q] = False
            history.append(z.copy())
            step += 1
        blocks.append(history)
    assert not calls  # every recorded call replayed
    return blocks, row_calls


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("name,options", [(n, o) for n, settings in SETTINGS.items() for o in settings])
def test_each_step_is_the_papers_rule(name, options, prior, monkeypatch):
    model = tiny_model(prior, seed=5, std=0.35)
    steps, temperature = 3, 0.8
    config = SamplerConfig(name, steps=steps, block_size=BLOCK, temperature=temperature, max_new_tokens=BUDGET,
                           options=tuple(options.items()))
    calls = []
    original = Decoder.denoise_rows

    def recorded(self, z, rows):
        logits = original(self, z, rows)
        calls.append((list(rows), logits.float().numpy().copy()))
        return logits

    monkeypatch.setattr(Decoder, "denoise_rows", recorded)
    traced = []
    result = generate(model, PROMPTS, config, eos_id=-1, pad_id=0, seeds=SEEDS,
                      trace=lambda block, step, z: traced.append((block, step, z.numpy().copy())))
    blocks, row_calls = _reference(name, options, prior, model, calls, steps, temperature)
    assert [(b, s) for b, s, _ in traced] == [(b, s) for b, history in enumerate(blocks) for s in range(len(history))]
    for (b, s, z), want in zip(traced, (z for history in blocks for z in history)):
        assert (z == want).all(), (b, s)
    assert result.row_calls == row_calls and result.row_blocks == [len(blocks)] * len(PROMPTS)
    assert result.model_calls == sum(len(history) for history in blocks)  # one batched call per step
    texts = [np.concatenate([blocks[b][-1][r] for b in range(len(blocks))]) for r in range(len(PROMPTS))]
    tails = [len(p) % BLOCK for p in PROMPTS]
    assert result.tokens == [texts[r][tails[r]:][:BUDGET].tolist() for r in range(len(PROMPTS))]
    if name == "low_confidence":  # a fixed schedule: min(steps, positions generated) calls per block and row
        assert row_calls == [min(steps, BLOCK - t) + 2 * steps for t in tails]
    else:
        assert len(set(row_calls)) > 1, "the rows' calls should differ (adaptive)"


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_cached_equals_uncached_and_a_row_alone_equals_it_in_a_batch_of_13(name, prior):
    model = tiny_model(prior, seed=5, std=0.35)
    config = SamplerConfig(name, steps=3, block_size=BLOCK, temperature=0.8, max_new_tokens=BUDGET,
                           options=tuple(SETTINGS[name][0].items()))
    cached = generate(model, PROMPTS, config, eos_id=-1, pad_id=0, seeds=SEEDS)
    uncached = generate(model, PROMPTS, config, eos_id=-1, pad_id=0, seeds=SEEDS, use_cache=False)
    assert cached.tokens == uncached.tokens and cached.row_calls == uncached.row_calls
    batch = generate(model, PROMPTS, config, eos_id=-1, pad_id=0, seeds=SEEDS, batch_invariant=True)
    alone = [generate(model, [p], config, eos_id=-1, pad_id=0, seeds=[s]) for p, s in zip(PROMPTS, SEEDS)]
    assert batch.tokens == [a.tokens[0] for a in alone]
    assert batch.row_calls == [a.row_calls[0] for a in alone] == cached.row_calls
    assert batch.row_max_calls_per_block == [a.row_max_calls_per_block[0] for a in alone]


def test_rows_done_sit_out_and_the_counts_say_so():
    """A row whose block is decided takes no part in the block's later calls: the batched calls are the block's
    slowest row's, each row counts its own; tokens per forward counts generated tokens only."""
    model = tiny_model("masked", seed=5, std=0.35)
    config = SamplerConfig("entropy_bounded", block_size=BLOCK, temperature=0.8, max_new_tokens=BLOCK,
                           options=(("entropy_bound", 0.5),))
    result = generate(model, [[1] * 8, [2] * 8, [3] * 8], config, eos_id=-1, pad_id=0, seeds=[1, 2, 3])
    assert result.model_calls == max(result.row_calls) and len(set(result.row_calls)) > 1
    assert result.row_max_calls_per_block == result.row_calls  # one block each
    assert result.calls_per_block_per_row == pytest.approx(sum(result.row_calls) / 3)
    assert result.tokens_per_forward == pytest.approx(3 * BLOCK / sum(result.row_calls))
    assert result.paper_nfe_per_block is None  # adaptive: measured, no label
    fixed = generate(model, [[1] * 8, [2] * 8], SamplerConfig("ancestral", steps=4, block_size=BLOCK, max_new_tokens=BLOCK),
                     eos_id=-1, pad_id=0, seeds=[1, 2])
    assert fixed.row_calls == [4, 4] and fixed.calls_per_block_per_row == 4.0 and fixed.paper_nfe_per_block == 4


def test_bad_settings_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"threshold=1.5; must be in 0.0 < threshold < 1.0"):
        SamplerConfig("confidence_threshold", options=(("threshold", 1.5),))
    with pytest.raises(ValueError, match=r"entropy_bound=-0.1; must be in 0.0 <= entropy_bound"):
        SamplerConfig("entropy_bounded", options=(("entropy_bound", -0.1),))
    with pytest.raises(ValueError, match=r"sampler 'low_confidence' has no setting \['threshold'\]; its own settings: \[\]"):
        SamplerConfig("low_confidence", options=(("threshold", 0.9),))
    with pytest.raises(ValueError, match=r"has no setting \['gamma'\]; its own settings: \['entropy_bound'\]"):
        SamplerConfig("entropy_bounded", options=(("gamma", 0.1),))
    timed = tiny_model("uniform", sizes=(8,)).config
    object.__setattr__(timed, "time_conditioning", True)  # a Duo-style network: conditioned on the noise level
    with pytest.raises(ValueError, match=r"follows no noise schedule .* choose one of \['ancestral', 'eipc', 'arpc'"):
        check_config(timed, SamplerConfig("confidence_threshold", block_size=8))
