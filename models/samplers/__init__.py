"""Samplers as registered objects: each module of this folder defines one or more `Sampler` subclasses and
registers them by name (`@register`). Everything that used to compare sampler names reads the registry
instead: whether a sampler decodes autoregressively, whether it has informed steps, its NFE label rule, its
model calls per block, what it is priced as, its plot colour, and the function that runs one block.

The declarations are plain Python (no torch): the sampler catalogue, the cost model and the reports read
them without loading the network code; a sampler's `block` imports what it runs when it is called.
A new sampler is one new module here (`docs/sampling.md`, "To add a sampler"); `load()` imports every
module of the folder once, on the first lookup, then the modules other packages name in the entry-point group
`blockgen.samplers` (a sampler of one's own, pip-installed, runs in `lm_eval --model blockgen` and the sweeps
without a change here).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from dataclasses import dataclass
from typing import Any, ClassVar

_REGISTRY: dict[str, "Sampler"] = {}
ENTRY_POINTS = "blockgen.samplers"  # other packages' sampler modules
_loaded = False


@dataclass(frozen=True)
class Option:
    """A setting of one sampler beyond those every sampler has (steps, temperature, block size, budget, seed,
    layout): its name is also its `--model_args` key, its `gen_kwargs` key and its `blockgen sample` flag."""

    name: str
    kind: type  # int or float
    default: int | float
    help: str  # one line
    low: float | None = None  # the range, inclusive unless open
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def range_text(self) -> str:
        low = "" if self.low is None else f"{self.low} {'<' if self.low_open else '<='} "
        high = "" if self.high is None else f" {'<' if self.high_open else '<='} {self.high}"
        return f"{low}{self.name}{high}"

    def check(self, value: Any) -> int | float:
        """The value as its kind, or a ValueError naming the range."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.kind is int and not (number and float(value).is_integer()):
            raise ValueError(f"{self.name}={value!r}; must be an integer ({self.range_text()})")
        if not number:
            raise ValueError(f"{self.name}={value!r}; must be a number ({self.range_text()})")
        value = self.kind(value)
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if below or above:
            raise ValueError(f"{self.name}={value!r}; must be in {self.range_text()}")
        return value


class Sampler:
    """What the rest of the project knows about a sampler, declared once. Subclasses set the class
    attributes and override the methods whose rule differs; `block` runs one block (torch, imported lazily).
    `config` is a `models.sampler_config.SamplerConfig`, named as a string: that module imports this one."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line: `--help` texts and docs
    autoregressive: ClassVar[bool] = False  # one token per model call at block size 1
    informed: ClassVar[bool] = False  # predictor-corrector: reads `ge` and `warmup`
    needs_ar_pass: ClassVar[bool] = False  # scores with the network at block size 1 (a token-causal clean stream)
    reads_temperature: ClassVar[bool] = True  # greedy decoding does not
    priced_as: ClassVar[str | None] = None  # priced with that sampler's measured calls (the same call per step)
    adaptive: ClassVar[bool] = False  # calls per block vary by row and block: NFE is measured, not a label
    needs_untimed_network: ClassVar[bool] = False  # follows no noise schedule: a time-conditioned network has no time
    commits_positions: ClassVar[bool] = False  # the field's parallel decoders (position_committing.py)
    color: ClassVar[str] = "tab:purple"  # plots
    options: ClassVar[tuple[Option, ...]] = ()  # its own settings (`SamplerConfig.options`)

    def paper_nfe_per_block(self, config: "SamplerConfig") -> int | None:
        """The paper's NFE label per block (appendix D); None for an adaptive sampler (its NFE is measured)."""
        return None if self.adaptive else 1 if self.autoregressive else config.steps

    def calls_per_block(self, config: "SamplerConfig", block_size: int, eps: float = 1e-3) -> int:
        """Model calls really made per block (per batched call, not per row); an adaptive sampler: its most."""
        return 1 if self.autoregressive else config.steps

    def check(self, config: "SamplerConfig") -> None:
        """Refuse settings this sampler cannot run (ValueError naming the valid choices)."""

    def block(self, dec, config: "SamplerConfig", generator, trace=None, block_index: int = 0):
        """One block of clean tokens (B, L') from the decoder's current position (models/sampling.py)."""
        raise NotImplementedError(f"sampler {self.name!r} has no block function")


def register(cls: type[Sampler]) -> type[Sampler]:
    """Class decorator: register one instance of `cls` under `cls.name`; a second sampler of the same name is an
    error naming both modules."""
    name = cls.name
    if name in _REGISTRY and type(_REGISTRY[name]).__module__ != cls.__module__:
        raise ValueError(f"two samplers are registered as {name!r}: {type(_REGISTRY[name]).__module__}."
                         f"{type(_REGISTRY[name]).__name__} and {cls.__module__}.{cls.__name__}")
    _REGISTRY[name] = cls()
    return cls


def load() -> dict[str, Sampler]:
    """Import every sampler module of this folder (once); the registry: the paper's diffusion samplers, the field's
    position-committing ones, then the AR ones, each in module-name and then registration order (choices, legends
    and tables list them so)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            importlib.import_module(f"{__name__}.{module.name}")
        for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda e: e.name):
            try:
                entry.load()  # importing the module registers its samplers
            except Exception as err:
                raise ImportError(f"the sampler plug-in {entry.name!r} ({entry.value}, entry point group "
                                  f"{ENTRY_POINTS!r}) failed to load: {err}") from err
        ordered = sorted(_REGISTRY.items(), key=lambda item: (item[1].autoregressive, item[1].commits_positions))
        _REGISTRY.clear()
        _REGISTRY.update(ordered)
    return _REGISTRY


def names() -> tuple[str, ...]:
    return tuple(load())


def get(name: Any) -> Sampler:
    """The registered sampler `name`, or a ValueError listing the registered ones."""
    found = load().get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown sampler {name!r}; choose one of {list(names())}")
    return found


def options() -> dict[str, Option]:
    """Every registered sampler's own settings by name (one declaration per name: samplers that share a setting
    declare the same `Option`)."""
    found: dict[str, Option] = {}
    for sampler in load().values():
        for option in sampler.options:
            if found.setdefault(option.name, option) != option:
                raise ValueError(f"setting {option.name!r} is declared twice, differently: {found[option.name]} and "
                                 f"{option} ({sampler.name!r})")
    return found


def autoregressive_names() -> tuple[str, ...]:
    return tuple(n for n, s in load().items() if s.autoregressive)
