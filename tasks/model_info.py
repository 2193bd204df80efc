"""What a task needs to know about the evaluated model, for any lm-eval model type.

lm-eval passes ``--model_args`` to tasks as metadata, so ``pretrained=`` names the model whatever
its type (``blockgen``, ``hf``, ``vllm``): a BlockGen checkpoint (its ``config.json`` records the
length and special tokens it was trained with) or a Hugging Face model directory or name.

- `checkpoint_tokenizer`: the tokenizer and its special ids;
- `model_max_length`: the longest sequence (prompt + generation) the model takes, as the model type
  itself resolves it, so a task can size its generation budget to fit;
- `unconditional_context`: the context string of an unconditional sample.
"""

from __future__ import annotations

from typing import Any

# hf and vllm model arguments that set the length instead of the model's config.
LENGTH_ARGS = ("max_length", "max_model_len")


def model_path(metadata: dict[str, Any]) -> str | None:
    """``pretrained`` as the model loads it: a released checkpoint (``hf:jdeschena/blockgen/...`` or its
    folder, `blockgen.harness.checkpoints.release_import`) is converted (once, cached) into a checkpoint directory, as
    the blockgen adapter does; anything else is returned as given. None when no model is named."""
    pretrained = metadata.get("pretrained")
    if not pretrained:
        return None
    from blockgen.harness.checkpoints.release_import import is_release_spec, resolve_model_args

    return str(resolve_model_args(metadata)) if is_release_spec(str(pretrained)) else str(pretrained)


def checkpoint_tokenizer(pretrained: str):
    """(tokenizer, SpecialTokens) of a checkpoint: the special ids recorded at training time, else
    the tokenizer's own (a Hugging Face model directory or name, as lm-eval's hf backend takes)."""
    from blockgen.harness.checkpoints.checkpoint import CheckpointError, load_checkpoint_tokenizer, read_config
    from blockgen.harness.checkpoints.tokenizer import SpecialTokens, load_tokenizer, special_tokens

    try:
        config = read_config(pretrained)
    except CheckpointError:  # not a BlockGen checkpoint: e.g. --model hf
        return (tokenizer := load_tokenizer(pretrained)), special_tokens(tokenizer)
    tokenizer = load_checkpoint_tokenizer(pretrained, config)
    recorded = config.special_tokens
    return tokenizer, SpecialTokens.from_dict(recorded) if recorded else special_tokens(tokenizer)


def model_max_length(metadata: dict[str, Any], tokenizer=None) -> int | None:
    """The model's length in tokens, or None when the metadata name no model.

    ``max_length`` / ``max_model_len`` model arguments win (hf, vllm); a BlockGen checkpoint has its
    ``seq_len``; any other model the length lm-eval's hf backend resolves from its config and
    tokenizer (``n_positions``, ``max_position_embeddings``, ... else 2048)."""
    for key in LENGTH_ARGS:
        value = metadata.get(key)
        if value not in (None, ""):
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ValueError(f"{key}={value!r} in --model_args: must be an integer >= 2")
            return value
    pretrained = model_path(metadata)
    if not pretrained:
        return None
    from blockgen.harness.checkpoints.checkpoint import CheckpointError, read_config

    try:
        return read_config(str(pretrained)).seq_len
    except CheckpointError:
        pass
    from lm_eval.models.utils import DEFAULT_MAX_LENGTH, resolve_max_length
    from transformers import AutoConfig

    from blockgen.harness.checkpoints.hub import hub_call

    config = hub_call(lambda: AutoConfig.from_pretrained(str(pretrained)), f"model config {pretrained}")
    return resolve_max_length(config, tokenizer, default=DEFAULT_MAX_LENGTH)


def unconditional_context(metadata: dict[str, Any]) -> str:
    """The context of an unconditional sample: the text of the model's BOS token.

    An empty context works for `blockgen` (it starts every prompt with BOS) but not for lm-eval's hf
    backend with a tokenizer that adds no BOS (GPT-2's): it would generate from zero tokens. BOS
    written as text encodes to the BOS id in both (special tokens are matched in text), and
    `blockgen` does not add a second one. Empty when no model is named, or when the hf backend adds
    BOS itself (``add_bos_token=True``)."""
    if not metadata.get("pretrained") or metadata.get("add_bos_token") is True:
        return ""
    tokenizer, special = checkpoint_tokenizer(model_path(metadata))
    return tokenizer.decode([special.bos], skip_special_tokens=False)
