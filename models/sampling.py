"""Samplers: block-by-block generation with a KV cache (paper section 3.3, appendix "Algorithms").

Generation runs left to right, one block of L' tokens at a time, right after the prompt. The keys
and values of committed clean tokens (prompt, finished blocks) are computed once, through
`DiT.forward_cached(..., n_commit)`, and reused by every later call. With a token-causal clean
stream (`causal_clean=True`) the same cache serves the diffusion passes (block size L') and the AR
verifier (block size 1).

Samplers (`SamplerConfig.name`):
- `ancestral`: N_step reverse steps per block, z_s ~ q_{s|t}(. | z_t, x_hat) with the denoiser's
  distribution plugged into the prior's posterior; t_i = (N-i)/N, s = (N-i-1)/N, restarting every
  block; alpha_t = 1 - (1 - eps) t and alpha_s = 1 exactly at s = 0, so the last step leaves a clean
  block (masked: no [MASK] left).
- `eipc` / `arpc` (Algorithms 2 and 3): `warmup` ancestral steps, then an informed step at the first
  non-warmup step and every `ge` steps after. An informed step draws a clean proposal
  x~ ~ q_{0|t}(. | z_t, x_hat), scores each token (EIPC: negative entropy of x_hat; ARPC: AR
  log-likelihood from one extra call at block size 1), picks the k = round((1 - alpha_s) L')
  lowest-scoring positions m, sets z = x~ and then draws z^l ~ q_s(. | x~^l; alpha_s) for l in m,
  literally as the algorithm's line reads: each chosen position goes through the forward process,
  so (masked) it becomes [MASK] with probability 1 - alpha_s and keeps x~ otherwise (uniform: it is
  redrawn uniformly, possibly onto x~ again, with probability 1 - alpha_s). The scores use the
  tempered distributions. Ties in the score go to torch.topk's order.
- `ar_greedy` / `ar_sample`: autoregression at block size 1, one token per model call.
Temperature divides the logits before normalisation, for diffusion and AR passes alike (greedy AR
ignores it). Categorical draws are float64 (`sample_categorical`); one `torch.Generator` seeded
from `SamplerConfig.seed` drives all randomness, so a fixed seed reproduces a batch exactly (same
prompts, same device).

Layout of the calls (see `attention.allowed`). Positions of a row start at 0 at its first real
token (prompts are left-padded; padding is `valid=False`). Block ids are positions, in a way that
reproduces the training layout: a noisy block starting at position p has block id p (so it sees
every clean token before p and its own block); a committed clean token has block id = its position
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
ancestral and EIPC and N_step + floor((N_step - 1 - warmup) / GE) + 1 for ARPC. An informed step
with k = 0 (always the case at the last step, where alpha_0 = 1, and at the step with s = 1/N once
N_step >= 2 L') re-noises nothing, so its AR scores could change nothing: we skip that AR pass.
Such a step still sets z = x~ (at s = 0 this is exactly an ancestral step). Hence the actual count
per block (`calls_per_block`) is N_step + #{informed steps with k > 0} for ARPC, one fewer than the
label per skipped pass; both are reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence, get_args

import torch

from blockgen.models.attention import Layout
from blockgen.models.backbone import KVCache
from blockgen.models.diffusion import Prior, sample_categorical
from blockgen.models.model import BlockGen, BlockGenConfig

SamplerName = Literal["ancestral", "eipc", "arpc", "ar_greedy", "ar_sample"]
SAMPLERS: tuple[str, ...] = get_args(SamplerName)
AR_SAMPLERS = ("ar_greedy", "ar_sample")
INFORMED_SAMPLERS = ("eipc", "arpc")

StopFn = Callable[[list[int]], bool]


@dataclass(frozen=True)
class SamplerConfig:
    name: SamplerName = "ancestral"
    steps: int = 16  # N_step: reverse steps per block (ignored by the AR samplers)
    ge: int = 1  # an informed step every `ge` steps after the warm-up (eipc, arpc)
    warmup: int = 0  # ancestral-only steps at the start of each block (eipc, arpc)
    temperature: float = 1.0  # divides the logits; ignored by ar_greedy
    block_size: int | None = None  # L'; None: the model's largest trained block size (AR: 1)
    max_new_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.name!r}; choose one of {list(SAMPLERS)}")
        for key, low in (("steps", 1), ("ge", 1), ("warmup", 0), ("max_new_tokens", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key}={value!r}; must be an integer >= {low}")
        if self.name in INFORMED_SAMPLERS and self.warmup >= self.steps:
            raise ValueError(
                f"warmup={self.warmup} leaves no informed step of {self.name!r}; choose warmup in 0..{self.steps - 1}"
            )
        if self.name != "ar_greedy" and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}; sampler {self.name!r} needs a temperature > 0")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size={self.block_size!r}; must be a positive integer or None")
        if self.name in AR_SAMPLERS and self.block_size not in (None, 1):
            raise ValueError(f"sampler {self.name!r} decodes one token per call; block_size must be 1 or None")
        if self.name not in AR_SAMPLERS and self.block_size == 1:
            raise ValueError(f"block size 1 is autoregression; use sampler 'ar_sample' or 'ar_greedy', not {self.name!r}")

    @property
    def is_ar(self) -> bool:
        return self.name in AR_SAMPLERS

    def informed(self, i: int) -> bool:
        """Whether step i of a block is an informed (predictor-corrector) step."""
        return self.name in INFORMED_SAMPLERS and i >= self.warmup and (i - self.warmup) % self.ge == 0


# ------------------------------------------------------------------------------- step schedule


def step_alphas(i: int, steps: int, eps: float) -> tuple[float, float]:
    """(alpha_t, alpha_s) of step i: t = (N - i) / N, s = (N - i - 1) / N; alpha_s = 1 exactly at s = 0."""
    t, s = (steps - i) / steps, (steps - i - 1) / steps
    return 1 - (1 - eps) * t, (1.0 if s == 0 else 1 - (1 - eps) * s)


def renoise_count(i: int, steps: int, block_size: int, eps: float) -> int:
    """k = round((1 - alpha_s) L') positions re-noised by an informed step at step i (Python's round)."""
    return round((1 - step_alphas(i, steps, eps)[1]) * block_size)


def paper_nfe_per_block(config: SamplerConfig) -> int:
    """The paper's NFE label per block (appendix D): ARPC counts one AR pass per informed step."""
    if config.is_ar:
        return 1
    if config.name == "arpc":
        return config.steps + (config.steps - 1 - config.warmup) // config.ge + 1
    return config.steps


def calls_per_block(config: SamplerConfig, block_size: int, eps: float = 1e-3) -> int:
    """Model calls this module really makes per block: ARPC skips the AR pass when k = 0."""
    if config.is_ar:
        return 1
    if config.name != "arpc":
        return config.steps
    passes = sum(
        1 for i in range(config.steps) if config.informed(i) and renoise_count(i, config.steps, block_size, eps) > 0
    )
    return config.steps + passes


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
            raise ValueError(f"this checkpoint is autoregressive (block sizes {list(sizes)}); choose one of {list(AR_SAMPLERS)}")
        raise ValueError(f"sampler {config.name!r} needs a block size > 1; choose one of {usable} or an AR sampler")
    if config.name == "arpc":
        if 1 not in sizes:
            raise ValueError(
                f"'arpc' needs block size 1 in the training mixture (this checkpoint has {list(sizes)}); "
                f"choose one of {[s for s in SAMPLERS if s not in ('arpc', *AR_SAMPLERS)]}"
            )
        if not cfg.causal_clean:
            raise ValueError("'arpc' needs a token-causal clean stream (causal_clean=True); choose 'ancestral' or 'eipc'")
    return block_size


def max_prompt_len(model: BlockGen | BlockGenConfig, config: SamplerConfig) -> int:
    """The longest prompt that leaves room for max_new_tokens (rounded up to whole blocks)."""
    cfg = model.config if isinstance(model, BlockGen) else model
    block_size = resolve_block_size(cfg, config)
    return cfg.seq_len - math.ceil(config.max_new_tokens / block_size) * block_size


# ----------------------------------------------------------------------------- the KV context


def _rows(n_rows: int, start: torch.Tensor, length: int, block_id: torch.Tensor | None, noisy: bool) -> Layout:
    """Layout of `length` tokens per row at positions start, start + 1, ...; block id = position if None."""
    positions = start[:, None] + torch.arange(length, device=start.device)
    block_ids = positions if block_id is None else block_id[:, None].expand(n_rows, length)
    flags = torch.ones(n_rows, length, dtype=torch.bool, device=start.device)
    return Layout(positions, block_ids, flags if noisy else ~flags, flags)


class Decoder:
    """The committed prefix of a batch: KV cache, clean tokens waiting to be committed, next positions.

    `denoise(z)` and `ar_pass(x)` are the only places that call the model. With `use_cache=False`
    every call recomputes the whole clean prefix instead (the benchmark's baseline); the outputs are
    the same up to float rounding.
    """

    def __init__(self, model: BlockGen, prompts: Sequence[Sequence[int]], pad_id: int, block_size: int, use_cache: bool = True):
        self.dit = model.dit
        self.prior: Prior = model.prior
        self.causal = model.config.causal_clean
        self.block_size = block_size
        self.use_cache = use_cache
        self.device = next(model.parameters()).device
        self.eps = model.schedule.eps
        self.calls = 0
        self.cache = KVCache()
        n, width = len(prompts), max((len(p) for p in prompts), default=0)
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
        self.next_pos = lengths.to(self.device)  # position of the next generated token, per row
        self._noisy_layout: Layout | None = None
        self._ar_layout: Layout | None = None

    @property
    def batch(self) -> int:
        return self.next_pos.shape[0]

    def _call(self, tokens: torch.Tensor, layout: Layout) -> torch.Tensor:
        """One model call on `[queued clean ; tokens]`; returns the logits of the noisy tokens."""
        self.calls += 1
        n_clean = 0
        if self.clean is not None:
            clean_tokens, clean_layout = self.clean
            n_clean = clean_tokens.shape[1]
            tokens, layout = torch.cat([clean_tokens, tokens], dim=1), clean_layout.cat(layout)
        if not self.use_cache:
            return self.dit.forward_cached(tokens, layout, KVCache(), 0)
        self.clean = None
        return self.dit.forward_cached(tokens, layout, self.cache, n_clean)

    def denoise(self, z: torch.Tensor) -> torch.Tensor:
        """Logits (B, L', V) of the noisy block z at the current position (block size L')."""
        if self._noisy_layout is None or self._noisy_layout.positions.shape[1] != z.shape[1]:
            self._noisy_layout = _rows(self.batch, self.next_pos, z.shape[1], self.next_pos, noisy=True)
        return self._call(z, self._noisy_layout)

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
        return self._call(torch.cat([x, noise], dim=1), self._ar_layout), noise

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

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch and cost nothing)."""
        rows = rows.to(self.device)
        if len(self.cache):
            self.cache = self.cache.select(rows)
        if self.clean is not None:
            tokens, layout = self.clean
            self.clean = (tokens[rows], Layout(*(f[rows] for f in layout._fields())))
        self.next_pos = self.next_pos[rows]
        self._noisy_layout = self._ar_layout = None


# ------------------------------------------------------------------------------ block samplers


def _probs(prior: Prior, logits: torch.Tensor, z: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, log-probabilities) of the denoiser at a temperature (logits / T first)."""
    log_p = prior.denoiser_log_probs(logits / temperature, z)
    return log_p.exp(), log_p


def ancestral_step(prior: Prior, z: torch.Tensor, x_probs: torch.Tensor, alpha_t: float, alpha_s: float, generator) -> torch.Tensor:
    """z_s ~ q_{s|t}(. | z_t, x_hat): the prior's posterior with the denoiser's distribution plugged in."""
    return sample_categorical(prior.posterior(z, x_probs, alpha_t, alpha_s), generator)


def _informed_step(dec: Decoder, config: SamplerConfig, z, x_probs, i: int, generator) -> torch.Tensor:
    prior, eps = dec.prior, dec.eps
    alpha_t, alpha_s = step_alphas(i, config.steps, eps)
    x = ancestral_step(prior, z, x_probs, alpha_t, 1.0, generator)  # clean proposal ~ q_{0|t}
    k = renoise_count(i, config.steps, z.shape[1], eps)
    if k == 0:  # nothing to re-noise: the scores (and ARPC's extra call) could change nothing
        return x
    if config.name == "eipc":
        score = torch.special.xlogy(x_probs, x_probs).sum(-1)  # negative entropy; 0 log 0 = 0
    else:
        ar_logits, noise = dec.ar_pass(x)
        _, ar_log_p = _probs(prior, ar_logits, noise, config.temperature)
        score = ar_log_p.gather(-1, x[..., None])[..., 0]
    worst = score.topk(k, dim=-1, largest=False).indices
    chosen = torch.zeros_like(x, dtype=torch.bool).scatter_(1, worst, True)
    # Algorithm 2/3: z^l ~ q_s(. | x~^l; alpha_s) for the chosen positions, z = x~ elsewhere.
    return torch.where(chosen, prior.noise(x, alpha_s, generator), x)


def diffusion_block(dec: Decoder, config: SamplerConfig, generator, trace=None, block_index: int = 0) -> torch.Tensor:
    """One block of L' clean tokens by ancestral, EIPC or ARPC sampling (Algorithms 2 and 3)."""
    prior = dec.prior
    z = prior.prior_sample((dec.batch, dec.block_size), device=dec.device, generator=generator)
    for i in range(config.steps):
        alpha_t, alpha_s = step_alphas(i, config.steps, dec.eps)
        x_probs, _ = _probs(prior, dec.denoise(z), z, config.temperature)
        if config.informed(i):
            z = _informed_step(dec, config, z, x_probs, i, generator)
        else:
            z = ancestral_step(prior, z, x_probs, alpha_t, alpha_s, generator)
        if trace is not None:
            trace(block_index, i, z)
    return z


def ar_token(dec: Decoder, config: SamplerConfig, generator, trace=None, block_index: int = 0) -> torch.Tensor:
    """One token per row by autoregression (block size 1): greedy or sampled at a temperature."""
    z = dec.prior.fully_noised((dec.batch, 1), device=dec.device)
    logits = dec.denoise(z)
    if config.name == "ar_greedy":
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
    model_calls_per_block: float  # model_calls / n_blocks (the same for every block: the schedule is fixed)
    paper_nfe_per_block: int  # the paper's NFE label (appendix D)
    block_size: int = 0
    n_blocks: int = 0  # block iterations of the batch loop
    finish_reasons: list[str] = field(default_factory=list)  # per prompt: "eos", "stop" or "length"


@torch.inference_mode()
def generate(
    model: BlockGen,
    prompts: list[list[int]],
    config: SamplerConfig,
    eos_id: int,
    pad_id: int,
    stop: StopFn | Sequence[StopFn | None] | None = None,
    *,
    use_cache: bool = True,
    validate: bool = True,
    progress: Callable[[int], None] | None = None,
    trace: Callable[[int, int, torch.Tensor], None] | None = None,
) -> GenerationResult:
    """Continue each prompt with up to `config.max_new_tokens` tokens, block by block.

    A row stops at its first generated EOS (prompts are never inspected, so BOS == EOS is safe),
    when `stop(generated ids so far)` is true after a committed block (one callable for all rows or
    one per row), or at max_new_tokens; finished rows leave the batch. `validate=False` skips the
    checkpoint checks (e.g. the benchmark's untrained full-sequence block). `progress(n)` is called
    after each block with the number of tokens it added per row; `trace(block, step, z)` after
    every reverse step (tests).
    """
    block_size = check_config(model, config) if validate else resolve_block_size(model.config, config)
    paper = paper_nfe_per_block(config)
    n = len(prompts)
    if n == 0:
        return GenerationResult([], 0, 0.0, paper, block_size, 0, [])
    n_blocks = math.ceil(config.max_new_tokens / block_size)
    longest = max(len(p) for p in prompts)
    if longest + n_blocks * block_size > model.config.seq_len:
        raise ValueError(
            f"prompt length {longest} + {n_blocks} blocks of {block_size} exceeds the model's seq_len "
            f"{model.config.seq_len}; truncate prompts to {model.config.seq_len - n_blocks * block_size} tokens"
        )
    stops = list(stop) if isinstance(stop, Sequence) else [stop] * n
    if len(stops) != n:
        raise ValueError(f"got {len(stops)} stop callbacks for {n} prompts")

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(config.seed)
    was_training = model.training
    model.eval()  # dropout off while sampling; restored below
    try:
        dec = Decoder(model, prompts, pad_id, block_size, use_cache)
        sample_block = ar_token if config.is_ar else diffusion_block
        active = list(range(n))  # original index of each batch row
        out: list[list[int]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        blocks = 0
        for j in range(n_blocks):
            block = sample_block(dec, config, generator, trace, j)
            blocks += 1
            dec.commit(block)
            keep = []
            for r, row in enumerate(block.tolist()):
                i = active[r]
                new = row[: config.max_new_tokens - len(out[i])]
                if eos_id in new:
                    out[i] += new[: new.index(eos_id)]
                    reasons[i] = "eos"
                    continue
                out[i] += new
                if stops[i] is not None and stops[i](out[i]):
                    reasons[i] = "stop"
                elif len(out[i]) < config.max_new_tokens:
                    keep.append(r)
            if progress is not None:
                progress(block_size)
            if not keep:
                break
            if len(keep) < len(active):
                dec.select(torch.tensor(keep))
                active = [active[r] for r in keep]
    finally:
        model.train(was_training)
    return GenerationResult(out, dec.calls, dec.calls / blocks, paper, block_size, blocks, reasons)
