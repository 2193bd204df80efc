"""Checkpoints in the Hugging Face layout: config.json, model.safetensors, tokenizer files.

`model.safetensors` holds the weights used for evaluation (the EMA weights when training keeps an
EMA). A resumable run also keeps `training_state.pt` (raw weights, optimizer, EMA, step, RNG).

Crash safety (`save_checkpoint`, `restore_latest_checkpoint`): two slots, `DIR` (the newest complete
checkpoint, the path evaluation reads) and `DIR.prev` (the one before it). A save writes everything
into `DIR.tmp`, fsyncs the files and the folder, then renames `DIR` to `DIR.prev` and `DIR.tmp` to
`DIR` and fsyncs the parent folder. A kill at any moment leaves `DIR` or `DIR.prev`
complete; `.tmp` is never trusted (it may be partial) and is removed by the next save. On resume the
newest slot that reads cleanly is put back at `DIR`; a torn one is moved aside to `NAME.torn` with a
warning naming it (left in place, the next save would rotate it over the good `.prev`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from blockgen.harness.checkpoints.tokenizer import SpecialTokens, special_tokens
from blockgen.models.model import BlockGen, BlockGenConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TRAINING_STATE = "training_state.pt"


class CheckpointError(RuntimeError):
    pass


PREVIOUS, TMP, TORN = ".prev", ".tmp", ".torn"  # suffixes of the sibling folders beside a checkpoint
# Test hook (tests/test_restart.py): "STEP:POINT" makes the process saving step STEP kill itself with
# SIGKILL at POINT, "written" (the new checkpoint complete in .tmp) or "rotated" (the old one already
# renamed to .prev, the new one not yet in place): the two moments a crash inside a save can hit.
KILL_IN_SAVE_ENV = "BLOCKGEN_TEST_KILL_IN_SAVE"


def _sibling(directory: Path, suffix: str) -> Path:
    return directory.with_name(directory.name + suffix)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then the folders: a rename is durable only after its contents are."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(Path(folder) / name, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def _test_kill(point: str, extra: dict[str, Any] | None) -> None:
    if os.environ.get(KILL_IN_SAVE_ENV) == f"{(extra or {}).get('step')}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(
    directory: str | Path,
    model: BlockGen,
    tokenizer=None,
    training_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep_previous: bool = False,
    keep_copy: str | Path | None = None,
) -> Path:
    """Write a checkpoint directory crash-safely (module docstring), replacing any previous one.

    `extra`: JSON metadata stored under config.json's "training" key (step, data, ...).
    `keep_previous`: leave the replaced checkpoint as `DIR.prev` (training's second slot), else remove it.
    `keep_copy`: also put a copy at this path, unless one is there already (kept copies are never
    overwritten; a rerun of the same step would write the same bytes).
    """
    directory = Path(directory)
    tmp, prev = _sibling(directory, TMP), _sibling(directory, PREVIOUS)
    shutil.rmtree(tmp, ignore_errors=True)  # a save killed while writing (never trusted)
    tmp.mkdir(parents=True)
    config = {"model_type": "blockgen", **model.config.to_dict(), "training": extra or {}}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp / WEIGHTS, 0o666 & ~umask)  # safetensors writes 0600; the rest of a checkpoint follows the umask
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if training_state is not None:
        torch.save(training_state, tmp / TRAINING_STATE)
    _fsync_tree(tmp)
    _test_kill("written", extra)
    if keep_copy is not None and not Path(keep_copy).exists():
        keep_copy = Path(keep_copy)
        keep_tmp = _sibling(keep_copy, TMP)
        shutil.rmtree(keep_tmp, ignore_errors=True)
        shutil.copytree(tmp, keep_tmp)
        _fsync_tree(keep_tmp)
        os.rename(keep_tmp, keep_copy)
        _fsync_dir(keep_copy.parent)
    if directory.exists():
        shutil.rmtree(prev, ignore_errors=True)  # `directory` is complete while the older slot goes
        os.rename(directory, prev)
    _test_kill("rotated", extra)
    os.rename(tmp, directory)
    _fsync_dir(directory.parent)
    if not keep_previous:
        shutil.rmtree(prev, ignore_errors=True)
    return directory


def _check_slot(directory: Path) -> None:
    """Read every file a resume needs (CheckpointError or another exception when one is torn)."""
    read_config(directory)
    read_weights(directory / WEIGHTS, "")
    torch.load(directory / TRAINING_STATE, map_location="cpu", weights_only=False)


def restore_latest_checkpoint(directory: str | Path) -> Path | None:
    """Put the newest slot that reads cleanly at `directory` and return it (None: nothing to resume).

    `directory` is tried before `DIR.prev`: a save renames the older checkpoint to `.prev` before the
    newer one appears, so `.prev` is never the newer. A torn slot is moved to `NAME.torn` with a
    warning; `.prev` chosen (the newer one torn, or killed between the two renames of a save) is
    renamed to `directory`, so evaluation finds the checkpoint training resumes from.
    """
    directory = Path(directory)
    for slot in (directory, _sibling(directory, PREVIOUS)):
        if not slot.is_dir():
            continue
        try:
            _check_slot(slot)
        except Exception as err:  # torch.load and safetensors raise their own types on truncation
            torn = _sibling(slot, TORN)
            shutil.rmtree(torn, ignore_errors=True)
            os.rename(slot, torn)
            reason = " ".join(str(err).split())[:300]
            print(f"blockgen: warning: skipping torn checkpoint {slot} (moved to {torn}): {reason}", file=sys.stderr, flush=True)
            continue
        if slot != directory:
            os.rename(slot, directory)
            _fsync_dir(directory.parent)
        return directory
    return None


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
    release's gpt2 layout (harness/checkpoints/release_vocab.py), where the authors' added [PAD] is the [MASK] row."""
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
