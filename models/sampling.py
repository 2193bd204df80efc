"""Samplers: block-by-block generation with a KV cache (paper section 3.3, appendix "Algorithms").

Generation runs left to right, one block of L' tokens at a time. The keys and values of committed
clean tokens (prompt, finished blocks) are computed once, through `DiT.forward_cached(..., n_commit)`,
and reused by every later call. With a token-causal clean stream (`causal_clean=True`) the same cache
serves the diffusion passes (block size L') and the AR verifier (block size 1).

Where the blocks sit (`SamplerConfig.layout`). Positions of a row start at 0 at its first real token
(prompts are left-padded; padding is `valid=False`).
- `grid` (default): blocks sit at multiples of L' from position 0, as in training and in the
  likelihood path. A prompt of length P commits its first P - (P mod L') tokens; its last
  P mod L' tokens (the tail, per row) sit clean at the start of the first noisy block, exactly as
  training's `condition_mask` keeps a question clean in the noisy stream: the tail is pinned after
  every step, never selected for re-noising, never returned as generated, and the first block
  generates only L' - (P mod L') tokens. A prompt of length P can therefore receive up to
  seq_len - P tokens. The tail lives only in the noisy block (and, for ARPC, the proposal), never
  also in the cache, so no key appears twice; the whole block, tail included, is committed after.
- `prompt_end`: a full block of L' noisy tokens starts right after the prompt (the layout of
  earlier versions); the prompt is committed whole and generation needs whole blocks of room.
For prompts whose length is a multiple of L' (and for the AR samplers) the two coincide.

Samplers (`SamplerConfig.name`):
- `ancestral`: N_step reverse steps per block, z_s ~ q_{s|t}(. | z_t, x_hat) with the denoiser's
  distribution plugged into the prior's posterior; t_i = (N-i)/N, s = (N-i-1)/N, restarting every
  block; alpha_t = 1 - (1 - eps) t and alpha_s = 1 exactly at s = 0, so the last step leaves a clean
  block (masked: no [MASK] left).
- `eipc` / `arpc` (Algorithms 2 and 3): `warmup` ancestral steps, then an informed step at the first
  non-warmup step and every `ge` steps after. An informed step draws a clean proposal
  x~ ~ q_{0|t}(. | z_t, x_hat), scores each token (EIPC: negative entropy of x_hat; ARPC: AR
  log-likelihood from one extra call at block size 1), and re-noises ALL of the k lowest-scoring
  positions with a draw from the prior ([MASK] for masked, a fresh uniform token for uniform),
  z = x~ elsewhere; see `_informed_step` for why the printed line of the algorithms reads otherwise.
  k = max(1, round((1 - alpha_s) n)) with n the positions the block generates (L'; fewer in a grid
  layout's first block), and k = 0 at the last step (s = 0), as in the authors' implementation:
  at any s > 0 the block keeps at least one noisy token, so the corrector never ends a block early.
  The scores use the tempered distributions, rounded to a grid of 2^-13 (`SCORE_GRID`) before
  ranking; ties go to the lower position.
- `ar_greedy` / `ar_sample`: autoregression at block size 1, one token per model call.
Temperature divides the logits before normalisation, for diffusion and AR passes alike (greedy AR
ignores it). Categorical draws are float64 (`sample_categorical`).

Randomness. Row i of a batch draws everything (prior samples, posterior draws, proposals,
re-noising) from its own counter-based stream (`diffusion.RowStreams`), seeded `seeds[i]` when `generate`
is given `seeds`, else `config.seed + i`. With `seeds` and `batch_invariant=True`, a row's text is
bit for bit the same alone or in any batch: the network runs in its row-invariant mode, where no
kernel sees a shape or a layout that depends on the other rows. Batched (`batch_invariant=False`), float
rounding that depends on the batch shape (~1e-7 in the logits) can still change a row: a uniform
landing that close to a boundary of an inverse-CDF draw, or two informed-step scores that close to
each other at the cut (measured on random micro models: 2 of 1,024 row samples differed).

Layout of the calls (see `attention.allowed`). Block ids are positions, in a way that reproduces
the training layout: a noisy block starting at position p has block id p (so it sees every clean
token before p and its own block); a committed clean token has block id = its position
(token-causal models) or = the start of its block (block-causal models; the prompt is cut into
blocks of L' from its first token, as in training). The AR pass at block size 1 runs
`[proposal x~ (clean, not committed) ; L' fully-noised tokens]`, token p of each with block id = its
position, so noisy token p sees the cached prefix, the proposal strictly before p, and itself: the
training layout at block size 1. The fully-noised tokens are `prior.fully_noised` (what training
feeds at block size 1).

Commits cost no call: a finished block (and, at the start, the prompt) is queued and prepended to
the next call, `[committed clean ; new tokens]` with `n_commit` = its length. So the first call of
every block carries the previous block (2 L' query tokens instead of L'), and the last block is
never committed since nothing reads it.

Counting model calls (`GenerationResult.model_calls` counts the forward passes really made; one
batched call counts once). The paper's label (appendix D, `paper_nfe_per_block`) is N_step for
ancestral and EIPC and N_step + floor((N_step - 1 - warmup) / GE) + 1 for ARPC. An informed step at
the last step (k = 0: alpha_0 = 1) re-noises nothing, so its AR scores could change nothing: we skip
that AR pass; the step still sets z = x~, which at s = 0 is exactly an ancestral step. Hence the
actual count per block (`calls_per_block`) is N_step + #{informed steps before the last} for ARPC,
one fewer than the label when the last step is informed; both are reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from blockgen.models.attention import Layout
from blockgen.models.backbone import INVARIANT_QUERY_ROWS, INVARIANT_WIDTH, KVCache, reused_static_cache
from blockgen.models.diffusion import Prior, Randomness, RowStreams, sample_categorical
from blockgen.models.host_reads import to_host
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models import samplers
from blockgen.models.sampler_config import (
    BlockLayout,
    SamplerConfig,
    paper_nfe_per_block,
    renoise_count,
    step_alphas,
)

StopFn = Callable[[list[int]], bool]


# ------------------------------------------------------------------------ config vs. the model


def resolve_block_size(model_config: BlockGenConfig, config: SamplerConfig) -> int:
    if config.is_ar:
        return 1
    return config.block_size if config.block_size is not None else max(model_config.block_sizes)


def check_config(model: BlockGen | BlockGenConfig, config: SamplerConfig) -> int:
    """Validate a sampler against a checkpoint; returns the block size L' to use."""
    cfg = model.config if isinstance(model, BlockGen) else model
    sizes = tuple(cfg.block_sizes)
    block_size = resolve_block_size(cfg, config)
    if block_size not in sizes:
        raise ValueError(f"block size {block_size} was not trained by this checkpoint; choose one of {list(sizes)}")
    if not config.is_ar and block_size == 1:
        usable = [s for s in sizes if s > 1]
        if not usable:
            raise ValueError(f"this checkpoint is autoregressive (block sizes {list(sizes)}); "
                             f"choose one of {list(samplers.autoregressive_names())}")
        raise ValueError(f"sampler {config.name!r} needs a block size > 1; choose one of {usable} or an AR sampler")
    if config.sampler.needs_untimed_network and getattr(cfg, "time_conditioning", False):
        raise ValueError(f"sampler {config.name!r} follows no noise schedule and this network is time-conditioned; "
                         f"choose one of {[n for n, s in samplers.load().items() if not s.needs_untimed_network]}")
    if config.sampler.needs_ar_pass:
        others = [n for n, s in samplers.load().items() if not (s.needs_ar_pass or s.autoregressive)]
        if 1 not in sizes:
            raise ValueError(f"{config.name!r} needs block size 1 in the training mixture (this checkpoint has "
                             f"{list(sizes)}); choose one of {others}")
        if not cfg.causal_clean:
            raise ValueError(f"{config.name!r} needs a token-causal clean stream (causal_clean=True); "
                             f"choose one of {others}")
    return block_size


def max_prompt_len(model: BlockGen | BlockGenConfig, config: SamplerConfig) -> int:
    """The longest prompt that leaves room for max_new_tokens.

    grid: the blocks up to position P + max_new_tokens must fit, i.e. P <= seq_len - max_new_tokens
    (when L' divides seq_len, as for every trained size). prompt_end: whole blocks after the prompt.
    """
    cfg = model.config if isinstance(model, BlockGen) else model
    block_size = resolve_block_size(cfg, config)
    if config.layout == "grid":
        return cfg.seq_len // block_size * block_size - config.max_new_tokens
    return cfg.seq_len - math.ceil(config.max_new_tokens / block_size) * block_size


def split_prompt(prompt: Sequence[int], block_size: int, layout: BlockLayout) -> tuple[list[int], list[int]]:
    """(committed prefix, tail kept clean inside the first noisy block) of one prompt."""
    prompt = list(prompt)
    tail = len(prompt) % block_size if layout == "grid" else 0
    return prompt[: len(prompt) - tail], prompt[len(prompt) - tail :]


# ----------------------------------------------------------------------------- the KV context


def _rows(n_rows: int, start: torch.Tensor, length: int, block_id: torch.Tensor | None, noisy: bool) -> Layout:
    """Layout of `length` tokens per row at positions start, start + 1, ...; block id = position if None."""
    positions = start[:, None] + torch.arange(length, device=start.device)
    block_ids = positions if block_id is None else block_id[:, None].expand(n_rows, length)
    flags = torch.ones(n_rows, length, dtype=torch.bool, device=start.device)
    return Layout(positions, block_ids, flags if noisy else ~flags, flags)


def prompt_width(dit, prompts: list) -> int:
    """The width of a generation's first call: the longest prompt, in the network's row-invariant mode rounded up to
    whole `INVARIANT_WIDTH` tokens (so a row's left padding in a batch is whole buckets of it)."""
    width = max((len(p) for p in prompts), default=0)
    return -(-width // INVARIANT_WIDTH) * INVARIANT_WIDTH if dit.row_invariant_active else width


class Decoder:
    """The committed prefix of a batch: KV cache, clean tokens waiting to be committed, next positions.

    `prompts` are committed as they are; `tails` (grid layout: each prompt's last P mod L' tokens,
    shorter than L') sit clean at the start of the first block: `pin(z)` writes them into a block,
    `generated` says how many positions of the current block each row generates.
    `denoise(z)` and `ar_pass(x)` are the only places that call the model. With `use_cache=False`
    every call recomputes the whole clean prefix instead (the benchmark's baseline); the outputs are
    the same up to float rounding.
    """

    def __init__(
        self,
        model: BlockGen,
        prompts: Sequence[Sequence[int]],
        pad_id: int,
        block_size: int,
        use_cache: bool = True,
        tails: Sequence[Sequence[int]] | None = None,
        capacity: int = 0,
        static_shapes: bool = False,
        compile: bool = False,
    ):
        self.dit = model.dit
        self.prior: Prior = model.prior
        self.causal = model.config.causal_clean
        self.block_size = block_size
        self.use_cache = use_cache
        self.device = next(model.parameters()).device
        self.eps = model.schedule.eps
        self.calls = 0  # batched calls: one per forward pass, whatever the rows in it
        self.row_calls = [0] * len(prompts)  # per batch row: the calls it took part in (`take_row_calls`)
        if compile and not use_cache:
            raise ValueError("compile=True runs the cached calls compiled; it needs use_cache=True")
        self.compile = compile
        n = len(prompts)
        if compile:  # a CUDA graph keeps the buffers' addresses: the next generation of this shape reuses them
            self.cache = reused_static_cache(self.dit, n, capacity)
        else:
            self.cache = KVCache(capacity, static_shapes)  # slots the generation will fill: allocated once
        width = prompt_width(self.dit, prompts)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        tokens = torch.full((n, width), pad_id, dtype=torch.long)
        for r, p in enumerate(prompts):  # left-pad
            if len(p):
                tokens[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        col = torch.arange(width)
        first = (width - lengths)[:, None]
        valid = col[None] >= first
        positions = (col[None] - first).clamp_min(0)
        # Block-causal models cut the prompt into blocks of L' from its first token, as training does.
        block_ids = positions if self.causal else positions // block_size * block_size
        block_ids = torch.where(valid, block_ids, -1)
        layout = Layout(positions, block_ids, torch.zeros_like(valid), valid).to(self.device)
        # The clean tokens not yet in the cache (uncached mode: the whole clean prefix).
        self.clean: tuple[torch.Tensor, Layout] | None = (tokens.to(self.device), layout) if width else None
        self.next_pos = lengths.to(self.device)  # start of the next block, per row
        self._noisy_layout: Layout | None = None
        self._ar_layout: Layout | None = None
        # The first block's pinned prefix (tokens, mask), each (B, L'); None when no row has a tail.
        self.tail_lens = [len(t) for t in tails] if tails is not None else [0] * n
        self.fixed: tuple[torch.Tensor, torch.Tensor] | None = None
        if len(self.tail_lens) != n:
            raise ValueError(f"got {len(self.tail_lens)} prompt tails for {n} prompts")
        if any(self.tail_lens):
            if max(self.tail_lens) >= block_size:
                raise ValueError(
                    f"a prompt tail of {max(self.tail_lens)} tokens leaves no position to generate in a block of {block_size}"
                )
            fixed = torch.zeros(n, block_size, dtype=torch.long)
            for r, t in enumerate(tails):
                fixed[r, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
            mask = torch.arange(block_size)[None] < torch.tensor(self.tail_lens)[:, None]
            self.fixed = (fixed.to(self.device), mask.to(self.device))

    @property
    def batch(self) -> int:
        return self.next_pos.shape[0]

    @property
    def generated(self) -> list[int]:
        """Positions of the current block each row generates (L' minus its pinned prompt tail)."""
        return [self.block_size - t for t in self.tail_lens]

    def pin(self, z: torch.Tensor) -> torch.Tensor:
        """The block z with each row's prompt tail written back (a no-op after the first block)."""
        if self.fixed is None:
            return z
        tokens, mask = self.fixed
        return torch.where(mask, tokens, z)

    def take_row_calls(self) -> list[int]:
        """The calls each batch row took part in since the last take (then zero again)."""
        out, self.row_calls = self.row_calls, [0] * self.batch
        return out

    def _call(self, tokens: torch.Tensor, layout: Layout, n_noisy: int, sigma: torch.Tensor | None = None,
              rows: list[int] | None = None, counted: list[int] | None = None) -> torch.Tensor:
        """One model call on `[queued clean ; tokens]` whose last `n_noisy` tokens are noisy; returns
        their logits. `sigma` (B,): the time conditioning, read only by time-conditioned networks (Duo).
        `rows`: the call computes only these batch rows (`denoise_rows`); `counted`: the rows it counts
        for (default: those it computes)."""
        self.calls += 1
        for r in counted if counted is not None else rows if rows is not None else range(self.batch):
            self.row_calls[r] += 1
        if rows is not None:
            return self._call_rows(tokens, layout, n_noisy, rows)
        n_clean = 0
        if self.clean is not None:
            clean_tokens, clean_layout = self.clean
            n_clean = clean_tokens.shape[1]
            tokens, layout = torch.cat([clean_tokens, tokens], dim=1), clean_layout.cat(layout)
        extra = {"n_noisy": n_noisy} if sigma is None else {"n_noisy": n_noisy, "sigma": sigma}
        if self.compile:  # all calls but the first, the prompt's (its shape comes once per prompt length)
            extra["compiled"] = self.calls > 1
        if not self.use_cache:
            return self.dit.forward_cached(tokens, layout, KVCache(), 0, **extra)
        self.clean = None
        return self.dit.forward_cached(tokens, layout, self.cache, n_clean, **extra)

    def _call_rows(self, tokens: torch.Tensor, layout: Layout, n_noisy: int, rows: list[int]) -> torch.Tensor:
        """A call of some batch rows only: they attend to their rows of the cache (a copy: the call's keys are
        not kept) or, uncached, of the clean prefix. Nothing is committed: a block's first call, which carries
        the queued clean tokens, is always a whole-batch call."""
        index = torch.tensor(rows, device=self.device)
        if self.use_cache:
            if self.clean is not None:
                raise RuntimeError("a call of some rows cannot commit the queued clean tokens of all rows")
            return self.dit.forward_cached(tokens, layout, self.cache.select(index), 0, n_noisy=n_noisy)
        if self.clean is not None:
            clean_tokens, clean_layout = self.clean
            tokens = torch.cat([clean_tokens[index], tokens], dim=1)
            layout = Layout(*(f[index] for f in clean_layout._fields())).cat(layout)
        return self.dit.forward_cached(tokens, layout, KVCache(), 0, n_noisy=n_noisy)

    def denoise_rows(self, z: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits (len(rows), L', V) of the noisy blocks of some batch rows (z: (B, L'), every row's); the other rows
        sit out the call and are not counted in it (`row_calls`). Compiled decoding keeps its shapes: it computes
        the whole batch and counts `rows` only."""
        if len(rows) == self.batch:
            return self.denoise(z)
        index = torch.tensor(rows, device=self.device)
        if self.compile:
            return self.denoise(z, counted=rows)[index]
        start = self.next_pos[index]
        return self._call(z[index], _rows(len(rows), start, z.shape[1], start, noisy=True), z.shape[1], rows=rows)

    def denoise(self, z: torch.Tensor, alpha_t: float | None = None, counted: list[int] | None = None) -> torch.Tensor:
        """Logits (B, L', V) of the noisy block z at the current position (block size L'); `alpha_t`:
        the step's noise level, embedded as sigma = -log alpha_t by time-conditioned networks."""
        if self._noisy_layout is None or self._noisy_layout.positions.shape[1] != z.shape[1]:
            self._noisy_layout = _rows(self.batch, self.next_pos, z.shape[1], self.next_pos, noisy=True)
        sigma = None
        if alpha_t is not None and self.dit.cfg.time_conditioning:
            sigma = torch.full((self.batch,), -math.log(alpha_t), device=self.device)
        return self._call(z, self._noisy_layout, z.shape[1], sigma, counted=counted)

    def ar_pass(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, noisy tokens) of the AR pass (block size 1) over a clean proposal x (B, L').

        Row p of the logits is the AR prediction of x[:, p] given the prefix and x[:, :p]
        (token-causal models: a block-causal clean stream has no block-size-1 cache).
        """
        n = x.shape[1]
        if noise is None:
            noise = self.prior.fully_noised(x.shape, device=x.device)  # what training feeds at block size 1
        if self._ar_layout is None or self._ar_layout.positions.shape[1] != 2 * n:
            clean = _rows(self.batch, self.next_pos, n, None, noisy=False)
            self._ar_layout = clean.cat(_rows(self.batch, self.next_pos, n, None, noisy=True))
        return self._call(torch.cat([x, noise], dim=1), self._ar_layout, n), noise

    def commit(self, block: torch.Tensor) -> None:
        """Queue a finished clean block; it enters the cache with the next call."""
        n = block.shape[1]
        block_id = None if self.causal else self.next_pos
        layout = _rows(self.batch, self.next_pos, n, block_id, noisy=False)
        if self.clean is not None:
            tokens, old = self.clean
            block, layout = torch.cat([tokens, block], dim=1), old.cat(layout)
        self.clean = (block, layout)
        self.next_pos = self.next_pos + n
        self._noisy_layout = self._ar_layout = None
        self.fixed, self.tail_lens = None, [0] * self.batch

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch and cost nothing)."""
        rows = rows.to(self.device)
        if self.cache.layout is not None:
            self.cache = self.cache.select(rows)
        if self.clean is not None:
            tokens, layout = self.clean
            self.clean = (tokens[rows], Layout(*(f[rows] for f in layout._fields())))
        self.next_pos = self.next_pos[rows]
        self._noisy_layout = self._ar_layout = None
        self.tail_lens = [self.tail_lens[r] for r in rows.tolist()]
        self.row_calls = [self.row_calls[r] for r in rows.tolist()]
        if self.fixed is not None:
            self.fixed = (self.fixed[0][rows], self.fixed[1][rows])


# ------------------------------------------------------------------------------ block samplers


def tempered_log_probs(prior: Prior, logits: torch.Tensor, z: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities of the denoiser at a temperature (logits / T first)."""
    return prior.denoiser_log_probs(logits / temperature, z)


def _probs(prior: Prior, logits: torch.Tensor, z: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, log-probabilities) of the denoiser at a temperature (logits / T first)."""
    log_p = tempered_log_probs(prior, logits, z, temperature)
    return log_p.exp(), log_p


def ancestral_step(prior: Prior, z: torch.Tensor, x_probs: torch.Tensor, alpha_t: float, alpha_s: float, generator: Randomness) -> torch.Tensor:
    """z_s ~ q_{s|t}(. | z_t, x_hat): the prior's posterior with the denoiser's distribution plugged in."""
    return sample_categorical(prior.posterior(z, x_probs, alpha_t, alpha_s), generator)


# Informed-step scores are ranked on this grid (2^-13 nats, exact in binary floating point): scores that
# differ by float noise only (~1e-7: confident tokens' entropies near 0, kernels that round differently
# by CPU or batch shape) tie exactly and go to the lower position instead of to the noise.
SCORE_GRID = 2.0**-13


def _lowest(score: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean (B, n): the k[b] lowest scores of each row b, compared on `SCORE_GRID`; ties go to the lower position."""
    score = torch.round(score / SCORE_GRID)
    order = score.argsort(dim=-1, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))
    return rank < k[:, None]


def _informed_step(dec: Decoder, config: SamplerConfig, z, x_probs, i: int, generator: Randomness) -> torch.Tensor:
    prior, eps = dec.prior, dec.eps
    alpha_t, _ = step_alphas(i, config.steps, eps)
    x = dec.pin(ancestral_step(prior, z, x_probs, alpha_t, 1.0, generator))  # clean proposal ~ q_{0|t}
    counts = [renoise_count(i, config.steps, n, eps) for n in dec.generated]  # known on the host: no read-back
    if not any(counts):  # the last step: nothing to re-noise, the scores (and ARPC's extra call) could change nothing
        return x
    k = torch.tensor(counts, device=x.device)
    score = config.sampler.score(dec, config, x, x_probs)  # EIPC: negative entropy; ARPC: AR log-likelihood
    if dec.fixed is not None:  # a prompt tail is never re-noised
        score = score.masked_fill(dec.fixed[1], torch.inf)
    chosen = _lowest(score, k)
    # Algorithms 2-3 print z^l ~ q_s(. | x~^l; alpha_s) for l in m. Read literally, each chosen
    # position would go through the forward process once more and only a (1 - alpha_s) share of the
    # k would end up noisy. But k is already the expected number of noisy tokens at time s: choosing
    # the k positions plays the part of the forward process's coin flips, and the text asks to
    # "re-noise the lowest-scoring k positions to the noise level at time s". So every chosen
    # position takes the prior's noise ([MASK], or a fresh uniform token), as the authors' code does.
    return torch.where(chosen, prior.prior_sample(x.shape, device=x.device, generator=generator), x)


def diffusion_block(dec: Decoder, config: SamplerConfig, generator: Randomness, trace=None, block_index: int = 0) -> torch.Tensor:
    """One block of L' clean tokens by ancestral, EIPC or ARPC sampling (Algorithms 2 and 3).

    A grid layout's prompt tail is pinned after every step (the masked posterior keeps it anyway;
    the uniform one would redraw it).
    """
    prior = dec.prior
    z = dec.pin(prior.prior_sample((dec.batch, dec.block_size), device=dec.device, generator=generator))
    for i in range(config.steps):
        alpha_t, alpha_s = step_alphas(i, config.steps, dec.eps)
        x_probs, _ = _probs(prior, dec.denoise(z, alpha_t), z, config.temperature)
        if config.informed(i):
            z = _informed_step(dec, config, z, x_probs, i, generator)
        else:
            z = dec.pin(ancestral_step(prior, z, x_probs, alpha_t, alpha_s, generator))
        if trace is not None:
            trace(block_index, i, z)
    return z


def entropy(log_p: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each distribution (..., V) given as log-probabilities; 0 log 0 = 0."""
    p = log_p.exp()
    return -torch.special.xlogy(p, p).sum(-1)


def on_score_grid(score: torch.Tensor) -> torch.Tensor:
    """Scores rounded to `SCORE_GRID`: compared and ranked there, float noise ties exactly."""
    return torch.round(score / SCORE_GRID) * SCORE_GRID


def unmasking_block(dec: Decoder, config: SamplerConfig, generator: RowStreams, trace=None, block_index: int = 0) -> torch.Tensor:
    """One block by a sampler that commits positions rather than following a noise schedule (the field's
    parallel decoders: models/samplers/confidence_threshold.py, low_confidence.py, entropy_bounded.py).

    Each step, one call on the rows that still have undecided positions (the rows done sit out: `denoise_rows`);
    every undecided position draws a token x from the tempered denoiser; the sampler's `plan` says how many k of
    them to commit and in what order (lowest key first, keys on `SCORE_GRID`, ties to the lower position); the k
    first take their draw and are decided, the others stay as they were: [MASK] for the masked prior, the prior's
    uniform draw for the uniform prior (committing from the proposal; their noisy token is what the denoiser
    reads). The block ends when a row has no undecided position, so a row's calls per block vary (adaptive
    samplers). A grid layout's prompt tail is decided from the start. Draws come from `generator.fork(block)`
    at call `step + 1` (the block's prior draw: call 0), so a row's draws do not depend on how many steps the
    other rows of its batch took.
    """
    sampler, prior = config.sampler, dec.prior
    streams = generator.fork(block_index)
    z = dec.pin(prior.prior_sample((dec.batch, dec.block_size), device=dec.device, generator=streams.at(0)))
    undecided = torch.ones(dec.batch, dec.block_size, dtype=torch.bool, device=dec.device)
    if dec.fixed is not None:
        undecided &= ~dec.fixed[1]
    generated = torch.tensor(dec.generated, device=dec.device)
    step = 0
    while rows := [r for r, left in enumerate(to_host(undecided.any(-1))) if left]:  # one read per step: k varies
        index = torch.tensor(rows, device=dec.device)
        z_rows, open_rows = z[index], undecided[index]
        logits = dec.denoise_rows(z, rows)
        log_p = tempered_log_probs(prior, logits, z_rows, config.temperature)
        x = sample_categorical(log_p.exp(), streams.select(rows).at(step + 1))
        # Confidence as LLaDA and Fast-dLLM read it: the untempered probability of the drawn token.
        confidence = prior.denoiser_log_probs(logits, z_rows).gather(-1, x[..., None])[..., 0].exp()
        key, k = sampler.plan(config, step, on_score_grid(confidence), on_score_grid(entropy(log_p)), open_rows,
                              generated[index])
        chosen = _lowest(key.masked_fill(~open_rows, torch.inf), k) & open_rows
        z[index] = torch.where(chosen, x, z_rows)
        undecided[index] = open_rows & ~chosen
        if trace is not None:
            trace(block_index, step, z)
        step += 1
    return z


def ar_token(dec: Decoder, config: SamplerConfig, generator: Randomness, trace=None, block_index: int = 0,
             greedy: bool = False) -> torch.Tensor:
    """One token per row by autoregression (block size 1): greedy or sampled at a temperature."""
    z = dec.prior.fully_noised((dec.batch, 1), device=dec.device)
    logits = dec.denoise(z)
    if greedy:
        x = dec.prior.denoiser_log_probs(logits, z).argmax(-1)
    else:
        x = sample_categorical(_probs(dec.prior, logits, z, config.temperature)[0], generator)
    if trace is not None:
        trace(block_index, 0, x)
    return x


# ---------------------------------------------------------------------------------- generate


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt (EOS and anything after it excluded)
    model_calls: int  # forward passes really made (a batched call counts once)
    model_calls_per_block: float  # model_calls / n_blocks (per block of the batch loop)
    paper_nfe_per_block: int | None  # the paper's NFE label (appendix D); None: adaptive, measured per row
    block_size: int = 0
    n_blocks: int = 0  # block iterations of the batch loop
    finish_reasons: list[str] = field(default_factory=list)  # per prompt: "eos", "stop" or "length"
    # Per prompt: the calls it took part in, its blocks, and its most calls in one block. A fixed schedule gives
    # every row the same calls per block; an adaptive sampler's rows differ (rows done sit out the calls).
    row_calls: list[int] = field(default_factory=list)
    row_blocks: list[int] = field(default_factory=list)
    row_max_calls_per_block: list[int] = field(default_factory=list)

    @property
    def calls_per_block_per_row(self) -> float:
        """Mean model calls per block of one row (an adaptive sampler's NFE)."""
        return sum(self.row_calls) / sum(self.row_blocks) if sum(self.row_blocks) else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens (never the prompt) per model call of a row."""
        return sum(map(len, self.tokens)) / sum(self.row_calls) if sum(self.row_calls) else 0.0


@torch.inference_mode()
def generate(
    model: BlockGen,
    prompts: list[list[int]],
    config: SamplerConfig,
    eos_id: int,
    pad_id: int,
    stop: StopFn | Sequence[StopFn | None] | None = None,
    *,
    seeds: Sequence[int] | None = None,
    max_new_tokens: Sequence[int] | None = None,
    use_cache: bool = True,
    validate: bool = True,
    progress: Callable[[int], None] | None = None,
    trace: Callable[[int, int, torch.Tensor], None] | None = None,
    batch_invariant: bool = False,
    static_shapes: bool = False,
    compile: bool = False,
) -> GenerationResult:
    """Continue each prompt with up to `config.max_new_tokens` tokens, block by block.

    A row stops at its first generated EOS (prompts are never inspected, so BOS == EOS is safe),
    when `stop(generated ids so far)` is true after a committed block (one callable for all rows or
    one per row), or at its budget: `max_new_tokens[i]` (default `config.max_new_tokens` for every
    row; rows of one batch may have different budgets); finished rows leave the batch. Row i draws all its
    randomness from a generator seeded `seeds[i]` (default `config.seed + i`), so with `seeds` its
    output does not depend on the batch it runs in. `validate=False` skips the checkpoint checks
    (e.g. the benchmark's untrained full-sequence block). `progress(n)` is called after each block
    with the number of tokens it added per row (at most); `trace(block, step, z)` after every
    reverse step (tests).

    `batch_invariant=True` runs the batch in the network's row-invariant mode (`DiT.row_invariant`: fixed-shape
    matrix products, each row's keys gathered in one order and attended as the row alone would: `row_invariant_attention`), so a row's text is bit for bit the
    one it gets alone, in any batch and order (bench/README.md, "Batch invariance", for the cost). Without a cache or
    with `compile`, it runs every row as a batch of one instead (model_calls and n_blocks then summed over the rows).

    `static_shapes=True` attends to the whole preallocated KV cache (unwritten slots masked), so every
    call of a block size has the same tensor shapes, as a captured CUDA graph needs; the default
    attends to the written slots only (same numbers up to float rounding, less work on a CPU).

    `compile=True` implies static shapes and runs every model call but the first (the prompt's, a
    shape seen once) through `torch.compile` (`backbone.compiled_forward_static`): on CUDA in mode
    "reduce-overhead", each call replayed as a CUDA graph; on a CPU with inductor's default mode
    (the same compiled program, no graphs). One graph per call kind: per block size a handful (a
    block's first call carries the previous block, 2 L' query tokens; its other calls L'; ARPC's AR
    pass 2 L'; AR samplers 2), per batch size and per cache capacity, which is rounded up to a power
    of two so that generations of similar lengths share graphs (and the cache's buffers: the next
    generation of the same batch and capacity reuses them, so one generation at a time per model).
    Rows that finish stay in the batch (their tokens ignored) until at most half of it is still
    running: a smaller batch is a new shape, compiled anew. Tokens agree with eager ones up to float
    rounding (a near-tie can flip).
    """
    block_size = check_config(model, config) if validate else resolve_block_size(model.config, config)
    paper = paper_nfe_per_block(config)
    n = len(prompts)
    if n == 0:
        return GenerationResult([], 0, 0.0, paper, block_size, 0, [], [], [], [])
    stops = list(stop) if isinstance(stop, Sequence) else [stop] * n
    if len(stops) != n:
        raise ValueError(f"got {len(stops)} stop callbacks for {n} prompts")
    if seeds is None:
        seeds = [config.seed + i for i in range(n)]
    elif len(seeds) != n:
        raise ValueError(f"got {len(seeds)} seeds for {n} prompts")
    limits = [config.max_new_tokens] * n if max_new_tokens is None else [int(b) for b in max_new_tokens]
    if len(limits) != n or min(limits) < 1:
        raise ValueError(f"max_new_tokens: need {n} budgets >= 1, got {list(max_new_tokens)}")
    splits = [split_prompt(p, block_size, config.layout) for p in prompts]
    # Blocks each row needs: its tail plus its budget, in whole blocks from its grid start.
    need = [math.ceil((len(tail) + limit) / block_size) for (_, tail), limit in zip(splits, limits)]
    ends = [len(prefix) + b * block_size for (prefix, _), b in zip(splits, need)]
    if max(ends) > model.config.seq_len:
        r = ends.index(max(ends))
        raise ValueError(
            f"prompt length {len(prompts[r])} + max_new_tokens {limits[r]} in blocks of {block_size} (layout {config.layout!r}) "
            f"exceeds the model's seq_len {model.config.seq_len}; truncate prompts to "
            f"{max_prompt_len(model.config, replace(config, max_new_tokens=limits[r]))} tokens or ask for fewer new tokens"
        )
    if batch_invariant and use_cache and not compile:  # the batch in the network's row-invariant mode
        with model.dit.row_invariant(query_rows=min(INVARIANT_QUERY_ROWS, 2 * block_size)):  # a call: 2 L' queries at most
            return generate(model, prompts, config, eos_id, pad_id, stop, seeds=seeds, max_new_tokens=limits, use_cache=True,
                            validate=False, progress=progress, trace=trace, static_shapes=static_shapes)
    if batch_invariant and n > 1:  # without a cache, or compiled: row by row
        rows = [generate(model, [p], config, eos_id, pad_id, [s], seeds=[seed], max_new_tokens=[limit], use_cache=use_cache,
                         validate=False, progress=progress, trace=trace, static_shapes=static_shapes, compile=compile)
                for p, s, seed, limit in zip(prompts, stops, seeds, limits)]
        calls, blocks = sum(r.model_calls for r in rows), sum(r.n_blocks for r in rows)
        return GenerationResult([r.tokens[0] for r in rows], calls, calls / blocks, paper, block_size, blocks,
                                [r.finish_reasons[0] for r in rows], [r.row_calls[0] for r in rows],
                                [r.row_blocks[0] for r in rows], [r.row_max_calls_per_block[0] for r in rows])
    generator = RowStreams(seeds)

    was_training = model.training
    model.eval()  # dropout off while sampling; restored below
    try:
        # Cache slots: the longest prefix, the blocks, and one call's new tokens (ARPC: 2 L').
        capacity = prompt_width(model.dit, [prefix for prefix, _ in splits]) + (max(need) + 2) * block_size
        if compile:  # one capacity for generations of similar lengths: their calls share compiled graphs
            capacity = 1 << (capacity - 1).bit_length()
        dec = Decoder(model, [prefix for prefix, _ in splits], pad_id, block_size, use_cache, [tail for _, tail in splits],
                      capacity, static_shapes, compile)
        sample_block = config.sampler.block  # models/samplers/: the registered sampler's block function
        active = list(range(n))  # original index of each batch row
        running = [True] * n  # per batch row: False once it finished but stays in the batch (compile)
        out: list[list[int]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        row_calls, row_blocks, row_max = [0] * n, [0] * n, [0] * n
        blocks = 0
        for j in range(max(need)):
            skip = dec.tail_lens  # the prompt's tail opens the first block: not generated
            block = sample_block(dec, config, generator, trace, j)
            blocks += 1
            dec.commit(block)
            calls = dec.take_row_calls()
            keep = []
            for r, row in enumerate(to_host(block)):  # the block's one read-back
                if not running[r]:
                    continue
                i = active[r]
                row_calls[i] += calls[r]
                row_blocks[i] += 1
                row_max[i] = max(row_max[i], calls[r])
                new = row[skip[r] :][: limits[i] - len(out[i])]
                if eos_id in new:
                    out[i] += new[: new.index(eos_id)]
                    reasons[i] = "eos"
                    continue
                out[i] += new
                if stops[i] is not None and stops[i](out[i]):
                    reasons[i] = "stop"
                elif len(out[i]) < limits[i]:
                    keep.append(r)
            if progress is not None:
                progress(block_size - min(skip))
            if not keep:
                break
            if len(keep) < sum(running):
                # A finished row stays while more than half of the batch runs (compile: a smaller batch
                # is a new shape) and its positions stay inside the model for the blocks left.
                stay = compile and 2 * len(keep) > len(active) and all(
                    len(splits[active[r]][0]) + max(need) * block_size <= model.config.seq_len
                    for r in range(len(active)) if r not in keep)
                if stay:
                    running = [r in keep for r in range(len(active))]
                else:
                    dec.select(torch.tensor(keep))
                    generator = generator.select(keep)
                    active = [active[r] for r in keep]
                    running = [True] * len(keep)
    finally:
        model.train(was_training)
    return GenerationResult(out, dec.calls, dec.calls / blocks, paper, block_size, blocks, reasons, row_calls, row_blocks,
                            row_max)
