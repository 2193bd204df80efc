"""Low-confidence remasking (LLaDA: Nie et al. 2025, "Large Language Diffusion Models", arXiv:2502.09992, section
2.4 and Appendix B.3, the `low_confidence` remasking of its `generate.py`). Each of `steps` steps commits a fixed
number of positions, the most confident first (a deterministic order instead of ancestral sampling's random
unmasking): a block's n positions are spread over the steps as evenly as possible, the earlier steps taking one
more when n is not a multiple of `steps` (the source's `get_num_transfer_tokens`). With more steps than positions
the steps that would commit nothing are not run.

Where the source is silent, chosen here: confidence is the untempered probability of the drawn token (the
source's `softmax(logits)` at the token drawn with Gumbel noise at the temperature); ties go to the lower
position; a uniform-state model's undecided positions keep their prior draw (committing from the proposal)."""

from __future__ import annotations

from blockgen.models.samplers import register
from blockgen.models.samplers.position_committing import PositionCommitting


@register
class LowConfidence(PositionCommitting):
    name = "low_confidence"
    summary = "`steps` steps per block, each committing an equal share of positions, the most confident first"
    color = "tab:brown"
    adaptive = False  # min(steps, positions) calls per block

    def paper_nfe_per_block(self, config) -> int:
        return config.steps

    def calls_per_block(self, config, block_size, eps=1e-3) -> int:
        return min(config.steps, block_size)

    def plan(self, config, step, confidence, entropy, undecided, generated):
        share = generated // config.steps + (step < generated % config.steps).long()
        return -confidence, share
