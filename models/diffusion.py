"""Noise processes inside a block: the masked and the uniform prior (paper section 2, appendix E).

Each prior is one small object with the same methods, so losses and samplers never branch on
"masked or uniform":
- `noise(x, alpha)`: draw z_t ~ Cat(alpha x + (1 - alpha) pi);
- `prior_sample(shape)`: a fully noised block;
- `denoiser_log_probs(logits, z_t)`: log x_hat over the real vocabulary (+ [MASK] column if any);
- `posterior(z_t, x_probs, alpha_t, alpha_s)`: q(z_s | z_t, x) with x one-hot or a distribution
  (plug-in: the learned reverse step uses the denoiser's distribution in place of x);
- `log_prob_clean(logits, x, z_t)`: log x_hat[x] per token (all that the masked losses need);
- `nelbo(logits, x, z_t, t)`: the per-token NELBO integrand (positive);
- `train_loss(...)`: masked: unweighted cross-entropy; uniform: the NELBO.
The losses take raw logits (log-probabilities work too) so each prior computes only what it needs.

Randomness: every draw goes through `uniform`, `randint` and `sample_categorical` below, which take
either a `torch.Generator` (or None: the global one) or `RowStreams`, one counter-based stream per
batch row computed on the device. With `RowStreams` row i's draws come from its own stream only
(inverse-CDF categorical draws), so a sampled row is the same alone or in any batch, on CPU or CUDA;
nothing else branches on it.

Conventions: schedule alpha_t = 1 - (1 - eps) t (log-linear, eps = 1e-3), `d_alpha = -(1 - eps)`.
Block size 1 is autoregression: the noisy stream is `fully_noised` (a fixed placeholder that carries
no information about x) and the loss is the exact cross-entropy, handled by the objectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

# Tokens per float64 chunk of the uniform prior's NELBO: 2,048 x 50k x 8 bytes = 0.8 GB per tensor.
NELBO_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class LogLinearSchedule:
    eps: float = 1e-3
    t_min: float = 1e-3

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 1 - (1 - self.eps) * t

    def d_alpha(self, t: torch.Tensor) -> torch.Tensor:
        """d alpha_t / dt (negative)."""
        return torch.full_like(t, -(1 - self.eps))

    def t_from_uniform(self, u: torch.Tensor) -> torch.Tensor:
        """Map u in [0, 1) to t in [t_min, 1]."""
        return self.t_min + (1 - self.t_min) * u


def _int64(value: int) -> int:
    """`value` mod 2^64 as a signed int64 (torch's int64 arithmetic wraps the same way)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_MASK64 = (1 << 64) - 1
# splitmix64 (Steele, Lea and Flood 2014): the golden-ratio increment and the finaliser's multipliers.
_GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection of 64-bit words; int64 products wrap mod 2^64."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


class RowStreams:
    """One counter-based random stream per batch row, drawn on the tensors' device.

    Draw `p` (row-major over the per-row shape) of call `c` on row i is a pure function of
    (seeds[i], c, p): `mix64(mix64(mix64(seed) + c * gamma) + (p + 1) * gamma)`, splitmix64's
    generator keyed by row and call, in exact int64 arithmetic, so it is the same bits on any CPU
    kernel and on CUDA, with no host round trip. A row's draws therefore depend on neither the other
    rows nor the batch size, and a shorter draw is a prefix of a longer one in its first dimension
    (windows of different lengths with one seed see the same noise at the same positions: common
    random numbers). The call counter lives on the host (every row of a batch makes the same calls);
    `select` keeps the streams of the rows that stay.
    """

    def __init__(self, seeds: Sequence[int], *, _keys: torch.Tensor | None = None, _calls: int = 0) -> None:
        if _keys is None:
            _keys = _mix64(torch.tensor([_int64(int(s)) for s in seeds], dtype=torch.long))
        self.keys = _keys
        self.calls = _calls

    def __len__(self) -> int:
        return len(self.keys)

    def select(self, rows: Sequence[int] | torch.Tensor) -> "RowStreams":
        rows = torch.as_tensor(rows, dtype=torch.long)
        return RowStreams((), _keys=self.keys[rows.to(self.keys.device)], _calls=self.calls)

    def fork(self, tag: int) -> "RowStreams":
        """Streams of their own, keyed by `tag` (e.g. a block's index), their counter at 0: row i's draws from them
        depend on (seeds[i], tag, call) only, not on how many draws its batch made before (samplers whose rows
        make different numbers of draws)."""
        return RowStreams((), _keys=_mix64(self.keys ^ _int64((int(tag) + 1) * _MIX1)))

    def at(self, call: int) -> "RowStreams":
        """These streams with their counter at `call` (the next draw is call `call`)."""
        return RowStreams((), _keys=self.keys, _calls=call)

    def bits(self, shape: Sequence[int], device=None) -> torch.Tensor:
        """Int64 words of `shape` (shape[0] rows), the next call's draws; advances the counter."""
        shape = tuple(shape)
        if not shape or shape[0] != len(self):
            raise ValueError(f"RowStreams with {len(self)} rows cannot draw a tensor of shape {shape}")
        if device is not None:
            self.keys = self.keys.to(device)
        call_key = _mix64(self.keys + _int64(self.calls * _GAMMA))
        self.calls += 1
        positions = torch.arange(1, math.prod(shape[1:]) + 1, device=self.keys.device) * _GAMMA
        return _mix64(call_key[:, None] + positions).view(shape)

    def uniform(self, shape: Sequence[int], device=None) -> torch.Tensor:
        """Float64 uniforms in [0, 1) of `shape` (53 random bits each); shape[0] must be the number of rows."""
        return _shift_right(self.bits(shape, device), 11).double() * 2.0**-53


Randomness = torch.Generator | RowStreams | None


def uniform(shape, device=None, generator: Randomness = None) -> torch.Tensor:
    """U[0, 1) draws: float64 from row streams, else torch.rand's float32."""
    if isinstance(generator, RowStreams):
        return generator.uniform(shape, device)
    return torch.rand(shape, device=device, generator=generator)


def randint(low: int, high: int, shape, device=None, generator: Randomness = None) -> torch.Tensor:
    """Integers uniform in [low, high)."""
    if isinstance(generator, RowStreams):
        u = generator.uniform(shape, device)
        return (low + (u * (high - low)).long()).clamp_max(high - 1)
    return torch.randint(low, high, shape, device=device, generator=generator)


def sample_categorical(probs: torch.Tensor, generator: Randomness = None) -> torch.Tensor:
    """One draw per row of `probs` (..., K), in float64: float32 Gumbel noise biases low-entropy draws.

    Row streams use the inverse CDF of one uniform per draw, so a tiny float difference in
    `probs` (another batch shape) changes a draw only if the uniform falls within it of a boundary.
    """
    p = probs.double().clamp_min(0)
    if isinstance(generator, RowStreams):
        cdf = p.cumsum(-1)
        u = generator.uniform(p.shape[:-1], p.device) * cdf[..., -1]
        return torch.searchsorted(cdf, u[..., None], right=True)[..., 0].clamp_max(p.shape[-1] - 1)
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


@dataclass(frozen=True)
class MaskedPrior:
    """Absorbing prior: pi is the one-hot of a dedicated [MASK] id, placed after the real vocabulary."""

    vocab_size: int  # real vocabulary; [MASK] = vocab_size
    kind: Literal["masked"] = "masked"

    @property
    def mask_id(self) -> int:
        return self.vocab_size

    @property
    def model_vocab_size(self) -> int:
        return self.vocab_size + 1

    def noise(self, x: torch.Tensor, alpha: torch.Tensor, generator: Randomness = None) -> torch.Tensor:
        keep = uniform(x.shape, x.device, generator) < alpha
        return torch.where(keep, x, torch.full_like(x, self.mask_id))

    def prior_sample(self, shape, device="cpu", generator: Randomness = None) -> torch.Tensor:
        return torch.full(shape, self.mask_id, dtype=torch.long, device=device)

    def is_noise(self, z: torch.Tensor) -> torch.Tensor:
        return z == self.mask_id

    def fully_noised(self, shape, device="cpu") -> torch.Tensor:
        """The noisy stream at block size 1 (autoregression): every token is [MASK]."""
        return torch.full(shape, self.mask_id, dtype=torch.long, device=device)

    def denoiser_log_probs(self, logits: torch.Tensor, z_t: torch.Tensor) -> torch.Tensor:
        """SUBS parameterisation: never predict [MASK]; visible tokens are carried over."""
        logits = logits.float().clone()
        logits[..., self.mask_id] = -torch.inf
        log_p = logits.log_softmax(-1)
        carry = F.one_hot(z_t, self.model_vocab_size).bool()
        visible = (z_t != self.mask_id)[..., None]
        return torch.where(visible, torch.where(carry, 0.0, -torch.inf), log_p)

    def posterior(self, z_t: torch.Tensor, x_probs: torch.Tensor, alpha_t, alpha_s) -> torch.Tensor:
        """eq. mdm-posterior: probabilities over the model alphabet (..., V + 1)."""
        alpha_t = torch.as_tensor(alpha_t, dtype=torch.float64, device=z_t.device)
        alpha_s = torch.as_tensor(alpha_s, dtype=torch.float64, device=z_t.device)
        x = x_probs.double()
        if x.shape[-1] == self.vocab_size:
            x = F.pad(x, (0, 1))
        z = F.one_hot(z_t, self.model_vocab_size).double()
        a_t, a_s = _bcast(alpha_t, z), _bcast(alpha_s, z)
        masked = ((a_s - a_t) / (1 - a_t)) * x + ((1 - a_s) / (1 - a_t)) * z
        return torch.where((z_t == self.mask_id)[..., None], masked, z)

    def log_prob_clean(self, logits: torch.Tensor, x: torch.Tensor, z_t: torch.Tensor) -> torch.Tensor:
        """log x_hat[x]: a softmax over the real vocabulary at [MASK]; 0 at visible positions (carry-over).

        Computed as logit[x] - logsumexp(real logits), without materialising the distribution.
        """
        logits = logits.float()
        log_px = logits.gather(-1, x[..., None])[..., 0] - logits[..., : self.vocab_size].logsumexp(-1)
        return torch.where(self.is_noise(z_t), log_px, torch.zeros_like(log_px))

    def nelbo(self, logits: torch.Tensor, x: torch.Tensor, z_t: torch.Tensor, t: torch.Tensor, schedule: LogLinearSchedule) -> torch.Tensor:
        """(d alpha/dt) / (1 - alpha_t) * log x_hat[x] on masked positions (>= 0)."""
        weight = schedule.d_alpha(t) / (1 - schedule.alpha(t))
        log_px = self.log_prob_clean(logits, x, z_t)
        return _bcast(weight, log_px) * log_px

    def train_loss(self, logits, x, z_t, t, schedule) -> torch.Tensor:
        """Unweighted cross-entropy; zero at visible positions by carry-over."""
        return -self.log_prob_clean(logits, x, z_t)


@dataclass(frozen=True)
class UniformPrior:
    """Uniform-state prior: pi = 1 / V over the real vocabulary; no [MASK] token."""

    vocab_size: int
    kind: Literal["uniform"] = "uniform"

    @property
    def mask_id(self) -> None:
        return None

    @property
    def model_vocab_size(self) -> int:
        return self.vocab_size

    def noise(self, x: torch.Tensor, alpha: torch.Tensor, generator: Randomness = None) -> torch.Tensor:
        keep = uniform(x.shape, x.device, generator) < alpha
        return torch.where(keep, x, randint(0, self.vocab_size, x.shape, x.device, generator))

    def prior_sample(self, shape, device="cpu", generator: Randomness = None) -> torch.Tensor:
        return randint(0, self.vocab_size, shape, device, generator)

    def fully_noised(self, shape, device="cpu") -> torch.Tensor:
        """The noisy stream at block size 1 (autoregression): one fixed token (id 0).

        A uniform draw would carry no information about x either, but the network's output would
        then depend on the draw; a fixed placeholder makes the AR likelihood exact and deterministic.
        """
        return torch.zeros(shape, dtype=torch.long, device=device)

    def denoiser_log_probs(self, logits: torch.Tensor, z_t: torch.Tensor) -> torch.Tensor:
        return logits.float().log_softmax(-1)

    def log_prob_clean(self, logits: torch.Tensor, x: torch.Tensor, z_t: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits.gather(-1, x[..., None])[..., 0] - logits.logsumexp(-1)

    def posterior(self, z_t: torch.Tensor, x_probs: torch.Tensor, alpha_t, alpha_s) -> torch.Tensor:
        """eq. usdm-posterior, with x one-hot or a distribution (plug-in), in float64."""
        v = self.vocab_size
        alpha_t = torch.as_tensor(alpha_t, dtype=torch.float64, device=z_t.device)
        alpha_s = torch.as_tensor(alpha_s, dtype=torch.float64, device=z_t.device)
        x = x_probs.double()
        z = F.one_hot(z_t, v).double()
        a_t, a_s = _bcast(alpha_t, z), _bcast(alpha_s, z)
        a_ts = a_t / a_s
        mu = v * a_t * z * x + (a_ts - a_t) * z + (a_s - a_t) * x + (1 - a_ts) * (1 - a_s) / v
        norm = v * a_t * (z * x).sum(-1, keepdim=True) + 1 - a_t
        return mu / norm

    def nelbo(
        self,
        logits: torch.Tensor,
        x: torch.Tensor,
        z_t: torch.Tensor,
        t: torch.Tensor,
        schedule: LogLinearSchedule,
        chunk_tokens: int | None = None,
    ) -> torch.Tensor:
        """Per-token f_ELBO of eq. supp:duo-felbo with alpha' = d alpha/dt, times -1 (>= 0).

        With xbar = V a x + (1 - a), xbar_theta = V a x_hat + (1 - a) and i = z_t:
          f = (d alpha/dt) / (V a) * [V/xbar_i - V/xbar_theta_i - sum_r xbar_r/xbar_i log(xbar_theta_i xbar_r / (xbar_theta_r xbar_i))]
        The sum is expanded so that only log xbar_theta needs the full vocabulary (xbar is two-valued).
        Computed in float64: the small terms vanish in bf16.

        The float64 work over the vocabulary is done `chunk_tokens` tokens at a time (default
        `NELBO_CHUNK_TOKENS`): whole, it is several (B, L, V) float64 tensors, 13 GB each at B = 32,
        L = 1024, V = 50k. Under autograd each chunk is checkpointed (recomputed in backward), so only
        the logits are kept for backward. Tokens are independent: chunking changes no value.
        """
        a = _bcast(schedule.alpha(t).double(), x).expand(x.shape)
        da = _bcast(schedule.d_alpha(t).double(), x).expand(x.shape)
        flat = (logits.reshape(-1, logits.shape[-1]), x.reshape(-1), z_t.reshape(-1), a.reshape(-1), da.reshape(-1))
        chunk = chunk_tokens or NELBO_CHUNK_TOKENS
        recompute = torch.is_grad_enabled() and logits.requires_grad
        out = []
        for start in range(0, flat[1].numel(), chunk):
            part = tuple(f[start : start + chunk] for f in flat)
            if recompute:
                out.append(torch.utils.checkpoint.checkpoint(self._nelbo_tokens, *part, use_reentrant=False))
            else:
                out.append(self._nelbo_tokens(*part))
        if not out:
            return torch.zeros(x.shape, device=x.device)
        return torch.cat(out).view(x.shape).float()

    def _nelbo_tokens(self, logits: torch.Tensor, x: torch.Tensor, z_t: torch.Tensor, a: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
        """`nelbo` of N tokens in float64: logits (N, V), the rest (N,)."""
        v = self.vocab_size
        log_x_hat = logits.double().log_softmax(-1)
        x_hat = log_x_hat.exp()
        log_xbar_theta = torch.log(v * a[:, None] * x_hat + (1 - a[:, None]))  # (N, V)
        hit = z_t == x
        hi, lo = v * a + 1 - a, 1 - a  # xbar at r == x and r != x
        xbar_i = torch.where(hit, hi, lo)
        log_xbar_theta_i = log_xbar_theta.gather(-1, z_t[:, None])[:, 0]
        log_xbar_theta_x = log_xbar_theta.gather(-1, x[:, None])[:, 0]
        # sum_r xbar_r log xbar_r and sum_r xbar_r log xbar_theta_r
        s_xlogx = hi * torch.log(hi) + (v - 1) * lo * torch.log(lo)
        s_xlogtheta = lo * log_xbar_theta.sum(-1) + v * a * log_xbar_theta_x
        total = v  # sum_r xbar_r
        sum_term = (total * (log_xbar_theta_i - torch.log(xbar_i)) + s_xlogx - s_xlogtheta) / xbar_i
        bracket = v / xbar_i - v / log_xbar_theta_i.exp() - sum_term
        return da / (v * a) * bracket

    def train_loss(self, logits, x, z_t, t, schedule) -> torch.Tensor:
        return self.nelbo(logits, x, z_t, t, schedule)


Prior = MaskedPrior | UniformPrior
PRIORS = {"masked": MaskedPrior, "uniform": UniformPrior}


def make_prior(kind: str, vocab_size: int) -> Prior:
    if kind not in PRIORS:
        raise ValueError(f"unknown prior {kind!r}; choose one of {sorted(PRIORS)}")
    return PRIORS[kind](vocab_size)


def _bcast(a: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Right-pad the dims of a per-sequence (or scalar) tensor so it broadcasts against `like`."""
    a = torch.as_tensor(a, device=like.device)
    while a.dim() < like.dim():
        a = a[..., None]
    return a
