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
from blockgen.models.backbone import INVARIANT_WIDTH
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


def bucket_width(length: int, max_len: int) -> int:
    """Row-invariant scoring pads a window to the next multiple of `INVARIANT_WIDTH` tokens (at most the model's
    length), so that it has the same width alone and in any batch; windows of one width run together."""
    return min(-(-length // INVARIANT_WIDTH) * INVARIANT_WIDTH, max(max_len, length))


@torch.no_grad()
def score_windows(model: BlockGen, batch: list[Window], seeds: list[int], k_mc: int, pad_id: int,
                  batch_invariant: bool = False) -> list[WindowScore]:
    """The bounds of a batch of windows; each window's result is that of the window scored alone.

    Each window draws from its own `RowStreams` row (keyed by position, so padding changes no draw) and its padding
    is invisible (`valid`). Batched (`batch_invariant=False`, the fastest), the batch is padded to its longest window:
    `BlockGen.nll_bounds` on the unpadded window with that generator gives the same numbers up to float rounding that
    depends on the batch's shapes (~1e-7 relative). `batch_invariant=True` groups the windows by `bucket_width` and
    runs each group padded to its width in the network's row-invariant mode (`DiT.row_invariant`): a window's bounds are
    then the same bit for bit alone, in any batch and in any order.
    """
    if batch_invariant:
        groups: dict[int, list[int]] = {}
        for j, w in enumerate(batch):
            groups.setdefault(bucket_width(len(w.tokens), model.config.seq_len), []).append(j)
        out: list[WindowScore | None] = [None] * len(batch)
        with model.dit.row_invariant():
            for width, rows in groups.items():
                scores = _score_padded(model, [batch[j] for j in rows], [seeds[j] for j in rows], k_mc, pad_id, width)
                for j, score in zip(rows, scores):
                    out[j] = score
        return out
    return _score_padded(model, batch, seeds, k_mc, pad_id, max(len(w.tokens) for w in batch))


def _score_padded(model: BlockGen, batch: list[Window], seeds: list[int], k_mc: int, pad_id: int,
                  width: int) -> list[WindowScore]:
    device = next(model.parameters()).device
    sizes, weights = model.mixture.sizes, model.mixture.weights
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
    log_w = torch.log(torch.tensor(weights, dtype=torch.float64, device=device))[:, None]
    bounds, terms = [], []
    # Window by window, each from its own contiguous copy of its draws: a reduction across the columns of (K, B) and
    # exp or log on a (M, B) tensor round a window's numbers by its column (vector lanes, the vector remainder).
    for j in range(len(batch)):
        column = torch.stack([d[:, j].contiguous().mean() for d in draws])[:, None]  # (M, 1): each size's NLL
        bounds.append((lse_bound(column, weights).item(), jensen_bound(column, weights).item()))
        posterior = torch.softmax(log_w - column, dim=0)[:, 0]  # d lse / d NLL_i
        # exact sizes (one draw at block size 1) carry no MC error: no terms
        terms.append([tuple((posterior[i] * d[:, j]).tolist()) if size > 1 else () for i, (size, d) in enumerate(zip(sizes, draws))])
    if dit.ar_logits is not None:
        argmax = dit.ar_logits[..., : model.prior.vocab_size].argmax(-1)  # real vocabulary only
        greedy = ((argmax == x) | ~scored).all(-1).tolist()
    else:
        greedy = [False] * len(batch)
    return [WindowScore(a, b, g, tuple(t)) for (a, b), g, t in zip(bounds, greedy, terms)]
