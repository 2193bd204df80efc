"""BlockGen: one DiT denoiser, one prior, one block-size mixture (paper section 3)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn as nn

from blockgen.models.backbone import BackboneConfig, DiT
from blockgen.models.diffusion import LogLinearSchedule, make_prior
from blockgen.models.objectives import BlockMixture, component_nll, mixture_nll, noisy_forward


@dataclass(frozen=True)
class BlockGenConfig:
    """Everything needed to rebuild a model from its checkpoint's config.json."""

    vocab_size: int  # real vocabulary (the tokenizer's); the masked prior adds [MASK] after it
    seq_len: int
    prior: Literal["masked", "uniform"] = "masked"
    block_sizes: tuple[int, ...] = (16,)
    block_weights: tuple[float, ...] = (1.0,)
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    cond_dim: int = 128
    dropout: float = 0.1
    causal_clean: bool = True
    eps: float = 1e-3
    attention: Literal["sdpa", "flex"] = "sdpa"
    special_tokens: dict = field(default_factory=dict)  # SpecialTokens.to_dict(): bos/eos/pad/sep ids

    def __post_init__(self) -> None:
        make_prior(self.prior, self.vocab_size)  # validates the name
        self.mixture.check_divides(self.seq_len)

    @property
    def mixture(self) -> BlockMixture:
        return BlockMixture(tuple(self.block_sizes), tuple(self.block_weights))

    def backbone(self) -> BackboneConfig:
        return BackboneConfig(
            vocab_size=make_prior(self.prior, self.vocab_size).model_vocab_size,
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            cond_dim=self.cond_dim,
            dropout=self.dropout,
            max_len=self.seq_len,
            causal_clean=self.causal_clean,
            attention=self.attention,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BlockGenConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known - {"model_type", "training"}
        if unknown:
            raise ValueError(f"unknown BlockGen config fields {sorted(unknown)}; known: {sorted(known)}")
        d = {k: v for k, v in d.items() if k in known}
        for key in ("block_sizes", "block_weights"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


class BlockGen(nn.Module):
    def __init__(self, config: BlockGenConfig) -> None:
        super().__init__()
        self.config = config
        self.prior = make_prior(config.prior, config.vocab_size)
        self.schedule = LogLinearSchedule(eps=config.eps)
        self.mixture = config.mixture
        self.dit = DiT(config.backbone())

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
        """
        losses = noisy_forward(self.dit, self.prior, x, block_size, t, self.schedule, condition_mask, generator)
        return (losses * loss_mask).sum(), loss_mask.sum()

    loss = forward

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
        return mixture_nll(self.dit, self.prior, self.mixture, x, loss_mask, k_mc, self.schedule, condition_mask, generator)

    def nll_by_block_size(
        self,
        x: torch.Tensor,
        loss_mask: torch.Tensor,
        k_mc: int = 8,
        condition_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Per-sequence NELBO of each trained block size alone, (M, B) in `mixture.sizes` order."""
        return component_nll(self.dit, self.prior, self.mixture, x, loss_mask, k_mc, self.schedule, condition_mask, generator)
