"""The ``blockgen`` model type's arguments: lm-eval's ``--model_args`` parsed and checked once
(`BlockGenLMArgs`), and a sampler setting to and from them in one place: `sampler_config_for` (a sampler's
options on a checkpoint -> `SamplerConfig`, the paper's variant when ``nfe=N`` is given; `blockgen sample`
uses it too), `default_sampler` (model arguments through it), `sampler_model_args` (the inverse, for the
sweep and the demo) and `gen_kwargs_sampler` (a task's ``gen_kwargs`` over them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from blockgen.harness.checkpoints.checkpoint import CONFIG, CheckpointError
from blockgen.harness.runtime.precision import check_dtype
from blockgen.models.model import BlockGenConfig
from blockgen.models import samplers
from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import check_config, max_prompt_len, resolve_block_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockGenLMArgs:
    """``--model_args`` (typed by lm-eval's parser) plus ``batch_size``/``device``, parsed once."""

    pretrained: str  # checkpoint directory, or a release: hf:jdeschena/blockgen/<subfolder> or its local folder
    k_mc: int = 8  # Monte Carlo draws per block size for the likelihood bound
    seed: int | None = None  # None: the torch seed lm-eval set from --seed
    add_bos: bool = True  # start every context and prompt with BOS, as training examples do
    sampler: str | None = None  # None: 'ancestral', or for AR checkpoints 'ar_greedy' / 'ar_sample'
    steps: int | None = None  # reverse steps per block (NFE of ancestral/eipc); None: the block size
    ge: int | None = None  # None: 1, or the variant nfe= picks
    warmup: int | None = None  # None: 0, or the variant nfe= picks
    nfe: int | None = None  # the paper's variant at this NFE per block (harness/evaluation/paper_variants.py)
    temperature: float | None = None  # None: 1.0 (AR checkpoints: greedy unless a task asks to sample)
    block_size: int | None = None  # None: the checkpoint's largest block size
    max_gen_toks: int | None = None  # None: min(256, seq_len // 2)
    layout: str = "grid"  # where generated blocks sit: 'grid' (training's) or 'prompt_end'
    # Precision of the network's matmuls (harness/runtime/precision.py): lm-eval hf's dtype names; bfloat16 is
    # autocast (weights, LayerNorm, logits and the bounds stay float32/float64). tf32: CUDA's TF32
    # matmuls during this model's calls (opt-in: not measured on a GPU; docs/lm_eval.md, "Evaluation cost and precision").
    dtype: str = "float32"
    tf32: bool = False
    # Batches in the network's row-invariant mode (models/backbone.py, `DiT.row_invariant`), so a score or a text is
    # bit for bit the same whatever --batch_size and the other rows. None: on a CPU, log-likelihoods and the diffusion
    # samplers' texts (at most 1.3x the fastest path's cost there), not autoregressive decoding (above it); nothing on
    # CUDA (not measured): bench/README.md and docs/lm_eval.md, "Batch invariance".
    batch_invariant: bool | None = None
    # Rows per generate_until batch; None: --batch_size (which, as in lm-eval's hf backend, sizes the
    # log-likelihood batches). A positive integer; 'auto' is --batch_size's (leave this unset for it).
    gen_batch_size: int | None = None
    # generate(compile=True): each kind of model call compiled once and replayed (CUDA graphs on a GPU,
    # inductor on a CPU; the same tokens as eager, tests/test_graphs.py). Off by default: compiling
    # costs minutes on a CPU and pays only over many calls.
    compile: bool = False
    # Released checkpoints only (harness/checkpoints/release_import.py): the tokenizer (a local copy, or for releases
    # whose path names none), and the setting where the path does not say it (lists as 1:16).
    tokenizer: str | None = None
    algo: str | None = None
    prior: str | None = None
    block_sizes: str | int | None = None
    block_weights: str | float | None = None
    x0_causal: bool | None = None
    # The samplers' own settings (models/samplers/: `Sampler.options`, e.g. a threshold), by their registered names.
    sampler_options: tuple[tuple[str, Any], ...] = ()
    # set by lm-eval from --batch_size / --device / --max_batch_size, not by the user
    batch_size: int | str = 1
    device: str | None = None
    max_batch_size: int | None = None

    @classmethod
    def user_args(cls) -> list[str]:
        """The model arguments a user may give: the fields, then every registered sampler's own settings."""
        hidden = ("batch_size", "device", "max_batch_size", "sampler_options")
        return [f.name for f in fields(cls) if f.name not in hidden] + sorted(samplers.options())

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> "BlockGenLMArgs":
        own = samplers.options()
        sampler_options = tuple(sorted((k, v) for k, v in kwargs.items() if k in own and v is not None))
        kwargs = {k: v for k, v in kwargs.items() if k not in own}
        known = {f.name for f in fields(cls)} - {"sampler_options"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            import difflib

            hints = [f"{name!r}: did you mean {close[0]!r}?" for name in unknown
                     if (close := difflib.get_close_matches(name, cls.user_args(), n=1, cutoff=0.6))]
            raise ValueError(f"unknown blockgen model argument(s) {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
                             + f"; valid: {cls.user_args()}")
        if kwargs.get("pretrained") in (None, ""):
            raise ValueError("blockgen needs pretrained=<checkpoint directory> in --model_args")
        values = {k: v for k, v in kwargs.items() if v is not None}
        if "batch_size" in values:
            values["batch_size"] = _batch_size(values["batch_size"])
        if "gen_batch_size" in values:
            values["gen_batch_size"] = _gen_batch_size(values["gen_batch_size"])
        args = cls(**values, sampler_options=sampler_options)
        _check_int("k_mc", args.k_mc, 1)
        for name, low in (("seed", None), ("steps", 1), ("ge", 1), ("warmup", 0), ("nfe", 1), ("block_size", 1), ("max_gen_toks", 1)):
            if getattr(args, name) is not None:
                _check_int(name, getattr(args, name), low)
        if args.temperature is not None and (not isinstance(args.temperature, (int, float)) or isinstance(args.temperature, bool)):
            raise ValueError(f"temperature={args.temperature!r}; must be a number")
        if not isinstance(args.add_bos, bool):
            raise ValueError(f"add_bos={args.add_bos!r}; must be true or false")
        for name in ("tf32", "batch_invariant", "compile"):
            if getattr(args, name) is not None and not isinstance(getattr(args, name), bool):
                raise ValueError(f"{name}={getattr(args, name)!r}; must be true or false")
        args = replace(args, dtype=check_dtype(args.dtype))
        temperature = None if args.temperature is None else float(args.temperature)
        return replace(args, pretrained=str(args.pretrained), temperature=temperature)


def _check_int(name: str, value: Any, low: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        raise ValueError(f"{name}={value!r}; must be an integer" + (f" >= {low}" if low is not None else ""))


def _batch_size(value: Any) -> int | str:
    """A positive integer, or 'auto' (lm-eval's 'auto:N' re-detects N times; one detection suffices here)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and value.strip().split(":")[0] == "auto":
        return "auto"
    raise ValueError(f"batch_size={value!r}; choose a positive integer or 'auto'")


def _gen_batch_size(value: Any) -> int:
    """A positive integer. No 'auto': unset, generation follows --batch_size, whose 'auto' already
    picks a size (`BlockGenLM._auto_batch_size`)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"gen_batch_size={value!r}; choose a positive integer, or leave gen_batch_size unset "
                     "for generation batches of --batch_size (its 'auto' included)")


def sampler_config_for(config: BlockGenConfig, name: str, *, nfe: int | None = None, steps: int | None = None,
                    ge: int | None = None, warmup: int | None = None, temperature: float | None = None,
                    block_size: int | None = None, max_new_tokens: int | None = None, layout: str = "grid",
                    seed: int = 0, options: tuple[tuple[str, Any], ...] = ()) -> SamplerConfig:
    """The one rule from a sampler's options on a checkpoint to a `SamplerConfig`, for lm-eval's
    ``--model_args`` (`default_sampler`) and `blockgen sample`'s flags alike: ``nfe`` picks the paper's
    variant, narrowed by any steps/ge/warmup given; otherwise steps default to the block size (one
    token per reverse step on average), ge to 1, warmup to 0, the temperature to 1 and the budget to
    min(256, seq_len // 2)."""
    from blockgen.harness.evaluation.paper_variants import PAPER_BLOCK_SIZE, settings_at

    steps, ge, warmup = settings_at(name, nfe, steps, ge, warmup)
    used = resolve_block_size(config, SamplerConfig(name=name, block_size=block_size))
    if nfe is not None and used != PAPER_BLOCK_SIZE and not samplers.get(name).autoregressive:
        warn_once(f"nfe={nfe}: the paper's {name} variant for block size {PAPER_BLOCK_SIZE} (steps {steps}, ge {ge}, "
                  f"warmup {warmup}); this model generates with block size {used}")
    steps = steps or used
    return SamplerConfig(name=name, steps=steps, ge=1 if ge is None else ge, warmup=warmup or 0,
                         temperature=1.0 if temperature is None else temperature, block_size=block_size,
                         max_new_tokens=max_new_tokens or min(256, config.seq_len // 2), seed=seed, layout=layout,
                         options=tuple(options))


def default_sampler(a: BlockGenLMArgs, config: BlockGenConfig) -> SamplerConfig:
    """The sampler `--model_args` select on a checkpoint (`sampler_model_args` is its inverse)."""
    if a.sampler:
        name = a.sampler
    elif config.block_sizes == (1,):  # AR checkpoint: greedy unless a temperature > 0 was given
        name = "ar_sample" if a.temperature else "ar_greedy"
    else:
        name = "ancestral"
    try:
        sampler = sampler_config_for(config, name, nfe=a.nfe, steps=a.steps, ge=a.ge, warmup=a.warmup,
                                  temperature=a.temperature, block_size=a.block_size, max_new_tokens=a.max_gen_toks,
                                  layout=a.layout, options=a.sampler_options)
    except ValueError as err:
        raise ValueError(f"blockgen --model_args: {err}") from None
    return checked_sampler(config, sampler, "--model_args")


def checked_sampler(config: BlockGenConfig, sampler: SamplerConfig, where: str) -> SamplerConfig:
    try:
        check_config(config, sampler)
        check_budget(config, sampler)
    except ValueError as err:
        raise ValueError(f"blockgen {where}: {err}") from None
    return sampler


def check_budget(config: BlockGenConfig, sampler: SamplerConfig, name: str = "max_gen_toks") -> None:
    """The generation budget (`name`: lm-eval's max_gen_toks, blockgen sample's --max-new-tokens) leaves room for a
    prompt of one token (BOS) in the model's context."""
    if max_prompt_len(config, sampler) < 1:
        raise ValueError(f"{name}={sampler.max_new_tokens} leaves no room for a prompt in seq_len={config.seq_len}; "
                         f"choose {name} <= {largest_budget(config, sampler)}")


def sampler_model_args(sampler: SamplerConfig) -> dict[str, Any]:
    """The ``--model_args`` that select `sampler`: the inverse of `default_sampler`, and the one spelling of
    a sampler setting (the sweep's results records and CI's stored outcomes are keyed by it). Every
    sampler field is written, ge and warmup for ancestral too; AR decoding as what it is, one token per
    call (steps 1, ge 1, warmup 0). The budget travels as max_gen_toks where a caller sets it."""
    steps, ge, warmup = (1, 1, 0) if sampler.is_ar else (sampler.steps, sampler.ge, sampler.warmup)
    args: dict[str, Any] = {"sampler": sampler.name, "steps": steps, "ge": ge, "warmup": warmup,
                            "temperature": sampler.temperature}
    if sampler.block_size is not None:
        args["block_size"] = sampler.block_size
    if sampler.layout != SamplerConfig.layout:
        args["layout"] = sampler.layout
    return {**args, **dict(sampler.options)}


# Generation settings a task's gen_kwargs may override, and the SamplerConfig field each one sets.
GEN_KWARGS = {"sampler": "name", "steps": "steps", "ge": "ge", "warmup": "warmup", "temperature": "temperature",
              "block_size": "block_size", "max_gen_toks": "max_new_tokens", "layout": "layout"}
# lm-eval's generic keys: `until` is honoured; `do_sample` / temperature choose greedy or sampled AR;
# `ignore_eos` (vLLM's name): generate past EOS, keeping it as a token (owt_genppl's length-L samples).
GENERIC_GEN_KWARGS = {"until", "do_sample", "ignore_eos"}


def gen_kwargs_sampler(base: SamplerConfig, config: BlockGenConfig, steps_given: bool,
                       gen_kwargs: dict, nfe: int | None = None) -> tuple[SamplerConfig, list[str]]:
    """(sampler, stop strings) of a task's `gen_kwargs` over the model arguments' sampler `base`
    (`steps_given`: the model arguments set steps, so a new block size does not reset it; `nfe`: they asked for
    the paper's variant at that NFE, which a new block size keeps and a new sampler takes at the same NFE)."""
    gen_kwargs.pop("ignore_eos", None)  # read by `_plan`
    until = gen_kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    do_sample = gen_kwargs.pop("do_sample", None)
    temperature = gen_kwargs.get("temperature")
    greedy = do_sample is False or temperature == 0
    own = samplers.options()
    ignored = sorted(set(gen_kwargs) - set(GEN_KWARGS) - set(own))
    if ignored:
        warn_once(f"blockgen ignores gen_kwargs {ignored}; it reads {sorted(GEN_KWARGS) + sorted(GENERIC_GEN_KWARGS) + sorted(own)}")
    overrides = {GEN_KWARGS[k]: v for k, v in gen_kwargs.items() if k in GEN_KWARGS}
    options = {k: v for k, v in gen_kwargs.items() if k in own}
    if options or overrides.get("name", base.name) != base.name:  # the base's own settings belong to its sampler
        kept = dict(base.options) if overrides.get("name", base.name) == base.name else {}
        overrides["options"] = tuple(sorted({**kept, **options}.items()))
    name = overrides.get("name", base.name)
    if samplers.get(name).autoregressive:
        if "name" not in overrides:  # as lm-eval's hf backend: greedy unless the task asks to sample
            if greedy:
                overrides["name"] = "ar_greedy"
            elif do_sample is True or (temperature or 0) > 0:
                overrides["name"] = "ar_sample"
    elif temperature == 0:
        raise ValueError(
            f"temperature=0 asks for greedy decoding, which diffusion sampler {name!r} does not have; "
            "set a temperature > 0 (e.g. --gen_kwargs temperature=0.1) or an AR sampler (sampler=ar_greedy)")
    elif do_sample is False:
        warn_once(f"a task asks for greedy decoding (do_sample=False); diffusion sampler {name!r} has no greedy "
                   f"mode and samples at temperature {overrides.get('temperature', base.temperature)}")
    sampler = base
    if overrides:
        renamed = overrides.get("name", base.name) != base.name
        if renamed and nfe is not None and "steps" not in overrides and not samplers.get(name).autoregressive:
            from blockgen.harness.evaluation.paper_variants import GRID, settings_at

            if name in GRID:  # the new sampler's paper variant at the NFE asked for
                steps, ge, warmup = settings_at(name, nfe, None, overrides.get("ge"), overrides.get("warmup"))
                overrides.update(steps=steps, ge=ge, warmup=warmup)
            else:  # a sampler without paper variants: nfe reverse steps per block
                overrides.update(steps=nfe, ge=overrides.get("ge", 1), warmup=overrides.get("warmup", 0))
        elif {"name", "block_size"} & set(overrides) and "steps" not in overrides and not steps_given and nfe is None:
            # steps follows the block size, as for the model arguments
            overrides["steps"] = resolve_block_size(config, replace(sampler, **{**overrides, "steps": 1, "warmup": 0}))
        sampler = replace(sampler, **overrides)  # SamplerConfig validates (its errors name the choices)
        if sampler.max_new_tokens > (room := largest_budget(config, sampler)):
            warn_once(f"max_gen_toks={sampler.max_new_tokens} does not fit seq_len={config.seq_len}; using {room}")
            sampler = replace(sampler, max_new_tokens=room)
        check_config(config, sampler)
    return sampler, until


def largest_budget(config: BlockGenConfig, sampler: SamplerConfig, prompt_len: int = 1) -> int:
    """The most tokens a sampler can add after a prompt of `prompt_len` tokens (default: BOS alone); 0: none."""
    for n in range(config.seq_len - 1, 0, -1):
        if max_prompt_len(config, replace(sampler, max_new_tokens=n)) >= prompt_len:
            return n
    return 0


def check_checkpoint_dir(path: str, flag: str = "pretrained=") -> None:
    """A checkpoint folder, not a training run's folder (lm-eval's pretrained=, blockgen sample's --checkpoint ):
    one rule for both, the message naming the flag the user gave."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{flag}{path}: checkpoint directory does not exist")
    if not (directory / CONFIG).is_file() and (directory / "checkpoint" / CONFIG).is_file():
        raise CheckpointError(f"{flag}{path} is a training run's folder; its checkpoint is "
                              f"{flag}{directory / 'checkpoint'}")


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


# lm-eval's command line sends device="cuda:0" when --device is not given (its `hf` backend then
# falls back to the CPU on a machine without a GPU): that default, and only it, means the CPU there.
LM_EVAL_DEFAULT_DEVICE = "cuda:0"


def requested_device(device: str | None) -> str | None:
    """The device to ask `setup_distributed` for: lm-eval's default read as above, anything else as given."""
    if device == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
        log.warning("blockgen: device %s requested but CUDA is not available; using the CPU", device)
        return "cpu"
    return device
