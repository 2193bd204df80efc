"""lm-evaluation-harness model type ``blockgen``: the only module that knows lm-eval's request types.

    lm_eval --model blockgen --model_args pretrained=DIR,k_mc=8,sampler=arpc,steps=8 --tasks ...

- ``loglikelihood`` / ``loglikelihood_rolling``: the log-sum-exp bound over the checkpoint's block
  sizes (paper appendix C), per scored window: the window's prefix stays clean in the noisy stream
  (``condition_mask``), positions start at 0 and blocks sit at multiples of L' as in training (the
  last block may be partial), and only the scored tokens carry loss. Windows of one batch are padded
  to a common length, and the padding is invisible to every real token (`DiT.forward_train`'s
  ``valid``), so a score depends on the request's tokens only. A window is at most ``seq_len``
  tokens; longer inputs are left-truncated (loglikelihood, with a warning) or cut into lm-eval's
  disjoint rolling windows (each token scored once). ``is_greedy`` comes from the AR pass (block
  size 1); without block size 1 in the mixture it is always False.
- ``generate_until``: any sampler of `blockgen.models.sampling`, chosen by model arguments and
  overridable per task through ``gen_kwargs``; requests are batched (``gen_batch_size``, else
  ``--batch_size``) with lm-eval's `Collator`, grouped by task and sampler settings except the
  generation budget (``max_gen_toks``), longest prompt first: rows of one batch keep their own
  budgets (gsm8k_code gives each its own), so one setting makes full batches.

Reproducibility: every scored window and every generation request draws from its own generator,
seeded from the run's seed and the request, so a result does not depend on the batch it ran in nor
on how torchrun split the work. Log-likelihood windows are seeded by their context only and draw at
fixed positions (`diffusion.RowStreams`: draw p of a call is keyed by p): the choices of one multiple-choice question see the
same times and the same noise at the same positions (common random numbers), so the differences
between choices are not drowned by draw-to-draw noise.

Monte Carlo error: each log-likelihood's standard error is estimated from its K_MC draws by the
delta method (`mc_variance`); the results JSON reports it per request and its effect on which
choice wins (``config.blockgen.tasks``, see `Usage`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
from tqdm import tqdm

import lm_eval.models  # noqa: F401  lm-eval's own models first: get_model adds them only to an empty registry
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from blockgen.harness.checkpoints.checkpoint import (
    CONFIG,
    CheckpointError,
    checkpoint_hash,
    checkpoint_special_tokens,
    load_checkpoint,
    read_config,
)
from blockgen.harness.runtime.distributed import setup_distributed
from blockgen.harness.runtime.precision import DTYPES, check_dtype, compute_precision
from blockgen.models.diffusion import RowStreams
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.objectives import jensen_bound, lse_bound
from blockgen.models.sampling import (
    AR_SAMPLERS,
    INFORMED_SAMPLERS,
    SamplerConfig,
    check_config,
    generate,
    max_prompt_len,
    paper_nfe_per_block,
    resolve_block_size,
)

log = logging.getLogger(__name__)

# `--batch_size auto` on a CPU: the model is small enough that memory is never the limit; 16 rows
# already amortise the per-call overhead of the micro and tiny models (bench/bench_generate.py).
AUTO_BATCH_SIZE_CPU = 16


# ------------------------------------------------------------------------------ model arguments


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
    nfe: int | None = None  # the paper's variant at this NFE per block (harness/evaluation/sampler_grid.py)
    temperature: float | None = None  # None: 1.0 (AR checkpoints: greedy unless a task asks to sample)
    block_size: int | None = None  # None: the checkpoint's largest block size
    max_gen_toks: int | None = None  # None: min(256, seq_len // 2)
    layout: str = "grid"  # where generated blocks sit: 'grid' (training's) or 'prompt_end'
    # Precision of the network's matmuls (harness/runtime/precision.py): lm-eval hf's dtype names; bfloat16 is
    # autocast (weights, LayerNorm, logits and the bounds stay float32/float64). tf32: CUDA's TF32
    # matmuls during this model's calls (opt-in: not measured on a GPU; docs/lm_eval.md, "Evaluation cost and precision").
    dtype: str = "float32"
    tf32: bool = False
    # Each row computed as a batch of one, so a score or a text is bit for bit the same whatever
    # --batch_size and the other rows (`generate`'s batch_invariant). None: log-likelihoods on a CPU
    # only (1.0-1.45x their batched cost there); generation stays batched (row by row costs it 3-12x
    # at batch 8-32 on a CPU, and about batch-size times the calls on CUDA, where a call costs about the
    # same at batch 1 and 64): docs/lm_eval.md, "Batch invariance".
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
    # set by lm-eval from --batch_size / --device / --max_batch_size, not by the user
    batch_size: int | str = 1
    device: str | None = None
    max_batch_size: int | None = None

    @classmethod
    def user_args(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("batch_size", "device", "max_batch_size")]

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> "BlockGenLMArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown blockgen model argument(s) {unknown}; valid: {cls.user_args()}")
        if kwargs.get("pretrained") in (None, ""):
            raise ValueError("blockgen needs pretrained=<checkpoint directory> in --model_args")
        values = {k: v for k, v in kwargs.items() if v is not None}
        if "batch_size" in values:
            values["batch_size"] = _batch_size(values["batch_size"])
        if "gen_batch_size" in values:
            values["gen_batch_size"] = _gen_batch_size(values["gen_batch_size"])
        args = cls(**values)
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


def sampler_model_args(sampler: SamplerConfig) -> dict[str, Any]:
    """The ``--model_args`` that select `sampler`: the inverse of `BlockGenLM._default_sampler` on the
    fields the sampler reads (max_new_tokens travels as max_gen_toks where a caller sets it)."""
    if sampler.is_ar:
        args: dict[str, Any] = {"sampler": sampler.name}
        return args if sampler.name == "ar_greedy" else {**args, "temperature": sampler.temperature}
    args = {"sampler": sampler.name, "steps": sampler.steps, "temperature": sampler.temperature}
    if sampler.name in INFORMED_SAMPLERS:
        args.update(ge=sampler.ge, warmup=sampler.warmup)
    if sampler.block_size is not None:
        args["block_size"] = sampler.block_size
    return args


# Generation settings a task's gen_kwargs may override, and the SamplerConfig field each one sets.
GEN_KWARGS = {"sampler": "name", "steps": "steps", "ge": "ge", "warmup": "warmup", "temperature": "temperature",
              "block_size": "block_size", "max_gen_toks": "max_new_tokens", "layout": "layout"}
# lm-eval's generic keys: `until` is honoured; `do_sample` / temperature choose greedy or sampled AR;
# `ignore_eos` (vLLM's name): generate past EOS, keeping it as a token (owt_genppl's length-L samples).
GENERIC_GEN_KWARGS = {"until", "do_sample", "ignore_eos"}


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from the run's seed and a request's content (JSON-serialisable parts)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


# ---------------------------------------------------------------------------------- scoring


class Window(NamedTuple):
    """One scored sequence: `tokens[:n_context]` stay clean, `tokens[n_context:]` are scored."""

    tokens: tuple[int, ...]
    n_context: int


class WindowScore(NamedTuple):
    lse: float  # log-sum-exp NLL bound (the reported one)
    jensen: float  # the looser mixture bound sum_i gamma_i NLL_i
    greedy: bool  # every scored token is the AR argmax (False without block size 1)
    # Per block size, its K draws linearised around the bound: pi_i * NLL_{i,k}, with pi_i = dLSE/dNLL_i
    # the posterior weight of size i. Their sample variances give the MC variance (`mc_variance`).
    terms: tuple[tuple[float, ...], ...] = ()


def windows(context: list[int], target: list[int], seq_len: int) -> list[Window]:
    """Windows of at most seq_len tokens that score every target token exactly once.

    A target shorter than seq_len is scored in one window behind as much context as fits (at least
    one token); a longer one in lm-eval's disjoint rolling windows, each conditioned on the tokens
    before it in the window.
    """
    if not target:
        return []
    if len(target) < seq_len:
        tokens = (context + target)[-seq_len:]
        return [Window(tuple(tokens), len(tokens) - len(target))]
    rolling = get_rolling_token_windows(target, prefix_token=context[-1], max_seq_len=seq_len - 1, context_len=1)
    return [Window(tuple(ctx + pred), len(ctx)) for ctx, pred in map(make_disjoint_window, rolling)]


class _KeepARLogits:
    """The denoiser, remembering the logits of its last block-size-1 (AR) call, for is_greedy."""

    def __init__(self, dit) -> None:
        self._dit = dit
        self.ar_logits: torch.Tensor | None = None

    def forward_train(self, x0, xt, block_size: int, valid=None) -> torch.Tensor:
        logits = self._dit.forward_train(x0, xt, block_size, valid)
        if block_size == 1:
            self.ar_logits = logits
        return logits


@torch.no_grad()
def score_windows(model: BlockGen, batch: list[Window], seeds: list[int], k_mc: int, pad_id: int,
                  batch_invariant: bool = False) -> list[WindowScore]:
    """The bounds of a batch of windows; each window's result is that of the window scored alone.

    Each window runs at its own length (the batch is padded, the padding invisible: `valid`) and
    draws from its own `RowStreams` row (keyed by position, so padding changes no draw): `BlockGen.nll_bounds` on the unpadded window
    with that generator gives the same numbers, up to float rounding that depends on the batch's
    shapes (~1e-7 relative). `batch_invariant=True` scores each window as a batch of one, unpadded:
    the same numbers bit for bit whatever the batch.
    """
    if batch_invariant and len(batch) > 1:
        return [score_windows(model, [w], [s], k_mc, pad_id)[0] for w, s in zip(batch, seeds)]
    device = next(model.parameters()).device
    sizes, weights = model.mixture.sizes, model.mixture.weights
    width = max(len(w.tokens) for w in batch)
    x = torch.full((len(batch), width), pad_id, dtype=torch.long)
    valid = torch.zeros_like(x, dtype=torch.bool)
    condition = torch.zeros_like(valid)
    scored = torch.zeros_like(valid)
    for j, w in enumerate(batch):
        x[j, : len(w.tokens)] = torch.tensor(w.tokens)
        valid[j, : len(w.tokens)] = True
        condition[j, : w.n_context] = True
        scored[j, w.n_context : len(w.tokens)] = True
    x, valid, condition, scored = x.to(device), valid.to(device), condition.to(device), scored.to(device)
    generators = RowStreams(seeds)
    dit = _KeepARLogits(model.dit)
    # per size (K_i, B), K_i = 1 at block size 1 (exact); the model picks its family's bound
    draws = [model.sequence_nll_draws(x, scored, size, k_mc, condition, generators, valid, net=dit) for size in sizes]
    nll = torch.stack([d.mean(0) for d in draws])
    lse, jensen = lse_bound(nll, weights), jensen_bound(nll, weights)
    log_w = torch.log(torch.tensor(weights, dtype=torch.float64, device=device))[:, None]
    posterior = torch.softmax(log_w - nll, dim=0)  # d lse / d NLL_i
    # exact sizes (one draw at block size 1) carry no MC error: no terms
    terms = [[tuple((posterior[i, j] * d[:, j]).tolist()) if size > 1 else () for i, (size, d) in enumerate(zip(sizes, draws))]
             for j in range(len(batch))]
    if dit.ar_logits is not None:
        argmax = dit.ar_logits[..., : model.prior.vocab_size].argmax(-1)  # real vocabulary only
        greedy = ((argmax == x) | ~scored).all(-1).tolist()
    else:
        greedy = [False] * len(batch)
    return [WindowScore(a, b, g, tuple(t)) for a, b, g, t in zip(lse.tolist(), jensen.tolist(), greedy, terms)]


def mc_variance(terms: Sequence[Sequence[float]]) -> float:
    """Delta-method MC variance of a bound from its linearised draws: sum_i var_k(terms_i) / K_i.

    Exact sizes (block size 1: no draws listed) add nothing. The K draws of a size are stratified in
    t, so their sample variance somewhat overstates the estimator's: the error bar is conservative.
    NaN when a size has a single draw (k_mc = 1): nothing to estimate the spread from.
    """
    total = 0.0
    for draws in terms:
        if len(draws) == 1:
            return math.nan
        if draws:
            total += statistics.variance(draws) / len(draws)
    return total


class RequestScore(NamedTuple):
    logp: float
    greedy: bool
    windows: tuple[WindowScore, ...]

    @property
    def mc_stderr(self) -> float:
        return math.sqrt(sum(mc_variance(w.terms) for w in self.windows))


def paired_mc_stderr(a: RequestScore, b: RequestScore) -> float:
    """MC standard error of logp(a) - logp(b). Single windows of one context share their draws
    (common random numbers): the variance comes from the paired differences; otherwise they add."""
    if len(a.windows) == len(b.windows) == 1 and len(a.windows[0].terms) == len(b.windows[0].terms):
        diff = [tuple(x - y for x, y in zip(ta, tb)) for ta, tb in zip(a.windows[0].terms, b.windows[0].terms)]
        return math.sqrt(mc_variance(diff))
    return math.hypot(a.mc_stderr, b.mc_stderr)


def seed_disagreement(scores: Sequence[RequestScore]) -> float:
    """Probability that a run with another seed picks another winner among one doc's choices.

    Normal approximation on the top two: their margin m and its paired MC standard error s, with m
    taken as the true margin; two independent runs disagree with probability 2 Phi(m/s) Phi(-m/s).
    """
    top, second = sorted(scores, key=lambda s: -s.logp)[:2]
    s = paired_mc_stderr(top, second)
    if s == 0 or math.isnan(s):
        return 0.0 if s == 0 else math.nan
    phi = statistics.NormalDist().cdf((top.logp - second.logp) / s)
    return 2 * phi * (1 - phi)


# ------------------------------------------------------------------ what a run actually used

# The request types lm-eval's --use_cache (its CachingLM) can answer without the model.
CACHED_REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


class Usage:
    """What a run really did, per task: requests and truncation, generation settings and model calls,
    Monte Carlo error of the log-likelihoods. Merged across torchrun ranks and reported under
    ``config.blockgen.tasks`` of the results JSON (`report`; the key names are listed in docs/lm_eval.md).
    For answers lm-eval's --use_cache gave, the record stored by the run that computed them
    (`BlockGenLM._settle_cache`).
    """

    COUNTS = ("requests", "truncated_requests", "truncated_tokens")
    GENERATION = ("requests", "model_calls", "blocks", "generated_tokens", "generate_seconds")

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], Counter] = defaultdict(Counter)  # (task, request type)
        self.generation: dict[tuple[str, str], Counter] = defaultdict(Counter)  # (task, settings as JSON)
        self.budgets: dict[tuple[str, str], int] = {}  # the same keys -> the largest max_gen_toks of their rows
        self.stderr: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(dict)  # doc -> per request
        self.disagreement: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)  # doc -> probability
        self.k_mc: int | None = None
        # lm-eval's --use_cache answers requests without calling the model (`BlockGenLM._settle_cache`)
        self.cached: Counter = Counter()  # (task, request type) -> requests answered from the cache
        self.stored: set[str] = set()  # tasks whose figures are the ones stored with their cached answers

    def request(self, task: str, kind: str, dropped: int) -> None:
        self.counts[task, kind].update(requests=1, truncated_requests=int(dropped > 0), truncated_tokens=dropped)

    def generated(self, task: str, settings: dict, result, requests: int, seconds: float) -> None:
        """One batch. Its rows may have their own budgets (gsm8k_code): the record of a setting is keyed
        without ``max_gen_toks`` and reports the largest budget its rows had (`report`), so one
        setting stays one record however its rows' budgets were batched."""
        key = task, json.dumps({k: v for k, v in settings.items() if k != "max_gen_toks"}, sort_keys=True)
        self.generation[key].update(
            requests=requests, model_calls=result.model_calls, blocks=result.n_blocks,
            generated_tokens=sum(map(len, result.tokens)), generate_seconds=seconds)
        if settings.get("max_gen_toks") is not None:
            self.budgets[key] = max(self.budgets.get(key, 0), settings["max_gen_toks"])

    def scored(self, task: str, kind: str, doc: Any, scores: list[tuple[int, RequestScore]], k_mc: int) -> None:
        self.k_mc = k_mc
        ordered = [score for _, score in sorted(scores, key=lambda item: item[0])]
        self.stderr[task, kind][str(doc)] = [_finite(s.mc_stderr) for s in ordered]
        if len(ordered) >= 2:
            self.disagreement[task, kind][str(doc)] = _finite(seed_disagreement(ordered))

    @staticmethod
    def merge(parts: Sequence["Usage"]) -> "Usage":
        out = Usage()
        for part in parts:
            for mine, theirs in ((out.counts, part.counts), (out.generation, part.generation)):
                for key, counter in theirs.items():
                    mine[key].update(counter)
            for key, budget in getattr(part, "budgets", {}).items():  # absent from a cache stored by older versions
                out.budgets[key] = max(out.budgets.get(key, 0), budget)
            for mine, theirs in ((out.stderr, part.stderr), (out.disagreement, part.disagreement)):
                for key, by_doc in theirs.items():
                    mine[key].update(by_doc)
            out.k_mc = part.k_mc or out.k_mc
            out.cached.update(part.cached)
            out.stored |= part.stored
        return out

    def only(self, task: str) -> "Usage":
        """The figures of one task (what `_settle_cache` stores beside lm-eval's cache)."""
        out = Usage()
        for name in ("counts", "generation", "budgets", "stderr", "disagreement"):
            getattr(out, name).update({key: value for key, value in getattr(self, name).items() if key[0] == task})
        out.k_mc = self.k_mc
        return out

    def report(self) -> dict[str, dict[str, dict]]:
        out: dict[str, dict[str, dict]] = defaultdict(dict)
        for (task, kind), counts in sorted(self.counts.items()):
            out[task][kind] = {name: counts[name] for name in self.COUNTS}
        for (task, key), counts in sorted(self.generation.items()):
            entry = out[task].setdefault("generate_until", {name: 0 for name in self.COUNTS})
            settings = json.loads(key)
            if (task, key) in self.budgets:
                settings = dict(sorted({**settings, "max_gen_toks": self.budgets[task, key]}.items()))
            row = {**settings, **{name: counts[name] for name in self.GENERATION}}
            row["model_calls_per_block"] = row["model_calls"] / row["blocks"] if row["blocks"] else 0.0
            entry.setdefault("settings", []).append(row)
            for name in ("model_calls", "generated_tokens", "generate_seconds"):
                entry[name] = entry.get(name, 0) + row[name]
        for (task, kind), by_doc in sorted(self.stderr.items()):
            stderrs = [se for ses in by_doc.values() for se in ses if se is not None]
            disagreement = [p for p in self.disagreement[task, kind].values() if p is not None]
            out[task][kind].update({
                "k_mc": self.k_mc,
                "mc_stderr_mean": statistics.fmean(stderrs) if stderrs else None,
                "mc_stderr_max": max(stderrs) if stderrs else None,
                "choice_docs": len(self.disagreement[task, kind]),
                "expected_seed_disagreement": statistics.fmean(disagreement) if disagreement else None,
                "mc_stderr_by_doc": dict(sorted(by_doc.items(), key=lambda item: _doc_order(item[0]))),
            })
        for (task, kind), n in sorted(self.cached.items()):
            entry = out[task].setdefault(kind, {name: 0 for name in self.COUNTS})
            entry.update(answered_from_cache=n, usage_from_cache=task in self.stored)
        return dict(out)


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def _doc_order(doc: str) -> tuple:
    return (0, int(doc), "") if doc.lstrip("-").isdigit() else (1, 0, doc)


# ---------------------------------------------------------------------------------- the model


class _Plan(NamedTuple):
    """One generation request, resolved: prompt ids, sampler, stop strings, seed and bookkeeping."""

    prompt: list[int]
    sampler: SamplerConfig
    until: list[str]
    seed: int
    task: str
    dropped: int  # prompt tokens cut from the left to fit
    ignore_eos: bool = False  # the whole budget, EOS kept in the text as a token


@register_model("blockgen")
class BlockGenLM(TemplateLM):
    """A BlockGen checkpoint behind lm-eval's LM interface (see the module docstring)."""

    # Seed a log-likelihood window by its context only (common random numbers across the choices of
    # one context). False seeds it by the whole window: bench/bench_mc_noise.py measures both.
    common_random_numbers = True
    # --use_cache: lm-eval's cache file (`set_cache_hook`, until `_settle_cache`) and the run's tasks (`check_tasks`)
    _cache_file: str | None = None
    _cache_tasks: dict | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        args = BlockGenLMArgs.parse(kwargs)
        if args.seed is None:  # lm-eval seeded torch from --seed before building the model
            args = replace(args, seed=torch.initial_seed())
        self.args = args
        # A release is converted once into a checkpoint directory (cached); its source is reported.
        from blockgen.harness.checkpoints.release_import import release_source, resolve
        from blockgen.harness.checkpoints.release_paths import ReleaseOverrides

        overrides = ReleaseOverrides.from_model_args(args.algo, args.prior, args.block_sizes, args.block_weights,
                                                     args.x0_causal, args.tokenizer)
        self.checkpoint_dir = str(resolve(args.pretrained, overrides))
        self.source = release_source(self.checkpoint_dir)
        # Everything checkable from config.json is checked before any weights load or ranks connect.
        _check_checkpoint_dir(self.checkpoint_dir)
        config = read_config(self.checkpoint_dir)
        self.sampler = self._default_sampler(config)
        self._gen_settings_cache: dict[str, tuple[SamplerConfig, list[str]]] = {}
        self._fewshot: dict[str, int] = {}  # task -> num_fewshot, from `check_tasks`
        self.usage = Usage()
        self._usage_by_rank: list[Usage] | None = None

        ranks = setup_distributed(_requested_device(args.device))  # joins torchrun's group when there is one
        self._device, self._world_size, self._rank = ranks.device, ranks.world_size, ranks.rank
        self.model, self.tokenizer = load_checkpoint(self.checkpoint_dir, self._device)
        self.special = checkpoint_special_tokens(self.model, self.tokenizer)
        self.checkpoint_hash = checkpoint_hash(self.checkpoint_dir)
        self._batch_size = self._auto_batch_size() if args.batch_size == "auto" else args.batch_size
        if args.batch_size == "auto":  # lm-eval records these in the results' config.batch_sizes
            self.batch_sizes = {0: self._batch_size}
        if 1 not in config.block_sizes:
            log.warning("blockgen: block sizes %s have no AR component (1): loglikelihood's is_greedy is always False",
                        list(config.block_sizes))

    # Model arguments that pick the weights; `with_settings` keeps them.
    LOADED_ARGS = ("pretrained", "tokenizer", "algo", "prior", "block_sizes", "block_weights", "x0_causal")

    def with_settings(self, **model_args: Any) -> "BlockGenLM":
        """This model as if built with other `--model_args` (sampler, steps, k_mc, ...), sharing the
        loaded weights: `blockgen sweep` evaluates many settings on one load. Arguments that pick the
        weights must equal the loaded ones; the seed, batch size and device stay."""
        changed = sorted(k for k in self.LOADED_ARGS if k in model_args and model_args[k] != getattr(self.args, k))
        if changed:
            raise ValueError(f"with_settings cannot change {changed}: they pick the loaded weights; build a new model")
        kept = {k: getattr(self.args, k) for k in (*self.LOADED_ARGS, "seed", "batch_size", "gen_batch_size", "device",
                                                    "max_batch_size")}
        args = BlockGenLMArgs.parse({**kept, **model_args})
        other = copy.copy(self)  # shallow: the model, tokenizer and process group are shared
        other.args = args
        other.sampler = other._default_sampler(self.config)
        other._gen_settings_cache, other._fewshot = {}, {}
        other.usage, other._usage_by_rank = Usage(), None
        return other

    def _default_sampler(self, config: BlockGenConfig) -> SamplerConfig:
        a = self.args
        if a.sampler:
            name = a.sampler
        elif config.block_sizes == (1,):  # AR checkpoint: greedy unless a temperature > 0 was given
            name = "ar_sample" if a.temperature else "ar_greedy"
        else:
            name = "ancestral"
        try:
            from blockgen.harness.evaluation.sampler_grid import settings_at

            # nfe=: the paper's variant at that NFE, narrowed by any steps/ge/warmup given
            steps, ge, warmup = settings_at(name, a.nfe, a.steps, a.ge, a.warmup)
            # steps defaults to the block size: one token per reverse step on average
            steps = steps or resolve_block_size(config, SamplerConfig(name=name, block_size=a.block_size))
            temperature = 1.0 if a.temperature is None else a.temperature
            sampler = SamplerConfig(name=name, steps=steps, ge=1 if ge is None else ge, warmup=warmup or 0, temperature=temperature,
                                    block_size=a.block_size, max_new_tokens=a.max_gen_toks or min(256, config.seq_len // 2),
                                    layout=a.layout)
        except ValueError as err:
            raise ValueError(f"blockgen --model_args: {err}") from None
        return self._checked(config, sampler, "--model_args")

    @staticmethod
    def _checked(config: BlockGenConfig, sampler: SamplerConfig, where: str) -> SamplerConfig:
        try:
            check_config(config, sampler)
        except ValueError as err:
            raise ValueError(f"blockgen {where}: {err}") from None
        if max_prompt_len(config, sampler) < 1:
            raise ValueError(f"blockgen {where}: max_gen_toks={sampler.max_new_tokens} leaves no room for a prompt "
                             f"in seq_len={config.seq_len}; choose max_gen_toks <= {_max_new_tokens(config, sampler)}")
        return sampler

    def _auto_batch_size(self) -> int:
        """`--batch_size auto`: on a CPU `AUTO_BATCH_SIZE_CPU`; on a GPU the largest power of two up to
        `max_batch_size` (default 64) whose heaviest call, a full-length scored window at the largest
        block size, fits in memory."""
        limit = self.args.max_batch_size or 64
        if self._device.type != "cuda":
            size = min(AUTO_BATCH_SIZE_CPU, limit)
        else:
            size = 1 << (limit.bit_length() - 1)
            window = Window(tuple([self.special.bos] * self.max_length), 1)
            while size > 1:
                try:
                    with self._precision():
                        score_windows(self.model, [window] * size, list(range(size)), 1, self.special.pad)
                    break
                except torch.cuda.OutOfMemoryError:
                    size //= 2
                finally:
                    torch.cuda.empty_cache()
        log.info("blockgen: --batch_size auto -> %d", size)
        return size

    @property
    def batch_invariant(self) -> dict[str, bool]:
        """Per kind of request, whether rows run one by one (the `batch_invariant` model argument;
        unset: log-likelihoods on a CPU only)."""
        chosen = self.args.batch_invariant
        return {"likelihood": self._device.type != "cuda" if chosen is None else chosen,
                "generation": bool(chosen)}

    def _precision(self):
        """The context of every model call: the `dtype` and `tf32` model arguments (harness/runtime/precision.py)."""
        return compute_precision(self._device, self.args.dtype, self.args.tf32)

    # -------------------------------------------------------------- lm-eval's interface: basics

    @property
    def config(self) -> BlockGenConfig:
        return self.model.config

    @property
    def eot_token_id(self) -> int:
        return self.special.eos

    @property
    def prefix_token_id(self) -> int:
        return self.special.bos

    @property
    def max_length(self) -> int:
        return self.config.seq_len

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def gen_batch_size(self) -> int:
        """Rows per generate_until batch: the gen_batch_size model argument, else the batch size."""
        return self.args.gen_batch_size or self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        """Checkpoint and every setting that changes an answer (not batch size or device)."""
        a = self.args
        # precision only when it is not the default, so that float32 runs keep their fingerprint (and --use_cache table)
        precision = [(a.dtype, a.tf32)] if (DTYPES[a.dtype], a.tf32) != (torch.float32, False) else []
        return derive_seed(self.checkpoint_hash, a.k_mc, a.seed, a.add_bos, asdict(self.sampler), *precision).to_bytes(8, "little").hex()

    @property
    def tokenizer_name(self) -> str:
        return f"blockgen-{self.fingerprint}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"blockgen: --apply_chat_template, but the checkpoint {self.args.pretrained} has no chat template "
                "(BlockGen models are trained on plain text); run without --apply_chat_template")
        return super().chat_template(chat_template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def set_cache_hook(self, cache_hook) -> None:
        # lm-eval's --use_cache (CachingLM) keys answers by request arguments only and hands its
        # SqliteDict over here. Reopening that dict on a table named after our fingerprint keeps
        # other checkpoints' and settings' answers (same file, other tables) out of reach.
        db = getattr(cache_hook, "dbdict", None)
        if db is not None and db.tablename != self.tokenizer_name:
            autocommit = db.autocommit
            db.close()
            db.__init__(db.filename, tablename=self.tokenizer_name, autocommit=autocommit)
        if db is not None:
            self._cache_file = db.filename
        super().set_cache_hook(cache_hook)

    def _settle_cache(self) -> None:
        """Once, after the requests ran: the usage of answers lm-eval's --use_cache gave without the model.

        A task whose requests all reached the model stores its `Usage` beside the answers (table
        ``usage-<fingerprint>``, keyed by the task and lm-eval's keys of its requests); a task answered
        wholly from the cache reports the usage so stored, so that its leaderboard rows (block size,
        calls, tokens/s) are those of the run that computed the answers. Either way the report counts
        the requests answered from the cache (`Usage.cached`).
        """
        path, self._cache_file = self._cache_file, None
        if path is None or not self._cache_tasks:
            return
        from lm_eval.api.model import hash_args
        from sqlitedict import SqliteDict

        with SqliteDict(path, tablename=f"usage-{self.tokenizer_name}", autocommit=True) as db:
            for name, task in self._cache_tasks.items():
                cacheable = [i for i in task.instances or [] if i.request_type in CACHED_REQUEST_TYPES]
                if not cacheable:  # e.g. owt_ppl's loglikelihood_windows, never cached
                    continue
                key = hash_args(name, sorted(hash_args(i.request_type, i.args) for i in cacheable))
                asked: Counter = Counter()
                for i in cacheable:
                    asked[i.request_type] += i.repeats
                # the requests that reached the model (torchrun's padding copies can make it more)
                ran = {kind: self.usage.counts.get((name, kind), Counter())["requests"] for kind in asked}
                cached = {(name, kind): n - ran[kind] for kind, n in asked.items() if n > ran[kind]}
                if not cached:
                    db[key] = self.usage.only(name)
                    continue
                if not any(ran.values()) and key in db:
                    self.usage = Usage.merge([self.usage, db[key]])
                    self.usage.stored.add(name)
                self.usage.cached.update(cached)

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.config
        self._settle_cache()
        usage = Usage.merge(self._usage_by_rank) if self._usage_by_rank else self.usage
        return {
            # a released model is named by its source (hf:jdeschena/blockgen/<subfolder>), not the cache
            "model_checkpoint": self.source or os.path.abspath(self.checkpoint_dir),
            "model_source": self.source,
            "model_sha": self.checkpoint_hash,
            "model_num_parameters": self.model.dit.n_params(),
            "blockgen": {
                "prior": cfg.prior,
                "block_sizes": list(cfg.block_sizes),
                "block_weights": list(cfg.block_weights),
                "seq_len": cfg.seq_len,
                "k_mc": self.args.k_mc,
                "seed": self.args.seed,
                "add_bos": self.args.add_bos,
                "dtype": self.args.dtype,
                "tf32": self.args.tf32,
                "batch_invariant": self.batch_invariant,
                # block size as used (None asks for the largest): rows of tasks without usage still name it
                "sampler": {**asdict(self.sampler), "block_size": resolve_block_size(cfg, self.sampler),
                            "paper_nfe_per_block": paper_nfe_per_block(self.sampler)},
                "nfe": self.args.nfe,  # as asked (None: steps/ge/warmup given directly)
                "batch_size": self._batch_size,  # the size used, also when --batch_size auto chose it
                "gen_batch_size": self.gen_batch_size,  # rows per generation batch used (gen_batch_size, else batch_size)
                "fingerprint": self.fingerprint,
                "tasks": usage.report(),
            },
        }

    # -------------------------------------------------------------- checks before any request

    def check_tasks(self, task_dict: dict) -> None:
        """Validate every generate_until task's gen_kwargs before any request runs (called by the
        `lm_eval.evaluator.evaluate` wrapper that `blockgen.lm_eval` installs)."""
        from lm_eval.evaluator_utils import _handle_back_comp

        tasks = task_dict["tasks"] if "tasks" in task_dict else _handle_back_comp(task_dict)[1]
        self._cache_tasks = tasks  # their requests, once built, are what --use_cache answered (`_settle_cache`)
        for name, task in tasks.items():
            config = getattr(task, "config", None)
            if config is None:
                continue
            self._fewshot[name] = int(getattr(config, "num_fewshot", 0) or 0)
            if getattr(task, "OUTPUT_TYPE", None) == "generate_until":
                self._settings(config.generation_kwargs, name)

    # -------------------------------------------------------------- likelihoods

    def _with_bos(self, context: list[int]) -> list[int]:
        if self.args.add_bos and context[:1] != [self.special.bos]:
            return [self.special.bos, *context]
        return context

    def _score(self, items: list[Window], seeds: list[int], what: str, disable_tqdm: bool) -> list[WindowScore]:
        """Score windows in batches of batch_size, longest first (lm-eval's Collator)."""
        collator = Collator(list(zip(items, seeds)), sort_fn=lambda item: (-len(item[0].tokens), item[0].tokens))
        out: list[WindowScore] = []
        bar = tqdm(total=len(items), desc=f"blockgen {what}", disable=disable_tqdm or self.rank != 0)
        for batch in collator.get_batched(n=self.batch_size):
            ws, ss = zip(*batch)
            with self._precision():
                out.extend(score_windows(self.model, list(ws), list(ss), self.args.k_mc, self.special.pad,
                                         self.batch_invariant["likelihood"]))
            bar.update(len(batch))
        bar.close()
        return collator.get_original(out)

    def _encode_pair_or_prefix(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's TemplateLM tokenisation: an empty context becomes the prefix (BOS) token."""
        if context == "":
            cont = self.tok_encode(continuation)
            return ([self.prefix_token_id], cont) if cont[:1] != [self.prefix_token_id] else (cont[:1], cont[1:])
        return self._encode_pair(context, continuation)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        tokenized = [((req.args[0], req.args[1]), *self._encode_pair_or_prefix(*req.args)) for req in requests]
        return self._loglikelihood_tokens(tokenized, disable_tqdm, owners=[_owner(req) for req in requests])

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, owners=None, **kwargs) -> list[tuple[float, bool]]:
        owners = owners or [_owner(None)] * len(requests)
        items, seeds, which, dropped = [], [], [], []
        for i, (_, context, continuation) in enumerate(requests):
            context = self._with_bos(list(context))
            ws = windows(context, list(continuation), self.max_length)
            kept = len(ws[0].tokens) - len(continuation) if len(ws) == 1 else 1  # rolling windows keep 1 context token
            dropped.append(len(context) - kept if ws else 0)
            for w in ws:
                # Seeded by the window's context only: the choices of one context share their draws.
                seeded_by = w.tokens[: w.n_context] if self.common_random_numbers else w
                seeds.append(derive_seed(self.args.seed, "loglikelihood", list(seeded_by)))
                items.append(w)
                which.append(i)
        scores = self._score(items, seeds, "loglikelihood", disable_tqdm)
        results = self._collect(requests, which, scores)
        self._record_likelihood("loglikelihood", owners, results, dropped)
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, (result.logp, result.greedy))
        return [(r.logp, r.greedy) for r in results]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        items, seeds, which = [], [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for w in windows([self.prefix_token_id], self.tok_encode(text), self.max_length):
                seeds.append(derive_seed(self.args.seed, "loglikelihood_rolling", list(w.tokens), w.n_context))
                items.append(w)
                which.append(i)
        scores = self._score(items, seeds, "loglikelihood_rolling", disable_tqdm)
        results = self._collect(requests, which, scores)
        self._record_likelihood("loglikelihood_rolling", [_owner(r) for r in requests], results, [0] * len(requests))
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result.logp)
        return [r.logp for r in results]

    def loglikelihood_windows(self, requests, disable_tqdm: bool = False) -> list[tuple[float, float]]:
        """Exact token windows (tasks/owt.py's ``owt_ppl``): request args (text, token ids), the ids
        scored whole from position 0 as training validates a chunk; returns (-LSE, -Jensen) bounds."""
        items = [Window(tuple(req.args[1]), 0) for req in requests]
        if any(len(w.tokens) > self.max_length for w in items):
            raise ValueError(f"blockgen loglikelihood_windows: a window is longer than seq_len={self.max_length}")
        seeds = [derive_seed(self.args.seed, "loglikelihood_windows", list(w.tokens)) for w in items]
        scores = self._score(items, seeds, "loglikelihood_windows", disable_tqdm)
        return [(-s.lse, -s.jensen) for s in scores]

    @staticmethod
    def _collect(requests, which: list[int], scores: list[WindowScore]) -> list[RequestScore]:
        per_request: list[list[WindowScore]] = [[] for _ in requests]
        for i, s in zip(which, scores):
            per_request[i].append(s)
        return [RequestScore(-sum(s.lse for s in ss), all(s.greedy for s in ss), tuple(ss)) for ss in per_request]

    def _record_likelihood(self, kind: str, owners, results: list[RequestScore], dropped: list[int]) -> None:
        docs: dict[str, dict] = defaultdict(lambda: defaultdict(list))
        for (task, doc, idx), result, cut in zip(owners, results, dropped):
            self.usage.request(task, kind, cut)
            docs[task][doc].append((idx, result))
        for task, by_doc in docs.items():
            for doc, scores in by_doc.items():
                self.usage.scored(task, kind, doc, scores, self.args.k_mc)
        self._warn_truncation(kind, owners, dropped, f"contexts were cut from the left to fit seq_len={self.max_length}")

    def _warn_truncation(self, kind: str, owners, dropped: list[int], what: str) -> None:
        """Truncation is never silent (as lm-eval's hf backend): per task, how many requests and tokens."""
        per_task: dict[str, list[int]] = defaultdict(list)
        for (task, _, _), cut in zip(owners, dropped):
            if cut:
                per_task[task].append(cut)
        for task, cuts in per_task.items():
            hint = ""
            if self._fewshot.get(task):
                hint = f"; the prompts carry --num_fewshot {self._fewshot[task]} examples: lower --num_fewshot"
            log.warning("blockgen %s, task %s: %d of %d requests' %s (%d tokens dropped in all, up to %d in one)%s",
                        kind, task, len(cuts), sum(1 for o in owners if o[0] == task), what, sum(cuts), max(cuts), hint)

    # -------------------------------------------------------------- generation

    def _settings(self, gen_kwargs: dict | None, task: str) -> tuple[SamplerConfig, list[str]]:
        """(sampler, stop strings) of a task's gen_kwargs; raises, naming the task, on a bad one."""
        key = json.dumps(gen_kwargs or {}, sort_keys=True, default=str)
        if key not in self._gen_settings_cache:
            try:
                self._gen_settings_cache[key] = self._resolve(dict(gen_kwargs or {}))
            except ValueError as err:
                raise ValueError(f"blockgen, task {task}: gen_kwargs {gen_kwargs}: {err}") from None
        return self._gen_settings_cache[key]

    def _resolve(self, gen_kwargs: dict) -> tuple[SamplerConfig, list[str]]:
        gen_kwargs.pop("ignore_eos", None)  # read by `_plan`
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        do_sample = gen_kwargs.pop("do_sample", None)
        temperature = gen_kwargs.get("temperature")
        greedy = do_sample is False or temperature == 0
        ignored = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if ignored:
            _warn_once(f"blockgen ignores gen_kwargs {ignored}; it reads {sorted(GEN_KWARGS) + sorted(GENERIC_GEN_KWARGS)}")
        overrides = {GEN_KWARGS[k]: v for k, v in gen_kwargs.items() if k in GEN_KWARGS}
        name = overrides.get("name", self.sampler.name)
        if name in AR_SAMPLERS:
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
            _warn_once(f"a task asks for greedy decoding (do_sample=False); diffusion sampler {name!r} has no greedy "
                       f"mode and samples at temperature {overrides.get('temperature', self.sampler.temperature)}")
        sampler = self.sampler
        if overrides:
            if {"name", "block_size"} & set(overrides) and "steps" not in overrides and self.args.steps is None:
                # steps follows the block size, as for the model arguments
                overrides["steps"] = resolve_block_size(self.config, replace(sampler, **{**overrides, "steps": 1, "warmup": 0}))
            sampler = replace(sampler, **overrides)  # SamplerConfig validates (its errors name the choices)
            if sampler.max_new_tokens > (room := _max_new_tokens(self.config, sampler)):
                _warn_once(f"max_gen_toks={sampler.max_new_tokens} does not fit seq_len={self.config.seq_len}; using {room}")
                sampler = replace(sampler, max_new_tokens=room)
            check_config(self.config, sampler)
        return sampler, until

    def _plan(self, req, repeat: int) -> _Plan:
        """`repeat`: how many identical requests of the same document came before this one (lm-eval's
        `repeats`, e.g. maj@k), so each repeat draws its own sample. The document id is global (the
        same on every torchrun rank), so documents with identical prompts (unconditional samples)
        draw different samples however the documents are split over ranks."""
        context, gen_kwargs = req.args
        task, doc_id, _ = _owner(req)
        sampler, until = self._settings(gen_kwargs, task)
        prompt = self._with_bos(self.tok_encode(context)) or [self.special.bos]
        room = max_prompt_len(self.config, sampler)
        dropped = max(0, len(prompt) - room)
        prompt = prompt[dropped:]
        seed = derive_seed(self.args.seed, "generate_until", prompt, asdict(sampler), doc_id, repeat)
        ignore_eos = (gen_kwargs or {}).get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"blockgen, task {task}: gen_kwargs ignore_eos={ignore_eos!r}; must be true or false")
        return _Plan(prompt, sampler, until, seed, task, dropped, ignore_eos)

    def _decode(self, ids: list[int], keep_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not keep_special)

    def _stop(self, until: list[str]) -> Callable[[list[int]], bool] | None:
        if not until:
            return None
        return lambda ids: any(s in self._decode(ids) for s in until)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        seen: Counter = Counter()
        plans = []
        for req in requests:  # every gen_kwargs is checked before any generation
            task, doc_id, _ = _owner(req)
            key = json.dumps([task, doc_id, req.args], sort_keys=True, default=str)
            plans.append(self._plan(req, seen[key]))
            seen[key] += 1
        for plan in plans:
            self.usage.request(plan.task, "generate_until", plan.dropped)
        self._warn_truncation("generate_until", [_owner(r) for r in requests], [p.dropped for p in plans],
                              "prompts were cut from the left to leave room for max_gen_toks")
        # One batch: one task and one sampler setting up to the budget, longest prompt first (lm-eval's
        # Collator). Each row keeps its own budget (and its seed, derived from its own settings).
        collator = Collator(list(zip(requests, plans)), sort_fn=lambda item: (-len(item[1].prompt), item[1].prompt),
                            group_fn=lambda item: _batch_key(item[1]), group_by="gen_kwargs")
        out: list[str] = []
        bar = tqdm(total=len(requests), desc="blockgen generate_until", disable=disable_tqdm or self.rank != 0)
        for batch in collator.get_batched(n=self.gen_batch_size):
            batch_plans = [plan for _, plan in batch]
            budgets = [p.sampler.max_new_tokens for p in batch_plans]
            sampler = replace(batch_plans[0].sampler, max_new_tokens=max(budgets))
            start = time.perf_counter()
            with self._precision():
                eos = -1 if batch_plans[0].ignore_eos else self.special.eos  # -1: no token stops a row
                result = generate(self.model, [p.prompt for p in batch_plans], sampler, eos, self.special.pad,
                                  stop=[self._stop(p.until) for p in batch_plans], seeds=[p.seed for p in batch_plans],
                                  max_new_tokens=budgets, batch_invariant=self.batch_invariant["generation"],
                                  compile=self.args.compile)
            self.usage.generated(batch_plans[0].task, _settings_record(self.config, sampler), result, len(batch),
                                 time.perf_counter() - start)
            for (req, plan), ids in zip(batch, result.tokens):
                text = self._decode(ids, keep_special=plan.ignore_eos)
                for s in plan.until:  # the sampler stops after a block; cut at the first stop string
                    text = text.split(s)[0]
                self.cache_hook.add_partial("generate_until", req.args, text)
                out.append(text)
            bar.update(len(batch))
        bar.close()
        return collator.get_original(out)

    # -------------------------------------------------------------- data parallel (torchrun)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """lm-eval gathers samples and metrics to rank 0 after all requests ran, on every rank; our
        per-rank `Usage` rides along, so rank 0's results JSON reports the whole run."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        self._settle_cache()  # each rank has its own cache file
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object((obj, self.usage), gathered, dst=dst)
        if gathered is None:
            return None
        self._usage_by_rank = [usage for _, usage in gathered]
        return [o for o, _ in gathered]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def _owner(req) -> tuple[str, Any, int]:
    """(task name, doc id, index within the doc) of a request; direct calls without a task use '-'."""
    if req is None:
        return "-", None, 0
    return req.task_name or "-", req.doc_id, req.idx


def _batch_key(plan: _Plan) -> dict:
    """What the rows of one generation batch share: the task, whether EOS stops a row, and the sampler
    settings but the budget."""
    return {"task": plan.task, "ignore_eos": plan.ignore_eos, **{k: v for k, v in asdict(plan.sampler).items() if k != "max_new_tokens"}}


def _settings_record(config: BlockGenConfig, sampler: SamplerConfig) -> dict:
    """The settings a batch really ran with, as the results JSON reports them (``max_gen_toks``: the
    batch's largest budget; `Usage` reports the largest of a setting's rows)."""
    return {"sampler": sampler.name, "steps": sampler.steps, "ge": sampler.ge, "warmup": sampler.warmup,
            "temperature": sampler.temperature, "block_size": resolve_block_size(config, sampler),
            "layout": sampler.layout, "max_gen_toks": sampler.max_new_tokens,
            "paper_nfe_per_block": paper_nfe_per_block(sampler)}


def _max_new_tokens(config: BlockGenConfig, sampler: SamplerConfig) -> int:
    """The most tokens a sampler can add while leaving room for a one-token prompt (BOS)."""
    for n in range(config.seq_len - 1, 0, -1):
        if max_prompt_len(config, replace(sampler, max_new_tokens=n)) >= 1:
            return n
    return 0


def _check_checkpoint_dir(path: str) -> None:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"pretrained={path}: checkpoint directory does not exist")
    if not (directory / CONFIG).is_file() and (directory / "checkpoint" / CONFIG).is_file():
        raise CheckpointError(f"pretrained={path} is a training run's folder; its checkpoint is "
                              f"pretrained={directory / 'checkpoint'}")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


# lm-eval's command line sends device="cuda:0" when --device is not given (its `hf` backend then
# falls back to the CPU on a machine without a GPU): that default, and only it, means the CPU there.
LM_EVAL_DEFAULT_DEVICE = "cuda:0"


def _requested_device(device: str | None) -> str | None:
    """The device to ask `setup_distributed` for: lm-eval's default read as above, anything else as given."""
    if device == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
        log.warning("blockgen: device %s requested but CUDA is not available; using the CPU", device)
        return "cpu"
    return device
