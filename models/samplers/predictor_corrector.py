"""The paper's informed predictor-corrector samplers (Algorithms 2 and 3): `warmup` ancestral steps, then an
informed step at the first non-warm-up step and every `ge` steps after, which draws a clean proposal and
re-noises its k lowest-scoring positions. EIPC scores a token by the negative entropy of the denoiser's
marginal; ARPC by its log-likelihood under the same network at block size 1 (one extra call)."""

from __future__ import annotations

from blockgen.models.sampler_config import renoise_count
from blockgen.models.samplers import Sampler, register


class PredictorCorrector(Sampler):
    informed = True

    def check(self, config) -> None:
        if config.warmup >= config.steps:
            raise ValueError(f"warmup={config.warmup} leaves no informed step of {self.name!r}; "
                             f"choose warmup in 0..{config.steps - 1}")

    def block(self, dec, config, generator, trace=None, block_index=0):
        from blockgen.models.sampling import diffusion_block

        return diffusion_block(dec, config, generator, trace, block_index)

    def score(self, dec, config, proposal, x_probs):
        """(B, L') score of each proposed token: the lowest are re-noised."""
        raise NotImplementedError


@register
class EIPC(PredictorCorrector):
    name = "eipc"
    summary = "informed steps re-noise the proposal's tokens of highest denoiser entropy (no extra call)"
    priced_as = "ancestral"  # the same model call per step
    color = "tab:green"

    def score(self, dec, config, proposal, x_probs):
        import torch

        return torch.special.xlogy(x_probs, x_probs).sum(-1)  # negative entropy; 0 log 0 = 0


@register
class ARPC(PredictorCorrector):
    name = "arpc"
    summary = "informed steps re-noise the proposal's tokens least likely under the same network at block size 1"
    needs_ar_pass = True
    color = "tab:red"

    def paper_nfe_per_block(self, config) -> int:
        """Appendix D: one AR pass per informed step counted, the last step's included."""
        return config.steps + (config.steps - 1 - config.warmup) // config.ge + 1

    def calls_per_block(self, config, block_size, eps=1e-3) -> int:
        """The AR pass is skipped where it could change nothing: at the last step k = 0."""
        passes = sum(1 for i in range(config.steps)
                     if config.informed(i) and renoise_count(i, config.steps, block_size, eps) > 0)
        return config.steps + passes

    def score(self, dec, config, proposal, x_probs):
        from blockgen.models.sampling import tempered_log_probs

        ar_logits, noise = dec.ar_pass(proposal)
        return tempered_log_probs(dec.prior, ar_logits, noise, config.temperature).gather(-1, proposal[..., None])[..., 0]
