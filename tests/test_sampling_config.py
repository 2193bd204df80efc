"""Sampler configuration: bad SamplerConfigs named with their choices, configs checked against the model,
the room each block layout leaves for the prompt, temperature, and `blockgen sample` on a checkpoint
(tiny random models, CPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models import samplers
from blockgen.models.sampler_config import BLOCK_LAYOUTS, SamplerConfig
from blockgen.models.sampling import check_config, generate, max_prompt_len
from sampling_models import tiny_model


# ------------------------------------------------------------------------------ block layouts


def test_grid_layout_keeps_the_prompt_tail_and_the_room(masked):
    """Grid: the tail is never returned and a prompt of P tokens gets up to seq_len - P new tokens;
    prompts whose length is a multiple of L' sample exactly as with prompt_end."""
    block, seq_len = 8, masked.config.seq_len
    config = SamplerConfig("eipc", steps=3, block_size=block, max_new_tokens=seq_len - 21, layout="grid")
    assert max_prompt_len(masked, config) == 21
    assert max_prompt_len(masked, replace(config, layout="prompt_end")) == seq_len - 48  # 43 new tokens: 6 whole blocks
    prompt = list(range(1, 22))
    result = generate(masked, [prompt, [2, 3]], config, eos_id=-1, pad_id=0)
    assert [len(t) for t in result.tokens] == [43, 43]
    assert result.n_blocks == 6  # ceil((2 + 43) / 8); the 21-token prompt's row needs 6 as well
    with pytest.raises(ValueError, match=r"seq_len 64.*truncate prompts to 21 tokens"):
        generate(masked, [prompt + [1]], config, eos_id=-1, pad_id=0)
    with pytest.raises(ValueError, match="truncate prompts to 16 tokens"):
        generate(masked, [prompt], replace(config, layout="prompt_end"), eos_id=-1, pad_id=0)
    aligned = [list(range(1, 17)), [], [5] * 8]
    for name in ("ancestral", "arpc"):
        runs = [generate(masked, aligned, SamplerConfig(name, steps=3, max_new_tokens=16, layout=layout), eos_id=-1, pad_id=0)
                for layout in BLOCK_LAYOUTS]
        assert runs[0].tokens == runs[1].tokens and runs[0].model_calls == runs[1].model_calls


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(name="beam"), ["ancestral", "eipc", "arpc", "ar_greedy", "ar_sample"]),
        (dict(steps=0), ["steps", ">= 1"]),
        (dict(name="arpc", ge=0), ["ge", ">= 1"]),
        (dict(name="eipc", warmup=-1), ["warmup", ">= 0"]),
        (dict(name="arpc", steps=4, warmup=4), ["warmup", "0..3"]),
        (dict(temperature=0.0), ["temperature"]),
        (dict(name="ar_sample", temperature=-1.0), ["temperature"]),
        (dict(name="ar_greedy", block_size=16), ["block_size", "1"]),
        (dict(block_size=1), ["ar_sample", "ar_greedy"]),
        (dict(max_new_tokens=0), ["max_new_tokens"]),
        (dict(layout="aligned"), ["layout", "grid", "prompt_end"]),
    ],
)
def test_bad_sampler_configs(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplerConfig(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_configs_checked_against_the_model(masked):
    assert SamplerConfig("ar_greedy", temperature=0.0).temperature == 0.0  # greedy ignores it
    assert check_config(masked, SamplerConfig("arpc")) == 8  # default: the largest trained size
    with pytest.raises(ValueError, match=r"\[1, 4, 8\]"):
        check_config(masked, SamplerConfig("ancestral", block_size=16))
    with pytest.raises(ValueError, match="block size 1 in the training mixture.*ancestral"):
        check_config(tiny_model(sizes=(4, 8)), SamplerConfig("arpc"))
    with pytest.raises(ValueError, match="causal_clean"):
        check_config(tiny_model(causal=False), SamplerConfig("arpc", block_size=4))
    with pytest.raises(ValueError, match=r"\[4, 8\]"):
        check_config(tiny_model(sizes=(4, 8)), SamplerConfig("ar_greedy"))
    with pytest.raises(ValueError, match="seq_len"):
        generate(masked, [[1] * 60], SamplerConfig("ancestral", max_new_tokens=8), eos_id=-1, pad_id=0)
    assert set(samplers.names()) == {"ancestral", "eipc", "arpc", "confidence_threshold", "entropy_bounded",
                                     "low_confidence", "ar_greedy", "ar_sample"}


def test_cli_samples_a_checkpoint(tmp_path, capsys):
    from blockgen.harness.checkpoints.checkpoint import save_checkpoint
    from blockgen.harness.cli import main
    from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe

    tok = train_bpe(["three apples and two pears make five fruits"] * 20, vocab_size=270)
    special = special_tokens(tok)
    config = BlockGenConfig(
        vocab_size=len(tok), seq_len=64, block_sizes=(1, 8), block_weights=(0.5, 0.5),
        shape=ModelShape(n_layers=1, d_model=32, n_heads=4, cond_dim=16, dropout=0.0), special_tokens=special.to_dict(),
    )
    save_checkpoint(tmp_path / "ckpt", BlockGen(config), tokenizer=tok)
    out = tmp_path / "samples.jsonl"
    argv = ["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "three apples", "--prompt", "", "--num-samples", "2",
            "--sampler", "arpc", "--steps", "3", "--ge", "3", "--max-new-tokens", "16", "--batch-size", "3", "--out", str(out)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["paper_nfe_per_block"] == 4 and rows[0]["sampler"]["name"] == "arpc"
    assert all(len(r["tokens"]) <= 16 and special.eos not in r["tokens"] for r in rows)
    printed = capsys.readouterr().out
    assert "model calls per block" in printed
    assert "prompt: three apples\nanswer: " in printed  # the prompt and its answer apart, not glued together
    # a training run's folder: refused as lm-eval's pretrained= refuses it, naming the checkpoint inside
    run_folder = tmp_path / "run"
    (run_folder / "checkpoint").mkdir(parents=True)
    (run_folder / "checkpoint" / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
    assert main(["sample", "--checkpoint", str(run_folder), "--prompt", "x"]) == 2
    assert f"blockgen sample: error: --checkpoint {run_folder} is a training run's folder; its checkpoint is " \
           f"--checkpoint {run_folder / 'checkpoint'}" in capsys.readouterr().err
    # Sample j is seeded --seed + j: the same samples at any --batch-size, and with either layout flag.
    one = tmp_path / "one.jsonl"
    assert main(argv[:-4] + ["--batch-size", "1", "--out", str(one), "--quiet", "--layout", "grid"]) == 0
    assert [json.loads(line)["tokens"] for line in one.read_text().splitlines()] == [r["tokens"] for r in rows]
    assert main(argv[:-2] + ["--out", str(one), "--quiet", "--layout", "prompt_end"]) == 0
    assert all(json.loads(line)["sampler"]["layout"] == "prompt_end" for line in one.read_text().splitlines())
    assert main(argv[:3] + ["--prompt", "x", "--sampler", "arpc", "--block-size", "4"]) == 2
    assert "[1, 8]" in capsys.readouterr().err
    # --nfe: the paper's variant at that NFE (the rule of lm-eval's nfe= model arg), narrowed by --ge
    from blockgen.harness.evaluation.paper_variants import settings_at

    by_nfe = tmp_path / "nfe.jsonl"
    base = argv[:5] + ["--sampler", "arpc", "--max-new-tokens", "16", "--quiet", "--out", str(by_nfe)]
    for extra, (steps, ge, warmup) in (([], settings_at("arpc", 4)), (["--ge", "1"], settings_at("arpc", 4, ge=1))):
        assert main(base + ["--nfe", "4", *extra]) == 0
        sampler = json.loads(by_nfe.read_text().splitlines()[0])["sampler"]
        assert (sampler["steps"], sampler["ge"], sampler["warmup"]) == (steps, ge, warmup)
    assert main(base + ["--nfe", "4", "--steps", "99"]) == 2
    assert "no arpc variant at NFE 4 with steps=99" in capsys.readouterr().err
    # Without --nfe or --steps: the block size, the setting lm-eval's model args give (one rule, sampler_config_for)
    from blockgen.harness.evaluation.lm_eval_model.arguments import BlockGenLMArgs, default_sampler

    assert main(base) == 0
    sampler = json.loads(by_nfe.read_text().splitlines()[0])["sampler"]
    assert sampler["steps"] == 8
    assert sampler == default_sampler(BlockGenLMArgs(pretrained="ckpt", sampler="arpc", max_gen_toks=16), config).as_dict()
    # Without --max-new-tokens: what the context holds after the prompt, 64 - (BOS + the prompt's tokens) on the grid
    # layout (it was 256, which no model of seq_len <= 256 holds: the documented `blockgen sample ... --nfe 4` ended in
    # a traceback on the demo's models).
    unbudgeted = [a for a in base if a not in ("--max-new-tokens", "16")]
    assert main(unbudgeted + ["--nfe", "4"]) == 0
    sampler = json.loads(by_nfe.read_text().splitlines()[0])["sampler"]
    assert sampler["max_new_tokens"] == 64 - 1 - len(tok.encode("three apples", add_special_tokens=False))
    assert main(unbudgeted + ["--max-new-tokens", "64"]) == 2  # no room left for the prompt: one line naming the largest
    assert capsys.readouterr().err.splitlines()[-1] == ("blockgen sample: error: --max-new-tokens=64 leaves no room for a "
                                                        "prompt in seq_len=64; choose --max-new-tokens <= 63")


def test_temperature_divides_the_logits(masked):
    """T -> 0 turns AR sampling into greedy decoding; T = 1 keeps the model's distribution."""
    prompts = [[1, 2, 3], [4]]
    greedy = generate(masked, prompts, SamplerConfig("ar_greedy", max_new_tokens=12), eos_id=-1, pad_id=0).tokens
    cold = generate(masked, prompts, SamplerConfig("ar_sample", temperature=1e-4, max_new_tokens=12, seed=5), eos_id=-1, pad_id=0)
    assert cold.tokens == greedy
    warm = generate(masked, prompts, SamplerConfig("ar_sample", temperature=1.0, max_new_tokens=12, seed=5), eos_id=-1, pad_id=0)
    assert warm.tokens != greedy


def test_nfe_on_another_block_size_says_which_variant_it_took(caplog):
    """nfe=N picks the paper's variant for block size 16; on a model that generates with another, it says so."""
    import logging

    from blockgen.harness.evaluation.lm_eval_model import arguments
    from blockgen.harness.evaluation.paper_variants import settings_at

    config = BlockGenConfig(vocab_size=64, seq_len=64, block_sizes=(1, 4), block_weights=(0.5, 0.5),
                            shape=ModelShape(n_layers=1, d_model=32, n_heads=4, cond_dim=16, dropout=0.0))
    arguments._warned.clear()
    with caplog.at_level(logging.WARNING):
        sampler = arguments.sampler_config_for(config, "arpc", nfe=4)
    assert (sampler.steps, sampler.ge, sampler.warmup) == settings_at("arpc", 4)
    assert "nfe=4: the paper's arpc variant for block size 16 (steps 3, ge 2, warmup 1); this model generates with block size 4" \
        in caplog.text
