"""What an evaluation setting costs: its work counted, then priced (`blockgen sweep GRID --dry-run`).

Work (`Work`): rows (scored sequences, generated samples or problems) in batches of the grid's batch
size, times the batched model calls each batch makes: likelihood passes (one per block size 1, K_MC
per other block size: `likelihood_passes`), sampler calls over all blocks of a sample
(`calls_per_block` x blocks, ARPC's AR passes included), or one call per token for AR decoding;
plus the samples a Gen PPL scorer reads.

Prices (`Price`: the headline seconds, and at full scale the FLOP bound beside it):
- offline grids (CPU): **measured** seconds per batched call of each kind (`cpu_rates()`), per preset at
  the grid's batch size, from `bench/bench_eval_cost.py` (which writes them: `CPU_RATES_FILE`);
- full-scale grids (GPU): the work counted by `eval_cost.plan_cost` (`FullScalePlan`) times the
  **measured** seconds per batched call of a rates file (harness/costs/rates.py: `make gpu-check` writes one,
  the stored H100 file otherwise), in the setting's own precision (`rates.full_scale_price`); a part without
  a measured rate (e.g. likelihood passes the file lacks, the Gen PPL scorer) is priced by the
  **derived** FLOP bound and counted apart (`Price.derived`). The FLOP bound of the whole setting is
  printed beside it: the reference bf16 H200 training steps (`h200_reference()`, BlockGen and AR), a
  forward = 1/3 of a step, scaled by tokens (see `full_scale_assumptions()`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from blockgen.harness.checkpoints.release_catalogue import RELEASES
from blockgen.harness.checkpoints.release_paths import DATASETS, parse_release_path
from blockgen.harness.costs.data_file import MEASURED_RATES, read_dataclass
from blockgen.models.sampler_config import SamplerConfig, calls_per_block

Kind = Literal["likelihood", "diffusion", "ar"]


def likelihood_passes(block_sizes: tuple[int, ...], k_mc: int) -> int:
    """Forward passes per scored sequence for the log-sum-exp bound: block size 1 is exact (one
    pass), every other block size averages K_MC draws (mix-flat over 1-16 at K_MC 8: 33)."""
    return sum(1 if size == 1 else k_mc for size in block_sizes)


@dataclass(frozen=True)
class Work:
    kind: Kind
    rows: int  # sequences scored, samples generated, or problems answered
    batch: int  # rows per model call
    calls: int  # batched model calls per batch of rows (passes, sampler calls over all blocks, or tokens)
    scored: int = 0  # samples a generative-perplexity scorer reads

    @property
    def batched_calls(self) -> int:
        return math.ceil(self.rows / self.batch) * self.calls

    def describe(self) -> str:
        what = {"likelihood": "passes", "diffusion": "sampler calls", "ar": "AR calls (one per token)"}[self.kind]
        text = f"{self.rows} rows / {self.batch} per call x {self.calls} {what} = {self.batched_calls} batched calls"
        return text + (f"; {self.scored} samples scored" if self.scored else "")


@dataclass(frozen=True)
class FullScalePlan:
    """A full-scale setting's counted work and its FLOP bound in derived H200-seconds (`eval_cost.plan_cost`)."""

    work: Work
    algo: str  # release_paths.ALGOS: blockgen, ar, mdlm, duo
    prior: str | None  # masked or uniform (None: a plain AR model)
    seq_len: int
    model_s: float  # the model calls' FLOP bound
    what: str
    sampler: str | None = None  # None: the likelihood setting
    block: int = 0  # tokens per block of the sampler's calls
    scorer_s: float = 0.0  # the Gen PPL scorer's FLOP bound (GPT-2 Large)

    @property
    def bound(self) -> float:
        return self.model_s + self.scorer_s


@dataclass(frozen=True)
class Price:
    """A setting's price: `seconds` is the headline (None: not priced), `what` the work counted and how it was priced."""

    seconds: float | None
    what: str
    bound: float | None = None  # full scale: the FLOP bound of the whole setting (derived H200-seconds)
    derived: float = 0.0  # the part of `seconds` priced by the FLOP bound, for want of a measured rate


# An adaptive sampler's calls per block depend on the model and the data; before it runs it is priced at its most.
ADAPTIVE_NOTE = "adaptive sampler: priced at its most calls, one per position of a block (its results give the mean)"


def generation_calls(sampler: SamplerConfig, block: int, new_tokens: int) -> tuple[Kind, int]:
    """(kind, model calls) to generate `new_tokens` tokens of one batch of rows in blocks of `block` (no early stop;
    an adaptive sampler at its most: `ADAPTIVE_NOTE`)."""
    if sampler.is_ar:
        return "ar", new_tokens
    return "diffusion", calls_per_block(sampler, block) * math.ceil(new_tokens / block)


# ------------------------------------------------------------------------------ measured CPU rates


@dataclass(frozen=True)
class CpuRate:
    """Seconds per batched model call at `batch` rows, measured (random weights of the preset's shape)."""

    batch: int
    pass_s: float  # one likelihood pass over `batch` full-length windows
    call_s: float | None  # one diffusion sampler call (the preset's own family: ARPC for mixtures with block size 1)
    ar_call_s: float | None  # one AR decoding call (one token per row), where the preset has block size 1
    scorer_sample_s: float | None = None  # owt_genppl's scoring per sample: Gen PPL, MAUVE features (sample and reference), MAUVE


CPU_RATES_FILE = MEASURED_RATES / "cpu-2-core.json"


@dataclass(frozen=True)
class CpuRates:
    """What `bench/bench_eval_cost.py --write-rates` measured on this project's 2-core CPU machine
    (`CPU_RATES_FILE`), float32. Regenerate after a model change."""

    command: str  # what measured them
    date: str
    torch_threads: int
    cores: int
    load_average: tuple[float, ...]  # over 1, 5 and 15 minutes, when the measurement ended
    rates: dict[str, tuple[CpuRate, ...]]  # preset -> its measured rates, one per batch size
    # per task, what one setting costs besides its model calls (lm-eval building the task and its
    # documents, the sweep's logging, for gsm8k the sandbox start): a real sweep setting at a small
    # limit minus its priced work
    setting_overhead_s: dict[str, float]
    sandbox_program_s: float | None  # one gsm8k_code program in the sandbox, programs in parallel on the cores

    @property
    def measured(self) -> str:
        """The conditions, as the dry run prints them."""
        load = " ".join(f"{x:.2f}" for x in self.load_average)
        return f"{self.date}, {self.torch_threads} torch thread(s) on {self.cores} cores, load average {load}"


@functools.cache  # read when first priced, not at import
def cpu_rates() -> CpuRates:
    return read_dataclass(CpuRates, CPU_RATES_FILE)


def cpu_rate(preset: str, batch: int, measured: CpuRates | None = None) -> tuple[CpuRate | None, str]:
    """The measured rate of a preset at a batch size, else the nearest measured batch scaled per row
    (calls cost roughly rows x tokens at these sizes: an estimate, said in the note). `measured`: the
    stored rates unless given (a bench's fresh ones)."""
    by_batch = {r.batch: r for r in (measured or cpu_rates()).rates.get(preset, ())}
    if batch in by_batch:
        return by_batch[batch], ""
    if not by_batch:
        return None, f"no measured rate for {preset}"
    near = min(by_batch, key=lambda b: abs(b - batch))
    r, scale = by_batch[near], batch / near
    mul = (lambda x: None if x is None else x * scale)
    return CpuRate(batch, r.pass_s * scale, mul(r.call_s), mul(r.ar_call_s), r.scorer_sample_s), f"rate scaled from batch {near}"


def cpu_seconds(work: Work, rate: CpuRate, task: str = "", measured: CpuRates | None = None) -> float | None:
    """Model calls x the measured seconds per call, plus the Gen PPL scorer per sample, the sandbox per
    gsm8k_code problem and the task's measured per-setting overhead."""
    per_call = {"likelihood": rate.pass_s, "diffusion": rate.call_s, "ar": rate.ar_call_s}[work.kind]
    if per_call is None:
        return None
    measured = measured or cpu_rates()
    scorer = work.scored * (rate.scorer_sample_s or 0.0)
    sandbox = work.rows * (measured.sandbox_program_s or 0.0) if task.startswith("gsm8k_code") else 0.0
    return work.batched_calls * per_call + scorer + sandbox + measured.setting_overhead_s.get(task, 0.0)


# ------------------------------------------------------------------------------ the offline tasks' rows


def task_metadata(task: str) -> dict:
    """A task YAML's metadata (lm-eval's `!function` tags read as nothing: only plain keys matter here)."""
    import yaml

    from blockgen.lm_eval import tasks_dir

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    path = Path(tasks_dir()) / f"{task}.yaml"
    return (yaml.load(path.read_text(), Loader=Loader) or {}).get("metadata", {}) if path.is_file() else {}


def offline_rows(task: str, limit: int | None, metadata: dict) -> int | None:
    """Rows of an offline task: the limit, else its documents (None: only known from the data)."""
    if limit is not None:
        return limit
    if task.startswith("gsm8k_code"):
        return int(metadata.get("embedded_problems", task_metadata(task)["embedded_problems"]))
    if "genppl" in task:
        return int(metadata.get("num_samples", task_metadata(task).get("num_samples", 0))) or None
    return None  # owt_ppl*: the held-out chunks of the prepared data


def new_tokens(task: str, seq_len: int, max_gen_toks: int | None) -> int:
    """Tokens a sample may generate: owt_genppl fills the model (BOS prompt); gsm8k_code the room its
    prompt leaves (the prompt taken as a quarter of the length), or the grid's max_gen_toks. An upper
    bound: the sampler stops a batch once every row has stopped."""
    if max_gen_toks is not None:
        return max_gen_toks
    return seq_len - 1 if "genppl" in task else seq_len - seq_len // 4


CPU_ASSUMPTIONS = ("CPU-seconds = batched calls x seconds per call MEASURED by bench/bench_eval_cost.py "
                   "(random weights of each preset's shape at the grid's batch size; {measured}) + the sandbox per gsm8k "
                   "problem + a per-setting overhead per task measured on a real setting (lm-eval task building, "
                   "logging); rows = --limit, "
                   "else the task's documents; generation budget: owt fills the model, gsm8k 3/4 of its length "
                   "(full batches: one batch per sampler setting, per-row budgets inside it) or max_gen_toks (upper bound: batches stop early); Gen PPL: the offline scorer's measured seconds per sample "
                   "(score, MAUVE features and MAUVE); model loads not counted")


# ------------------------------------------------------------------------------ full-scale settings

H200_REFERENCE_FILE = MEASURED_RATES / "h200-reference.json"


@dataclass(frozen=True)
class H200Reference:
    """The FLOP bound's yardstick (`H200_REFERENCE_FILE`): reference H200 training steps of the paper-size
    network, not measured in this repository (no GPU was lent to this work)."""

    source: str  # where the figures come from, and how they were taken
    train_step_s: dict[str, float]  # per step: two_stream (BlockGen over [x0 ; xt], 2L tokens), one_stream (plain AR)
    step_batch: int  # sequences per step
    step_len: int  # tokens per sequence (L)


@functools.cache  # read when first priced, not at import
def h200_reference() -> H200Reference:
    return read_dataclass(H200Reference, H200_REFERENCE_FILE)


# OWT's held-out split: the last 100,000 of 8,013,769 documents, ~9e9 GPT-2 tokens in all (~1,120 per
# document) -> ~1.1e8 tokens = ~110,000 chunks of 1,024 (approximate).
OWT_PPL_SEQUENCES = 110_000
GENPPL_SAMPLES, GSM8K_PROBLEMS = 1024, 1319  # the paper's Gen PPL samples; GSM8K's test set
GSM8K_NEW_TOKENS = 256  # tokens generated per GSM8K problem
SCORER_PARAMS_RATIO = 774 / 170  # GPT-2 Large scores owt_genppl samples: its forward vs the 170M network's


def forward_seconds(stream: str, tokens: float) -> float:
    """Seconds of one forward pass over `tokens` tokens (of one sequence) on an H200 (derived): a third of a
    reference training step (the backward costs about two forwards), scaled by tokens (attention's L^2 ignored)."""
    ref = h200_reference()
    per_token = ref.train_step_s[stream] / 3 / (ref.step_batch * ref.step_len * (2 if stream == "two_stream" else 1))
    return per_token * tokens


def full_scale_assumptions() -> str:
    """The full-scale pricing's assumptions, as the dry run prints them: the reference figures from
    `h200_reference()` and the module's counts, so each number has one home."""
    ref = h200_reference()
    step = ref.train_step_s
    return ("GPU-hours = batched calls x seconds per batched call MEASURED on the rates file's device "
            "(harness/costs/rates.py: sampler calls per sampler and block size, likelihood passes per model and prior; "
            "a batch between two measured ones interpolated; the setting's precision, else its dtype with TF32 "
            "the other way), the parts without a measured rate (likelihood passes or block sizes the file "
            "lacks, the Gen PPL scorer) at the FLOP bound; model loads and vLLM start-up not counted. "
            "FLOP bound beside it: H200-hours DERIVED (eval_cost.plan_cost): a forward = 1/3 of the reference "
            f"bf16 H200 training step ({step['two_stream']:g} s BlockGen over 2L, {step['one_stream']:g} s AR over L, "
            f"batch {ref.step_batch} x {ref.step_len:,}), "
            "scaled by tokens; assumes bf16 matmuls; generation FLOP-proportional, a lower bound (cached "
            "calls of a 16-32-token block are latency-bound); uniform prior's float64 NELBO not counted. "
            f"owt_ppl: the whole held-out split as the paper (last 100k documents, ~{OWT_PPL_SEQUENCES:,} chunks of 1,024), "
            f"gsm8k: {GSM8K_PROBLEMS:,} problems x {GSM8K_NEW_TOKENS} tokens")


def plan_cost(name: str, task: str, sampler: SamplerConfig | None, k_mc: int, limit: int | None,
              batch: int = 32) -> FullScalePlan:
    """One setting's counted work and FLOP bound (H200-seconds, derived) on release `name`: generation with
    `sampler`, or the likelihood passes (None). Generation also counts its batched model calls (`batch` rows
    per call), whose latency the FLOP count does not see: `rates.full_scale_price` prices them with measured rates."""
    setting = parse_release_path(RELEASES[name])
    seq_len = DATASETS[setting.dataset].seq_len
    sizes = setting.block_sizes or ((1,) if setting.algo == "ar" else (seq_len,))
    two_stream = setting.algo == "blockgen"
    stream = "two_stream" if two_stream else "one_stream"
    plan = dict(algo=setting.algo, prior=setting.prior, seq_len=seq_len)
    if sampler is None:
        n = limit or OWT_PPL_SEQUENCES
        passes = likelihood_passes(sizes, k_mc) if setting.algo != "ar" else 1
        tokens = seq_len * (2 if two_stream else 1)
        return FullScalePlan(Work("likelihood", n, batch, passes), model_s=n * passes * forward_seconds(stream, tokens),
                             what=f"{n} sequences x {passes} passes", **plan)
    if task.startswith("gsm8k"):
        n, new_tokens, scorer = limit or GSM8K_PROBLEMS, GSM8K_NEW_TOKENS, 0.0
    else:
        n, new_tokens = limit or GENPPL_SAMPLES, seq_len
        scorer = n * SCORER_PARAMS_RATIO * forward_seconds("one_stream", seq_len)
    block = seq_len if setting.algo in ("mdlm", "duo") else max(sizes)
    kind, calls = generation_calls(sampler, block, new_tokens)
    work = Work(kind, n, batch, calls, scored=n if scorer else 0)
    plan.update(sampler=sampler.name, block=block, scorer_s=scorer)
    if kind == "ar":  # one token per call, cached: about one forward per sample
        gen = n * forward_seconds(stream, new_tokens * (2 if two_stream else 1))
        return FullScalePlan(work, model_s=gen, what=f"{n} x {new_tokens} tokens, one per call", **plan)
    per_call = forward_seconds(stream, (2 * block) if two_stream else block)  # a block and the committed one
    note = f" ({ADAPTIVE_NOTE})" if sampler.sampler.adaptive else ""
    return FullScalePlan(work, model_s=n * calls * per_call,
                         what=f"{n} x {calls} calls of {block}-token blocks{note}", **plan)
