"""A sampler setting: which sampler, how many reverse steps per block, where the informed steps fall
(`SamplerConfig`, the one type of a sampler setting from the command line to the sampler loop), and
what a setting costs per block: the paper's NFE label (`paper_nfe_per_block`) and the model calls
really made (`calls_per_block`). Plain Python (no torch): the sampler catalogue and the cost model
read it without loading the network code (models/sampling.py runs the samplers)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from blockgen.models import samplers

BlockLayout = Literal["grid", "prompt_end"]
BLOCK_LAYOUTS: tuple[str, ...] = get_args(BlockLayout)


@dataclass(frozen=True)
class SamplerConfig:
    name: str = "ancestral"  # a registered sampler (models/samplers/)
    steps: int = 16  # N_step: reverse steps per block (ignored by the AR samplers)
    ge: int = 1  # an informed step every `ge` steps after the warm-up (eipc, arpc)
    warmup: int = 0  # ancestral-only steps at the start of each block (eipc, arpc)
    temperature: float = 1.0  # divides the logits; ignored by ar_greedy
    block_size: int | None = None  # L'; None: the model's largest trained block size (AR: 1)
    max_new_tokens: int = 256
    seed: int = 0  # row i of a batch uses seed + i unless generate() is given per-row seeds
    layout: BlockLayout = "grid"  # blocks on the training grid, or a whole block right after the prompt
    # The sampler's own settings (its `Sampler.options`), as sorted (name, value) pairs; unset ones take their default.
    options: tuple[tuple[str, int | float], ...] = ()

    def __post_init__(self) -> None:
        sampler = samplers.get(self.name)  # an unknown name lists the registered ones
        if self.layout not in BLOCK_LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; choose one of {list(BLOCK_LAYOUTS)}")
        for key, low in (("steps", 1), ("ge", 1), ("warmup", 0), ("max_new_tokens", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key}={value!r}; must be an integer >= {low}")
        if sampler.reads_temperature and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}; sampler {self.name!r} needs a temperature > 0")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size={self.block_size!r}; must be a positive integer or None")
        if not sampler.autoregressive and self.block_size == 1:
            raise ValueError(f"block size 1 is autoregression; use sampler {' or '.join(map(repr, samplers.autoregressive_names()))}, "
                             f"not {self.name!r}")
        declared = {o.name: o for o in sampler.options}
        given = dict(self.options)
        if len(given) != len(self.options) or set(given) - set(declared):
            unknown = sorted(set(given) - set(declared)) or [name for name, _ in self.options]
            raise ValueError(f"sampler {self.name!r} has no setting {unknown}; its own settings: {sorted(declared)}")
        object.__setattr__(self, "options", tuple(sorted((k, declared[k].check(v)) for k, v in given.items())))
        sampler.check(self)

    def as_dict(self) -> dict:
        """The setting as a flat dict: its fields, then the sampler's own settings that were given. Seeds and records
        are derived from it, so a setting without options reads as it did before options existed."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        return {**out, **dict(self.options)}

    def option(self, name: str) -> int | float:
        """The value of one of the sampler's own settings: as given, else its default."""
        declared = {o.name: o for o in self.sampler.options}
        if name not in declared:
            raise KeyError(f"sampler {self.name!r} has no setting {name!r}")
        return dict(self.options).get(name, declared[name].default)

    @property
    def sampler(self) -> samplers.Sampler:
        """The registered sampler this setting runs."""
        return samplers.get(self.name)

    @property
    def is_ar(self) -> bool:
        return self.sampler.autoregressive

    def informed(self, i: int) -> bool:
        """Whether step i of a block is an informed (predictor-corrector) step."""
        return self.sampler.informed and i >= self.warmup and (i - self.warmup) % self.ge == 0


# ------------------------------------------------------------------------------- step schedule


def step_alphas(i: int, steps: int, eps: float) -> tuple[float, float]:
    """(alpha_t, alpha_s) of step i: t = (N - i) / N, s = (N - i - 1) / N; alpha_s = 1 exactly at s = 0."""
    t, s = (steps - i) / steps, (steps - i - 1) / steps
    return 1 - (1 - eps) * t, (1.0 if s == 0 else 1 - (1 - eps) * s)


def renoise_count(i: int, steps: int, n: int, eps: float) -> int:
    """k positions re-noised by an informed step at step i among n generated positions of a block.

    k = max(1, round((1 - alpha_s) n)) (Python's round) for s > 0, the expected number of noisy
    tokens at time s but at least one; k = 0 at the last step (s = 0, alpha_s = 1).
    """
    alpha_s = step_alphas(i, steps, eps)[1]
    return 0 if alpha_s == 1.0 or n < 1 else max(1, round((1 - alpha_s) * n))


def paper_nfe_per_block(config: SamplerConfig) -> int:
    """The paper's NFE label per block (appendix D): the sampler's rule (ARPC counts one AR pass per informed step)."""
    return config.sampler.paper_nfe_per_block(config)


def calls_per_block(config: SamplerConfig, block_size: int, eps: float = 1e-3) -> int:
    """Model calls the sampler really makes per block (ARPC skips the AR pass when k = 0, at the last step)."""
    return config.sampler.calls_per_block(config, block_size, eps)
