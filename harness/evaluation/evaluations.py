"""A grid's evaluations (`Evaluation`): one lm-eval run each, a task on a checkpoint with one sampler setting
(`SamplerConfig`, the one type of a sampler setting; none for the likelihood task). Per model: the
likelihood task once, then per sampler family (`families`: AR decoding for block size 1 alone, ARPC
for mixtures with block size 1, ancestral and EIPC otherwise) every variant of the grid at every
temperature, then the grid's field samplers (`Grid.field`). Evaluations that decode the same way are kept once
(`ar_greedy` does not read the temperature: it runs at the grid's first one). An evaluation's model arguments
are its sampler's (`sampler_model_args`, the adapter's one spelling) plus the grid's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from blockgen.harness.evaluation.grids import AR_RUNS, Grid, ModelSource, demo_samplers
from blockgen.harness.evaluation.lm_eval_model.arguments import sampler_model_args
from blockgen.harness.runtime.precision import DTYPES, check_dtype
from blockgen.harness.training.presets import preset
from blockgen.models.sampler_config import SamplerConfig

LIKELIHOOD = "likelihood"
GENPPL_TASKS = ("owt_genppl", "owt_genppl_embedded")


@dataclass(frozen=True)
class Evaluation:
    """One lm-eval run: a task on a checkpoint with one sampler setting (likelihood: no sampler)."""

    run: str  # the model's run name (Grid.run_name)
    checkpoint: str  # pretrained=
    task: str
    sampler: SamplerConfig | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # the grid's further model arguments

    @property
    def temperature(self) -> float | None:
        return None if self.sampler is None else self.sampler.temperature

    @property
    def label(self) -> str:
        """The setting's results folder: sampler-steps-ge-warmup-T<temperature>[-<option><value>...], or 'likelihood'."""
        extra = dict(self.extra)
        precision = "".join(f"-{x}" for x in (extra.get("dtype"), "tf32" if extra.get("tf32") else None) if x)
        if self.sampler is None:
            return LIKELIHOOD + precision
        a = sampler_model_args(self.sampler)
        own = "".join(f"-{name}{value}" for name, value in self.sampler.options)  # the sampler's own settings
        return f"{a['sampler']}-{a['steps']}-{a['ge']}-{a['warmup']}-T{a['temperature']}{own}{precision}"

    def model_args(self, k_mc: int) -> dict[str, Any]:
        """The blockgen `--model_args`, as the per-process Makefile command passed them."""
        args: dict[str, Any] = {"pretrained": self.checkpoint, "k_mc": k_mc}
        if self.sampler is not None:
            args.update(sampler_model_args(self.sampler))
        return {**args, **dict(self.extra)}

    def key(self, k_mc: int) -> str:
        """What decides the results: greedy AR decoding does not read the temperature."""
        args = self.model_args(k_mc)
        if self.sampler is not None and not self.sampler.sampler.reads_temperature:
            args.pop("temperature")
        return json.dumps([self.task, args], sort_keys=True)


def families(block_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The samplers the paper runs on a model: AR decoding (block size 1 alone), ARPC (a mixture with
    block size 1), else ancestral and EIPC (single block sizes, MDLM, Duo)."""
    if tuple(block_sizes) == (1,):
        return ("ar",)
    if 1 in block_sizes:
        return ("arpc",)
    return ("ancestral", "eipc")


def samplers(g: Grid, block_sizes: tuple[int, ...]) -> tuple[SamplerConfig, ...]:
    """The grid's sampler settings for a model, at temperature 1 (`settings` sets each temperature)."""
    if g.source is ModelSource.DEMO:
        found = demo_samplers(block_sizes, g.temperatures[:1], g.ancestral_nfe, g.field)
        return tuple(dict.fromkeys(replace(s, temperature=1.0) for s in found))
    out: list[SamplerConfig] = []
    for family in families(block_sizes):
        out += {"ar": AR_RUNS, "arpc": g.arpc, "eipc": g.eipc,
                "ancestral": tuple(SamplerConfig("ancestral", steps=n) for n in g.ancestral_nfe)}[family]
    return tuple(out) + (g.field if tuple(block_sizes) != (1,) else ())


def model_block_sizes(g: Grid, model: str, checkpoint: str) -> tuple[int, ...]:
    """From the checkpoint when it exists, else from the preset (or the release's path) it will come from."""
    if g.source is not ModelSource.RELEASED and (Path(checkpoint) / "config.json").is_file():
        from blockgen.harness.checkpoints.checkpoint import read_config

        return tuple(read_config(checkpoint).block_sizes)
    if g.source is ModelSource.RELEASED:
        from blockgen.harness.checkpoints.release_catalogue import RELEASES
        from blockgen.harness.checkpoints.release_paths import DATASETS, parse_release_path

        setting = parse_release_path(RELEASES[f"{g.benchmark}-{model}"])
        if setting.block_sizes:
            return tuple(setting.block_sizes)
        return (1,) if setting.algo == "ar" else (DATASETS[setting.dataset].seq_len,)
    return tuple(preset(g.run_name(model)).block_sizes)


def checkpoint_of(g: Grid, model: str, runs: str) -> str:
    if g.source is ModelSource.RELEASED:
        from blockgen.harness.checkpoints.release_catalogue import release_spec

        return release_spec(f"{g.benchmark}-{model}")
    return str(Path(runs) / g.run_name(model) / "checkpoint")


def likelihood_args(g: Grid) -> tuple[tuple[str, Any], ...]:
    """The likelihood setting's model arguments: the grid's, with its likelihood precision unless they
    name a dtype (a sweep's --dtype) or it is float32 (no dtype argument: the float32 code path)."""
    if "dtype" in dict(g.model_args) or DTYPES[check_dtype(g.likelihood_dtype)] == DTYPES["float32"]:
        return g.model_args
    return (*g.model_args, ("dtype", g.likelihood_dtype))


def evaluations(g: Grid, runs: str = "runs") -> list[Evaluation]:
    """Every setting of a grid, deduplicated (the first of equal settings is kept), per model:
    likelihood first, then sampler by sampler, each at every temperature."""
    out: dict[str, Evaluation] = {}
    for model in g.models:
        run, ckpt = g.run_name(model), checkpoint_of(g, model, runs)
        todo = [Evaluation(run, ckpt, g.likelihood_task, extra=likelihood_args(g))] if g.likelihood_task else []
        todo += [Evaluation(run, ckpt, g.generation_task, replace(s, temperature=t), g.model_args)
                 for s in samplers(g, model_block_sizes(g, model, ckpt)) for t in g.temperatures]
        for s in todo:
            out.setdefault(s.key(g.k_mc), s)
    return list(out.values())
