"""`generate(..., compile=True)` (issue 30, item 5): the model calls of a block, compiled (CPU inductor
here, CUDA graphs on a GPU), compute what eager calls compute; the number of compiled graphs is
bounded by the kinds of call, not by the number of blocks; no graph breaks.

One micro network shape serves both priors (the masked prior's [MASK] makes its 40 tokens 41
outputs; the uniform model has 41 tokens), so every test of this module shares three graphs: a
block's calls (L' = 4 query tokens), a block's first call carrying the previous block and ARPC's AR
pass (2 L' = 8), and the AR samplers' calls (2 tokens, block size 1); all at batch 4 and a cache of
64 slots, and a fourth, the AR call at batch 2 (rows leaving the batch). Compiling them took 2 minutes
on a cold inductor cache on a busy 2-core machine (the module then runs in about 15 s).

Why tokens are compared for `ar_greedy` only: the compiled kernels round differently from eager ones
(~1e-6 in the logits), so a sampled token or an informed-step ranking that sits that close to a
boundary can flip, on some CPU. Every call's logits are compared instead, in lockstep (both paths
fed the same tokens); greedy tokens are compared where the eager top-2 margins are far above that.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from blockgen.models import backbone
from blockgen.models.backbone import DiT, KVCache, ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import generate

PROMPTS = [[1, 5, 7], [2, 3, 4, 9, 11], [6], [8, 9, 10, 12, 13, 14, 15]]
SEEDS = [11, 12, 13, 14]
BUDGETS = [24, 24, 24, 9]  # the last row finishes early and stays in the batch (3 of 4 still run)
TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # measured here: compiled and eager logits differ by < 5e-7
MARGIN = 1e-3  # eager top-2 logit margin that float rounding cannot bridge


def micro(prior: str, seed: int = 0) -> BlockGen:
    vocab = 40 if prior == "masked" else 41  # the same network: 41 outputs
    config = BlockGenConfig(vocab_size=vocab, seq_len=64, prior=prior, block_sizes=(1, 4), block_weights=(0.5, 0.5),
                            shape=ModelShape(n_layers=2, d_model=32, n_heads=4, cond_dim=16, dropout=0.0))
    torch.manual_seed(seed)
    model = BlockGen(config).eval()
    with torch.no_grad():  # adaLN and the output layer start at zero: scale everything up
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def graphs() -> int:
    """Graphs compiled so far for the decode call (dynamo's cache entries of `DiT.forward_static`)."""
    return len(_debug_get_cache_entry_list(DiT.forward_static.__code__))


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def config(name: str, max_new_tokens: int = 24) -> SamplerConfig:
    return SamplerConfig(name, steps=3, ge=1, warmup=1 if name == "arpc" else 0, temperature=0.7,
                         block_size=None if name.startswith("ar_") else 4, max_new_tokens=max_new_tokens)


@pytest.fixture(scope="module")
def models():
    torch._dynamo.reset()  # this module counts its own graphs
    return {prior: micro(prior) for prior in ("masked", "uniform")}


@pytest.fixture(scope="module")
def first_run(models):
    """The module's first compiled generation: 8 blocks of ancestral sampling, graphs counted per block."""
    breaks, per_block = graph_breaks(), []
    budgets = [32 - len(p) % 4 for p in PROMPTS]  # 8 blocks for every row (a grid layout's tail opens block 1)
    result = generate(models["masked"], PROMPTS, config("ancestral", max_new_tokens=32), eos_id=-1, pad_id=0, seeds=SEEDS,
                      max_new_tokens=budgets, compile=True, progress=lambda n: per_block.append(graphs()))
    return result, per_block, graph_breaks() - breaks


def test_graphs_do_not_grow_with_the_blocks(first_run):
    """A block's calls (L') compile in block 1, the first call carrying a block (2 L') in block 2; then
    nothing compiles, however many blocks follow; no graph breaks."""
    result, per_block, breaks = first_run
    assert result.n_blocks == len(per_block) == 8 and [len(t) + len(p) % 4 for t, p in zip(result.tokens, PROMPTS)] == [32] * 4
    assert per_block[:2] == [1, 2] and per_block[-1] == per_block[1], per_block
    assert breaks == 0, dict(counters["graph_break"])


class Lockstep:
    """Stands in for `DiT.forward_cached` in a compiled generation: each call also runs eagerly on a
    cache of its own (the default, sliced one), fed the same tokens; the sampler gets the compiled
    logits, so the run is the compiled generation and every call is checked against eager."""

    def __init__(self, dit: DiT):
        self.real, self.shadow = dit.forward_cached, KVCache()
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.compiled: list[bool] = []
        self.batches: list[int] = []
        self.n_layers = len(dit.blocks)

    def __call__(self, tokens, layout, cache, n_commit=0, sigma=None, n_noisy=None, compiled=False):
        self.compiled.append(compiled and len(cache.keys) == self.n_layers)
        self.batches.append(tokens.shape[0])
        got = self.real(tokens, layout, cache, n_commit, sigma, n_noisy, compiled)
        want = self.real(tokens, layout, self.shadow, n_commit, sigma, n_noisy)
        self.pairs.append((got.clone(), want))
        return got


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("name", ["ancestral", "eipc", "arpc", "ar_greedy"])
def test_compiled_calls_equal_eager_calls(models, first_run, monkeypatch, name, prior):
    """Every call of a compiled generation (grid-layout prompt tails, a row finishing early that stays
    in the batch) against the same call eager; no new graphs beyond the module's, no graph break."""
    model, breaks = models[prior], graph_breaks()
    lockstep = Lockstep(model.dit)
    monkeypatch.setattr(model.dit, "forward_cached", lockstep)
    result = generate(model, PROMPTS, config(name), eos_id=-1, pad_id=0, seeds=SEEDS, max_new_tokens=BUDGETS, compile=True)
    assert [len(t) for t in result.tokens] == BUDGETS
    assert lockstep.compiled == [False] + [True] * (result.model_calls - 1)  # the prompt's call stays eager
    assert set(lockstep.batches) == {4}  # the finished row stayed: no new batch size, no new graph
    for i, (got, want) in enumerate(lockstep.pairs):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m: f"call {i}: {m}")
    assert graphs() <= 4 and graph_breaks() == breaks  # 3 at batch 4 (+1: test_greedy_tokens_equal_eager's batch 2)


def margins(logits: list[torch.Tensor], vocab: int) -> float:
    """The smallest top-2 margin among the tokens (the masked prior's [MASK] output is never chosen)."""
    top = torch.cat([x[..., :vocab].reshape(-1, vocab) for x in logits]).topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def recorded(model, monkeypatch, name: str, **kw):
    """(result, logits of every call) of a generation."""
    seen, real = [], model.dit.forward_cached

    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(model.dit, "forward_cached", call)
    result = generate(model, PROMPTS, config(name), eos_id=-1, pad_id=0, seeds=SEEDS, **kw)
    monkeypatch.undo()
    return result, seen


@pytest.mark.parametrize("prior", ["masked", "uniform"])
def test_greedy_tokens_equal_eager(models, first_run, monkeypatch, prior):
    """ar_greedy: compiled tokens == eager tokens, where the eager top-2 margins exceed float rounding
    by far (checked, so that the equality holds on any CPU); also with rows leaving the batch
    (2 of 4 finish: a batch of 2, compiled anew once)."""
    model = models[prior]
    eager, seen = recorded(model, monkeypatch, "ar_greedy", max_new_tokens=BUDGETS)
    assert margins(seen, model.config.vocab_size) > MARGIN
    compiled = generate(model, PROMPTS, config("ar_greedy"), eos_id=-1, pad_id=0, seeds=SEEDS, max_new_tokens=BUDGETS,
                        compile=True)
    assert compiled.tokens == eager.tokens
    budgets = [24, 5, 5, 24]
    eager, seen = recorded(model, monkeypatch, "ar_greedy", max_new_tokens=budgets)
    assert margins(seen, model.config.vocab_size) > MARGIN
    before = graphs()
    compiled = generate(model, PROMPTS, config("ar_greedy"), eos_id=-1, pad_id=0, seeds=SEEDS, max_new_tokens=budgets,
                        compile=True)
    assert compiled.tokens == eager.tokens and [len(t) for t in compiled.tokens] == budgets
    assert graphs() - before <= 1  # batch 2: the AR call's graph once, for both priors together


def test_a_second_generation_reuses_the_buffers_and_graphs(models, first_run):
    """The next generation of the same (batch, capacity) writes the same buffers (a CUDA graph keeps
    their addresses) and compiles nothing; the stale slots it finds are masked: same tokens."""
    model = models["masked"]
    run = lambda: generate(model, PROMPTS, config("eipc"), eos_id=-1, pad_id=0, seeds=SEEDS, compile=True)  # noqa: E731
    first = run()
    buffers = [t.data_ptr() for t in backbone._STATIC_CACHES[model.dit].keys]
    before = graphs()
    second = run()
    assert [t.data_ptr() for t in backbone._STATIC_CACHES[model.dit].keys] == buffers
    assert graphs() == before and second.tokens == first.tokens


def test_static_cache_drops_rows_like_the_default(models, monkeypatch):
    """Eager static shapes, rows leaving the batch (`KVCache.select` keeps the device offset): every
    call's logits match the default cache's."""
    model, budgets = models["uniform"], [24, 5, 9, 13]
    _, sliced = recorded(model, monkeypatch, "arpc", max_new_tokens=budgets)
    _, static = recorded(model, monkeypatch, "arpc", max_new_tokens=budgets, static_shapes=True)
    assert len(static) == len(sliced) and {x.shape[0] for x in static} == {1, 2, 3, 4}
    for a, b in zip(sliced, static):
        torch.testing.assert_close(a, b, **TOLERANCE)


@pytest.mark.parametrize("prompt_len, batches", [(20, {4}), (50, {4, 3})])
def test_a_finished_row_stays_only_where_it_fits(models, monkeypatch, prompt_len, batches):
    """compile=True keeps a finished row in the batch (3 of 4 still run) unless the blocks left would
    take its positions past the model's seq_len (64): 20 + 30 fits, 50 + 30 does not. The compiled
    function is swapped for the eager one here: this is the sampler's bookkeeping."""
    monkeypatch.setattr(backbone, "compiled_forward_static", lambda device_type: DiT.forward_static)
    model, seen = models["masked"], []
    real = model.dit.forward_cached
    monkeypatch.setattr(model.dit, "forward_cached", lambda tokens, *a, **k: seen.append(tokens.shape[0]) or real(tokens, *a, **k))
    prompts = [[1 + i % 30 for i in range(prompt_len)], [2], [3], [4]]
    result = generate(model, prompts, config("ar_greedy", 30), eos_id=-1, pad_id=0, seeds=SEEDS, max_new_tokens=[4, 30, 30, 30],
                      compile=True)
    assert [len(t) for t in result.tokens] == [4, 30, 30, 30] and set(seen) == batches


def test_compile_needs_the_cache(models):
    """compile=True is the cached path's option: without a cache, or with a sliced one, it says so."""
    with pytest.raises(ValueError, match="needs use_cache=True"):
        generate(models["masked"], PROMPTS, config("ancestral"), eos_id=-1, pad_id=0, use_cache=False, compile=True)
    with pytest.raises(ValueError, match="needs a static KVCache"):
        dit = models["masked"].dit
        layout = backbone.Layout(*(torch.zeros(1, 2, dtype=d) for d in (torch.long, torch.long, torch.bool, torch.bool)))
        dit.forward_cached(torch.zeros(1, 2, dtype=torch.long), layout, KVCache(), n_noisy=1, compiled=True)


def test_gpu_check_compares_graphs_on_a_gpu_only(models, first_run, tmp_path):
    """`blockgen gpu-check`'s generate stage: its eager-against-compiled helper (the GPU's; run here on
    a CPU, with this module's graphs) and its CPU mode, which times eager calls only and says so."""
    from dataclasses import replace

    from blockgen.harness.gpu_check import generate_stage
    from blockgen.harness.gpu_check.config import CPU_SCALE, GpuCheckConfig

    before = graphs()
    row = generate_stage._graph_run(models["masked"], PROMPTS, config("ar_greedy"), "cpu")
    assert graphs() == before and row["model_calls"] == 24 and 0 <= row["rows_same_tokens"] <= 4
    assert min(row["eager_ms_per_call"], row["compiled_ms_per_call"], row["speedup"], row["compile_seconds"]) > 0
    stage = generate_stage.stage_generate(GpuCheckConfig(device="cpu", generate_batches=(1,)), "cpu",
                                          replace(CPU_SCALE, new_tokens=4), tmp_path)
    assert stage["graphs"]["measured"] is False and "make gpu-check" in stage["graphs"]["why"]
    assert [r["sampler"] for r in stage["runs"]] == ["ar_greedy", "arpc", "ancestral"]
    assert all("error" not in r and r["ms_per_call"] > 0 for r in stage["runs"])


def test_inductor_writes_scalar_code_where_aten_has_no_simd(monkeypatch):
    """`ATEN_CPU_CAPABILITY=default`: inductor's vectorised C++ does not compile there (`at::vec` undeclared, torch 2.13),
    so CPU compiles ask for scalar code; with a SIMD capability inductor's choice stays. (Checked by hand: a compiled
    generation of this module's micro model under that variable failed before, 24 calls after.)"""
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor.cpp, "simdlen", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    backbone.fit_inductor_to_this_cpu()
    assert inductor.cpp.simdlen is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    backbone.fit_inductor_to_this_cpu()
    assert inductor.cpp.simdlen == 1
