"""The rates file: measured seconds per batched model call on one device, which `blockgen sweep GRID
--dry-run` prices full-scale grids with (harness/costs/eval_cost.py) and `blockgen gpu-check` writes.

A rates file (JSON, `Rates`, version `RATES_VERSION`) holds what one device measured, per precision:
- `sampler_calls`: seconds per batched sampler call (`generate()`'s model calls, ARPC's AR passes
  included) per sampler, block size and batch;
- `likelihood_passes`: seconds per batched likelihood pass (one NELBO draw over a batch of full-length
  sequences) per model kind, prior, batch and length;
- `training`: tokens/s of one training process (`TrainRate`) per prior, block-size mixture, micro-batch and
  length, and its peak memory (version 2; a version-1 file, which has none, reads as an empty list);
- `provenance`: the command, date and commit that measured them, where the figures are recorded, and
  what was and was not measured.

Which file prices a sweep (`rate_source`): `--rates FILE`; else RUNS/gpu-check/rates.json (the sweep's
`--runs` folder, `make`'s $(RUNS)), which `make gpu-check` writes, when it was measured at the paper's
size (a GPU run); else the stored `STORED_RATES` (the H100 figures of docs/results.md). A sharded sweep
does not pick up gpu-check's file by itself: every job must price (and so split) alike.

Lookups (`Rates.call_seconds`, `Rates.pass_seconds`) take the rows of the asked precision, else of
the same dtype with TF32 the other way (said in the note); between two measured batches the seconds
are interpolated linearly, outside them the nearest measured batch is scaled per row. Training:
`training_tokens_per_s` (a prior at a length: the asked micro-batch, else the largest measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from blockgen.harness.costs.data_file import MEASURED_RATES, RatesError, build, read_json, write_dataclass
from blockgen.harness.costs.eval_cost import FullScalePlan, Price

RATES_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before `training` (read as none measured)
RATES_FILE = "rates.json"  # in gpu-check's output folder
GPU_CHECK_FOLDER = "gpu-check"  # gpu-check's output folder in the runs folder (`make gpu-check`: $(RUNS)/gpu-check)
STORED_RATES = MEASURED_RATES / "nvidia-h100-80gb-hbm3.json"

PRECISIONS = ("float32", "float32+tf32", "bfloat16", "bfloat16+tf32")
SIZES = ("micro", "tiny", "paper")


def precision_label(dtype: str | None, tf32: bool = False) -> str:
    """A setting's precision as rates files name it: the matmuls' dtype (lm-eval's "auto" is float32),
    +tf32 when TF32 is on."""
    from blockgen.harness.runtime.precision import DTYPES, check_dtype

    name = "float32" if dtype is None else str(DTYPES[check_dtype(dtype)]).removeprefix("torch.")
    return name + ("+tf32" if tf32 else "")


@dataclass(frozen=True)
class CallRate:
    precision: str  # one of PRECISIONS: the matmuls' dtype, +tf32 when TF32 was on
    sampler: str  # a registered sampler (models/samplers/)
    block_size: int  # tokens per block of the calls (1: AR decoding)
    batch: int  # rows per call
    seconds: float  # per batched call


@dataclass(frozen=True)
class PassRate:
    precision: str
    algo: str  # release_paths.ALGOS: blockgen ([x0 ; xt], 2L tokens), ar, mdlm, duo
    prior: str  # masked or uniform
    batch: int  # sequences per pass
    seq_len: int  # tokens per sequence (L)
    seconds: float  # per batched pass (one NELBO draw at one block size)


@dataclass(frozen=True)
class TrainRate:
    precision: str  # the training's matmuls: bfloat16 (+tf32: bf16 autocast, TF32 on), float32 on a CPU
    prior: str  # masked or uniform
    block_sizes: tuple[int, ...]  # the mixture trained, one block size per step
    micro_batch: int  # sequences per process and micro-batch
    seq_len: int  # tokens per sequence (L)
    tokens_per_s: float  # one process: micro_batch x seq_len / seconds per step (the mixture's weighted mean)
    peak_memory_gb: float | None  # torch.cuda.max_memory_allocated; None on a CPU


@dataclass(frozen=True)
class Provenance:
    command: str
    date: str
    commit: str
    source: str  # where the figures are recorded (a summary.json, a docs section)
    notes: str = ""  # what was measured and what was not


@dataclass(frozen=True)
class Rates:
    version: int
    device: str  # as torch names it (e.g. "NVIDIA H100 80GB HBM3")
    size: str  # the network measured: SIZES (paper: 12 x 768, the full-scale grids' models)
    provenance: Provenance
    sampler_calls: tuple[CallRate, ...] = ()
    likelihood_passes: tuple[PassRate, ...] = ()
    training: tuple[TrainRate, ...] = ()

    def describe(self) -> str:
        p = self.provenance
        kinds = (("sampler calls", self.sampler_calls), ("likelihood passes", self.likelihood_passes), ("training", self.training))
        measured = [f"{what} in {', '.join(sorted({r.precision for r in rows}))}" for what, rows in kinds if rows]
        return (f"{self.device}, {self.size} size, {p.date}, `{p.command}`, commit {p.commit}; measured: "
                + ("; ".join(measured) or "nothing"))

    def call_seconds(self, sampler: str, block_size: int, batch: int, precision: str) -> tuple[float | None, str]:
        """(seconds per batched call, how it was found) or (None, why there is none)."""
        from blockgen.models import samplers

        # priced with another sampler's measured calls where the model call per step is the same (Sampler.priced_as)
        name = samplers.get(sampler).priced_as or sampler
        rows = [r for r in self.sampler_calls if r.sampler == name and r.block_size == block_size]
        what = f"{name} calls of {block_size}-token blocks" + (f" (for {sampler})" if name != sampler else "")
        return _lookup(rows, batch, precision, what)

    def pass_seconds(self, algo: str, prior: str | None, seq_len: int, batch: int, precision: str) -> tuple[float | None, str]:
        """The same for likelihood passes (`prior` None: any prior, e.g. for a plain AR model)."""
        rows = [r for r in self.likelihood_passes
                if r.algo == algo and (prior is None or r.prior == prior) and r.seq_len == seq_len]
        what = f"{algo}{'' if prior is None else ' ' + prior} likelihood passes at L = {seq_len}"
        return _lookup(rows, batch, precision, what)


def training_tokens_per_s(rates: Rates, prior: str, seq_len: int, micro_batch: int | None = None) -> float | None:
    """Measured tokens/s of one training process for `prior` at length `seq_len`: at `micro_batch` when it
    was measured, else at the largest measured micro-batch (the fullest GPU); None when none was measured.
    Several rows of one micro-batch (other mixtures or precisions): the first in the file."""
    rows = [r for r in rates.training if r.prior == prior and r.seq_len == seq_len]
    if not rows:
        return None
    measured = {r.micro_batch for r in rows}
    micro = micro_batch if micro_batch in measured else max(measured)
    return next(r.tokens_per_s for r in rows if r.micro_batch == micro)


def _lookup(rows: list, batch: int, precision: str, what: str) -> tuple[float | None, str]:
    same = [r for r in rows if r.precision == precision]
    note = ""
    if not same:  # the nearest precision that was measured: the same dtype, TF32 the other way (said)
        dtype = precision.split("+")[0]
        same = [r for r in rows if r.precision.split("+")[0] == dtype]
        if same:
            note = f", measured in {same[0].precision} for {precision}"
            same = [r for r in same if r.precision == same[0].precision]
    if not same:
        return None, f"no measured {what} in {precision}"
    points = {r.batch: r.seconds for r in same}
    seconds, how = interpolate(points, batch)
    return seconds, f"{what}, {how}{note}"


def interpolate(points: dict[int, float], batch: int) -> tuple[float, str]:
    """Seconds at `batch` from seconds measured at some batches: exact, else linear between the two
    measured batches around it, else the nearest measured batch scaled per row (an estimate)."""
    if batch in points:
        return points[batch], f"batch {batch}"
    below = [b for b in points if b < batch]
    above = [b for b in points if b > batch]
    if below and above:
        lo, hi = max(below), min(above)
        seconds = points[lo] + (points[hi] - points[lo]) * (batch - lo) / (hi - lo)
        return seconds, f"batch {batch} interpolated between {lo} and {hi}"
    near = max(below) if below else min(above)
    return points[near] * batch / near, f"batch {batch} scaled per row from {near}"


# ------------------------------------------------------------------------------ reading and writing


def write_rates(rates: Rates, path: str | Path) -> Path:
    """Write atomically (a reader never sees half a file); returns the path."""
    return write_dataclass(rates, path)


def read_rates(path: str | Path) -> Rates:
    """A rates file, checked: RatesError names the file and the first bad field."""
    return from_dict(read_json(path), str(path))


def from_dict(data: Any, where: str = "rates") -> Rates:
    """A checked `Rates` of this version; an older readable version is read as this one (its missing lists empty)."""
    if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise RatesError(f"rates file {where}: version: expected one of {list(READABLE_VERSIONS)}, found {found!r}")
    rates = replace(build(Rates, data, where), version=RATES_VERSION)
    _check_values(rates, where)
    return rates


def _check_values(rates: Rates, where: str) -> None:
    from blockgen.harness.checkpoints.release_paths import ALGOS
    from blockgen.models import samplers

    def bad(name: str, value: Any, expected: str) -> RatesError:
        return RatesError(f"rates file {where}: {name}: {value!r}; expected {expected}")

    if rates.size not in SIZES:
        raise bad("size", rates.size, f"one of {list(SIZES)}")
    for kind, rows in (("sampler_calls", rates.sampler_calls), ("likelihood_passes", rates.likelihood_passes)):
        for i, r in enumerate(rows):
            name = f"{kind}[{i}]"
            if r.precision not in PRECISIONS:
                raise bad(f"{name}.precision", r.precision, f"one of {list(PRECISIONS)}")
            if not (r.seconds > 0 and r.seconds < float("inf")):
                raise bad(f"{name}.seconds", r.seconds, "a positive number of seconds")
            if r.batch < 1:
                raise bad(f"{name}.batch", r.batch, "an integer >= 1")
            if isinstance(r, CallRate) and r.sampler not in samplers.names():
                raise bad(f"{name}.sampler", r.sampler, f"one of {list(samplers.names())}")
            if isinstance(r, CallRate) and r.block_size < 1:
                raise bad(f"{name}.block_size", r.block_size, "an integer >= 1")
            if isinstance(r, PassRate) and r.algo not in ALGOS:
                raise bad(f"{name}.algo", r.algo, f"one of {list(ALGOS)}")
            if isinstance(r, PassRate) and r.prior not in ("masked", "uniform"):
                raise bad(f"{name}.prior", r.prior, "masked or uniform")
            if isinstance(r, PassRate) and r.seq_len < 1:
                raise bad(f"{name}.seq_len", r.seq_len, "an integer >= 1")
    for i, t in enumerate(rates.training):
        name = f"training[{i}]"
        if t.precision not in PRECISIONS:
            raise bad(f"{name}.precision", t.precision, f"one of {list(PRECISIONS)}")
        if t.prior not in ("masked", "uniform"):
            raise bad(f"{name}.prior", t.prior, "masked or uniform")
        if not t.block_sizes or min(t.block_sizes) < 1:
            raise bad(f"{name}.block_sizes", list(t.block_sizes), "one or more integers >= 1")
        for field_name in ("micro_batch", "seq_len"):
            if getattr(t, field_name) < 1:
                raise bad(f"{name}.{field_name}", getattr(t, field_name), "an integer >= 1")
        if not (t.tokens_per_s > 0 and math.isfinite(t.tokens_per_s)):
            raise bad(f"{name}.tokens_per_s", t.tokens_per_s, "a positive number of tokens per second")
        if t.peak_memory_gb is not None and not (t.peak_memory_gb > 0 and math.isfinite(t.peak_memory_gb)):
            raise bad(f"{name}.peak_memory_gb", t.peak_memory_gb, "a positive number of GB, or null (not measured)")


# ------------------------------------------------------------------------------ which file prices a sweep


@dataclass(frozen=True)
class RateSource:
    rates: Rates
    path: Path
    note: str = ""  # why this file (e.g. a user's file that was passed over)

    def describe(self) -> str:
        path = self.path.resolve()
        shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
        return f"{shown}: {self.rates.describe()}" + (f" ({self.note})" if self.note else "")


def gpu_check_rates(runs: str | Path = "runs") -> Path:
    """Where `blockgen gpu-check --out-dir RUNS/gpu-check` (`make gpu-check`) writes its rates file."""
    return Path(runs) / GPU_CHECK_FOLDER / RATES_FILE


def rate_source(explicit: str | None = None, user: Path | None = None) -> RateSource:
    """The rates that price a full-scale sweep: `explicit` (--rates), else gpu-check's file `user` when it
    was measured at the paper's size (a GPU run), else the stored H100 figures. A file measured at another
    size cannot price the paper's models: given explicitly, it is an error; found, it is passed over
    (said in the note). `user` None: none is looked for (a sharded sweep)."""
    if explicit:
        rates = read_rates(explicit)
        if rates.size != "paper":
            raise RatesError(f"rates file {explicit}: size: {rates.size!r}, measured on the {rates.size} model "
                             "(gpu-check on a CPU); full-scale grids run the paper's models: give a file of a "
                             "GPU run (`make gpu-check` on the GPU, then --rates runs/gpu-check/rates.json)")
        return RateSource(rates, Path(explicit))
    note = ""
    if user is not None and user.is_file():
        found = read_rates(user)
        if found.size == "paper":
            return RateSource(found, user)
        note = f"{user} passed over: measured at {found.size} size"
    elif user is None:
        note = "a sharded sweep prices with --rates or the stored file, never with gpu-check's file by itself"
    return RateSource(read_rates(STORED_RATES), STORED_RATES, note)


def full_scale_price(plan: FullScalePlan, precision: str, rates: Rates) -> Price:
    """The model calls at the rates file's measured seconds per batched call (`Rates`) in `precision`
    (`precision_label`); the scorer, and calls the file has no rate for, at the FLOP bound."""
    if plan.sampler is None:
        prior = None if plan.algo == "ar" else plan.prior
        per_call, how = rates.pass_seconds(plan.algo, prior, plan.seq_len, plan.work.batch, precision)
    else:
        per_call, how = rates.call_seconds(plan.sampler, plan.block, plan.work.batch, precision)
    calls, scorer = plan.work.batched_calls, "; scorer: FLOP bound" if plan.scorer_s else ""
    if per_call is None:
        return Price(plan.bound, f"{plan.what}; {calls} batched calls, {how}: FLOP bound{scorer}", plan.bound, derived=plan.bound)
    what = f"{plan.what}; {calls} batched calls x {per_call * 1e3:.2f} ms ({how}){scorer}"
    return Price(calls * per_call + plan.scorer_s, what, plan.bound, derived=plan.scorer_s)
