"""BlockGen: one DiT denoiser, one prior, one block-size mixture (paper section 3).

The same class holds the paper's baselines, chosen by `BlockGenConfig.architecture` (never a fork):
- "blockgen" (default): `[x0 ; xt]`, the block-size mixture, the log-sum-exp bound;
- "ar": a plain causal transformer (block sizes (1,), masked prior whose [MASK] row is never
  predicted): loss and likelihood are the exact next-token cross-entropy;
- "full_sequence": one bidirectional pass over the noisy sequence (block sizes (seq_len,)): MDLM
  with the masked prior, Duo with the uniform prior and `time_conditioning=True`; loss and
  likelihood are the prior's NELBO at K_MC stratified times; generation is one block of seq_len.
Every family has the same methods: `forward` (training loss), `nll_bounds`, `nll_by_block_size`,
`sequence_nll_draws`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal

import torch
import torch.nn as nn

from blockgen.models.backbone import ARCHITECTURES, BackboneConfig, DiT, ModelShape
from blockgen.models.diffusion import LogLinearSchedule, Randomness, UniformPrior, make_prior, uniform
from blockgen.models.objectives import (
    BlockMixture,
    component_nll,
    jensen_bound,
    lse_bound,
    mixture_nll,
    noisy_forward,
    prior_losses,
    sequence_nll_draws,
)


@dataclass(frozen=True)
class BlockGenConfig:
    """Everything needed to rebuild a model from its checkpoint's config.json.

    config.json is flat: the network's size (`shape`) is written as its fields (n_layers, d_model,
    ...) at the top level where they always stood, so every checkpoint reads and writes one format.
    """

    vocab_size: int  # real vocabulary (the tokenizer's); the masked prior adds [MASK] after it
    seq_len: int
    prior: Literal["masked", "uniform"] = "masked"
    block_sizes: tuple[int, ...] = (16,)
    block_weights: tuple[float, ...] = (1.0,)
    shape: ModelShape = ModelShape()  # the network's size (backbone.SIZES names some)
    causal_clean: bool = True
    eps: float = 1e-3
    attention: Literal["sdpa", "flex"] = "sdpa"
    special_tokens: dict = field(default_factory=dict)  # SpecialTokens.to_dict(): bos/eos/pad/sep ids
    # Options for the baselines and for other code bases' networks (module docstrings here and in
    # backbone.py); the defaults are this project's BlockGen, so older config.json files load unchanged.
    architecture: Literal["blockgen", "ar", "full_sequence"] = "blockgen"
    adaln: bool = True
    time_conditioning: bool = False
    cond_silu: bool = False
    # The noisy stream at block size 1 under the uniform prior: "fixed" (token 0, this project's
    # training) or "random" (a fixed pseudo-random draw per position: the authors train on uniform draws).
    ar_placeholder: Literal["fixed", "random"] = "fixed"

    def __post_init__(self) -> None:
        make_prior(self.prior, self.vocab_size)  # validates the name
        self.mixture.check_divides(self.seq_len)
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; choose one of {list(ARCHITECTURES)}")
        if self.architecture == "ar" and (tuple(self.block_sizes) != (1,) or self.prior != "masked"):
            raise ValueError(f"architecture='ar' needs block_sizes=(1,) and prior='masked' (its [MASK] row is never "
                             f"predicted), got block_sizes={tuple(self.block_sizes)} prior={self.prior!r}")
        if self.architecture == "full_sequence" and tuple(self.block_sizes) != (self.seq_len,):
            raise ValueError(f"architecture='full_sequence' is one block over the sequence: block_sizes=({self.seq_len},), "
                             f"got {tuple(self.block_sizes)}")
        if self.ar_placeholder not in ("fixed", "random"):
            raise ValueError(f"ar_placeholder={self.ar_placeholder!r}; choose 'fixed' or 'random'")
        self.backbone()  # validates the network options

    @property
    def mixture(self) -> BlockMixture:
        return BlockMixture(tuple(self.block_sizes), tuple(self.block_weights))

    def backbone(self) -> BackboneConfig:
        return BackboneConfig(
            vocab_size=make_prior(self.prior, self.vocab_size).model_vocab_size,
            shape=self.shape,
            max_len=self.seq_len,
            causal_clean=self.causal_clean,
            attention=self.attention,
            architecture=self.architecture,
            adaln=self.adaln,
            time_conditioning=self.time_conditioning,
            cond_silu=self.cond_silu,
        )

    def to_dict(self) -> dict:
        """config.json's fields: flat, the shape's fields in its place (the order is the file's)."""
        out: dict = {}
        for key, value in asdict(self).items():
            out.update(value if key == "shape" else {key: value})
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "BlockGenConfig":
        """From config.json's flat fields (`to_dict`); a missing field takes its default."""
        shape_keys = [f.name for f in fields(ModelShape)]
        own = [f.name for f in fields(cls) if f.name != "shape"]
        unknown = set(d) - set(own) - set(shape_keys) - {"model_type", "training"}
        if unknown:
            raise ValueError(f"unknown BlockGen config fields {sorted(unknown)}; known: {sorted(own + shape_keys)}")
        kwargs = {k: d[k] for k in own if k in d}
        for key in ("block_sizes", "block_weights"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs, shape=ModelShape(**{k: d[k] for k in shape_keys if k in d}))


@dataclass(frozen=True)
class RandomPlaceholderUniformPrior(UniformPrior):
    """The uniform prior whose block-size-1 placeholder is a fixed pseudo-random token per position.

    The authors feed uniform draws at block size 1; a fixed draw (seed 0) is one such input and keeps
    the AR likelihood deterministic.
    """

    def fully_noised(self, shape, device="cpu") -> torch.Tensor:
        n = shape[-1]
        draw = torch.randint(0, self.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        return draw.to(device).expand(*shape).clone()


class BlockGen(nn.Module):
    def __init__(self, config: BlockGenConfig) -> None:
        super().__init__()
        self.config = config
        self.prior = make_prior(config.prior, config.vocab_size)
        if config.prior == "uniform" and config.ar_placeholder == "random":
            self.prior = RandomPlaceholderUniformPrior(config.vocab_size)
        self.schedule = LogLinearSchedule(eps=config.eps)
        self.mixture = config.mixture
        self.dit = DiT(config.backbone())

    @property
    def architecture(self) -> str:
        return self.config.architecture

    def forward(
        self,
        x: torch.Tensor,
        loss_mask: torch.Tensor,
        block_size: int,
        t: torch.Tensor,
        condition_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training loss: (sum over loss_mask, number of loss tokens) for one micro-batch.

        It is `forward` so that DistributedDataParallel can wrap the model; `loss` is the same call.
        AR: next-token cross-entropy (t is unused; the first token, which nothing predicts, carries
        no loss). Full sequence: the prior's training loss at time t over the whole sequence.
        """
        if self.architecture == "full_sequence":
            losses = self.full_sequence_losses(x, t, condition_mask, generator, "train")
        else:
            losses = noisy_forward(self.dit, self.prior, x, block_size, t, self.schedule, condition_mask, generator)
        if self.architecture == "ar":
            loss_mask = loss_mask.clone()
            loss_mask[:, 0] = 0
        return (losses * loss_mask).sum(), loss_mask.sum()

    loss = forward

    def sigma(self, t: torch.Tensor) -> torch.Tensor:
        """The time conditioning sigma = -log alpha_t (B,), what a time-conditioned network embeds."""
        return -torch.log(self.schedule.alpha(t))

    def full_sequence_losses(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        condition_mask: torch.Tensor | None = None,
        generator: Randomness = None,
        objective: str = "train",
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token losses (B, L) of full-sequence diffusion at times t (B,): noise the whole sequence
        (the prompt, `condition_mask`, stays clean), one bidirectional pass, the prior's loss
        ("train") or NELBO integrand ("nelbo")."""
        z_t = self.prior.noise(x, self.schedule.alpha(t)[:, None], generator=generator)
        if condition_mask is not None:
            z_t = torch.where(condition_mask, x, z_t)
        logits = self.dit.forward_full(z_t, self.sigma(t), valid)
        return prior_losses(self.prior, logits, x, z_t, t, self.schedule, objective, condition_mask)

    @torch.no_grad()
    def sequence_nll_draws(
        self,
        x: torch.Tensor,
        loss_mask: torch.Tensor,
        block_size: int,
        k_mc: int,
        condition_mask: torch.Tensor | None = None,
        generator: Randomness = None,
        valid: torch.Tensor | None = None,
        net=None,
    ) -> torch.Tensor:
        """Per-sequence NELBO of each of K_MC draws at one block size, (K, B) (objectives.sequence_nll_draws).

        `net` replaces the denoiser of the BlockGen and AR paths (a wrapper that records logits).
        Full sequence: K_MC stratified times, each with its own noise, time-conditioned where the
        model is.
        """
        if self.architecture != "full_sequence":
            return sequence_nll_draws(net or self.dit, self.prior, x, loss_mask, block_size, k_mc, self.schedule,
                                      condition_mask, generator, valid)
        u = uniform((x.shape[0],), x.device, generator)
        out = []
        for k in range(k_mc):
            t = self.schedule.t_from_uniform((u + k / k_mc) % 1.0)
            loss = self.full_sequence_losses(x, t, condition_mask, generator, "nelbo", valid)
            out.append((loss.double() * loss_mask).sum(-1))
        return torch.stack(out)

    @torch.no_grad()
    def nll_bounds(
        self,
        x: torch.Tensor,
        loss_mask: torch.Tensor,
        k_mc: int = 8,
        condition_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence (log-sum-exp, Jensen) NLL bounds over the model's mixture."""
        if self.architecture == "blockgen":
            return mixture_nll(self.dit, self.prior, self.mixture, x, loss_mask, k_mc, self.schedule, condition_mask, generator)
        per_size = self.nll_by_block_size(x, loss_mask, k_mc, condition_mask, generator)
        return lse_bound(per_size, self.mixture.weights), jensen_bound(per_size, self.mixture.weights)

    def nll_by_block_size(
        self,
        x: torch.Tensor,
        loss_mask: torch.Tensor,
        k_mc: int = 8,
        condition_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Per-sequence NELBO of each trained block size alone, (M, B) in `mixture.sizes` order."""
        if self.architecture == "blockgen":
            return component_nll(self.dit, self.prior, self.mixture, x, loss_mask, k_mc, self.schedule, condition_mask, generator)
        return torch.stack([self.sequence_nll_draws(x, loss_mask, s, k_mc, condition_mask, generator).mean(0)
                            for s in self.mixture.sizes])
