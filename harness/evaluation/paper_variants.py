"""The paper's sampler variants, grouped by NFE per block (tables 5-6, appendix D): the one place
that lists them. The Makefile's grids, the adapter's ``nfe=N`` and the demo read them from here.

A variant is a `SamplerConfig` (sampler, N_step, GE, warm-up) at temperature 1 (at another:
`dataclasses.replace(v, temperature=t)`). Its NFE label per block is N_step for ancestral and
EIPC and N_step + floor((N_step - 1 - warm-up) / GE) + 1 for ARPC (`paper_nfe_per_block`; the
tests check every entry against it). Where the paper lists several variants at one NFE, the first
is the one ``nfe=N`` picks unless ``ge``/``warmup``/``steps`` say otherwise (the demo's choice:
GE 2-4, no warm-up, except ARPC (3, 2, 1) at NFE 4).

    blockgen variants arpc --nfe 4 8          # defaults: NFE 4: 3:2:1, NFE 8: 6:3:0
    blockgen variants eipc --all              # every EIPC variant, steps:ge:warmup

This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import argparse
import sys

from blockgen.models.sampler_config import SamplerConfig

NFES = (4, 8, 16, 32, 64)
PAPER_BLOCK_SIZE = 16  # the block size the paper's variants were chosen for (L' = 16)


def _variants(name: str, *settings: tuple[int, int, int]) -> tuple[SamplerConfig, ...]:
    """A sampler's variants at one NFE, each (steps, ge, warmup), at temperature 1."""
    return tuple(SamplerConfig(name, steps=steps, ge=ge, warmup=warmup) for steps, ge, warmup in settings)


# NFE per block -> variants, the default first.
GRID: dict[str, dict[int, tuple[SamplerConfig, ...]]] = {
    "ancestral": {n: (SamplerConfig("ancestral", steps=n),) for n in NFES},
    "eipc": {
        4: _variants("eipc", (4, 2, 0), (4, 3, 1)),
        8: _variants("eipc", (8, 3, 0), (8, 2, 6)),
        16: _variants("eipc", (16, 4, 0), (16, 2, 12)),
        32: _variants("eipc", (32, 4, 0), (32, 2, 20), (32, 2, 26)),
        64: _variants("eipc", (64, 4, 0), (64, 2, 40), (64, 2, 52), (64, 2, 58)),
    },
    "arpc": {
        4: _variants("arpc", (3, 2, 1), (2, 1, 0), (3, 3, 0)),
        8: _variants("arpc", (6, 3, 0), (4, 1, 0), (5, 2, 0), (7, 2, 5)),
        16: _variants("arpc", (12, 3, 0), (8, 1, 0), (11, 2, 1), (14, 2, 10), (14, 4, 8)),
        32: _variants("arpc", (24, 3, 0), (16, 1, 0), (21, 2, 0), (28, 2, 20), (30, 2, 26), (30, 4, 24)),
        64: _variants("arpc", (48, 3, 0), (32, 1, 0), (43, 2, 1), (56, 2, 40), (60, 2, 52), (62, 2, 58), (62, 4, 56)),
    },
}


def spec(v: SamplerConfig) -> str:
    """steps:ge:warmup, as `blockgen variants` prints a variant (the Makefile reads it)."""
    return f"{v.steps}:{v.ge}:{v.warmup}"


def variants(sampler: str, nfe: int) -> tuple[SamplerConfig, ...]:
    if sampler not in GRID:
        raise ValueError(f"nfe= picks a variant of {sorted(GRID)}; sampler {sampler!r} has none "
                         "(AR samplers make one call per token)")
    if nfe not in GRID[sampler]:
        raise ValueError(f"the paper has no {sampler} variant at NFE {nfe} per block; choose nfe from {sorted(GRID[sampler])}")
    return GRID[sampler][nfe]


def pick(sampler: str, nfe: int, steps: int | None = None, ge: int | None = None, warmup: int | None = None) -> SamplerConfig:
    """The variant at that NFE matching the settings given (None: any); the default when several match."""
    given = {"steps": steps, "ge": ge, "warmup": warmup}
    matching = [v for v in variants(sampler, nfe) if all(x is None or getattr(v, k) == x for k, x in given.items())]
    if not matching:
        listed = ", ".join(f"steps={v.steps},ge={v.ge},warmup={v.warmup}" for v in variants(sampler, nfe))
        said = ",".join(f"{k}={x}" for k, x in given.items() if x is not None)
        raise ValueError(f"no {sampler} variant at NFE {nfe} with {said}; the paper's are: {listed}")
    return matching[0]


def settings_at(sampler: str, nfe: int | None, steps: int | None = None, ge: int | None = None,
                warmup: int | None = None) -> tuple[int | None, int | None, int | None]:
    """(steps, ge, warmup) of a setting asked for by NFE per block: the paper's variant at `nfe` narrowed by
    those given (`pick`), or those given when `nfe` is None. The one rule behind `nfe=N` (lm-eval's model
    args) and `blockgen sample --nfe N`."""
    if nfe is None:
        return steps, ge, warmup
    v = pick(sampler, nfe, steps, ge, warmup)
    return v.steps, v.ge, v.warmup


def build_parser(parser: argparse.ArgumentParser) -> None:
    """`blockgen variants` (mounted by harness/cli.py)."""
    parser.add_argument("sampler", choices=sorted(GRID))
    parser.add_argument("--nfe", type=int, nargs="+", default=list(NFES), help="NFE per block (default: all)")
    parser.add_argument("--all", action="store_true", help="every variant at each NFE, not only the default")
    parser.add_argument("--steps-only", action="store_true", help="print N_step alone (ancestral's grid)")


def run(args: argparse.Namespace) -> int:
    try:  # one line per NFE per block: the variants that carry that label
        chosen = {n: variants(args.sampler, n) if args.all else (pick(args.sampler, n),) for n in args.nfe}
    except ValueError as err:
        print(f"blockgen variants: error: {err}", file=sys.stderr)
        return 2
    for n, found in chosen.items():
        print(f"NFE {n}: " + " ".join(str(v.steps) if args.steps_only else spec(v) for v in found))
    return 0
