"""Entropy-bounded unmasking (the EB-sampler: Ben-Hamu et al. 2025, "Accelerated Sampling from Masked Diffusion
Models via Entropy Bounded Unmasking", arXiv:2505.24857, section 3; vLLM's DiffusionGemma sampler uses the same
acceptance rule). Each step orders the undecided positions by the entropy of their (tempered) distribution, lowest
first, and commits the longest prefix U of that order whose entropies satisfy sum(H_U) - max(H_U) <= gamma
(`entropy_bound`): at least one position, more when the model is sure of several; gamma = 0 commits one position
per step whenever entropies are positive.

Where the source is silent, chosen here: entropies are compared on the score grid (2^-13 nats) so that float
noise cannot change k; a uniform-state model's undecided positions keep their prior draw (committing from the
proposal)."""

from __future__ import annotations

from blockgen.models.samplers import Option, register
from blockgen.models.samplers.position_committing import PositionCommitting


# gamma, the EB-sampler's error bound in nats (0: one position per step wherever entropies are positive)
GAMMA = Option("entropy_bound", float, 0.1, "gamma (nats): sum(H) - max(H) of a step's positions at most this", low=0.0)


@register
class EntropyBounded(PositionCommitting):
    name = "entropy_bounded"
    summary = "each step commits the lowest-entropy positions while their summed entropy less its largest <= the bound"
    options = (GAMMA,)
    color = "tab:pink"

    def plan(self, config, step, confidence, entropy, undecided, generated):
        import torch

        order_key = entropy.masked_fill(~undecided, torch.inf)
        ordered = order_key.sort(dim=-1, stable=True).values  # ties to the lower position, as the commit's order
        ordered = torch.where(ordered.isinf(), 0.0, ordered)  # decided positions add nothing (they are not counted)
        within = ordered.cumsum(-1) - ordered.cummax(-1).values <= config.option(GAMMA.name)
        prefix = (within & (torch.arange(ordered.shape[-1], device=ordered.device) < undecided.sum(-1, keepdim=True)))
        return entropy, prefix.sum(-1).clamp_min(1)
