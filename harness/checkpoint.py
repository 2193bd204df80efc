"""Checkpoints in the Hugging Face layout: config.json, model.safetensors, tokenizer files.

`model.safetensors` holds the weights used for evaluation (the EMA weights when training keeps an
EMA). A resumable run also keeps `training_state.pt` (raw weights, optimizer, EMA, step, RNG).
Every save writes into a temporary sibling directory and renames it into place, so a crash never
leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from blockgen.harness.tokenizer import SpecialTokens, special_tokens
from blockgen.models.model import BlockGen, BlockGenConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TRAINING_STATE = "training_state.pt"


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(
    directory: str | Path,
    model: BlockGen,
    tokenizer=None,
    training_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Atomically write a checkpoint directory (replacing any previous one).

    `extra`: JSON metadata stored under config.json's "training" key (step, data, ...).
    """
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {"model_type": "blockgen", **model.config.to_dict(), "training": extra or {}}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if training_state is not None:
        torch.save(training_state, tmp / TRAINING_STATE)
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        os.rename(directory, old)
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def finish_interrupted_save(directory: str | Path) -> None:
    """Complete a save that was killed between its two renames (only `.old` and `.tmp` exist).

    The `.tmp` directory is renamed into place only after it is complete, and `.old` exists only
    from that moment on, so `.old` without `directory` means `.tmp` is a whole checkpoint.
    """
    directory = Path(directory)
    tmp, old = directory.with_name(directory.name + ".tmp"), directory.with_name(directory.name + ".old")
    if not directory.exists() and old.is_dir() and tmp.is_dir():
        os.rename(tmp, directory)


def read_config(directory: str | Path) -> BlockGenConfig:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a BlockGen checkpoint: {CONFIG} is missing")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON (truncated checkpoint?): {err}") from err
    if raw.get("model_type") != "blockgen":
        raise CheckpointError(f"{path} has model_type={raw.get('model_type')!r}, expected 'blockgen'")
    return BlockGenConfig.from_dict(raw)  # "training" metadata (step, data) is informative only


def read_weights(path: Path, fix: str, error: type[CheckpointError] = CheckpointError) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, or `error` in one line naming the file, its size and `fix`
    (safetensors' own error on a truncated or empty file names no file)."""
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error type on truncation
        size = path.stat().st_size if path.is_file() else 0
        reason = " ".join(str(err).split())
        raise error(f"{path}: truncated or corrupt safetensors file ({size:,} bytes: {reason}); fix: {fix}") from None


def check_tokenizer_fits(config: BlockGenConfig, tokenizer, where: str | Path) -> None:
    """A tokenizer of another size maps the model's ids to other text (garbage, silently), so it must be
    the model's vocabulary: `len(tokenizer) == vocab_size`. One token more is allowed only as a converted
    release's gpt2 layout (harness/released.py), where the authors' added [PAD] is the [MASK] row."""
    size, vocab = len(tokenizer), config.vocab_size
    gpt2_layout = config.prior == "masked" and size == vocab + 1 and tokenizer.pad_token_id == vocab
    if size != vocab and not gpt2_layout:
        raise CheckpointError(f"{where}: the tokenizer has {size:,} tokens, but {CONFIG} says vocab_size {vocab:,}; fix: "
                              f"put the tokenizer the model was trained with beside its weights (the training run's "
                              f"checkpoint folder has it)")


def load_checkpoint_tokenizer(directory: str | Path, config: BlockGenConfig):
    """The tokenizer saved in a checkpoint directory, checked against its config."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    check_tokenizer_fits(config, tokenizer, Path(directory) / "tokenizer.json")
    return tokenizer


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu", load_tokenizer: bool = True):
    """(model in eval mode, tokenizer or None) from a checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    config = read_config(directory)
    model = BlockGen(config)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{directory} has no {WEIGHTS}")
    state = read_weights(weights, "save the checkpoint again (or copy it again from where it was trained)")
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    mismatched = sorted(k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape)
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"{weights} does not match {CONFIG}: missing={missing[:5]} unexpected={unexpected[:5]} "
            f"shape mismatches={mismatched[:5]}"
        )
    model.load_state_dict(state)
    model.to(device).eval()
    tokenizer = load_checkpoint_tokenizer(directory, config) if load_tokenizer else None
    return model, tokenizer


def checkpoint_special_tokens(model: BlockGen, tokenizer) -> SpecialTokens:
    """The special ids recorded at training time, else those of the tokenizer."""
    if model.config.special_tokens:
        return SpecialTokens.from_dict(model.config.special_tokens)
    return special_tokens(tokenizer)


def checkpoint_hash(directory: str | Path) -> str:
    """sha256 of the weights and config: identifies a checkpoint in results and caches."""
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        with open(Path(directory) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
