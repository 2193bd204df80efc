"""Autoregressive decoding at block size 1: the network as its own AR model, one token per call."""

from __future__ import annotations

from blockgen.models.samplers import Sampler, register


class Autoregressive(Sampler):
    autoregressive = True

    def check(self, config) -> None:
        if config.block_size not in (None, 1):
            raise ValueError(f"sampler {self.name!r} decodes one token per call; block_size must be 1 or None")

    def block(self, dec, config, generator, trace=None, block_index=0):
        from blockgen.models.sampling import ar_token

        return ar_token(dec, config, generator, trace, block_index, greedy=not self.reads_temperature)


@register
class ARGreedy(Autoregressive):
    name = "ar_greedy"
    summary = "the most likely token at each position (reads no temperature)"
    reads_temperature = False
    color = "black"


@register
class ARSample(Autoregressive):
    name = "ar_sample"
    summary = "a token drawn from the tempered distribution at each position"
    priced_as = "ar_greedy"  # the same call; only the draw differs
    color = "tab:gray"
