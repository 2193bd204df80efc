"""Bitwise batch invariance at batched speed (models/backbone.py `DiT.row_invariant`, `fixed_shape_linear`): a row's
numbers are the same bit for bit alone, in one batch, in reversed order and in batches of 1, 7 and 16, on model
shapes no other test uses, with 1 and 2 threads and under ATEN_CPU_CAPABILITY=avx2 and =default (each such run in a
subprocess: the capability is read once, at torch's import; MKL_ENABLE_INSTRUCTIONS=AVX2 or SSE4_2 beside it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from blockgen.models.backbone import ModelShape, fixed_shape_linear

# Shapes of no other test (and none of SIZES): odd head counts, widths off the powers of two, a long window.
SHAPES = {"narrow": ModelShape(n_layers=2, d_model=48, n_heads=3, cond_dim=24, dropout=0.0),
          "wide": ModelShape(n_layers=3, d_model=160, n_heads=5, cond_dim=40, dropout=0.0)}
VOCAB, SEQ_LEN = 57, 160
LENGTHS = (5, 17, 33, 64, 65, 90, 128, 3, 41, 160, 12, 77, 100)  # 13 windows, on and off the 32-token buckets

# ATen's scalar kernels (no vector remainder anywhere) and MKL's SSE4.2 GEMMs: a CPU without AVX
DEFAULT_KERNELS = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def kernel_and_thread_settings(*extra: dict[str, str]) -> list:
    """Environments of a subprocess: two threads, and one or two on MKL's AVX2 GEMMs, and ATen without SIMD. Only the
    two-thread ones hold the machine alone: beside another test their OpenMP threads oversubscribe 2 cores (5x slower,
    measured); a one-thread run shares it like any test."""
    settings = [*extra, {"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2", **AVX2}, {"OMP_NUM_THREADS": "1", **AVX2}, DEFAULT_KERNELS]
    return [pytest.param(env, id="-".join(env.values()), marks=[pytest.mark.whole_machine] if env["OMP_NUM_THREADS"] == "2" else [])
            for env in settings]

# Scores of the 13 windows under every batching, for one model; prints whether each equals the alone run bit for bit.
CHECK = """
import json, sys, torch
from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows
from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig
shape, prior, architecture = sys.argv[1], sys.argv[2], sys.argv[3]
shapes = %s
kind = {"blockgen": dict(block_sizes=(1, 16), block_weights=(0.3, 0.7)), "ar": dict(block_sizes=(1,), block_weights=(1.0,)),
        "full_sequence": dict(block_sizes=(%d,), block_weights=(1.0,))}[architecture]
config = BlockGenConfig(vocab_size=%d, seq_len=%d, prior=prior, shape=ModelShape(**shapes[shape]), architecture=architecture, **kind)
torch.manual_seed(0)
model = BlockGen(config).eval()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.3)
g = torch.Generator().manual_seed(1)
lengths = %s
windows = [Window(tuple(torch.randint(0, %d, (n,), generator=g).tolist()), max(1, n // 3)) for n in lengths]
seeds = list(range(100, 100 + len(windows)))
def run(order, size):
    out = {}
    for i in range(0, len(order), size):
        rows = order[i : i + size]
        for j, s in zip(rows, score_windows(model, [windows[j] for j in rows], [seeds[j] for j in rows], 3, 0, batch_invariant=True)):
            out[j] = s
    return [out[j] for j in range(len(windows))]
n = len(windows)
alone = run(list(range(n)), 1)
runs = {"batch": run(list(range(n)), n), "reversed": run(list(reversed(range(n))), n), "7": run(list(range(n)), 7),
        "16": run(list(range(n)), 16), "shuffled 7": run([5, 2, 12, 0, 9, 1, 7, 3, 11, 4, 8, 6, 10], 7)}
plain = score_windows(model, windows, seeds, 3, 0)
print(json.dumps({"equal": {k: v == alone for k, v in runs.items()},
                  "vs_plain": max(abs(a.lse - b.lse) / abs(b.lse) for a, b in zip(alone, plain))}))
""" % ({k: v.__dict__ for k, v in SHAPES.items()}, SEQ_LEN, VOCAB, SEQ_LEN, list(LENGTHS), VOCAB)


def _check(shape: str, prior: str, architecture: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHECK, shape, prior, architecture], capture_output=True, text=True,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("kept_transpose", [False, True], ids=["view", "kept"])
@pytest.mark.parametrize("rows", [8, 64])
@pytest.mark.parametrize("k, n", [(48, 144), (160, 640), (640, 160), (1024, 256)])
def test_a_fixed_shape_linear_row_does_not_depend_on_the_other_rows(k, n, rows, kept_transpose):
    """Alone (one chunk, run as two) and among 1-690 rows (1-87 chunks), with the weight's transpose as a view or
    kept contiguous (`DiT.row_invariant` keeps one)."""
    torch.manual_seed(k + n)
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(700, k)
    weight_t = weight.t().contiguous() if kept_transpose else None
    for start in (0, 1, 5):  # the row at the start of a chunk, and further in
        alone = fixed_shape_linear(x[start : start + 1], weight, bias, rows, weight_t)[0]
        for m in (1, 2, rows - 1, rows, rows + 1, 3 * rows + 5, 690):
            rows_before = min(start, 3)
            batch = fixed_shape_linear(x[start - rows_before : start + m], weight, bias, rows, weight_t)
            assert torch.equal(batch[rows_before], alone), (start, m)
    torch.testing.assert_close(fixed_shape_linear(x, weight, bias, rows, weight_t), F.linear(x, weight, bias),
                               rtol=1e-5, atol=2e-4)


def _left_padded_attention(lengths: list[int], n: int, heads: int = 3, d: int = 16, slots: int = 256, seed: int = 0):
    """Query (B, H, n, D), keys and values as views of (B, H, slots, D) buffers, and the mask (B, 1, n, S) of rows of
    the given key counts left-padded to the longest: each row's last n keys are its queries, causal over its keys."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    q = torch.randn(b, heads, n, d, generator=g)
    keys, values = torch.randn(b, heads, slots, d, generator=g), torch.randn(b, heads, slots, d, generator=g)
    mask = torch.zeros(b, 1, n, s, dtype=torch.bool)
    for i, length in enumerate(lengths):
        for j in range(n):
            mask[i, 0, j, s - length : s - n + j + 1] = True
    return q, keys[:, :, :s], values[:, :, :s], mask


@pytest.mark.parametrize("attention", ["per_span_attention", "chunked_attention"])
@pytest.mark.parametrize("lengths, n", [([70, 20, 150], 16), ([250, 300, 200, 320], 200)])
def test_row_invariant_attention_is_sdpa_and_a_row_alone_in_any_batch(attention, lengths, n):
    """Both invariant attentions (the CPU's in float32, `per_span_attention`, and the fixed-shape products,
    `chunked_attention`) against SDPA (float rounding apart), and each row bit for bit the same alone (its own keys
    only, as a batch of one) as in the batch, where the longer rows add key chunks and left padding the row lacks
    alone: rows of 1 to 5 chunks of 64 keys (a row at least as long as its queries), their spans out of order (the per-span path sorts the rows), and 16
    queries (one query chunk) or 200 (past `FLASH_QUERY_CALL`: several calls)."""
    from blockgen.models import backbone
    from blockgen.models.backbone import InvariantKeys, RowInvariance

    attend = getattr(backbone, attention)
    q, k, v, mask = _left_padded_attention(lengths, n, slots=320)
    together = attend(q, k, v, InvariantKeys.of(mask, RowInvariance(16)))
    reference = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask)
    torch.testing.assert_close(together, reference, rtol=1e-5, atol=1e-5)
    s = max(lengths)
    for i, length in enumerate(lengths):
        own = slice(s - length, s)
        alone = attend(q[i : i + 1], k[i : i + 1, :, own], v[i : i + 1, :, own],
                       InvariantKeys.of(mask[i : i + 1, :, :, own], RowInvariance(16)))
        assert torch.equal(alone[0], together[i]), i
    # the query chunk: 4 rows at a time give the same numbers for a row as 16 (only the chunks' shapes differ)
    four = attend(q, k, v, InvariantKeys.of(mask, RowInvariance(4)))
    torch.testing.assert_close(four, together, rtol=1e-5, atol=1e-5)


def test_the_keys_order_is_reused_for_an_equal_mask_and_recomputed_for_another():
    """`RowInvariance.keys_of` (a sampler's steps within a block share their mask): an equal mask in a new tensor
    gets the previous call's order, which is bit for bit `InvariantKeys.of`'s; another mask gets its own."""
    from blockgen.models.backbone import InvariantKeys, RowInvariance

    _, _, _, mask = _left_padded_attention([70, 20, 150], 16)
    mode = RowInvariance(16)
    first = mode.keys_of(mask)
    assert mode.keys_of(mask.clone()) is first
    fresh = InvariantKeys.of(mask, RowInvariance(16))
    assert torch.equal(first.order, fresh.order) and torch.equal(first.allowed, fresh.allowed)
    other = mask.clone()
    other[0, 0, -1, -1] = False  # one query no longer sees its own key
    changed = mode.keys_of(other)
    assert changed is not first and not torch.equal(changed.allowed, first.allowed)
    assert mode.keys_of(mask[:2]) is not changed  # another batch: another shape


def test_the_gpu_grouping_of_products_keeps_a_row_invariant(monkeypatch):
    """What `INVARIANT_MATRIX_GROUP` does on CUDA, run here on the CPU's kernels (groups of 3: every count pads):
    each product of a batch equals its product alone, shared and per-matrix operands alike, and texts stay bit for
    bit the same in any batch."""
    from blockgen.models import backbone

    monkeypatch.setitem(backbone.INVARIANT_MATRIX_GROUP, "cpu", 3)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 8, 32, generator=g), torch.randn(7, 40, 32, generator=g).transpose(1, 2)
    weight_t = torch.randn(32, 24, generator=g)
    for count in range(1, 8):
        per_matrix = backbone.invariant_bmm(a[:count], b[:count])
        with_shared = backbone.invariant_bmm(a[:count], backbone.shared(weight_t, count))
        for i in range(count):
            assert torch.equal(per_matrix[i], backbone.invariant_bmm(a[i : i + 1], b[i : i + 1])[0]), (count, i)
            assert torch.equal(with_shared[i], backbone.invariant_bmm(a[i : i + 1], backbone.shared(weight_t, 1))[0])
    assert texts_in_every_batching("ancestral", "masked")


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_likelihood_bounds_are_bitwise_the_same_in_any_batch(shape, prior):
    """13 windows of mixed lengths, a mixture of block sizes 1 and 16: alone == one batch == reversed == batches of 7
    and 16 == a shuffled order, bit for bit; and within float rounding of the plain batched path."""
    result = _check(shape, prior, "blockgen")
    assert all(result["equal"].values()), result
    assert result["vs_plain"] < 1e-5, result


@pytest.mark.parametrize("architecture", ["ar", "full_sequence"])
def test_the_baselines_likelihoods_are_bitwise_the_same_in_any_batch(architecture):
    result = _check("narrow", "masked", architecture)
    assert all(result["equal"].values()), result


@pytest.mark.parametrize("env", kernel_and_thread_settings({"OMP_NUM_THREADS": "1"}))
def test_invariance_holds_on_either_kernel_and_thread_count(env):
    result = _check("narrow", "uniform", "blockgen", **env)
    assert all(result["equal"].values()), (env, result)


@pytest.mark.parametrize("prior", ["masked", "uniform"])
def test_many_short_windows_with_many_draws_are_bitwise_the_same_alone(prior):
    """16 short windows (4-11 tokens, one width bucket) at K_MC = 8, six draws of them: each window's bounds and MC
    terms alone equal those in the batch (the mean over draws and the bounds were once taken across the batch's
    columns, which rounds by a window's column)."""
    from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows

    model = _random_model(prior)
    for trial in range(6):
        g = torch.Generator().manual_seed(trial)
        lengths = torch.randint(4, 12, (16,), generator=g).tolist()
        windows = [Window(tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist()), n - 1) for n in lengths]
        seeds = torch.randint(0, 2**62, (16,), generator=g).tolist()
        together = score_windows(model, windows, seeds, 8, 0, batch_invariant=True)
        alone = [score_windows(model, [w], [s], 8, 0, batch_invariant=True)[0] for w, s in zip(windows, seeds)]
        assert together == alone, trial


def _random_model(prior: str, vocab: int = VOCAB, shape: str = "narrow"):
    from blockgen.models.model import BlockGen, BlockGenConfig

    config = BlockGenConfig(vocab_size=vocab, seq_len=SEQ_LEN, prior=prior, shape=SHAPES[shape], block_sizes=(1, 16),
                            block_weights=(0.3, 0.7))
    torch.manual_seed(0)
    model = BlockGen(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


PROMPT_LENGTHS = (5, 17, 33, 40, 16, 21, 3, 9, 48, 12, 30, 7, 1)  # 13 requests, on and off the 16-token grid


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _sampler_names() -> list[str]:
    from blockgen.models import samplers

    return list(samplers.names())


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("name", _sampler_names())
def test_texts_are_bitwise_the_same_in_any_batch(name, prior):
    """Every registered sampler, both priors, 13 prompts of mixed lengths with mixed budgets: each text alone equals
    it in one batch, in reversed order and in batches of 7 and 16 (`generate(batch_invariant=True)`, the batch in the
    row-invariant mode)."""
    assert texts_in_every_batching(name, prior)


@pytest.mark.parametrize("env", kernel_and_thread_settings())
def test_texts_are_invariant_on_either_kernel_and_thread_count(env):
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import test_row_invariant as t\n"
              "print([t.texts_in_every_batching(n, p) for n, p in (('arpc', 'uniform'), ('ancestral', 'masked'), ('ar_sample', 'masked'))])")
    done = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], capture_output=True, text=True,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["[True,", "True,", "True]"], (env, done.stdout)


def texts_in_every_batching(name: str, prior: str) -> bool:
    """Whether the 13 texts alone equal those in one batch, in reversed order and in batches of 7 and 16."""
    from blockgen.models.sampler_config import SamplerConfig
    from blockgen.models.sampling import generate

    model, prompts = _random_model(prior), _prompts(VOCAB)
    config = SamplerConfig(name, steps=4, ge=2, max_new_tokens=64, temperature=0.9)
    seeds, budgets = list(range(200, 213)), [20 + 3 * i for i in range(13)]

    def texts(order: list[int], size: int) -> list[list[int]]:
        out = {}
        for i in range(0, len(order), size):
            rows = order[i : i + size]
            result = generate(model, [prompts[j] for j in rows], config, -1, 0, seeds=[seeds[j] for j in rows],
                              max_new_tokens=[budgets[j] for j in rows], batch_invariant=True)
            out.update(zip(rows, result.tokens))
        return [out[j] for j in range(len(prompts))]

    alone = texts(list(range(13)), 1)
    return all(texts(order, size) == alone for order, size in ((list(range(13)), 13), (list(reversed(range(13))), 13),
                                                               (list(range(13)), 7), (list(range(13)), 16)))


@pytest.mark.parametrize("name, prior", [("ancestral", "masked"), ("arpc", "uniform"), ("ar_greedy", "masked")])
def test_static_shapes_give_the_same_texts_in_the_row_invariant_mode(name, prior):
    """`static_shapes=True` attends to the whole preallocated cache (unwritten slots masked) where the default
    attends to the written slots: in the row-invariant mode a call attends to its rows' own keys either way, so the
    13 texts, alone and in one batch, are those of the default bit for bit."""
    from blockgen.models.sampler_config import SamplerConfig
    from blockgen.models.sampling import generate

    model, prompts = _random_model(prior), _prompts(VOCAB)
    config = SamplerConfig(name, steps=4, ge=2, max_new_tokens=64, temperature=0.9)
    seeds, budgets = list(range(200, 213)), [20 + 3 * i for i in range(13)]

    def texts(rows: list[int], static: bool) -> list[list[int]]:
        return generate(model, [prompts[j] for j in rows], config, -1, 0, seeds=[seeds[j] for j in rows],
                        max_new_tokens=[budgets[j] for j in rows], batch_invariant=True, static_shapes=static).tokens

    alone = [texts([j], False)[0] for j in range(13)]
    assert texts(list(range(13)), True) == alone
    assert [texts([j], True)[0] for j in range(13)] == alone


@pytest.mark.parametrize("prior", ["masked", "uniform"])
@pytest.mark.parametrize("name", ["arpc", "ar_sample", "low_confidence"])
def test_every_logit_of_a_row_is_bitwise_the_same_alone_and_in_a_batch(name, prior):
    """The sensitive check under the texts: the logits of every model call of rows 0, 6 and 12, alone and in the batch
    of 13 (equal budgets in whole blocks and no EOS, so the rows keep their places), equal bit for bit; the plain batched path's
    differ for one of them at least (so the comparison can see a difference)."""
    from blockgen.models.sampler_config import SamplerConfig
    from blockgen.models.sampling import generate

    model, prompts = _random_model(prior, vocab=500, shape="wide"), _prompts(500)
    # whole blocks after each prompt: every row needs the same blocks, none leaves the batch before the others
    config = SamplerConfig(name, steps=4, ge=2, max_new_tokens=40, temperature=0.9, layout="prompt_end")
    calls: list[torch.Tensor] = []
    forward = model.dit.forward_cached

    def recorded(*args, **kwargs):
        logits = forward(*args, **kwargs)
        calls.append(logits.detach().clone())
        return logits

    model.dit.forward_cached = recorded

    def logits(rows: list[int], invariant: bool = True) -> list[torch.Tensor]:
        calls.clear()
        generate(model, [prompts[j] for j in rows], config, -1, 0, seeds=[200 + j for j in rows], batch_invariant=invariant)
        return list(calls)

    together, plain = logits(list(range(13))), logits(list(range(13)), invariant=False)
    for j in (0, 6, 12):
        alone = logits([j])
        assert len(alone) == len(together)
        assert all(torch.equal(a[0], b[j]) for a, b in zip(alone, together)), j
    moved = [j for j in range(13) if not all(torch.equal(a[j], b[j]) for a, b in zip(together, plain))]
    print("moved", moved)
    assert moved


def test_every_logit_stays_the_same_alone_and_in_a_batch_on_mkl_avx2_gemms():
    """The logits check above under MKL's AVX2 GEMMs (what an AVX2-only CPU runs), where a token's result depends on
    its place in a chunk of rows: a prompt call (rows of different widths) and AR decoding's 2-token calls."""
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import test_row_invariant as t\n"
              "for n, p in (('arpc', 'masked'), ('ar_sample', 'uniform')):\n"
              "    t.test_every_logit_of_a_row_is_bitwise_the_same_alone_and_in_a_batch(n, p)\n"
              "print('equal')")
    env = {"OMP_NUM_THREADS": "2", **AVX2}
    done = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], capture_output=True, text=True,
                          env={**os.environ, **env})
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["equal"], done.stderr[-3000:]


def test_bfloat16_autocast_keeps_texts_and_likelihoods_bitwise_the_same():
    """Under bfloat16 autocast (the adapter's `dtype=bfloat16`: the matrix products in bf16) a row's text and
    likelihood bounds are still those it gets alone, bit for bit (13 prompts, 13 windows)."""
    from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows
    from blockgen.models.sampler_config import SamplerConfig
    from blockgen.models.sampling import generate

    model, prompts = _random_model("masked"), _prompts(VOCAB)
    config = SamplerConfig("ancestral", steps=4, max_new_tokens=40, temperature=0.9)
    g = torch.Generator().manual_seed(1)
    windows = [Window(tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist()), max(1, n // 3)) for n in LENGTHS]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        alone = [generate(model, [p], config, -1, 0, seeds=[j], batch_invariant=True).tokens[0] for j, p in enumerate(prompts)]
        assert generate(model, prompts, config, -1, 0, seeds=list(range(13)), batch_invariant=True).tokens == alone
        scored = [score_windows(model, [w], [j], 3, 0, batch_invariant=True)[0] for j, w in enumerate(windows)]
        assert score_windows(model, windows, list(range(13)), 3, 0, batch_invariant=True) == scored
