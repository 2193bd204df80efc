"""Ancestral sampling (the paper's baseline): N_step reverse steps per block, z_s ~ q_{s|t}(. | z_t, x_hat)."""

from __future__ import annotations

from blockgen.models.samplers import Sampler, register


@register
class Ancestral(Sampler):
    name = "ancestral"
    summary = "N_step reverse steps per block, each drawn from the prior's posterior with the denoiser plugged in"
    color = "tab:blue"

    def block(self, dec, config, generator, trace=None, block_index=0):
        from blockgen.models.sampling import diffusion_block

        return diffusion_block(dec, config, generator, trace, block_index)
