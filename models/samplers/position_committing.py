"""The base of the field's parallel decoders (confidence_threshold.py, entropy_bounded.py, low_confidence.py): each
step commits some undecided positions of the block to tokens drawn from the denoiser and leaves the others as they
are (`models.sampling.unmasking_block`); a subclass writes only its `plan`."""

from __future__ import annotations

from blockgen.models.samplers import Sampler


class PositionCommitting(Sampler):
    """A sampler of the field's parallel decoders: each step commits some undecided positions of the block to
    tokens drawn from the denoiser and leaves the others as they are (`models.sampling.unmasking_block`).
    `plan` is its rule: how many positions each row commits at this step, and in what order."""

    needs_untimed_network = True
    commits_positions = True
    adaptive = True  # calls per block follow the data (a fixed schedule says otherwise)
    priced_as = "ancestral"  # the same call per step: a block of noisy tokens

    def calls_per_block(self, config, block_size, eps=1e-3) -> int:
        """At most one call per position: what a dry run prices an adaptive sampler at, and says so."""
        return block_size

    def plan(self, config, step: int, confidence, entropy, undecided, generated):
        """(key, k): commit the k[b] undecided positions of row b of lowest key (ties: the lower position).
        `confidence` (r, L'): the untempered probability of each position's draw; `entropy`: of its tempered
        distribution (both on the score grid); `undecided` (r, L') bool; `generated` (r,): the positions the
        row generates in this block; `step`: the block's step, from 0."""
        raise NotImplementedError

    def block(self, dec, config, generator, trace=None, block_index=0):
        from blockgen.models.sampling import unmasking_block

        return unmasking_block(dec, config, generator, trace, block_index)
