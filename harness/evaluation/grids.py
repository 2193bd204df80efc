"""The evaluation grids: one registry of what `blockgen sweep` and `blockgen demo` evaluate, apart from the runner.

A `Grid` names a benchmark's models (training presets `<benchmark>[-embedded]-<model>`, the demo's
presets, or the paper's releases), its likelihood and generation tasks, and the sampler x NFE x
temperature settings; `GRIDS` holds them by name (`blockgen sweep NAME`), `grid(name)` returns one.
The sampler variants by NFE come from `paper_variants` (`GRID`, `pick`). The demo's grid (`demo`)
and its samplers (`demo_samplers`, the `DEMO_*` constants) are here too: `blockgen demo` schedules
them on its own worker pool (harness/demo.py). How a grid becomes settings and runs: harness/evaluation/sweep.py.

A new grid is one entry in `GRIDS`; its models must be presets (harness/training/presets.py) or releases.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Iterable, Literal

from blockgen.harness.training.presets import DEMO_PRESETS
from blockgen.harness.evaluation.paper_variants import GRID, NFES, pick
from blockgen.models.sampler_config import SamplerConfig

Benchmark = Literal["owt", "tinygsm"]
AR_RUNS = (SamplerConfig("ar_greedy", steps=1), SamplerConfig("ar_sample", steps=1))


def _all(sampler: str, nfes: Iterable[int] = NFES) -> tuple[SamplerConfig, ...]:
    return tuple(v for n in nfes for v in GRID[sampler][n])


def _defaults(sampler: str, nfes: Iterable[int]) -> tuple[SamplerConfig, ...]:
    return tuple(pick(sampler, n) for n in nfes)


class ModelSource(str, Enum):
    """Where a grid's models come from, and so how their run folders are named and their cost priced."""

    RUNS = "runs"  # this project's full-scale training runs: RUNS/<benchmark>-<model>
    EMBEDDED = "embedded"  # the embedded presets, trained offline on a CPU: RUNS/<benchmark>-embedded-<model>
    RELEASED = "released"  # the paper's releases (harness/checkpoints/release_catalogue.py), converted when they load
    DEMO = "demo"  # `blockgen demo`'s presets: RUNS/<model>, samplers `demo_samplers`

    @property
    def cpu_scale(self) -> bool:
        """Models small enough for a CPU: priced in CPU-seconds from measured CPU rates."""
        return self in (ModelSource.EMBEDDED, ModelSource.DEMO)


@dataclass(frozen=True)
class Grid:
    """One benchmark's sweep: models x (likelihood task + generation settings)."""

    benchmark: Benchmark
    models: tuple[str, ...]
    generation_task: str
    likelihood_task: str | None
    temperatures: tuple[float, ...]
    ancestral_nfe: tuple[int, ...]
    eipc: tuple[SamplerConfig, ...]  # the paper's variants (paper_variants.GRID), at temperature 1
    arpc: tuple[SamplerConfig, ...]
    field: tuple[SamplerConfig, ...] = ()  # the field's samplers (models/samplers/), on every diffusion model
    k_mc: int = 8
    limit: int | None = None
    batch_size: int = 32
    source: ModelSource = ModelSource.RUNS
    model_args: tuple[tuple[str, Any], ...] = ()  # more blockgen model arguments for every setting
    # The likelihood settings' precision unless the sweep names one (--dtype). Full scale: bf16 autocast,
    # which moved likelihoods by at most 1e-4 relative (docs/lm_eval.md, "bf16 against float32"); offline
    # and CI grids: float32, in which their stored references were made.
    likelihood_dtype: str = "float32"

    def run_name(self, model: str) -> str:
        """The model's run folder (its checkpoint, and its results folder under the results dir)."""
        if self.source is ModelSource.RELEASED:
            return f"released/{self.benchmark}-{model}"
        if self.source is ModelSource.DEMO:
            return model
        return f"{self.benchmark}{'-embedded' if self.source is ModelSource.EMBEDDED else ''}-{model}"


_OWT_MODELS = ("ar", "masked-16", "uniform-16", "masked-mix", "uniform-mix", "masked-mix-flat", "uniform-mix-flat")
_GSM_MODELS = ("ar", "masked-16", "uniform-16", "masked-mix", "uniform-mix")
_OWT_TEMPS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
# OWT's ARPC: the defaults at NFE 8-32 and the paper's NFE-64 variant with GE 2.
_OWT_ARPC = (*_defaults("arpc", (8, 16, 32)), pick("arpc", 64, 60, 2, 52))
_FULL = dict(ancestral_nfe=NFES, eipc=_all("eipc"), k_mc=8, batch_size=32, likelihood_dtype="bfloat16")
_OFFLINE = dict(ancestral_nfe=(4, 8), eipc=_defaults("eipc", (4, 8)), k_mc=2, limit=16, batch_size=8, source=ModelSource.EMBEDDED)

# The demo's grid (`blockgen demo` schedules it on its own worker pool, harness/demo.py): per NFE the
# default variant of each diffusion sampler (`nfe=N`'s pick), ARPC only with block size 1; AR greedy
# beside the mixtures as their speed-quality reference. DEMO_MAX_GEN_TOKS: the tokens each answer may
# take at most (5 blocks of 16): gsm8k_code gives each row the smaller of this and the room its prompt
# leaves in the demo's 128, so a longer prompt shortens the budget instead of being cut (`budget_hits`
# counts the rows that used all of it).
# DEMO_NFES: the NFEs the demo sweeps by default, the two ends (NFE 8 went for the demo's 30 minutes; `--nfes 4 8 16`).
DEMO_NFES = (4, 16)
DEMO_VARIANTS: dict[int, tuple[SamplerConfig, ...]] = {n: tuple(pick(name, n) for name in ("ancestral", "eipc", "arpc"))
                                                       for n in (4, 8, 16)}
DEMO_MAX_GEN_TOKS = 80


def _field(thresholds: Iterable[float], bounds: Iterable[float], nfes: Iterable[int]) -> tuple[SamplerConfig, ...]:
    """The field's samplers at some settings: confidence thresholds, entropy bounds, low-confidence NFEs."""
    return (*(SamplerConfig("confidence_threshold", options=(("threshold", t),)) for t in thresholds),
            *(SamplerConfig("entropy_bounded", options=(("entropy_bound", b),)) for b in bounds),
            *(SamplerConfig("low_confidence", steps=n) for n in nfes))


# The demo's and the offline grids' field samplers, one setting each (the demo's 30 minutes; the synthetic
# language sweeps low-confidence at every NFE); the full-scale grids add the three samplers at three settings
# each with `blockgen sweep --field-samplers` (their price: `--dry-run`).
DEMO_FIELD = _field((0.9,), (0.1,), (4,))
FULL_FIELD = _field((0.7, 0.9, 0.95), (0.01, 0.1, 1.0), (8, 16, 32))


def demo_samplers(block_sizes: tuple[int, ...], temperatures: tuple[float, ...], nfes: tuple[int, ...],
                  field: tuple[SamplerConfig, ...] = DEMO_FIELD) -> list[SamplerConfig]:
    """The demo's samplers for a model (SamplerConfig): AR decoding for block size 1 alone; else every
    NFE's variants at every temperature, ARPC where block size 1 is in the mixture, the field's samplers
    (`field`), then AR greedy."""
    ar_greedy = SamplerConfig("ar_greedy")
    if tuple(block_sizes) == (1,):
        return [ar_greedy] + [SamplerConfig("ar_sample", temperature=t) for t in temperatures]
    out = [replace(v, temperature=t)
           for t in temperatures for n in nfes for v in DEMO_VARIANTS[n] if v.name != "arpc" or 1 in block_sizes]
    out += [replace(f, temperature=t) for t in temperatures for f in field]
    return out + ([ar_greedy] if 1 in block_sizes else [])


# The demo's second part, the synthetic language (tasks/synthlang.py): every sampler at NFE 1-16 per block of 16,
# at temperature 1 (its scores compare the model's distribution with the process's). Below the paper's
# NFE 4: ancestral and low-confidence take N steps; EIPC (1, 1, 0) and (2, 2, 0); ARPC (1, 1, 0), its
# smallest (one draft step and the AR pass: NFE 2; it has none at NFE 1).
LANGUAGE_TASK = "synthlang_gen"
LANGUAGE_NFES = (1, 2, 4, 8, 16)
LANGUAGE_TEMPERATURE = 1.0
_BELOW_PAPER = {("eipc", 1): (1, 1, 0), ("eipc", 2): (2, 2, 0), ("arpc", 2): (1, 1, 0)}


def language_samplers(block_sizes: tuple[int, ...], nfes: tuple[int, ...] = LANGUAGE_NFES) -> list[SamplerConfig]:
    """The language grid for a model: AR greedy and sampling where block size 1 is trained; on a diffusion
    model ancestral, EIPC, ARPC (block size 1 trained) and low-confidence at each NFE, confidence-threshold
    (0.9) and entropy-bounded (0.1)."""
    t = LANGUAGE_TEMPERATURE
    ar = [SamplerConfig("ar_greedy"), SamplerConfig("ar_sample", temperature=t)] if 1 in block_sizes else []
    if tuple(block_sizes) == (1,):
        return ar
    out = []
    for n in nfes:
        out.append(SamplerConfig("ancestral", steps=n, temperature=t))
        for name in ("eipc", "arpc") if 1 in block_sizes else ("eipc",):
            if (name, n) in _BELOW_PAPER:
                steps, ge, warmup = _BELOW_PAPER[name, n]
                out.append(SamplerConfig(name, steps=steps, ge=ge, warmup=warmup, temperature=t))
            elif n in GRID[name]:
                out.append(replace(pick(name, n), temperature=t))
        out.append(SamplerConfig("low_confidence", steps=n, temperature=t))
    out += [replace(f, temperature=t) for f in _field((0.9,), (0.1,), ())]
    return out + ar


def sampler_label(s: SamplerConfig) -> str:
    """The demo's name of a setting: its results file (`<model>/<label>.json`) and its table row. What the sampler
    reads: steps (not for AR and adaptive samplers), GE and warm-up (informed ones), its own settings, T."""
    if not s.sampler.reads_temperature:
        return s.name
    parts = [] if s.is_ar or s.sampler.adaptive else [f"N{s.steps}"]
    if s.sampler.informed:
        parts += [f"GE{s.ge}"] + ([f"W{s.warmup}"] if s.warmup else [])
    parts += [f"{name}{value:g}" for name, value in s.options] + [f"T{s.temperature:g}"]
    return f"{s.name}({','.join(parts)})"


GRIDS: dict[str, Grid] = {
    "owt": Grid("owt", _OWT_MODELS, "owt_genppl", "owt_ppl", _OWT_TEMPS, arpc=_OWT_ARPC, **_FULL),
    "gsm8k": Grid("tinygsm", _GSM_MODELS, "gsm8k_code", None, (1.0, 0.1), arpc=_all("arpc"), **_FULL),
    "owt-embedded": Grid("owt", ("ar", "masked-mix", "uniform-mix"), "owt_genppl_embedded", "owt_ppl_embedded", (1.0,),
                         arpc=(pick("arpc", 8),), **_OFFLINE),
    "gsm8k-embedded": Grid("tinygsm", ("ar", "masked-16", "masked-mix"), "gsm8k_code_embedded", None, (0.1,),
                           arpc=_defaults("arpc", (4, 8)), field=DEMO_FIELD, **_OFFLINE),
    "released-owt": Grid("owt", ("ar", "mdlm", "duo", *_OWT_MODELS[1:]), "owt_genppl", "owt_ppl", _OWT_TEMPS,
                         arpc=_OWT_ARPC, source=ModelSource.RELEASED, **_FULL),
    "released-gsm8k": Grid("tinygsm", ("ar", "masked-16", "uniform-16", "masked-32", "uniform-32", "masked-mix", "uniform-mix",
                                       "masked-mix32", "uniform-mix32"), "gsm8k_code", None, (1.0, 0.1), arpc=_all("arpc"),
                           source=ModelSource.RELEASED, **_FULL),
    "demo": Grid("tinygsm", DEMO_PRESETS, "gsm8k_code_embedded", None, (0.1,), ancestral_nfe=DEMO_NFES, eipc=(), arpc=(),
                 field=DEMO_FIELD, k_mc=8, batch_size=16, source=ModelSource.DEMO, model_args=(("max_gen_toks", DEMO_MAX_GEN_TOKS),)),
    # CI's gsm8k_code regression (harness/reports/outcomes.py): the demo's masked mixture stored under
    # leaderboards/ci_gsm8k/ (--runs), its demo settings at NFE 4 (ancestral, EIPC, ARPC) and AR greedy.
    "ci-gsm8k": Grid("tinygsm", ("gsm-masked-mix",), "gsm8k_code_embedded", None, (0.1,), ancestral_nfe=(4,), eipc=(), arpc=(),
                     k_mc=8, limit=200, batch_size=32, source=ModelSource.DEMO, model_args=(("max_gen_toks", DEMO_MAX_GEN_TOKS),)),
}


def grid(name: str) -> Grid:
    if name not in GRIDS:
        raise ValueError(f"no grid {name!r}; choose one of {sorted(GRIDS)}")
    return GRIDS[name]
