"""What a GPU would wait for, counted on a CPU (issue 30): host reads per denoising step and per block
under a `TorchDispatchMode` (`models/host_reads.py`), the KV cache written in place with the same
shapes every call in static mode, and per-row budgets inside one batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from blockgen.models.host_reads import HostReads, to_host
from blockgen.models import samplers
from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import generate
from sampling_models import V, tiny_model

# Host reads a sampler may make: none inside a block, at most one per block (its tokens, read once
# for EOS, stop strings and budgets).
PER_STEP, PER_BLOCK = 0, 1


@pytest.fixture(scope="module", params=["masked", "uniform"])
def model(request):
    return tiny_model(request.param)


def test_the_counter_sees_what_makes_a_gpu_wait():
    x = torch.arange(12.0).view(3, 4)
    for read in (lambda: x.sum().item(), lambda: int(x[0, 0]), lambda: bool(x.any()), lambda: x[x > 3],
                 lambda: torch.nonzero(x), lambda: x.masked_select(x > 1), lambda: to_host(x)):
        for mode in (torch.no_grad, torch.inference_mode):  # inference_mode dispatches `item` whole
            with mode(), HostReads() as reads:
                read()
            assert reads.count >= 1, reads.ops
    with torch.inference_mode(), HostReads() as reads:  # device-side work and uploads are not reads
        y = (x * 2).softmax(-1).argsort(-1)
        torch.where(x > 2, x, -x).cumsum(-1)
        x.to("cpu")
        x.double()
        y[:, :2]
    assert reads.count == 0, reads.ops


@pytest.mark.parametrize("layout", ["grid", "prompt_end"])
@pytest.mark.parametrize("name", samplers.names())
def test_host_reads_per_step_and_per_block(model, name, layout):
    """Every sampler, both priors and layouts, rows leaving the batch at different blocks: no host read
    between two denoising steps of a block, at most one per block (its read-back). The position-committing
    samplers (the field's) read one per step: which rows still decide positions is the next call's batch."""
    config = SamplerConfig(name, steps=4, ge=2, warmup=1 if name == "arpc" else 0, temperature=0.7, layout=layout,
                           max_new_tokens=24)
    prompts = [[1, 5, 7], [2, 3, 4, 9, 11], [6], list(range(1, 14))]
    events: list[tuple[int, int, int]] = []
    with HostReads() as reads:
        result = generate(model, prompts, config, eos_id=-1, pad_id=0, seeds=[1, 2, 3, 4],
                          max_new_tokens=[24, 8, 16, 24], trace=lambda b, i, z: events.append((b, i, reads.count)))
    committing = samplers.get(name).commits_positions
    for (b0, _, c0), (b1, _, c1) in zip(events, events[1:]):
        if b0 == b1:
            assert c1 - c0 == (1 if committing else PER_STEP), (name, b0, reads.ops)
    # committing: one per step, one when the block is decided, and the block's read-back
    most = len(events) + 2 * result.n_blocks if committing else PER_BLOCK * result.n_blocks
    assert reads.count <= most, (name, reads.count, result.n_blocks, reads.ops)
    assert [len(t) for t in result.tokens] == [24, 8, 16, 24]


def test_a_layout_without_n_noisy_costs_a_read(model):
    """`forward_cached` without the count reads it from the layout: the sampler always passes it."""
    from blockgen.models.attention import Layout
    from blockgen.models.backbone import KVCache

    tokens = torch.randint(0, V, (2, 8))
    positions = torch.arange(8)[None].expand(2, 8)
    noisy = torch.arange(8)[None].expand(2, 8) >= 4
    layout = Layout(positions, torch.where(noisy, 4, positions), noisy, torch.ones(2, 8, dtype=torch.bool))
    with torch.inference_mode():
        with HostReads() as told:
            given = model.dit.forward_cached(tokens, layout, KVCache(), 4, n_noisy=4)
        with HostReads() as untold:
            read = model.dit.forward_cached(tokens, layout, KVCache(), 4)
    assert told.count == 0 and untold.count == 1 and torch.equal(given, read)


@pytest.mark.parametrize("name", ["ancestral", "arpc", "ar_greedy"])
def test_static_cache_keeps_shapes_and_numbers(model, name, monkeypatch):
    """static_shapes: every call attends to keys of one length (the preallocated capacity), whatever
    the block; the logits agree with the sliced cache's up to float rounding."""
    import blockgen.models.backbone as backbone

    key_lengths: dict[bool, set[int]] = {False: set(), True: set()}
    logits: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    static = {"on": False}
    real_sdpa, real_call = backbone.F.scaled_dot_product_attention, model.dit.forward_cached

    def sdpa(q, k, v, **kw):
        key_lengths[static["on"]].add(k.shape[2])
        return real_sdpa(q, k, v, **kw)

    def call(*args, **kwargs):
        out = real_call(*args, **kwargs)
        logits[static["on"]].append(out)
        return out

    monkeypatch.setattr(backbone.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(model.dit, "forward_cached", call)
    config = SamplerConfig(name, steps=3, ge=1, temperature=0.7, max_new_tokens=24)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    for on in (False, True):
        static["on"] = on
        result = generate(model, prompts, config, eos_id=-1, pad_id=0, seeds=[5, 6], static_shapes=on)
        assert all(len(t) == 24 for t in result.tokens)
    assert len(key_lengths[True]) == 1 and len(key_lengths[False]) > 1, key_lengths
    assert len(logits[True]) == len(logits[False])
    for a, b in zip(logits[False], logits[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_per_row_budgets_equal_each_row_alone(model):
    """One batch with a budget per row: each row's tokens are those of the row run alone with its
    budget (batch-invariant mode: bit for bit), and no row gets more than its budget."""
    config = SamplerConfig("ancestral", steps=4, temperature=0.7, max_new_tokens=30)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    budgets, seeds = [30, 5, 17, 1], [7, 8, 9, 10]
    batch = generate(model, prompts, config, eos_id=-1, pad_id=0, seeds=seeds, max_new_tokens=budgets, batch_invariant=True)
    alone = [generate(model, [p], replace(config, max_new_tokens=b), eos_id=-1, pad_id=0, seeds=[s]).tokens[0]
             for p, b, s in zip(prompts, budgets, seeds)]
    assert batch.tokens == alone and [len(t) for t in batch.tokens] == budgets
    assert batch.finish_reasons == ["length"] * 4
    with pytest.raises(ValueError, match="4 budgets >= 1"):
        generate(model, prompts, config, eos_id=-1, pad_id=0, max_new_tokens=[3, 0, 1, 1])
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        generate(model, prompts, config, eos_id=-1, pad_id=0, max_new_tokens=[3, 3, 3, 64])
