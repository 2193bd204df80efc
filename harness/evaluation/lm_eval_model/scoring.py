"""Scoring windows with the paper's log-sum-exp mixture bound (appendix C): a request's tokens cut into
windows of at most ``seq_len`` tokens (`windows`), each window's bound over the checkpoint's block sizes
with its K_MC draws linearised for the Monte Carlo error (`score_windows`), and the seeds that make a
score independent of the batch it ran in (`derive_seed`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import torch
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from blockgen.harness.evaluation.lm_eval_model.mc_error import WindowScore
from blockgen.models.diffusion import RowStreams
from blockgen.models.model import BlockGen
from blockgen.models.objectives import jensen_bound, lse_bound


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from the run's seed and a request's content (JSON-serialisable parts)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


class Window(NamedTuple):
    """One scored sequence: `tokens[:n_context]` stay clean, `tokens[n_context:]` are scored."""

    tokens: tuple[int, ...]
    n_context: int


def windows(context: list[int], target: list[int], seq_len: int) -> list[Window]:
    """Windows of at most seq_len tokens that score every target token exactly once.

    A target shorter than seq_len is scored in one window behind as much context as fits (at least
    one token); a longer one in lm-eval's disjoint rolling windows, each conditioned on the tokens
    before it in the window.
    """
    if not target:
        return []
    if len(target) < seq_len:
        tokens = (context + target)[-seq_len:]
        return [Window(tuple(tokens), len(tokens) - len(target))]
    rolling = get_rolling_token_windows(target, prefix_token=context[-1], max_seq_len=seq_len - 1, context_len=1)
    return [Window(tuple(ctx + pred), len(ctx)) for ctx, pred in map(make_disjoint_window, rolling)]


class _KeepARLogits:
    """The denoiser, remembering the logits of its last block-size-1 (AR) call, for is_greedy."""

    def __init__(self, dit) -> None:
        self._dit = dit
        self.ar_logits: torch.Tensor | None = None

    def forward_train(self, x0, xt, block_size: int, valid=None) -> torch.Tensor:
        logits = self._dit.forward_train(x0, xt, block_size, valid)
        if block_size == 1:
            self.ar_logits = logits
        return logits


@torch.no_grad()
def score_windows(model: BlockGen, batch: list[Window], seeds: list[int], k_mc: int, pad_id: int,
                  batch_invariant: bool = False) -> list[WindowScore]:
    """The bounds of a batch of windows; each window's result is that of the window scored alone.

    Each window runs at its own length (the batch is padded, the padding invisible: `valid`) and
    draws from its own `RowStreams` row (keyed by position, so padding changes no draw): `BlockGen.nll_bounds` on the unpadded window
    with that generator gives the same numbers, up to float rounding that depends on the batch's
    shapes (~1e-7 relative). `batch_invariant=True` scores each window as a batch of one, unpadded:
    the same numbers bit for bit whatever the batch.
    """
    if batch_invariant and len(batch) > 1:
        return [score_windows(model, [w], [s], k_mc, pad_id)[0] for w, s in zip(batch, seeds)]
    device = next(model.parameters()).device
    sizes, weights = model.mixture.sizes, model.mixture.weights
    width = max(len(w.tokens) for w in batch)
    x = torch.full((len(batch), width), pad_id, dtype=torch.long)
    valid = torch.zeros_like(x, dtype=torch.bool)
    condition = torch.zeros_like(valid)
    scored = torch.zeros_like(valid)
    for j, w in enumerate(batch):
        x[j, : len(w.tokens)] = torch.tensor(w.tokens)
        valid[j, : len(w.tokens)] = True
        condition[j, : w.n_context] = True
        scored[j, w.n_context : len(w.tokens)] = True
    x, valid, condition, scored = x.to(device), valid.to(device), condition.to(device), scored.to(device)
    generators = RowStreams(seeds)
    dit = _KeepARLogits(model.dit)
    # per size (K_i, B), K_i = 1 at block size 1 (exact); the model picks its family's bound
    draws = [model.sequence_nll_draws(x, scored, size, k_mc, condition, generators, valid, net=dit) for size in sizes]
    nll = torch.stack([d.mean(0) for d in draws])
    lse, jensen = lse_bound(nll, weights), jensen_bound(nll, weights)
    log_w = torch.log(torch.tensor(weights, dtype=torch.float64, device=device))[:, None]
    posterior = torch.softmax(log_w - nll, dim=0)  # d lse / d NLL_i
    # exact sizes (one draw at block size 1) carry no MC error: no terms
    terms = [[tuple((posterior[i, j] * d[:, j]).tolist()) if size > 1 else () for i, (size, d) in enumerate(zip(sizes, draws))]
             for j in range(len(batch))]
    if dit.ar_logits is not None:
        argmax = dit.ar_logits[..., : model.prior.vocab_size].argmax(-1)  # real vocabulary only
        greedy = ((argmax == x) | ~scored).all(-1).tolist()
    else:
        greedy = [False] * len(batch)
    return [WindowScore(a, b, g, tuple(t)) for a, b, g, t in zip(lse.tolist(), jensen.tolist(), greedy, terms)]
