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
    assert {n: s.priced_as for n, s in registry.items() if s.priced_as} == {"eipc": "ancestral", "confidence_threshold": "ancestral",
                                                                       "entropy_bounded": "ancestral",
                                                                       "low_confidence": "ancestral", "ar_sample": "ar_greedy"}
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
    from blockgen.harness.evaluation.evaluations import Evaluation

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
    assert Evaluation("run", "ckpt", "task", sampler).label == "toy_leftmost-4-1-0-T1.0-lead2"
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


# ------------------------------------------------------------------ a sampler from another package (entry points)

PLUG_IN = '''"""A sampler of one's own, in a package of its own: one module, registered through the entry point group
`blockgen.samplers` (its dist-info's entry_points.txt)."""

import torch

from blockgen.models.samplers import Option, register
from blockgen.models.samplers.position_committing import PositionCommitting


@register
class LeftToRight(PositionCommitting):
    name = "toy_left_to_right"
    summary = "commits the `lead` leftmost undecided positions of a block per step"
    adaptive = True  # its calls per block follow the positions a row generates in it
    priced_as = "ancestral"
    color = "tab:olive"
    options = (Option("lead", int, 2, "positions committed per step", low=1, high=64),)

    def plan(self, config, step, confidence, entropy, undecided, generated):
        position = torch.arange(undecided.shape[-1], device=undecided.device).expand(undecided.shape).double()
        return position, torch.full_like(generated, config.option("lead"))
'''


def _plug_in(folder) -> dict:
    """The plug-in installed as pip would leave it (a module and its dist-info) in `folder`; the environment that
    puts it on the path."""
    import os

    (folder / "toy_sampler.py").write_text(PLUG_IN)
    info = folder / "toy_sampler-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-sampler\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[blockgen.samplers]\ntoy_left_to_right = toy_sampler\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_a_sampler_plug_in_runs_through_lm_eval_a_sweep_a_leaderboard_row_and_a_plot(ckpts, tmp_path):
    """One module outside this project, found through its entry point: the real `lm_eval --model blockgen` runs it
    with its own setting, a sweep's dry run prices it, a leaderboard row and a plot show it at its measured NFE."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    from PIL import Image

    env = _plug_in(tmp_path)
    bin_dir = Path(sys.executable).parent
    out = tmp_path / "out"
    proc = subprocess.run([str(bin_dir / "lm_eval"), "--model", "blockgen", "--model_args",
                           f"pretrained={ckpts['mixture']},sampler=toy_left_to_right,lead=3,temperature=0.5",
                           "--tasks", "blockgen_toy_gen", "--limit", "4", "--output_path", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    (record,) = json.loads(results.read_text())["config"]["blockgen"]["tasks"]["blockgen_toy_gen"]["generate_until"]["settings"]
    block = record["block_size"]
    assert (record["sampler"], record["lead"], record["paper_nfe_per_block"]) == ("toy_left_to_right", 3, None)
    assert record["max_calls_per_block"] == math.ceil(block / 3)  # a whole block: ceil(8 / 3) calls
    assert 1 <= record["calls_per_block_per_row"] <= math.ceil(block / 3)
    assert record["tokens_per_forward"] == pytest.approx(record["generated_tokens"] / record["row_calls"])

    dry = subprocess.run([str(bin_dir / "blockgen"), "sweep", "gsm8k-embedded", "--dry-run", "--models", "masked-mix",
                          "--add-sampler", "sampler=toy_left_to_right,lead=3"], capture_output=True, text=True, env=env)
    assert dry.returncode == 0, dry.stderr
    (line,) = [l for l in dry.stdout.splitlines() if "toy_left_to_right" in l]
    assert "-lead3" in line and "CPU-s" in line and "adaptive sampler: priced at its most calls" in line

    board = tmp_path / "board.json"
    for command in (["leaderboard", "add", str(results), "--to", str(board), "--model", "toy-mixture"],
                    ["leaderboard", "plot", str(board), "--out-dir", str(tmp_path / "plots")]):
        done = subprocess.run([str(bin_dir / "blockgen"), *command], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
    (row,) = [r for r in json.loads(board.read_text())["rows"] if r["metric"] == "exact_match"]
    assert row["sampler"] == "toy_left_to_right" and row["options"] == {"lead": 3}
    assert row["nfe_per_block"] == pytest.approx(record["calls_per_block_per_row"])  # the NFE its rows really took
    (png,) = (tmp_path / "plots").glob("accuracy_vs_nfe_*.png")
    with Image.open(png) as image:
        assert image.size[0] > 400 and len(image.convert("RGB").getcolors(1 << 24)) > 10  # a drawn plot, not a blank
