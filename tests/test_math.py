"""The mathematics of BlockGen against independent, brute-force definitions."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from blockgen.models.attention import Layout, allowed, dense_mask, training_block_mask, training_layout
from blockgen.models.backbone import ModelShape
from blockgen.models.diffusion import LogLinearSchedule, MaskedPrior, UniformPrior
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.objectives import BlockMixture, jensen_bound, lse_bound, noisy_forward, stratified_indices

SCHEDULE = LogLinearSchedule()


def forward_matrix(prior, alpha: float) -> torch.Tensor:
    """Q[a, b] = q(z = b | x = a) for the forward process Cat(alpha x + (1 - alpha) pi)."""
    k = prior.model_vocab_size
    pi = torch.zeros(k, dtype=torch.float64)
    if isinstance(prior, MaskedPrior):
        pi[prior.mask_id] = 1.0
    else:
        pi[:] = 1.0 / k
    return alpha * torch.eye(k, dtype=torch.float64) + (1 - alpha) * pi[None]


@pytest.mark.parametrize("prior", [MaskedPrior(5), UniformPrior(5)], ids=["masked", "uniform"])
def test_posterior_equals_bayes(prior):
    """q(z_s | z_t, x) = q(z_s | x) q(z_t | z_s) / q(z_t | x), enumerated over a tiny vocabulary."""
    t, s = 0.7, 0.35
    a_t, a_s = 1 - (1 - 1e-3) * t, 1 - (1 - 1e-3) * s
    q_s = forward_matrix(prior, a_s)  # q(z_s | x)
    q_ts = forward_matrix(prior, a_t / a_s)  # q(z_t | z_s): the same family with alpha_{t|s}
    q_t = forward_matrix(prior, a_t)
    assert torch.allclose(q_s @ q_ts, q_t)  # the family is consistent
    for x in range(prior.vocab_size):  # x is never [MASK]
        for z_t in range(prior.model_vocab_size):
            if q_t[x, z_t] == 0:
                continue
            bayes = q_s[x] * q_ts[:, z_t] / q_t[x, z_t]
            x_onehot = F.one_hot(torch.tensor(x), prior.vocab_size).double()
            got = prior.posterior(torch.tensor(z_t), x_onehot, a_t, a_s)
            torch.testing.assert_close(got, bayes, rtol=1e-10, atol=1e-12)


def felbo_transcription(z_t: int, x_hat: list[float], alpha: float, d_alpha: float, x: int) -> float:
    """eq. supp:duo-felbo written out term by term, with alpha' = d alpha/dt, times -1."""
    v = len(x_hat)
    xbar = [v * alpha * (r == x) + (1 - alpha) for r in range(v)]
    xbar_t = [v * alpha * x_hat[r] + (1 - alpha) for r in range(v)]
    i = z_t
    bracket = v / xbar[i] - v / xbar_t[i]
    bracket -= sum(xbar[r] / xbar[i] * math.log(xbar_t[i] * xbar[r] / (xbar_t[r] * xbar[i])) for r in range(v))
    return -(-d_alpha / (v * alpha) * bracket)


def test_uniform_nelbo_matches_appendix_transcription():
    gen = torch.Generator().manual_seed(0)
    prior = UniformPrior(6)
    n = 200
    x = torch.randint(0, 6, (n,), generator=gen)
    t = torch.rand(n, generator=gen) * 0.98 + 0.01
    z = prior.noise(x, SCHEDULE.alpha(t), generator=gen)
    log_x_hat = (torch.randn(n, 6, generator=gen) * 2).log_softmax(-1)
    got = prior.nelbo(log_x_hat[:, None], x[:, None], z[:, None], t, SCHEDULE)[:, 0]
    want = [
        felbo_transcription(int(z[j]), log_x_hat[j].double().exp().tolist(), float(SCHEDULE.alpha(t[j])), -(1 - 1e-3), int(x[j]))
        for j in range(n)
    ]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert (got >= -1e-6).all(), "the NELBO integrand is a KL rate: never negative"


@pytest.mark.parametrize("prior", [MaskedPrior(7), UniformPrior(7)], ids=["masked", "uniform"])
def test_nelbo_is_continuous_time_kl_limit(prior):
    """The per-token NELBO equals lim_{s->t} KL(q(z_s|z_t,x) || p_theta(z_s|z_t)) / (t - s)."""
    gen = torch.Generator().manual_seed(1)
    n, dt = 300, 1e-6
    x = torch.randint(0, 7, (n,), generator=gen)
    t = torch.rand(n, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    z = prior.noise(x, SCHEDULE.alpha(t), generator=gen)
    log_x_hat = prior.denoiser_log_probs(torch.randn(n, prior.model_vocab_size, generator=gen) * 2, z)
    nelbo = prior.nelbo(log_x_hat, x, z, t, SCHEDULE).double()
    a_t, a_s = SCHEDULE.alpha(t)[:, None], SCHEDULE.alpha(t - dt)[:, None]
    q = prior.posterior(z, F.one_hot(x, 7).double(), a_t, a_s)
    p = prior.posterior(z, log_x_hat.double().exp()[:, :7], a_t, a_s)
    kl = torch.where(q > 0, q * (q.log() - p.log()), torch.zeros_like(q)).sum(-1) / dt
    torch.testing.assert_close(nelbo, kl, rtol=1e-3, atol=1e-3)


def brute_force_allowed(L: int, block: int, causal_clean: bool) -> torch.Tensor:
    """The training pattern of appendix B, written index by index."""
    n = 2 * L
    mask = torch.zeros(n, n, dtype=torch.bool)
    for qi, ki in itertools.product(range(n), range(n)):
        q_noisy, k_noisy = qi >= L, ki >= L
        qp, kp = qi % L, ki % L
        if q_noisy and k_noisy:
            ok = qp // block == kp // block  # bidirectional within the block
        elif q_noisy:
            ok = kp // block < qp // block  # clean tokens of strictly earlier blocks
        elif k_noisy:
            ok = False  # the clean stream never sees noise
        else:
            ok = kp <= qp if causal_clean else kp // block <= qp // block
        mask[qi, ki] = ok
    return mask


@pytest.mark.parametrize("L,block,causal_clean", [(L, b, c) for L in (4, 8, 12) for b in (1, 2, 4) if L % b == 0 for c in (True, False)])
def test_training_mask_matches_brute_force(L, block, causal_clean):
    layout = training_layout(L, block)
    assert torch.equal(dense_mask(layout, layout, causal_clean)[0, 0], brute_force_allowed(L, block, causal_clean))


def repaired_with_host_read(mask: torch.Tensor) -> torch.Tensor:
    """The empty-row repair as it was before issue 30 (`if empty.any()`: a host read, a graph break):
    an empty row (B, Nq, Nk) becomes its query's own key, the queries being the last Nq keys."""
    empty = ~mask.any(dim=-1, keepdim=True)
    if empty.any():
        n_q, n_k = mask.shape[-2:]
        diag = torch.zeros(n_q, n_k, dtype=torch.bool)
        diag[torch.arange(n_q), torch.arange(n_q) + n_k - n_q] = True
        mask = torch.where(empty, diag, mask)
    return mask


@pytest.mark.parametrize("causal_clean", [True, False])
@pytest.mark.parametrize("n_queries", [24, 8])  # the training layout; a cache-like call (the last keys)
def test_empty_row_repair_without_host_read_equals_the_old_one(causal_clean, n_queries):
    """dense_mask repairs empty rows with tensor ops only (no `if empty.any()`): the same mask as the old
    repair, on rows padded at the end, a row with no padding (no empty row), and an all-padding row."""
    L, block = 12, 4
    keys = training_layout(L, block).expand(4)
    valid = torch.arange(L)[None] < torch.tensor([[12], [7], [1], [0]])
    keys = replace(keys, valid=torch.cat([valid, valid], dim=1))
    queries = Layout(*(f[:, 2 * L - n_queries :] for f in keys._fields()))
    grid = allowed(queries.block_ids[:, :, None], queries.positions[:, :, None], queries.noisy[:, :, None],
                   keys.block_ids[:, None], keys.positions[:, None], keys.noisy[:, None], keys.valid[:, None], causal_clean)
    assert grid[0].any(-1).all() and not grid[1:].any(-1).all()  # sequence 0 (no padding): no empty row; the others: some
    assert torch.equal(dense_mask(queries, keys, causal_clean)[:, 0], repaired_with_host_read(grid))
    first = lambda layout: Layout(*(f[:1] for f in layout._fields()))  # noqa: E731 (the old code's branch not taken)
    assert torch.equal(dense_mask(first(queries), first(keys), causal_clean)[:, 0], repaired_with_host_read(grid[:1]))


@pytest.mark.parametrize("causal_clean", [True, False])
def test_flex_block_mask_matches_dense_mask(causal_clean):
    """The FlexAttention BlockMask (CUDA training) comes from the same rule as the SDPA mask."""
    L, block = 128, 16
    block_mask = training_block_mask(L, block, causal_clean, "cpu")
    layout = training_layout(L, block)
    dense = dense_mask(layout, layout, causal_clean)[0, 0]
    # BlockMask.to_dense() is block-granular; compare its mask_mod evaluated on the full grid.
    q, k = torch.meshgrid(torch.arange(2 * L), torch.arange(2 * L), indexing="ij")
    via_mod = block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q, k)
    assert torch.equal(via_mod, dense)
    # and the block-sparse structure skips no block that has an allowed entry
    coarse = block_mask.to_dense()[0, 0].bool()
    bs = block_mask.BLOCK_SIZE[0]
    needed = dense.view(2 * L // bs, bs, 2 * L // bs, bs).any(dim=(1, 3))
    assert torch.equal(coarse | ~needed, torch.ones_like(coarse))


def tiny_model(prior: str, sizes=(1, 4), weights=(0.5, 0.5), seed: int = 0) -> BlockGen:
    torch.manual_seed(seed)
    cfg = BlockGenConfig(
        vocab_size=11, seq_len=16, prior=prior, block_sizes=sizes, block_weights=weights,
        shape=ModelShape(n_layers=2, d_model=32, n_heads=4, cond_dim=16, dropout=0.0),
    )
    model = BlockGen(cfg)
    for p in model.parameters():  # DiT zero-inits its output; random weights make outputs non-trivial
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@pytest.mark.parametrize("prior", ["masked", "uniform"])
def test_block_size_one_is_autoregressive_nll(prior):
    """At L' = 1 the loss is the exact AR NLL, computed here by a plain causal pass on the same weights."""
    model = tiny_model(prior)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 11, (3, 16), generator=gen)
    with torch.no_grad():
        loss = noisy_forward(model.dit, model.prior, x, 1, torch.rand(3), SCHEDULE, generator=gen)
        for p in range(16):
            # [x_<p ; noise at p] through a causal mask: the noisy token carries no information
            noise = model.prior.fully_noised((3, 1))
            tokens = torch.cat([x[:, :p], noise], dim=1)
            positions = torch.arange(p + 1)[None].expand(3, -1)
            causal = torch.ones(p + 1, p + 1, dtype=torch.bool).tril()
            logits = model.dit._run(tokens, positions, causal, None, 0, 1)[:, 0]
            if prior == "masked":
                logits[:, model.prior.mask_id] = -torch.inf
            want = -logits.log_softmax(-1).gather(-1, x[:, p, None])[:, 0]
            torch.testing.assert_close(loss[:, p], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", [(0.05, 0.95), (0.3, 0.7), (0.2, 0.3, 0.5), (0.1, 0.1, 0.1, 0.7)])
@pytest.mark.parametrize("slots", [1, 2, 3, 8, 13])
def test_stratified_selection_counts(weights, slots):
    """Each block size gets floor or ceil of D * gamma_i slots, for any u."""
    for u in torch.linspace(0, 0.999, 37).tolist():
        chosen = stratified_indices(weights, slots, u)
        for i, w in enumerate(weights):
            assert math.floor(slots * w) <= chosen.count(i) <= math.ceil(slots * w)


def test_stratified_selection_is_unbiased():
    """Marginally, slot d picks component i with probability gamma_i (u uniform)."""
    weights = (0.2, 0.3, 0.5)
    grid = [(k + 0.5) / 1000 for k in range(1000)]
    counts = torch.zeros(3)
    for u in grid:
        counts[stratified_indices(weights, 1, u)[0]] += 1
    torch.testing.assert_close(counts / len(grid), torch.tensor(weights), atol=2e-3, rtol=0)


def test_block_mixture_validation():
    with pytest.raises(ValueError, match="sum to 1"):
        BlockMixture((1, 16), (0.5, 0.6))
    with pytest.raises(ValueError, match="distinct positive"):
        BlockMixture((4, 4), (0.5, 0.5))
    with pytest.raises(ValueError, match="do not divide"):
        BlockMixture((1, 16), (0.05, 0.95)).check_divides(24)


@pytest.mark.parametrize("prior", ["masked", "uniform"])
def test_lse_bound_dominates_jensen_and_is_reproducible(prior):
    model = tiny_model(prior, sizes=(1, 4, 8), weights=(0.2, 0.3, 0.5))
    x = torch.randint(0, 11, (5, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(5, 16)
    lse, jensen = model.nll_bounds(x, mask, k_mc=4, generator=torch.Generator().manual_seed(7))
    lse2, jensen2 = model.nll_bounds(x, mask, k_mc=4, generator=torch.Generator().manual_seed(7))
    lse3, _ = model.nll_bounds(x, mask, k_mc=4, generator=torch.Generator().manual_seed(8))
    assert (lse <= jensen + 1e-9).all()  # as NLLs: the log-sum-exp bound is the tighter one
    assert torch.equal(lse, lse2) and torch.equal(jensen, jensen2)
    assert not torch.equal(lse, lse3)


def test_lse_bound_formula():
    """-log sum gamma exp(-NLL), per sequence, and it lies between min NLL and the Jensen bound."""
    nll = torch.tensor([[3.0, 10.0], [5.0, 2.0]], dtype=torch.float64)  # (M=2 block sizes, B=2)
    w = (0.25, 0.75)
    want = torch.tensor([-math.log(0.25 * math.exp(-3) + 0.75 * math.exp(-5)), -math.log(0.25 * math.exp(-10) + 0.75 * math.exp(-2))])
    torch.testing.assert_close(lse_bound(nll, w), want.double())
    torch.testing.assert_close(jensen_bound(nll, w), torch.tensor([4.5, 4.0], dtype=torch.float64))
    assert (lse_bound(nll, w) >= nll.min(0).values).all()


def test_pure_ar_bound_is_exact_and_draw_independent():
    model = tiny_model("masked", sizes=(1,), weights=(1.0,))
    x = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(0))
    a, _ = model.nll_bounds(x, torch.ones(2, 16), k_mc=8, generator=torch.Generator().manual_seed(1))
    b, _ = model.nll_bounds(x, torch.ones(2, 16), k_mc=3, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(a, b)


def test_masked_ids_never_collide():
    prior = MaskedPrior(50257)
    assert prior.mask_id == 50257 and prior.model_vocab_size == 50258
    x = torch.randint(0, 50257, (4, 32))
    z = prior.noise(x, torch.full((4, 1), 0.5))
    assert ((z == x) | (z == prior.mask_id)).all()


def test_condition_mask_keeps_prompt_clean_and_lossless():
    model = tiny_model("masked", sizes=(4,), weights=(1.0,))
    x = torch.randint(0, 11, (2, 16))
    cond = torch.zeros(2, 16, dtype=torch.bool)
    cond[:, :6] = True
    loss = noisy_forward(model.dit, model.prior, x, 4, torch.ones(2), SCHEDULE, condition_mask=cond)
    assert (loss[:, :6] == 0).all() and (loss[:, 6:] > 0).all()
