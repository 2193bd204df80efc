"""Training objective and evaluation bounds of BlockGen (paper section 3, appendices C and E).

- `BlockMixture`: block sizes and weights gamma; `stratified_block_sizes` is Algorithm 1.
- `noisy_forward`: noise x -> z_t for one block size, run `[x0 ; z_t]`, return per-token losses.
  Block size 1 is autoregression: z_t is `prior.fully_noised` and the loss is the exact cross-entropy.
- `sequence_nll_draws` / `sequence_nll`: per-sequence NELBO (or exact NLL at block size 1) of each
  of K_MC draws / their mean.
- `lse_bound` / `jensen_bound`: eq. supp:valid-lse and the mixture (Jensen) bound, per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockgen.models.backbone import DiT
from blockgen.models.diffusion import LogLinearSchedule, Prior, Randomness, uniform


@dataclass(frozen=True)
class BlockMixture:
    sizes: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.weights) or not self.sizes:
            raise ValueError(f"need one weight per block size, got sizes={self.sizes} weights={self.weights}")
        if any(s < 1 for s in self.sizes) or len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"block sizes must be distinct positive integers, got {self.sizes}")
        if any(w <= 0 for w in self.weights) or not math.isclose(sum(self.weights), 1.0, abs_tol=1e-6):
            raise ValueError(f"weights must be positive and sum to 1, got {self.weights}")

    @classmethod
    def single(cls, size: int) -> "BlockMixture":
        return cls((size,), (1.0,))

    @property
    def is_autoregressive(self) -> bool:
        return self.sizes == (1,)

    def check_divides(self, seq_len: int) -> None:
        bad = [s for s in self.sizes if seq_len % s]
        if bad:
            raise ValueError(f"block sizes {bad} do not divide the sequence length {seq_len}")


def stratified_indices(weights: torch.Tensor | tuple[float, ...], n_slots: int, u: float) -> list[int]:
    """Algorithm 1: one mixture component per slot; slot d takes the bin containing (d/D + u) mod 1.

    Each component i then gets floor(D gamma_i) or ceil(D gamma_i) slots, and every slot is
    marginally distributed as Cat(gamma), so the gradient stays unbiased.
    """
    cum = torch.cumsum(torch.as_tensor(weights, dtype=torch.float64), 0)
    cum[-1] = 1.0  # guard against rounding: every u~ in [0, 1) falls in a bin
    shifted = [(d / n_slots + u) % 1.0 for d in range(n_slots)]
    return [int(torch.searchsorted(cum, torch.tensor(v, dtype=torch.float64), right=True)) for v in shifted]


def stratified_times(n: int, u: float, schedule: LogLinearSchedule, device="cpu") -> torch.Tensor:
    """n evenly spaced, randomly shifted points in [0, 1), mapped to t in [t_min, 1]."""
    grid = (torch.arange(n, dtype=torch.float64, device=device) / n + u) % 1.0
    return schedule.t_from_uniform(grid).float()


def noisy_forward(
    model: DiT,
    prior: Prior,
    x: torch.Tensor,
    block_size: int,
    t: torch.Tensor,
    schedule: LogLinearSchedule,
    condition_mask: torch.Tensor | None = None,
    generator: Randomness = None,
    objective: str = "train",
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token losses (B, L) for one block size.

    `condition_mask` marks tokens that stay clean in the noisy stream (a prompt, e.g. the question of
    a word problem), as they are at sampling time. `objective` is "train" (masked: unweighted CE;
    uniform: NELBO) or "nelbo" (the evaluation bound). At block size 1 both are the exact AR NLL.
    `valid` marks real tokens of rows padded to a common length (`DiT.forward_train`): padding is
    invisible to them; its own losses are meaningless and must be masked out by the caller.
    """
    if block_size == 1:  # fully noised: the noisy token carries no information about x
        z_t = prior.fully_noised(x.shape, device=x.device)
    else:
        z_t = prior.noise(x, schedule.alpha(t)[:, None], generator=generator)
    if condition_mask is not None:
        z_t = torch.where(condition_mask, x, z_t)
    logits = model.forward_train(x, z_t, block_size, valid)
    if block_size == 1:
        loss = -prior.log_prob_clean(logits, x, z_t)
        return loss if condition_mask is None else loss.masked_fill(condition_mask, 0.0)
    return prior_losses(prior, logits, x, z_t, t, schedule, objective, condition_mask)


def prior_losses(
    prior: Prior,
    logits: torch.Tensor,
    x: torch.Tensor,
    z_t: torch.Tensor,
    t: torch.Tensor,
    schedule: LogLinearSchedule,
    objective: str,
    condition_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token losses (B, L) of the denoiser's `logits` for noisy `z_t` at times t: the prior's
    training loss ("train") or NELBO integrand ("nelbo"); zero on the clean prompt (`condition_mask`)."""
    if objective == "train":
        loss = prior.train_loss(logits, x, z_t, t, schedule)
    elif objective == "nelbo":
        loss = prior.nelbo(logits, x, z_t, t, schedule)
    else:
        raise ValueError(f"objective={objective!r}; choose 'train' or 'nelbo'")
    if condition_mask is not None:
        loss = loss.masked_fill(condition_mask, 0.0)
    return loss


@torch.no_grad()
def sequence_nll_draws(
    model: DiT,
    prior: Prior,
    x: torch.Tensor,
    loss_mask: torch.Tensor,
    block_size: int,
    k_mc: int,
    schedule: LogLinearSchedule,
    condition_mask: torch.Tensor | None = None,
    generator: Randomness = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """eq. supp:mc-nll's terms: the per-sequence NELBO of each of K_MC draws of (t, z_t), (K, B).

    The K_MC times of one sequence are stratified over [t_min, 1]. Block size 1 is exact, so one
    draw suffices (K = 1). Summed over `loss_mask` positions (float64). With `RowStreams` each
    row draws its times and noise from its own stream (`valid`: see `noisy_forward`).
    """
    draws = 1 if block_size == 1 else k_mc
    u = uniform((x.shape[0],), x.device, generator)
    out = []
    for k in range(draws):
        t = schedule.t_from_uniform((u + k / draws) % 1.0)
        loss = noisy_forward(model, prior, x, block_size, t, schedule, condition_mask, generator, "nelbo", valid)
        out.append((loss.double() * loss_mask).sum(-1))
    return torch.stack(out)


def sequence_nll(*args, **kwargs) -> torch.Tensor:
    """eq. supp:mc-nll: per-sequence NLL bound (B,), the mean of `sequence_nll_draws` (same arguments)."""
    return sequence_nll_draws(*args, **kwargs).mean(0)


def lse_bound(nll: torch.Tensor, weights: tuple[float, ...] | torch.Tensor) -> torch.Tensor:
    """eq. supp:valid-lse: -log sum_i gamma_i exp(-NLL_i) per sequence; `nll` is (M, B)."""
    log_w = torch.log(torch.as_tensor(weights, dtype=torch.float64, device=nll.device))[:, None]
    return -torch.logsumexp(log_w - nll.double(), dim=0)


def jensen_bound(nll: torch.Tensor, weights: tuple[float, ...] | torch.Tensor) -> torch.Tensor:
    """The mixture likelihood bound sum_i gamma_i NLL_i (looser; its gradient is what training uses)."""
    w = torch.as_tensor(weights, dtype=torch.float64, device=nll.device)[:, None]
    return (w * nll.double()).sum(0)


@torch.no_grad()
def mixture_nll(
    model: DiT,
    prior: Prior,
    mixture: BlockMixture,
    x: torch.Tensor,
    loss_mask: torch.Tensor,
    k_mc: int,
    schedule: LogLinearSchedule,
    condition_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp bound, Jensen bound) per sequence, each (B,), from every component's NELBO."""
    per_size = component_nll(model, prior, mixture, x, loss_mask, k_mc, schedule, condition_mask, generator)
    return lse_bound(per_size, mixture.weights), jensen_bound(per_size, mixture.weights)


@torch.no_grad()
def component_nll(
    model: DiT,
    prior: Prior,
    mixture: BlockMixture,
    x: torch.Tensor,
    loss_mask: torch.Tensor,
    k_mc: int,
    schedule: LogLinearSchedule,
    condition_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Each block size's NELBO alone, per sequence: (M, B) in the mixture's order of sizes."""
    return torch.stack(
        [sequence_nll(model, prior, x, loss_mask, s, k_mc, schedule, condition_mask, generator) for s in mixture.sizes]
    )
