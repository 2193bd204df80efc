"""The network's shape has one definition (`ModelShape`): checkpoints' flat config.json files load into
it and are written back byte for byte, and the named sizes (`SIZES`) keep their parameter counts."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch

from blockgen.harness.checkpoints.checkpoint import CONFIG, checkpoint_hash, load_checkpoint, read_config, save_checkpoint
from blockgen.harness.training.presets import PRESETS
from blockgen.harness.training.train_config import TrainConfig
from blockgen.models.backbone import SIZES, ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig

REPO = Path(__file__).resolve().parents[1]
STORED = REPO / "leaderboards" / "ci_gsm8k" / "gsm-masked-mix" / "checkpoint"  # the demo's masked mixture


def test_stored_checkpoint_loads_and_saves_back_to_the_same_hash(tmp_path):
    """A checkpoint written before the shape had its own class: its config.json holds n_layers ... flat.
    Loaded and saved again, config.json is the same bytes and the checkpoint hash (results, caches) is unchanged."""
    raw_text = (STORED / CONFIG).read_text()
    config = read_config(STORED)
    assert config.shape == SIZES["tiny"]  # the demo trains tiny models
    assert BlockGenConfig.from_dict(config.to_dict()) == config
    model, tokenizer = load_checkpoint(STORED)
    again = save_checkpoint(tmp_path / "again", model, tokenizer, extra=json.loads(raw_text)["training"])
    assert (again / CONFIG).read_text() == raw_text
    assert checkpoint_hash(again) == checkpoint_hash(STORED)


def test_hand_written_flat_config_fills_the_shape_and_round_trips(tmp_path):
    """An old-style file naming part of the shape: the rest takes ModelShape's defaults; written back flat."""
    raw = {"model_type": "blockgen", "vocab_size": 30, "seq_len": 16, "prior": "uniform", "block_sizes": [1, 4],
           "block_weights": [0.5, 0.5], "n_layers": 1, "d_model": 16, "n_heads": 2, "training": {"step": 3}}
    (tmp_path / CONFIG).write_text(json.dumps(raw))
    config = read_config(tmp_path)
    assert config.shape == ModelShape(n_layers=1, d_model=16, n_heads=2, cond_dim=128, dropout=0.1)
    flat = config.to_dict()
    shape_keys = [f.name for f in fields(ModelShape)]
    # the keys in the order every checkpoint has them: the shape's fields where BlockGenConfig holds it
    assert list(flat) == ["vocab_size", "seq_len", "prior", "block_sizes", "block_weights", *shape_keys, "causal_clean",
                          "eps", "attention", "special_tokens", "architecture", "adaln", "time_conditioning", "cond_silu",
                          "ar_placeholder"]
    assert {k: flat[k] for k in shape_keys} == {"n_layers": 1, "d_model": 16, "n_heads": 2, "cond_dim": 128, "dropout": 0.1}
    assert BlockGenConfig.from_dict(json.loads(json.dumps(flat))) == config
    net = BlockGen(config).dit  # the network has the shape the file names
    assert (len(net.blocks), net.embed.weight.shape, net.time.mlp[0].out_features) == (1, (30, 16), 128)


def test_config_fields_are_checked():
    base = {"vocab_size": 30, "seq_len": 16}
    with pytest.raises(ValueError, match=r"unknown BlockGen config fields \['shape'\]; known: .*'n_layers'"):
        BlockGenConfig.from_dict({**base, "shape": {"n_layers": 1}})  # config.json has one format: flat
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        BlockGenConfig.from_dict({**base, "d_model": 30, "n_heads": 4})


def reference_params(shape: ModelShape, vocab: int, adaln: bool) -> int:
    """The DiT's parameters by hand (appendix B): embedding, per layer qkv + output (no bias), MLP 4d
    with biases, two norm weights and adaLN (6d, with bias); final norm, output layer, adaLN (2d); time MLP."""
    d, c = shape.d_model, shape.cond_dim
    layer = 4 * d * d + (8 * d * d + 5 * d) + 2 * d + (c * 6 * d + 6 * d if adaln else 0)
    final = d + d * vocab + vocab + (c * 2 * d + 2 * d if adaln else 0)
    time = 256 * c + c + c * c + c if adaln else 0
    return vocab * d + shape.n_layers * layer + final + time


# Counted with the code before the shape had one home (vocabulary 50,257 + [MASK]).
PARAMS = {("micro", "blockgen"): 6_621_394, ("micro", "ar"): 6_582_546, ("tiny", "blockgen"): 21_469_458,
          ("tiny", "ar"): 21_124_370, ("paper", "blockgen"): 169_627_218, ("paper", "ar"): 162_246_482}


@pytest.mark.parametrize("size,architecture", sorted(PARAMS))
def test_sizes_keep_their_parameter_counts(size, architecture):
    train = TrainConfig(size=size, architecture=architecture, block_sizes=(1,) if architecture == "ar" else (16,))
    config = train.model_config(50_257, {}, "cpu")
    assert config.shape == SIZES[size]
    with torch.device("meta"):  # counts without allocating the paper size
        n = sum(p.numel() for p in BlockGen(config).parameters())
    assert n == PARAMS[size, architecture] == reference_params(SIZES[size], 50_258, architecture != "ar")


def test_presets_pick_their_sizes():
    """CI, the synthetic language's and the offline ("-embedded") presets are micro, the demo's tiny, the paper's benchmarks paper size."""
    def size(name: str) -> str:
        return "micro" if name.startswith(("ci", "lang-")) or "-embedded-" in name else "tiny" if name.startswith("gsm-") else "paper"

    assert {name: p.size for name, p in PRESETS.items()} == {name: size(name) for name in PRESETS}


def test_cli_size_and_nested_options_reach_the_model_shape():
    from blockgen.harness.cli import build_parser, config_from_args

    assert get_args(get_type_hints(TrainConfig)["size"]) == tuple(SIZES)  # `--size` choices: the named shapes
    args = build_parser().parse_args(["train", "--preset", "ci", "--size", "tiny", "--data.n-val", "8"])
    config = config_from_args(args)
    assert (config.size, config.data.n_val) == ("tiny", 8)
    assert config.model_config(100, {}, "cpu").shape == SIZES["tiny"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--size", "huge"])


def test_adam_beta2_is_checked_and_set_per_recipe():
    """The demo's and the language's tiny models train with AdamW beta2 0.95 (docs/results.md, "Why a word-problem
    seed trains worse"); every other preset keeps the authors' 0.999; a decay outside [0, 1) is refused."""
    with pytest.raises(ValueError, match=r"adam_beta2=1.0; choose a decay in \[0, 1\)"):
        TrainConfig(adam_beta2=1.0)
    assert {name: p.adam_beta2 for name, p in PRESETS.items()} == {
        name: 0.95 if name.startswith(("gsm-", "lang-")) else 0.999 for name in PRESETS}


@pytest.mark.parametrize("field,value,message", [
    ("save_every", 0, r"save_every=0 \(--save-every\); choose a whole number >= 1"),
    ("eval_every", 0, r"eval_every=0 \(--eval-every\)"),
    ("log_every", 0, r"log_every=0 \(--log-every\)"),
    ("k_mc", 0, r"k_mc=0 \(--k-mc\)"),
    ("max_steps", 0, r"max_steps=0 \(--max-steps\)"),
    ("batch_size", 0, r"batch_size=0 \(--batch-size\)"),
    ("dist_timeout_s", 0, r"dist_timeout_s=0 \(--dist-timeout-s\)"),
    ("warmup_steps", -1, r"warmup_steps=-1 \(--warmup-steps\); choose 0 \(no warm-up\) or more"),
    ("grad_clip", 0.0, r"grad_clip=0.0 \(--grad-clip\); choose a norm > 0"),
    ("ema_decay", 1.5, r"ema_decay=1.5 \(--ema-decay\); choose a decay in \[0, 1\)"),
])
def test_settings_a_run_cannot_use_are_refused_before_it_starts(field, value, message):
    """Each of these crashed mid-run (a step count of 0 divided by zero at the first save or validation; k_mc 0 in the
    validation pass) or trained nothing (grad_clip 0); now the config refuses it, naming the flag."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_a_refused_setting_is_one_line_on_the_command_line(tmp_path, capsys):
    from blockgen.harness.cli import main

    assert main(["train", "--preset", "ci", "--out-dir", str(tmp_path / "run"), "--save-every", "0"]) == 2
    assert capsys.readouterr().err == "blockgen train: error: save_every=0 (--save-every); choose a whole number >= 1\n"
    assert main(["demo", "--train-only", "--presets", "ci", "--jobs", "-1", "--out-dir", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockgen demo: error: ") and "jobs >= 0" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists() and not (tmp_path / "demo").exists()
