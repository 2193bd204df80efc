"""A sampler as blockgen `--model_args` and back: `sampler_model_args` (SamplerConfig -> model arguments)
is the inverse of the adapter's parsing (`BlockGenLMArgs.parse` and the model's default sampler), so
the demo, which names its samplers as SamplerConfig, runs exactly the sampler it names.

The model is the stored CI checkpoint (a masked mixture of block sizes 1 and 16, seq_len 128)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from blockgen.harness.evaluation.lm_eval_model.arguments import BlockGenLMArgs, sampler_model_args
from blockgen.harness.evaluation.lm_eval_model.model import BlockGenLM
from blockgen.harness.evaluation.paper_variants import GRID
from blockgen.harness.evaluation.grids import demo_samplers
from blockgen.models.sampler_config import SamplerConfig

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "leaderboards" / "ci_gsm8k" / "gsm-masked-mix" / "checkpoint"


@pytest.fixture(scope="module")
def lm() -> BlockGenLM:
    return BlockGenLM(pretrained=str(CHECKPOINT), device="cpu")


def samplers() -> list[SamplerConfig]:
    """The demo's samplers of a mixture with block size 1, every variant of the paper's grid, explicit
    block sizes, AR decoding, and a generation budget other than the default."""
    out = demo_samplers((1, 16), (1.0, 0.1), (4, 8, 16))
    out += [replace(v, temperature=0.7)
            for by_nfe in GRID.values() for n in (4, 8, 16) for v in by_nfe[n]]
    out += [SamplerConfig("eipc", steps=8, ge=2, warmup=1, temperature=0.5, block_size=16),
            SamplerConfig("ancestral", steps=4, block_size=16), SamplerConfig("ar_sample", temperature=0.3),
            SamplerConfig("ar_greedy"), SamplerConfig("arpc", steps=6, ge=3, max_new_tokens=40)]
    # the default budget (256) leaves no room for a prompt in seq_len 128: half of it, as the adapter's default
    return [replace(s, max_new_tokens=64) if s.max_new_tokens == SamplerConfig.max_new_tokens else s for s in out]


def test_sampler_round_trips_through_the_adapters_model_args(lm):
    checked = 0
    for sampler in samplers():
        args = {**sampler_model_args(sampler), "max_gen_toks": sampler.max_new_tokens}
        parsed = BlockGenLMArgs.parse({"pretrained": str(CHECKPOINT), **args})
        own = dict(parsed.sampler_options)  # the sampler's own settings (models/samplers/), e.g. a threshold
        assert {k: own[k] if k in own else getattr(parsed, k) for k in args} == args  # every argument typed and kept
        back = lm.with_settings(**args).sampler
        # AR decoding makes one call per token: it reads neither steps nor (greedy) the temperature
        expected = replace(sampler, steps=back.steps) if sampler.is_ar else sampler
        if sampler.name == "ar_greedy":
            expected = replace(expected, temperature=back.temperature)
        assert back == expected, (sampler, args, back)
        checked += 1
    assert checked > 40


def test_model_args_are_one_spelling_of_a_setting():
    """Every field written (ge, warmup for ancestral too), AR as one token per call: the spelling the sweep's
    results records and CI's stored outcomes (leaderboards/ci_gsm8k/outcomes.json) are keyed by."""
    assert sampler_model_args(SamplerConfig("ar_greedy", temperature=0.5)) == {
        "sampler": "ar_greedy", "steps": 1, "ge": 1, "warmup": 0, "temperature": 0.5}
    assert sampler_model_args(SamplerConfig("ar_sample", steps=7, temperature=0.5)) == {
        "sampler": "ar_sample", "steps": 1, "ge": 1, "warmup": 0, "temperature": 0.5}
    assert sampler_model_args(SamplerConfig("ancestral", steps=8)) == {
        "sampler": "ancestral", "steps": 8, "ge": 1, "warmup": 0, "temperature": 1.0}
    assert sampler_model_args(SamplerConfig("arpc", steps=6, ge=3, warmup=1, temperature=0.1, block_size=16)) == {
        "sampler": "arpc", "steps": 6, "ge": 3, "warmup": 1, "temperature": 0.1, "block_size": 16}
    assert sampler_model_args(SamplerConfig("ancestral", steps=4, layout="prompt_end"))["layout"] == "prompt_end"
    stored = json.loads((REPO / "leaderboards" / "ci_gsm8k" / "outcomes.json").read_text())["settings"]
    for setting in stored:  # the stored spelling is this one
        args = {k: v for k, v in setting["model_args"].items() if k not in ("k_mc", "max_gen_toks")}
        steps, ge, warmup = (args[k] for k in ("steps", "ge", "warmup"))
        sampler = SamplerConfig(args["sampler"], steps=steps, ge=ge, warmup=warmup, temperature=args["temperature"])
        assert sampler_model_args(sampler) == args


def test_gen_kwargs_that_change_the_sampler_or_block_size_keep_the_nfe_the_model_args_asked_for():
    """nfe=N in the model arguments, then a task's gen_kwargs naming a block size or another sampler: the NFE stays N
    (a new block size keeps the variant; a new sampler takes its own paper variant at N, a sampler without variants N
    steps), where it used to reset steps to the block size and keep the old variant's ge and warm-up."""
    from blockgen.harness.evaluation.lm_eval_model.arguments import default_sampler, gen_kwargs_sampler
    from blockgen.models.sampler_config import paper_nfe_per_block
    from sampling_models import tiny_model

    config = tiny_model(sizes=(1, 4, 16)).config

    def base(**model_args):
        args = BlockGenLMArgs.parse({"pretrained": "-", **model_args})
        return default_sampler(args, config), args

    ancestral, args = base(sampler="ancestral", nfe=8)
    smaller, _ = gen_kwargs_sampler(ancestral, config, args.steps is not None, {"block_size": 4}, nfe=args.nfe)
    assert (smaller.block_size, smaller.steps, paper_nfe_per_block(smaller)) == (4, 8, 8)
    arpc, args = base(sampler="arpc", nfe=8)
    assert (arpc.steps, arpc.ge, arpc.warmup) == (6, 3, 0)
    eipc, _ = gen_kwargs_sampler(arpc, config, False, {"sampler": "eipc"}, nfe=8)
    assert (eipc.name, eipc.steps, eipc.ge, eipc.warmup, paper_nfe_per_block(eipc)) == ("eipc", 8, 3, 0, 8)
    low, _ = gen_kwargs_sampler(arpc, config, False, {"sampler": "low_confidence"}, nfe=8)
    assert (low.steps, low.ge, low.warmup) == (8, 1, 0)
    # without nfe, as before: steps follow the block size of a new sampler or block size
    plain, args = base(sampler="ancestral")
    assert gen_kwargs_sampler(plain, config, False, {"block_size": 4})[0].steps == 4
