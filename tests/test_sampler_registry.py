"""The sampler registry (models/samplers/): what it holds, its errors, and a sampler defined outside the built-in
modules run by `generate` and read by the parts that used to compare sampler names (pricing, labels, plots)."""

import pytest
import torch

from blockgen.models import samplers
from blockgen.models.sampler_config import SamplerConfig, calls_per_block, paper_nfe_per_block
from blockgen.models.sampling import diffusion_block, generate
from sampling_models import tiny_model


def test_the_built_in_samplers_and_their_declarations():
    registry = samplers.load()
    # the paper's diffusion samplers, the field's position-committing ones, then AR
    assert list(registry) == ["ancestral", "eipc", "arpc", "confidence_threshold", "entropy_bounded", "low_confidence",
                              "ar_greedy", "ar_sample"]
    assert samplers.autoregressive_names() == ("ar_greedy", "ar_sample")
    assert [n for n, s in registry.items() if s.adaptive] == ["confidence_threshold", "entropy_bounded"]
    assert [n for n, s in registry.items() if s.needs_untimed_network] == ["confidence_threshold", "entropy_bounded",
                                                                             "low_confidence"]
    assert [n for n, s in registry.items() if s.informed] == ["eipc", "arpc"]
    assert [n for n, s in registry.items() if s.needs_ar_pass] == ["arpc"]
    assert [n for n, s in registry.items() if not s.reads_temperature] == ["ar_greedy"]
    assert {n: s.priced_as for n, s in registry.items() if s.priced_as} == {"eipc": "ancestral", "ar_sample": "ar_greedy"}
    assert len({s.color for s in registry.values()}) == len(registry)  # one colour each
    assert all(s.summary for s in registry.values())


def test_unknown_and_duplicate_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown sampler 'ancestrall'; choose one of \['ancestral', 'eipc'"):
        SamplerConfig("ancestrall")
    monkeypatch.setattr(samplers, "_REGISTRY", dict(samplers.load()))

    class Impostor(samplers.Sampler):
        name = "eipc"
        summary = "another eipc"

    with pytest.raises(ValueError, match=r"two samplers are registered as 'eipc': "
                                         r"blockgen.models.samplers.predictor_corrector.EIPC and test_sampler_registry.Impostor"):
        samplers.register(Impostor)


class FirstCommitted(samplers.Sampler):
    """A toy sampler: each step, ancestral sampling, then only the `lead` leftmost masked positions keep their draw."""

    name = "toy_leftmost"
    summary = "ancestral draws, `lead` positions committed per step, left to right"
    priced_as = "ancestral"
    color = "tab:olive"
    options = (samplers.Option("lead", int, 1, "positions committed per step", low=1, high=8),)

    def calls_per_block(self, config, block_size, eps=1e-3):
        return config.steps

    def block(self, dec, config, generator, trace=None, block_index=0):
        from blockgen.models.sampling import _probs, ancestral_step

        prior = dec.prior
        z = dec.pin(prior.prior_sample((dec.batch, dec.block_size), device=dec.device, generator=generator))
        for i in range(config.steps):
            x_probs, _ = _probs(prior, dec.denoise(z), z, config.temperature)
            drawn = ancestral_step(prior, z, x_probs, 1.0 - 1e-3, 1.0, generator)
            masked = z == prior.mask_id
            first = masked & (masked.cumsum(-1) <= config.option("lead"))
            z = dec.pin(torch.where(first | (i == config.steps - 1) & masked, drawn, z))
            if trace is not None:
                trace(block_index, i, z)
        return z


@pytest.fixture()
def toy(monkeypatch):
    monkeypatch.setattr(samplers, "_REGISTRY", dict(samplers.load()))
    samplers.register(FirstCommitted)
    return samplers.get("toy_leftmost")


def test_a_sampler_of_one_class_runs_everywhere_the_registry_is_read(toy):
    model = tiny_model("masked", sizes=(1, 4))
    config = SamplerConfig("toy_leftmost", steps=4, block_size=4, max_new_tokens=8, temperature=0.5)
    steps = []
    out = generate(model, [[1, 2, 3, 4], [5, 6, 7, 8]], config, eos_id=-1, pad_id=0, seeds=[3, 4],
                   trace=lambda block, step, z: steps.append((block, step, (z == model.prior.mask_id).sum(-1).tolist())))
    assert [len(t) for t in out.tokens] == [8, 8] and out.model_calls == 2 * 4
    assert [masked for block, step, masked in steps] == [[3, 3], [2, 2], [1, 1], [0, 0]] * 2  # one position per step
    alone = generate(model, [[5, 6, 7, 8]], config, eos_id=-1, pad_id=0, seeds=[4])
    assert alone.tokens[0] == out.tokens[1]  # its randomness comes from the row's stream
    assert (paper_nfe_per_block(config), calls_per_block(config, 4)) == (4, 4)

    from blockgen.harness.evaluation.grids import sampler_label
    from blockgen.harness.reports import plots

    assert sampler_label(config) == "toy_leftmost(N4,T0.5)"
    assert plots.color("toy_leftmost") == "tab:olive" and not plots.is_ar("toy_leftmost")
    assert plots.color("someone_elses") == plots.OTHER_COLOR
    from blockgen.harness.costs.rates import STORED_RATES, read_rates

    rates = read_rates(STORED_RATES)
    assert rates.call_seconds("toy_leftmost", 16, 32, "bfloat16")[0] == rates.call_seconds("ancestral", 16, 32, "bfloat16")[0]


def test_the_built_in_block_functions_are_the_registered_ones():
    """`generate` runs `config.sampler.block`; ancestral's is the shared diffusion loop."""
    assert samplers.get("ancestral").block.__func__.__module__ == "blockgen.models.samplers.ancestral"
    assert diffusion_block.__module__ == "blockgen.models.sampling"


def test_a_samplers_own_setting_is_validated_and_travels_with_the_setting(toy):
    """An `Option` of the toy sampler: checked by SamplerConfig, a model argument, a gen_kwargs key, a flag of
    `blockgen sample`, part of the sweep's results label and of the seeds' record (absent when not given)."""
    from blockgen.harness.evaluation.lm_eval_model.arguments import (BlockGenLMArgs, default_sampler, gen_kwargs_sampler,
                                                                   sampler_model_args)
    from blockgen.harness.evaluation.settings import Setting

    assert SamplerConfig("toy_leftmost").option("lead") == 1
    with pytest.raises(ValueError, match=r"sampler 'ancestral' has no setting \['lead'\]; its own settings: \[\]"):
        SamplerConfig("ancestral", options=(("lead", 2),))
    with pytest.raises(ValueError, match=r"lead=9; must be in 1 <= lead <= 8"):
        SamplerConfig("toy_leftmost", options=(("lead", 9),))
    with pytest.raises(ValueError, match=r"lead=1.5; must be an integer"):
        SamplerConfig("toy_leftmost", options=(("lead", 1.5),))
    assert "lead" not in SamplerConfig("toy_leftmost").as_dict()
    assert SamplerConfig("toy_leftmost", options=(("lead", 2),)).as_dict()["lead"] == 2

    model = tiny_model("masked", sizes=(1, 4))
    args = BlockGenLMArgs.parse({"pretrained": "ckpt", "sampler": "toy_leftmost", "lead": 2, "block_size": 4})
    assert "lead" in BlockGenLMArgs.user_args() and args.sampler_options == (("lead", 2),)
    sampler = default_sampler(args, model.config)
    assert sampler.option("lead") == 2 and sampler_model_args(sampler)["lead"] == 2
    assert Setting("run", "ckpt", "task", sampler).label == "toy_leftmost-4-1-0-T1.0-lead2"
    again, _ = gen_kwargs_sampler(sampler, model.config, False, {"lead": 3})
    assert again.option("lead") == 3
    other, _ = gen_kwargs_sampler(sampler, model.config, False, {"sampler": "ancestral"})
    assert other.name == "ancestral" and other.options == ()

    steps = []
    generate(model, [[1, 2, 3, 4]], again, eos_id=-1, pad_id=0, seeds=[0],
             trace=lambda block, step, z: steps.append(int((z == model.prior.mask_id).sum())))
    assert steps[:2] == [1, 0]  # three positions committed at the first step, the last one at the second

    import argparse

    from blockgen.harness.evaluation import sample

    parser = argparse.ArgumentParser()
    sample.build_parser(parser)
    assert parser.parse_args(["--checkpoint", "c", "--lead", "2"]).lead == 2
    assert "positions committed per step (toy_leftmost; 1 <= lead <= 8, default 1)" in " ".join(parser.format_help().split())
