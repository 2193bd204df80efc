"""Confidence-threshold parallel decoding (Fast-dLLM: Wu et al. 2025, "Fast-dLLM: Training-free Acceleration of
Diffusion LLM by Enabling KV Cache and Parallel Decoding", arXiv:2505.22618, section 3.3 and its `generate.py`,
threshold mode; SGLang's `LowConfidence` and dInfer run the same rule). Each step commits every undecided position
whose drawn token has probability above `threshold`, and at least the most confident one, so the calls per block
vary by row and by block. `max_per_step` (0: no cap) keeps only the most confident ones when more pass.

Where the source is silent, chosen here: confidence is the untempered probability of the drawn token (as the
source's code reads it; the token is drawn at the temperature); a uniform-state model has no [MASK], so its
undecided positions keep their prior draw as input and a position is committed from the proposal."""

from __future__ import annotations

from blockgen.models.samplers import Option, register
from blockgen.models.samplers.position_committing import PositionCommitting


@register
class ConfidenceThreshold(PositionCommitting):
    name = "confidence_threshold"
    summary = "each step commits every position whose drawn token has probability above `threshold` (at least one)"
    color = "tab:orange"
    options = (Option("threshold", float, 0.9, "commit positions whose drawn token is this likely (Fast-dLLM: 0.9)",
                      low=0.0, high=1.0, low_open=True, high_open=True),
               Option("max_per_step", int, 0, "commit at most this many positions per step (0: no cap)", low=0))

    def plan(self, config, step, confidence, entropy, undecided, generated):
        passing = (undecided & (confidence > config.option("threshold"))).sum(-1).clamp_min(1)
        if config.option("max_per_step"):
            passing = passing.clamp_max(config.option("max_per_step"))
        return -confidence, passing
